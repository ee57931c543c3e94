"""pagelab.memory: glibc's allocator settings for long runs (no-ops where the C library is not glibc)."""
from __future__ import annotations

import platform

import pyarrow as pa
import pytest

from pagelab import memory

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt / malloc_trim")


@glibc
def test_map_large_blocks_takes_the_settings_and_moves_arrow_to_the_system_allocator():
    assert memory.map_large_blocks() is True
    assert pa.default_memory_pool().backend_name == "system"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@glibc
def test_release_free_memory_returns_free_pages_inside_the_heap():
    memory.map_large_blocks()  # 64 KB blocks come from the heap, not from their own mappings
    blocks = [bytearray(64 << 10) for _ in range(400)]  # 25 MB, touched (zero-filled)
    pin = bytearray(64 << 10)  # the heap's top stays in use: free() alone cannot shrink the heap
    before = _rss_bytes()
    del blocks
    assert memory.release_free_memory() is True
    assert before - _rss_bytes() > 10 << 20
    del pin


def test_without_glibc_both_are_no_ops(monkeypatch):
    monkeypatch.setattr(memory, "_LIBC", None)
    assert memory.map_large_blocks() is False
    assert memory.release_free_memory() is False


@glibc
def test_the_cli_keeps_every_thread_on_one_arena():
    import subprocess
    import sys

    # malloc_info lists one <heap> per arena; numpy's OpenBLAS threads took a second one before.
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
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"
