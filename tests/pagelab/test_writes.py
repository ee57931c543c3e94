"""The write layer every file goes through: a full disk is one error naming the file, its bytes and the space
left, and whoever was writing leaves nothing half-written behind (the child process's tables included)."""
from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from pagelab.atomic import atomic_dir, atomic_write_bytes
from pagelab.table_sinks import ParquetSink
from pagelab.writes import TEST_DISK_FULL_ENV, DiskFullError, destination, limit_disk, open_out, space_left
from simulator.config import SimConfig
from simulator.loop import simulate
from simulator.output import RunFolder, Sizes
from traces import load_trace

ROOT = Path(__file__).resolve().parents[2]


def test_out_file_counts_what_reaches_the_file(tmp_path):
    with open_out(tmp_path / "a.bin") as f:
        f.write(b"abc")
        f.write(memoryview(np.arange(4, dtype=np.int64)))
        assert f.written == f.tell() == 3 + 32
    assert (tmp_path / "a.bin").read_bytes()[:3] == b"abc"


def test_a_full_disk_names_the_destination_the_bytes_and_the_space_left(tmp_path):
    with limit_disk(1000), pytest.raises(DiskFullError) as caught:
        atomic_write_bytes(tmp_path / "result.json", b"x" * 5000)
    message = str(caught.value)
    assert f"writing {tmp_path / 'result.json'} failed after 1,000 bytes of it" in message
    left = re.search(r"; (.*) left on its file system", message).group(1)
    assert left.endswith(("bytes", "KiB", "MiB", "GiB", "TiB"))
    assert "\n" not in message
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the temporary file went with the failure


def test_the_limit_counts_only_matching_paths(tmp_path):
    with limit_disk(10, "/keep/"):
        with open_out(tmp_path / "other.bin") as f:
            f.write(b"y" * 100)
        (tmp_path / "keep").mkdir()
        with open_out(tmp_path / "keep" / "f.bin") as f, pytest.raises(DiskFullError):
            f.write(b"z" * 100)
    assert (tmp_path / "other.bin").stat().st_size == 100
    assert (tmp_path / "keep" / "f.bin").stat().st_size == 10


def test_destination_maps_temporary_names_to_what_they_become(tmp_path):
    with atomic_dir(tmp_path / "run") as tmp:
        inner = tmp / "paged" / "events.parquet" / "part-00000.parquet"
        assert destination(inner) == tmp_path / "run" / "paged" / "events.parquet" / "part-00000.parquet"
    assert destination(tmp_path / ".fig.png.123.0123abcd.png") == tmp_path / "fig.png"
    assert destination(tmp_path / ".events.parquet.part") == tmp_path / "events.parquet"


def test_space_left_reads_the_nearest_existing_folder(tmp_path):
    assert space_left(tmp_path / "not" / "yet") == space_left(tmp_path) > 0


def test_a_parquet_sink_on_a_full_disk_raises_the_layer_error(tmp_path):
    schema = pa.schema([("a", pa.int64())])
    sink = ParquetSink(tmp_path / "t.parquet", schema, group_rows=1)
    with limit_disk(2000), pytest.raises(DiskFullError, match=r"t\.parquet/part-00000\.parquet failed"):
        for _ in range(100):
            sink.write({"a": np.arange(1000, dtype=np.int64)})


def test_writes_after_a_failure_or_after_close_are_dropped(tmp_path):
    f = open_out(tmp_path / "a.bin")
    with limit_disk(10), pytest.raises(DiskFullError):
        f.write(b"x" * 100)
    assert f.write(b"y" * 5) == 5  # what a collected writer writes: no exception, no bytes
    f.close()
    assert f.write(b"z") == 1
    assert (tmp_path / "a.bin").read_bytes() == b"x" * 10


COLLECTED_WRITER = """
import ast, gc
from pathlib import Path
import numpy as np, pandas as pd
from pagelab.run_folder import write_table
from pagelab.writes import DiskFullError, limit_disk

def fail(folder):
    kept = []
    try:
        with limit_disk(100):
            write_table(pd.DataFrame({"x": np.random.default_rng(0).random(400_000)}), folder, "parquet")
    except DiskFullError as exc:
        kept.append(exc)
        exc.cycle = kept  # only the cyclic collector frees the writer now

fail(Path(FOLDER))
gc.set_threshold(1)  # collect during the parse
ast.parse("def f():\\n    " + "\\n    ".join(f"x{i} = [{i}, ({i}, {{'a': [{i}]}})]" for i in range(300)))
print("parsed")
"""


def test_a_writer_collected_after_a_full_disk_breaks_nothing(tmp_path):
    # pyarrow's writer writes its footer when collected, into the closed file; an exception raised in a
    # collection that runs inside the AST constructor breaks it (CPython 3.11: "recursion depth mismatch").
    code = COLLECTED_WRITER.replace("FOLDER", repr(str(tmp_path / "t")))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "parsed", done.stderr


def _previous_run(folder):
    """A finished folder standing in for the previous run in --out."""
    folder.mkdir()
    (folder / "run.json").write_text('{"previous": true}')
    return folder


@pytest.mark.parametrize("child", [False, True], ids=["in-process", "child-process"])
def test_a_run_folder_on_a_full_disk_leaves_the_previous_run_and_no_temporary_folder(tmp_path, monkeypatch,
                                                                                       child):
    trace = load_trace("azure-conv").iloc[:300].reset_index(drop=True)
    out = _previous_run(tmp_path / "run")
    # The child reads the hook from its environment when it starts; this process keeps no limit.
    monkeypatch.setenv(TEST_DISK_FULL_ENV, "20000:/paged/")
    sizes = Sizes(child_min_requests=0 if child else 1 << 62, memory_group_rows=64, memory_min_group_rows=16,
                  request_group_rows=64, event_group_rows=256, batch_rows=32, spool_batch_rows=32)
    limit = limit_disk(20000, "/paged/") if not child else contextlib.nullcontext()
    with pytest.raises(DiskFullError) as caught, atomic_dir(out) as tmp, limit:
        (tmp / "paged").mkdir()
        output = RunFolder(tmp / "paged", num_requests=len(trace), sizes=sizes)
        assert output.in_child == child
        simulate(trace, SimConfig(), output)
    assert f"writing {out / 'paged'}/" in str(caught.value)
    assert (out / "run.json").read_text() == '{"previous": true}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_real_full_file_system_gives_the_same_error(small_tmpfs):
    small = small_tmpfs("1m")
    out = _previous_run(small / "run")
    big = pd.DataFrame({"x": np.random.default_rng(0).random(400_000)})  # ~3 MiB of Parquet
    from pagelab.run_folder import write_table

    with pytest.raises(DiskFullError) as caught, atomic_dir(out) as tmp:
        write_table(big, tmp / "big", "parquet")
    message = str(caught.value)
    assert f"writing {out / 'big.parquet'} failed after" in message
    assert re.search(r"; \d[\d,.]* (bytes|KiB) left on its file system", message)
    assert (out / "run.json").read_text() == '{"previous": true}'
    assert sorted(p.name for p in small.iterdir()) == ["run"]


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_a_trace_saved_on_a_full_disk_leaves_no_file(tmp_path, suffix):
    from traces import save_trace

    where = f"writing {re.escape(str(tmp_path))}/t{suffix} "
    with limit_disk(500), pytest.raises(DiskFullError, match=where):
        save_trace(load_trace("azure-conv").iloc[:500], tmp_path / f"t{suffix}")
    assert list(tmp_path.iterdir()) == []


def test_a_swap_cut_short_keeps_both_folders_and_a_finished_one_leaves_none(tmp_path, dead_pid):
    from pagelab.atomic import stale_temp_dirs

    old, new = tmp_path / f".r.old-{dead_pid}", tmp_path / f".r.tmp-{dead_pid}-0123abcd"
    old.mkdir()
    new.mkdir()
    assert stale_temp_dirs(tmp_path / "r") == ([], [old, new])  # the only copies of the two runs
    (tmp_path / "r").mkdir()
    assert stale_temp_dirs(tmp_path / "r") == ([old, new], [])


def test_atomic_dir_onto_a_mount_point_names_it_and_leaves_nothing_behind(small_tmpfs, tmp_path):
    from pagelab.atomic import FolderReplaceError

    mount = small_tmpfs()
    (mount / "keep.txt").write_text("x")
    expected = f"the output folder {mount} cannot be replaced: it is a mount point; choose a folder inside it"
    with pytest.raises(FolderReplaceError, match=re.escape(expected)), atomic_dir(mount) as tmp:
        (tmp / "summary.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small"]
    assert sorted(p.name for p in mount.iterdir()) == ["keep.txt"]


@pytest.mark.skipif(sys.platform != "linux", reason="Linux answers a rename of '.' with EBUSY")
def test_a_rename_refused_as_busy_is_named_a_mount_point(tmp_path):
    import errno
    import os

    from pagelab.atomic import replace_error

    (tmp_path / "d").mkdir()
    with pytest.raises(OSError) as caught:
        os.rename(f"{tmp_path / 'd'}/.", tmp_path / "e")
    assert caught.value.errno == errno.EBUSY
    assert str(replace_error(tmp_path / "d", caught.value)) == (
        f"the output folder {tmp_path / 'd'} cannot be replaced: it is a mount point (or in use by the "
        "system); choose a folder inside it")
