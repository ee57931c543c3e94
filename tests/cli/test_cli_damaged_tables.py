"""`plot`, `view`, `export` and `compare` on run folders whose tables lack columns, are cut short or are not
run folders at all: one line naming the file (and the row or column), exit code 2, and nothing written."""
from __future__ import annotations

import re
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from cli import app

runner = CliRunner()
pytestmark = pytest.mark.usefixtures("wide_consoles")
TRACE = "request_id,arrival_s,prompt_len,output_len\n0,0,10,5\n1,0.5,20,6\n2,1.0,30,7\n"


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def error_line(result) -> str:
    """The one `error:` line of a user error (exit code 2, no traceback)."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.output
    return lines[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A simulation of a three-request trace, in Parquet and in CSV, and a sweep of it."""
    tmp = tmp_path_factory.mktemp("runs")
    (tmp / "t.csv").write_text(TRACE)
    for name, extra in (("run", ()), ("csv", ("--table-format", "csv"))):
        result = run("simulate", tmp / "t.csv", "-a", "paged", *extra, "--out", tmp / name)
        assert result.exit_code == 0, result.output
    result = run("sweep", tmp / "t.csv", "--rate", "1,2", "-a", "paged", "-j", 1, "--out", tmp / "sweep")
    assert result.exit_code == 0, result.output
    return tmp


def _copy(runs, tmp_path, name: str = "run", to: str | None = None):
    return shutil.copytree(runs / name, tmp_path / (to or name))


def _drop_column(path, column: str) -> None:
    pq.write_table(pq.read_table(path).drop([column]), path)


def _snapshot(folder) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_export_names_a_missing_request_column(runs, tmp_path):
    bad = _copy(runs, tmp_path)
    _drop_column(bad / "paged" / "requests.parquet", "finish_s")
    line = error_line(run("export", bad, "--out", tmp_path / "x.json"))
    assert line.startswith(f"error: {bad / 'paged' / 'requests.parquet'}: missing column 'finish_s' (found: "
                           "request_id, arrival_s,")
    assert not (tmp_path / "x.json").exists()


def test_parquet_table_with_other_columns_lists_them(runs, tmp_path):
    bad = _copy(runs, tmp_path)
    pq.write_table(pa.table({"a": [1, 2], "b": [3.0, 4.0]}), bad / "paged" / "memory.parquet")
    for command in ("view", "export"):
        line = error_line(run(command, bad, "--out", tmp_path / "out"))
        assert re.fullmatch(rf"error: {re.escape(str(bad / 'paged' / 'memory.parquet'))}: missing column "
                            r"'\w+' \(found: a, b\)", line), line


@pytest.mark.parametrize("table, column", [("memory", None), ("requests", "ttft_s")])
def test_plot_that_fails_writes_no_figure(runs, tmp_path, table, column):
    bad = _copy(runs, tmp_path)
    path = bad / "paged" / f"{table}.parquet"
    if column is None:
        pq.write_table(pa.table({"a": [1, 2], "b": [3.0, 4.0]}), path)
    else:
        _drop_column(path, column)
    error_line(run("plot", bad, "--out", tmp_path / "figs"))
    assert not (tmp_path / "figs").exists()
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "breakdown.png").write_bytes(b"an earlier figure")
    (earlier / "notes.txt").write_text("kept")
    before = _snapshot(earlier)
    error_line(run("plot", bad, "--out", earlier))
    assert _snapshot(earlier) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary folder left


def test_plot_keeps_the_out_folders_other_files(runs, tmp_path):
    out = tmp_path / "figs"
    out.mkdir()
    (out / "notes.txt").write_text("kept")
    result = run("plot", runs / "run", "--out", out, "--only", "breakdown")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["breakdown.png", "notes.txt"]
    assert f"wrote {out / 'breakdown.png'}" in result.output


def test_compare_that_fails_writes_nothing(runs, tmp_path):
    bad = _copy(runs, tmp_path, to="bad")
    _drop_column(bad / "paged" / "requests.parquet", "ttft_s")
    line = error_line(run("compare", bad, runs / "run", "--out", tmp_path / "cmp"))
    assert "missing column 'ttft_s'" in line
    assert not (tmp_path / "cmp").exists()
    result = run("compare", runs / "csv", runs / "run", "--out", tmp_path / "cmp")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "cmp").iterdir()) == ["breakdown.png", "comparison.json",
                                                                   "latency_cdf.png"]


def _cut_first_row(path, keep: int = 20) -> None:
    header, first = path.read_bytes().split(b"\n")[:2]
    path.write_bytes(header + b"\n" + first[:keep])


def test_csv_row_cut_short_is_named(runs, tmp_path):
    bad = _copy(runs, tmp_path, "csv")
    path = bad / "paged" / "requests.csv"
    _cut_first_row(path)
    fields = path.read_text().splitlines()[1].count(",") + 1
    for command in ("view", "export"):
        line = error_line(run(command, bad, "--out", tmp_path / "out"))
        assert line == f"error: {path}: row 1 (line 2) has {fields} of the header's 17 fields", line
        assert not (tmp_path / "out").exists()
    result = run("plot", bad, "--out", tmp_path / "figs")  # left out of the figures that need it, as Parquet
    assert f"warning: {path}: row 1 (line 2) has {fields} of the header's 17 fields: the figures that need " \
           "the requests table leave out csv/paged" in result.output
    assert result.exit_code == 0, result.output
    assert "latency_cdf.png" not in result.output


def test_csv_table_without_its_last_newline_is_cut_short(runs, tmp_path):
    bad = _copy(runs, tmp_path, "csv")
    path = bad / "paged" / "memory.csv"
    path.write_bytes(path.read_bytes()[:-2])
    lines = path.read_text().count("\n") + 1
    line = error_line(run("export", bad, "--out", tmp_path / "x.json"))
    assert line == f"error: {path}: row {lines - 1} (line {lines}) is cut short (no newline at its end)"


def test_request_table_shorter_than_the_summary_is_named(runs, tmp_path):
    bad = _copy(runs, tmp_path)
    path = bad / "paged" / "requests.parquet"
    pq.write_table(pq.read_table(path).slice(0, 2), path)
    line = error_line(run("view", bad, "--out", tmp_path / "v.html"))
    summary = bad / "paged" / "summary.json"
    assert line == f"error: {path}: 2 rows, but {summary} counts 3 requests (the table is cut short)"


def test_csv_header_with_a_column_twice_names_it(runs, tmp_path):
    bad = _copy(runs, tmp_path, "csv")
    path = bad / "paged" / "requests.csv"
    text = path.read_text()
    header, rest = text.split("\n", 1)
    path.write_text(header.replace('"output_len"', '"prompt_len"') + "\n" + rest)
    line = error_line(run("view", bad, "--out", tmp_path / "v.html"))
    assert line == f"error: {path}: column 'prompt_len' appears twice in the header"
    assert "prompt_len.1" not in line


@pytest.mark.parametrize("command", ["plot", "view", "export", "compare"])
def test_sweep_folder_points_to_its_runs(runs, command):
    sweep = runs / "sweep"
    args = (sweep, runs / "run") if command == "compare" else (sweep,)
    line = error_line(run(command, *args))
    assert line == (f"error: {sweep} is a sweep folder (pagelab sweep), not a run folder: `pagelab sweep ... "
                    f"--plot` draws its figures; its runs are under {sweep / 'points'}/*")


def test_compare_warning_names_an_allocator_folder_once(runs, tmp_path):
    bad = tmp_path / "truncreq"
    shutil.copytree(runs / "run", bad)
    req = bad / "paged" / "requests.parquet"
    req.write_bytes(req.read_bytes()[:100])
    result = run("compare", bad, runs / "run", "--out", tmp_path / "cmp")
    warnings = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert warnings and all("paged/paged" not in w for w in warnings), warnings
    assert warnings[0].endswith("the figures that need the requests table leave out truncreq/paged")
