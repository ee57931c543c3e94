"""A full disk as the commands meet it (the write layer's test hook, pagelab/writes.py, and a real small
tmpfs): one line naming the file, the bytes written and the space left, exit 2, the previous result intact,
no temporary file left."""
from __future__ import annotations

import contextlib
import hashlib
import re
from pathlib import Path

import pytest
from clirun import one_line_error, pagelab
from typer.testing import CliRunner

import cli.common
from cli import app
from pagelab.writes import TEST_DISK_FULL_ENV, limit_disk
from traces import SyntheticConfig, generate_trace, save_trace

SIM = ("simulate", "azure-conv", "--limit", "60", "-a", "paged", "--kv-memory-gb", "2")
FULL = (r"disk full: writing (\S+) failed after ([\d,.]+ (?:bytes|KiB|MiB)) of it; (.+) left on its file "
        r"system\.")


def _fingerprint(folder: Path) -> dict[str, str]:
    """Every file under `folder` with its content hash."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _full(result) -> re.Match:
    line = one_line_error(result)
    match = re.search(FULL, line)
    assert match, line
    return match


def test_simulate_on_a_full_disk_keeps_the_previous_run(tmp_path):
    assert pagelab(*SIM, "--out", "r", cwd=tmp_path).returncode == 0
    before = _fingerprint(tmp_path / "r")
    result = pagelab(*SIM, "--out", "r", "--overwrite", cwd=tmp_path, **{TEST_DISK_FULL_ENV: "3000:r/paged/"})
    assert _full(result).group(1).startswith("r/paged/")  # the destination, as the user named it
    assert _fingerprint(tmp_path / "r") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]


def test_sweep_on_a_full_disk_keeps_the_finished_points_and_tables(tmp_path):
    trace = tmp_path / "t.parquet"
    save_trace(generate_trace(SyntheticConfig(num_requests=40, lengths="sharegpt", rate=1.0, seed=0)), trace)
    args = ("sweep", trace, "-a", "paged", "--capacity-tokens", "8192", "--max-model-len", "2048",
            "--jobs", "1", "--no-search", "--out", "s")
    assert pagelab(*args, "--rate", "1,2", cwd=tmp_path).returncode == 0
    before = _fingerprint(tmp_path / "s")
    result = pagelab(*args, "--rate", "1,2,4", cwd=tmp_path, **{TEST_DISK_FULL_ENV: "0:s/points/"})
    assert _full(result).group(1).startswith("s/points/paged-r4-")
    assert _fingerprint(tmp_path / "s") == before  # the new point left nothing, the tables are the old ones
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s", "t.parquet"]


def _invoke(*args, limit: tuple | None = None):
    """`pagelab ARGS` in this process (torch and matplotlib are loaded once), under `limit_disk(*limit)`."""
    with limit_disk(*limit) if limit else contextlib.nullcontext():
        return CliRunner().invoke(app, [str(a) for a in args])


def _full_here(result) -> re.Match:
    """The one disk-full error line of an in-process command (exit 2, no traceback)."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.output
    match = re.search(FULL, lines[0])
    assert match, lines[0]
    return match


@pytest.fixture
def here(tmp_path, monkeypatch):
    """Commands run in tmp_path, with consoles wide enough to keep each message on one line."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli.common.err_console, "width", 400)
    return tmp_path


def test_replay_on_a_full_disk_writes_no_folder(here):
    save_trace(generate_trace(SyntheticConfig(num_requests=3, arrival="burst", lengths="uniform",
                                              prompt_range=(5, 20), output_range=(2, 4), seed=0)), "t.csv")
    result = _invoke("replay", "t.csv", "--device", "cpu", "--time-scale", "0", "--num-blocks", "64",
                     "--out", "r", limit=(2000,))
    assert _full_here(result).group(1).startswith("r/paged/")
    assert sorted(p.name for p in here.iterdir()) == ["t.csv"]


def test_plot_on_a_full_disk_keeps_the_figures_drawn_before(here):
    assert _invoke(*SIM, "--out", "r", "--no-events").exit_code == 0
    assert _invoke("plot", "r", "--only", "breakdown").exit_code == 0
    before = _fingerprint(here / "r" / "figures")
    path, written, _ = _full_here(_invoke("plot", "r", "--only", "breakdown", limit=(1000,))).groups()
    assert path == "r/figures/breakdown.png" and written == "1,000 bytes"
    assert _fingerprint(here / "r" / "figures") == before


@pytest.mark.parametrize("command", ["simulate", "plot"])
def test_a_real_full_file_system(here, small_tmpfs, command):
    small = small_tmpfs("256k")
    if command == "simulate":
        result = _invoke("simulate", "azure-conv", "--limit", "3000", "-a", "paged", "--out", small / "r")
    else:
        assert _invoke(*SIM, "--out", "r", "--no-events").exit_code == 0
        (small / "filler").write_bytes(b"\0" * (256 * 1024 - 8192))
        result = _invoke("plot", "r", "--only", "breakdown", "--out", small / "figs")
    assert _full_here(result).group(1).startswith(str(small) + "/")
    assert sorted(p.name for p in small.iterdir()) in ([], ["filler"], ["figs", "filler"])
