"""A full disk as the commands meet it (the write layer's test hook, pagelab/writes.py): one line naming the
file, the bytes written and the space left, exit 2, the previous result intact, no temporary file left."""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
from clirun import one_line_error, pagelab

from pagelab.writes import TEST_DISK_FULL_ENV
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


def test_replay_on_a_full_disk_writes_no_folder(tmp_path):
    trace = tmp_path / "t.csv"
    save_trace(generate_trace(SyntheticConfig(num_requests=3, arrival="burst", lengths="uniform",
                                              prompt_range=(5, 20), output_range=(2, 4), seed=0)), trace)
    result = pagelab("replay", trace, "--device", "cpu", "--time-scale", "0", "--num-blocks", "64",
                     "--out", "r", cwd=tmp_path, **{TEST_DISK_FULL_ENV: "2000"})
    assert _full(result).group(1).startswith("r/paged/")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.csv"]


def test_plot_on_a_full_disk_keeps_the_figures_drawn_before(tmp_path):
    assert pagelab(*SIM, "--out", "r", "--no-events", cwd=tmp_path).returncode == 0
    assert pagelab("plot", "r", "--only", "breakdown", cwd=tmp_path).returncode == 0
    before = _fingerprint(tmp_path / "r" / "figures")
    result = pagelab("plot", "r", "--only", "breakdown", cwd=tmp_path, **{TEST_DISK_FULL_ENV: "1000"})
    path, written, _ = _full(result).groups()
    assert path == "r/figures/breakdown.png" and written == "1,000 bytes"
    assert _fingerprint(tmp_path / "r" / "figures") == before


@pytest.mark.parametrize("command", ["simulate", "plot"])
def test_a_real_full_file_system(tmp_path, small_tmpfs, command):
    small = small_tmpfs("256k")
    if command == "simulate":
        result = pagelab("simulate", "azure-conv", "--limit", "3000", "-a", "paged", "--out", small / "r",
                         cwd=tmp_path)
    else:
        assert pagelab(*SIM, "--out", "r", "--no-events", cwd=tmp_path).returncode == 0
        (small / "filler").write_bytes(b"\0" * (256 * 1024 - 8192))
        result = pagelab("plot", "r", "--only", "breakdown", "--out", small / "figs", cwd=tmp_path)
    assert _full(result).group(1).startswith(str(small) + "/")
    assert sorted(p.name for p in small.iterdir()) in ([], ["filler"], ["figs", "filler"])
