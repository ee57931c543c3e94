"""pagelab.malloc: glibc's allocator settings for long runs (no-ops where the C library is not glibc)."""
from __future__ import annotations

import os
import platform
import sys

import pyarrow as pa
import pytest
from fresh_process import run_script

from pagelab import malloc

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt / malloc_trim")


@glibc
def test_map_large_allocations_takes_the_settings_and_moves_arrow_to_the_system_allocator():
    assert malloc.map_large_allocations() is True
    assert pa.default_memory_pool().backend_name == "system"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@glibc
def test_release_free_memory_returns_free_pages_inside_the_heap():
    malloc.map_large_allocations()  # 32 KB allocations come from the heap (under LARGE_ALLOCATION_BYTES)
    blocks = [bytearray(32 << 10) for _ in range(800)]  # 25 MB, touched (zero-filled)
    pin = bytearray(32 << 10)  # the heap's top stays in use: free() alone cannot shrink the heap
    before = _rss_bytes()
    del blocks
    assert malloc.release_free_memory() is True
    assert before - _rss_bytes() > 10 << 20
    del pin


def test_without_glibc_both_are_no_ops(monkeypatch):
    monkeypatch.setattr(malloc, "_LIBC", None)
    assert malloc.map_large_allocations() is False
    assert malloc.release_free_memory() is False


@glibc
def test_the_cli_keeps_every_thread_on_one_arena():
    # malloc_info lists one <heap> per arena; without the CLI's setting numpy's OpenBLAS threads take another.
    code = (
        "import ctypes, re, tempfile, threading\n"
        "import cli, numpy\n"
        "worker = threading.Thread(target=lambda: [numpy.ones(100_000) for _ in range(20)])\n"
        "worker.start(); worker.join()\n"
        "libc = ctypes.CDLL('libc.so.6')\n"
        "libc.fopen.restype = ctypes.c_void_p\n"
        "libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]\n"
        "libc.fclose.argtypes = [ctypes.c_void_p]\n"
        "libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]\n"
        "path = tempfile.NamedTemporaryFile(delete=False).name\n"
        "fp = libc.fopen(path.encode(), b'w'); libc.malloc_info(0, fp); libc.fclose(fp)\n"
        "print(len(re.findall('<heap nr=', open(path).read())))\n"
    )
    assert run_script(code) == "1"


# glibc's mallinfo2 in a fresh process (the scripts below start with it), and `fill_holes`: glibc serves a
# block of any size, one over the mmap threshold included, from a free chunk of the heap that fits before it
# maps one. How many such holes a process starts with depends on how its imports went (compiling modules
# without cached bytecode leaves megabytes of them), so each script takes them first: what it measures
# then comes from the heap's top or from mappings, as in a process whose imports left none.
_MALLINFO2 = """
import ctypes
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
_holes = []
def fill_holes():
    size = 1 << 24
    while size >= 4096:
        was = libc.mallinfo2()
        block = libc.malloc(size)
        now = libc.mallinfo2()
        if now.hblkhd > was.hblkhd or now.arena > was.arena:  # mapped, or grew the heap: no hole that big
            libc.free(block)
            size //= 2
        else:
            _holes.append(block)
"""

_READ_AND_HOLD = _MALLINFO2 + """
import sys
from pathlib import Path
import cli  # one arena, as the CLI sets it
from pagelab import malloc
malloc.map_large_allocations(int(sys.argv[2]))
from traces.batches import open_parquet_batches
chunks = open_parquet_batches(Path(sys.argv[1]))  # checks the file a batch at a time, as the CLI does
fill_holes()
before = libc.mallinfo2().hblkhd
held = list(chunks.iter_batches(chunks.columns))
print(sum(a.nbytes for batch in held for a in batch.values()), libc.mallinfo2().hblkhd - before)
"""


@glibc
def test_a_traces_read_batches_are_mappings_of_their_own_under_the_runs_threshold(tmp_path):
    from traces import SyntheticConfig, generate_trace, save_trace

    # What the CLI does before and during a run: read the Parquet trace 65,536 rows at a time. Under a
    # 4 MiB threshold the batches' column buffers come from the heap and leave it grown (holes the run
    # then spreads into); under LARGE_ALLOCATION_BYTES each is a mapping of its own, unmapped when dropped.
    # The test checks which allocations are mappings, not how much the heap grows: that depends on the
    # holes a process's imports leave, which allocations are mappings does not.
    path = tmp_path / "trace.parquet"
    save_trace(generate_trace(SyntheticConfig(num_requests=300_000, rate=40.0, seed=1)), path)

    held, mapped = map(int, run_script(_READ_AND_HOLD, path, malloc.LARGE_ALLOCATION_BYTES).split())
    assert held == 300_000 * 6 * 8  # six 8-byte columns
    assert mapped >= held
    held, mapped = map(int, run_script(_READ_AND_HOLD, path, malloc.PAIRING_ALLOCATION_BYTES).split())
    assert mapped < held // 4  # the setting is what makes the difference


# Scripts that print 1 when what they grow is a mapping of its own under the threshold in argv[1].
_UNDER_THRESHOLD = _MALLINFO2 + """
import sys
from pagelab import malloc
malloc.map_large_allocations(int(sys.argv[1]))
fill_holes()
before = libc.mallinfo2().hblkhd
"""
_BATCH_MAPPED = _UNDER_THRESHOLD + """
import struct
from array import array
row = struct.Struct("=17d").pack(*range(17))
batch = array("d")  # what the memory log does: a 2^14-row batch of packed rows, grown by appends
for _ in range(1 << 14):
    batch.frombytes(row)
print(int(libc.mallinfo2().hblkhd - before >= len(batch) * batch.itemsize))
"""


@glibc
def test_the_loops_growing_batch_buffers_are_mappings_under_the_runs_threshold():
    # A 2.2 MB batch grown by appends moves ~100 times on its way up; from the heap, the small blocks
    # the loop places between those moves pin the holes it leaves, and a long run's heap grows.
    # Under LARGE_ALLOCATION_BYTES it is a mapping of its own, unmapped when dropped. 1 = a mapping.
    assert run_script(_BATCH_MAPPED, malloc.LARGE_ALLOCATION_BYTES) == "1"
    assert run_script(_BATCH_MAPPED, malloc.PAIRING_ALLOCATION_BYTES) == "0"


_SHOW = "import {}os; print(os.environ.get({!r}, 'unset'))"


def _in_a_new_process(code: str, **env_vars: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in malloc.ARROW_ENV}
    return run_script(code, env={**env, **env_vars})


def test_the_cli_chooses_arrows_pool_before_pyarrow_is_imported():
    pool, purge = malloc.ARROW_POOL_VARIABLE, malloc.MIMALLOC_PURGE_VARIABLE
    assert _in_a_new_process(_SHOW.format("", pool)) == "unset"
    assert _in_a_new_process(_SHOW.format("cli, ", pool)) == malloc.ARROW_POOL
    assert _in_a_new_process(_SHOW.format("cli, ", purge)) == "0"
    # What the user chose stands.
    assert _in_a_new_process(_SHOW.format("cli, ", pool), **{pool: "mimalloc"}) == "mimalloc"
    assert _in_a_new_process(_SHOW.format("cli, ", purge), **{purge: "250"}) == "250"
    # Arrow's C++ default pool, which the Parquet reader and writers use, is the one chosen (and exists:
    # Arrow would fall back to mimalloc with a warning).
    backend = "import cli, pyarrow; print(pyarrow.default_memory_pool().backend_name)"
    assert _in_a_new_process(backend) == malloc.ARROW_POOL
    # The CLI sets them right after importing pagelab.malloc, which must not import pyarrow (Arrow reads
    # the variables at pyarrow's first import).
    assert _in_a_new_process("import sys, pagelab.malloc; print('pyarrow' in sys.modules)") == "False"


# pandas first: pyarrow imports it at its first `pa.array(ndarray)` when it can, which would land ~45 MB
# of its own in the measured window.
_ARROW_FREES = """
import {}numpy as np, pandas, pyarrow as pa
def rss():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:"))
before = rss()
arrays = [pa.array(np.arange(25_000) + i) for i in range(100)]  # Arrow's pool: 100 arrays of 200 KB
del arrays
print(pa.default_memory_pool().backend_name, (rss() - before) >> 10)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Arrow's jemalloc pool: Linux wheels")
def test_under_the_cli_arrows_jemalloc_returns_freed_pages():
    backend, kept_mib = _in_a_new_process(_ARROW_FREES.format("cli, ")).split()
    assert backend == "jemalloc" and int(kept_mib) < 5  # of the 20 MB Arrow held


def test_choose_arrow_pool_says_whether_it_can_still_take_effect(monkeypatch):
    pool, purge = malloc.ARROW_POOL_VARIABLE, malloc.MIMALLOC_PURGE_VARIABLE
    for name in malloc.ARROW_ENV:
        monkeypatch.delenv(name, raising=False)
    assert "pyarrow" in sys.modules  # imported above: too late for this process
    assert malloc.choose_arrow_pool() is False
    assert (os.environ[pool], os.environ[purge]) == (malloc.ARROW_POOL, "0")  # for the processes it starts
    assert os.environ[malloc.JEMALLOC_CONF_VARIABLE] == malloc.JEMALLOC_CONF
    monkeypatch.setenv(pool, "jemalloc")
    monkeypatch.setenv(purge, "250")
    monkeypatch.delitem(sys.modules, "pyarrow")
    assert malloc.choose_arrow_pool() is True
    assert (os.environ[pool], os.environ[purge]) == ("jemalloc", "250")  # the user's choice stands


_LIST_MAPPED = _UNDER_THRESHOLD + """
keys = []
for i in range(12_500):  # the recorder's raw list of block ids, grown a run at a time: ~200 KB of pointers
    keys.extend((i, i + 1))
print(int(libc.mallinfo2().hblkhd - before >= 8 * len(keys)))
"""


@glibc
def test_the_recorders_growing_lists_leave_the_heap_under_the_runs_threshold():
    # Between 64 and 256 KB, the heap's churn on a long run is mostly the recorder's raw lists on their way
    # up (and the pickled batches). Under LARGE_ALLOCATION_BYTES a list that size is a mapping of its own;
    # under 256 KB it is in the heap.
    assert run_script(_LIST_MAPPED, malloc.LARGE_ALLOCATION_BYTES) == "1"
    assert run_script(_LIST_MAPPED, 256 << 10) == "0"


def test_a_started_processs_peak_is_its_own_not_its_parents():
    # Linux starts an exec'd child's ru_maxrss at its parent's peak (subprocess and multiprocessing's
    # spawn use vfork); peak_rss_mib reads the child's own high-water mark.
    import subprocess

    from pagelab.malloc import peak_rss_mib

    ballast = b"\x01" * (600 << 20)  # touched: this process's peak is now over 600 MiB
    out = subprocess.run([sys.executable, "-c", "import resource; from pagelab.malloc import peak_rss_mib; "
                          "print(peak_rss_mib(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"],
                         capture_output=True, text=True, check=True).stdout.split()
    del ballast
    assert peak_rss_mib() > 600
    assert float(out[0]) < 300  # an interpreter and the module, not the 600 MiB above
