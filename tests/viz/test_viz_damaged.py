"""Run folders with a table cut short (copied back from a machine that stopped mid-copy): `plot` names every
file it cannot read, and draws what it can with a warning."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from viz import figure_results, plot_runs
from viz.load import load_runs, table_problem

ROOT = Path(__file__).resolve().parents[2]


def _pagelab(*args, timeout: float | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from cli import main; main()", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "COLUMNS": "400"},
                          timeout=timeout)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    """A small two-allocator run folder with every table (simulated once for the module)."""
    out = tmp_path_factory.mktemp("base") / "run"
    done = _pagelab("simulate", "azure-conv", "--limit", "60", "-a", "paged,contiguous-max",
                    "--kv-memory-gb", "2", "--out", out)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture
def run(base_run, tmp_path) -> Path:
    """A copy of the base run to damage."""
    return Path(shutil.copytree(base_run, tmp_path / "run"))


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _plot(run: Path, **kw) -> tuple[list[str], list[str]]:
    warnings: list[str] = []
    written = plot_runs([run], run / "figures", warn=warnings.append, **kw)
    return sorted(p.stem for p in written), warnings


def test_a_truncated_events_table_skips_the_block_maps_only(run):
    _truncate(run / "paged" / "events.parquet")
    drawn, warnings = _plot(run)
    assert drawn == ["batch_size", "block_map", "block_snapshot", "breakdown", "latency_cdf",
                     "memory_over_time"]  # the block maps of contiguous-max
    assert warnings == [f"{run / 'paged' / 'events.parquet'}: cannot read table (Parquet magic bytes not "
                        "found in footer. Either the file is corrupted or this is not a parquet file.): the "
                        "figures that need the events table leave out run/paged"]


def test_a_figure_is_skipped_when_no_run_has_its_table(run):
    for name in ("paged", "contiguous-max"):
        _truncate(run / name / "events.parquet")
    drawn, warnings = _plot(run, only=["breakdown", "block_map", "block_snapshot"])
    assert drawn == ["breakdown"]
    assert len(warnings) == 4  # two files, two figures
    assert "figure 'block_map' skipped: none of its events tables can be read" in warnings


def test_a_truncated_request_table_is_named_by_its_file(run):
    _truncate(run / "paged" / "requests.parquet")
    drawn, warnings = _plot(run, only=["latency_cdf"])
    assert drawn == ["latency_cdf"]  # contiguous-max alone
    assert warnings[0].startswith(f"{run / 'paged' / 'requests.parquet'}: cannot read table (")


def test_a_truncated_part_of_a_parted_table_is_named(run):
    table = run / "paged" / "memory.parquet"
    table.rename(run / "part-00000.parquet")
    table.mkdir()
    (run / "part-00000.parquet").rename(table / "part-00000.parquet")
    shutil.copy(table / "part-00000.parquet", table / "part-00001.parquet")
    _truncate(table / "part-00001.parquet", 0.9)
    _, warnings = _plot(run, only=["memory_over_time"])
    assert warnings[0].startswith(f"{table / 'part-00001.parquet'}: cannot read table (")


def test_damage_the_footer_does_not_show_is_found_while_drawing(run):
    path = run / "paged" / "requests.parquet"
    data = bytearray(path.read_bytes())
    data[8:len(data) // 2] = bytes(len(data) // 2 - 8)  # the column data zeroed, the footer intact
    path.write_bytes(bytes(data))
    assert table_problem(run / "paged", "requests") is None  # its footer reads
    warnings: list[str] = []
    results = list(figure_results(load_runs([run]), ["latency_cdf"], warn=warnings.append))
    assert [r.name for r in results] == ["latency_cdf"]
    assert len(warnings) == 1 and warnings[0].startswith(f"{path}: cannot read table (")


def test_plot_prints_one_warning_line_per_file_and_exits_0(run, monkeypatch):
    import cli.common
    from cli import app

    monkeypatch.setattr(cli.common.err_console, "width", 400)
    _truncate(run / "paged" / "events.parquet")
    done = CliRunner().invoke(app, ["plot", str(run), "--only", "block_map"])
    assert done.exit_code == 0, done.output
    assert "Traceback" not in done.output
    warning = [line for line in done.output.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and f"{run / 'paged' / 'events.parquet'}: cannot read table" in warning[0]
    assert (run / "figures" / "block_map.png").is_file()  # contiguous-max's


@pytest.mark.parametrize("damage", ["missing", "cut short"])
def test_the_block_map_needs_no_request_table(run, damage):
    path = run / "paged" / "requests.parquet"
    if damage == "missing":
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[:1000])
    # In a process of its own: a figure that kept meeting the damage used to redraw without end.
    done = _pagelab("plot", run, "--only", "block_map,latency_cdf", timeout=60)
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: {path}: ")
    assert warnings[0].endswith("the figures that need the requests table leave out run/paged")
    assert sorted(p.name for p in (run / "figures").iterdir()) == ["block_map.png", "latency_cdf.png"]
    block_map = next(figure_results(load_runs([run]), ["block_map"], warn=[].append))
    assert sorted(block_map.data["full"]) == ["contiguous-max", "paged"]  # paged's map is still drawn


def _keep_header_only(path: Path) -> None:
    """The table with its columns and no rows."""
    pd.read_parquet(path).iloc[:0].to_parquet(path)


def test_a_memory_table_without_rows_is_an_error_naming_the_run(run):
    from viz.errors import VizError

    _keep_header_only(run / "paged" / "memory.parquet")
    with pytest.raises(VizError, match=r"run/paged: the memory table has no rows"):
        _plot(run, only=["memory_over_time"])


def test_an_events_table_without_rows_draws_an_empty_pool(run):
    _keep_header_only(run / "paged" / "events.parquet")  # as a run whose every request was refused
    drawn, warnings = _plot(run, only=["block_snapshot"])
    assert drawn == ["block_snapshot"] and warnings == []


@pytest.mark.parametrize("command", ["view", "export"])
def test_view_and_export_name_a_memory_table_without_rows(run, tmp_path, command):
    from cli import app

    _keep_header_only(run / "paged" / "memory.parquet")
    out = tmp_path / "out.html"
    done = CliRunner().invoke(app, [command, str(run), "--out", str(out)])
    assert done.exit_code == 2, done.output
    assert "run/paged: the memory table has no rows" in done.output and not out.exists()
