"""Keep a long run's resident memory to what it holds (glibc's allocator; elsewhere these do nothing).

A long simulation frees as much as it allocates (requests come and go, tenures are paired and written),
yet allocator behaviours make RSS grow with the run: glibc's dynamic mmap threshold lets freed big
blocks become heap holes that later small allocations pin; free chunks stay in the arenas; each thread
gets its own arena; Arrow's default pool keeps what it frees. The CLI's process therefore runs with one
arena (`one_arena`), a fixed 64 KB mmap threshold (`map_large_allocations`), Arrow on its jemalloc pool
returning freed pages at once (`choose_arrow_pool`), and returns free heap pages at a few points of a
run (`release_free_memory`). docs/design.md says what each setting bought on the 1M- and 10M-request runs.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8  # mallopt parameters (malloc.h)
LARGE_ALLOCATION_BYTES = 64 << 10  # the CLI's process: trace reads, the loop, the statistics after it
# The process that pairs a long run's tenures (simulator/output/child.py): its numpy temporaries would
# otherwise be fresh mappings, page faults and all, every batch.
PAIRING_ALLOCATION_BYTES = 4 << 20
ARROW_POOL_VARIABLE = "ARROW_DEFAULT_MEMORY_POOL"
# Arrow's jemalloc: in pyarrow's Linux wheels only (elsewhere Arrow would warn and fall back to mimalloc).
ARROW_POOL = "jemalloc" if sys.platform.startswith("linux") else "system"
MIMALLOC_PURGE_VARIABLE = "MIMALLOC_PURGE_DELAY"
# Arrow's jemalloc (built with the je_arrow_ prefix) reads its options from this variable when it starts;
# `pyarrow.jemalloc_set_decay_ms` comes too late, it binds only arenas not made yet.
JEMALLOC_CONF_VARIABLE = "JE_ARROW_MALLOC_CONF"
# Return freed pages at once: Arrow's release builds let them decay over a second of allocator activity,
# so a writer's or a reader's freed buffers stay resident beside the next ones.
JEMALLOC_CONF = "dirty_decay_ms:0,muzzy_decay_ms:0"
# What the CLI's process and the child that writes a long run's tables run Arrow with (a variable already
# set is kept).
ARROW_ENV = {ARROW_POOL_VARIABLE: ARROW_POOL, MIMALLOC_PURGE_VARIABLE: "0",
             JEMALLOC_CONF_VARIABLE: JEMALLOC_CONF}


def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is None or not hasattr(libc, "malloc_trim") or not hasattr(libc, "mallopt"):
            return None  # not glibc (musl, macOS, Windows)
    except OSError:
        return None
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return libc


_LIBC = _libc()


def peak_rss_mib() -> float:
    """This process's own peak resident memory, in MiB: `VmHWM` where /proc has it. Not `ru_maxrss`: a
    process started by vfork and exec (subprocess, multiprocessing's spawn) starts that count at its
    parent's peak, so a benchmark child of a parent that had built a 10M-request trace reported 1.68 GB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB elsewhere


def release_free_memory() -> bool:
    """Return free heap pages to the OS; True when glibc released something."""
    return bool(_LIBC.malloc_trim(0)) if _LIBC is not None else False


def choose_arrow_pool() -> bool:
    """Set `ARROW_ENV` in this process's environment, for it and the processes it starts: Arrow allocates
    from its jemalloc pool (glibc's where it has none), and jemalloc, or mimalloc if a user picks it,
    returns freed pages at once; True when it takes effect here (Arrow reads them when pyarrow is first
    imported)."""
    for name, value in ARROW_ENV.items():
        os.environ.setdefault(name, value)
    return "pyarrow" not in sys.modules


def one_arena() -> bool:
    """Serve every thread from one malloc arena; True when glibc took the setting. It binds only threads
    that have no arena yet: call it before numpy is imported (OpenBLAS's threads take one at import)."""
    return bool(_LIBC.mallopt(_M_ARENA_MAX, 1)) if _LIBC is not None else False


def set_mmap_threshold(threshold: int) -> bool:
    """Serve blocks of at least `threshold` bytes from their own mappings from now on, in this process
    (nothing else: see map_large_allocations); True when glibc took it."""
    return bool(_LIBC.mallopt(_M_MMAP_THRESHOLD, threshold)) if _LIBC is not None else False


def map_large_allocations(threshold: int = LARGE_ALLOCATION_BYTES) -> bool:
    """Serve blocks of at least `threshold` bytes from their own mappings from now on, in this process
    (fixes glibc's otherwise rising threshold), Arrow's included, and every thread from one arena
    (call it before threads allocate); True when glibc took the settings."""
    if _LIBC is None:
        return False
    import pyarrow as pa

    pa.set_memory_pool(pa.system_memory_pool())
    return set_mmap_threshold(threshold) and one_arena()
