"""Keep a long run's resident memory to what it holds (glibc's allocator; elsewhere these do nothing).

A simulation frees as much as it allocates (requests come and go, event batches are paired and written).
Allocator behaviours made its RSS grow with the run anyway, measured on the 10M-request trace
(docs/simulator-performance.md tells each sitting's measurements):

- glibc's mmap threshold is dynamic: once a large block (a pairing batch's 8 MB numpy temporary) is
  freed, blocks up to that size come from the heap from then on. The pairing thread's batch-sized
  temporaries then left the heap fragmented: after 3M requests 340 MB of arena of which 290 MB free,
  while 30-60 MB was in use. A fixed threshold (`map_large_blocks`) keeps big blocks in their own
  mappings, returned to the OS when freed: the arena stayed at ~40 MB (15 MB free) and RSS at 0.3 GB.
  (A free chunk of the heap that fits still serves a block over the threshold before glibc maps one:
  the threshold keeps big blocks from making such holes, it does not move blocks out of those there are.)
- Freed chunks below the threshold stay in the arenas; `release_free_memory` (`malloc_trim(0)`, 7-20 ms
  on a long run's heap) returns their whole free pages: after reading the trace, after every 65,536
  request rows, and before the summary.
- Reading and checking a trace before the run (a 10M-row file: 153 batches of 65,536 rows, ~0.5 MB a
  column) left the heap at 67 MB with 41 MB free in holes under a 4 MiB threshold, and the loop then
  spread its working set over the holes for the whole run. Under 256 KB (now 64 KB) those buffers are
  mappings of their own: 28 MB of heap at the first step for 1M and 10M rows alike.
- The loop's own batch buffers grow and go: the memory log's packed rows (`array.frombytes`, up to
  2.25 MB a 2^14-row batch), the request log's (a bytearray, 1.7 MB), the recorder's raw lists (~0.3 MB),
  the Parquet writers' buffers (~0.6 MB) and the trace cursors' row-group blocks. Under a 4 MiB
  threshold each batch left holes in the heap that later small allocations pinned: over a 10M-request
  run the heap grew 33 -> 46 MB, its free part 3 -> 12 MB, while 28-36 MB was in use. Under 256 KB the
  heap still crept to 34-37 MB (free 6-8 MB): what was left in it between 64 and 256 KB were mostly the
  recorder's raw lists on their way up (list growth, ~40 a thousand requests), the pickled event
  batches and the request log's dict tables, and glibc's free chunks of 64 KB and more grew from 0.6
  to 4.4 MB in the first two million requests. So the CLI's process runs under `LARGE_BLOCK_BYTES` =
  64 KB, from reading the trace through the statistics after the loop: the heap holds small objects
  only (26-29 MB, free 2-3 MB, flat from 1M requests on). Measured side by side, peak of the 10M run
  (1M): 256 KB 170.4 MB (166.3), 64 KB 167.5 (165.8); it costs page faults (+2.6-3.2 s of system time
  a million requests, 1-2 % of the run's CPU). (The pairing process keeps 4 MiB, `PAIRING_BLOCK_BYTES`:
  its numpy temporaries would otherwise be fresh mappings, page faults and all, every batch.)
- Arrow's own pool, mimalloc, keeps what Arrow frees: checking the 10M-row trace file alone once left
  the process at 312 MB resident, and `pa.set_memory_pool` moves only pyarrow's Python layer; the
  Parquet reader and writers' C++ code keeps the default pool. Even returning freed pages at once
  (MIMALLOC_PURGE_DELAY=0), a 10M-request run's mimalloc regions grew by 10-15 MB at two points of the
  run, while Arrow counted at most 9 MB allocated from it. On glibc (the system pool), Arrow's small
  buffers took the heap's free part from 3 to 14 MB in the first million requests. Arrow's jemalloc
  keeps them apart and returns what they free: `choose_arrow_pool` sets
  ARROW_DEFAULT_MEMORY_POOL before pyarrow is imported (the CLI does first thing; the events process
  inherits it). Measured, peak of the 10M run (1M): mimalloc and a 4 MiB threshold 190 MB (177),
  the system pool and 256 KB 176 (172), jemalloc and 256 KB 169 (165); CPU in alternating pairs: the
  system pool no cost visible, jemalloc 1-3 % more than it in four pairs of five (within the noise).
- Each thread that allocates gets its own arena: the tenure-pairing thread's grew from 18 to 39 MB
  over a 4M-request run (about half of it free), beside a main arena with 20-27 MB free. One arena for
  all threads (`one_arena`, `M_ARENA_MAX` 1) lets each reuse the other's free space: a 3M-request run
  peaked at 243 MB instead of 252 MB (loop median 222 vs 232 MB), half the system time, the same wall
  time. The setting binds only threads without an arena, and importing numpy starts OpenBLAS threads
  that take one, so the CLI calls `one_arena` first thing (cli/__init__.py).
- Not the allocator's doing, but the same creep: a Parquet writer keeps every row group's footer entry
  until it closes (~13 MB over a 10M run's tables, placed a few kilobytes at a time among the loop's
  allocations); streamed tables start a new part file every 64 row groups (pagelab/parquet_parts.py),
  the memory and request tables every 16 (their entries sit among the loop's objects: simulator/sinks.py).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8  # mallopt parameters (malloc.h)
LARGE_BLOCK_BYTES = 64 << 10  # the CLI's process: trace reads, the loop, the statistics after it
PAIRING_BLOCK_BYTES = 4 << 20  # the events process (simulator/event_process.py)
ARROW_POOL_VARIABLE = "ARROW_DEFAULT_MEMORY_POOL"
# Arrow's jemalloc: in pyarrow's Linux wheels only (elsewhere Arrow would warn and fall back to mimalloc).
ARROW_POOL = "jemalloc" if sys.platform.startswith("linux") else "system"
MIMALLOC_PURGE_VARIABLE = "MIMALLOC_PURGE_DELAY"
# Arrow's jemalloc (built with the je_arrow_ prefix) reads its options from this variable when it starts;
# `pyarrow.jemalloc_set_decay_ms` comes too late, it binds only arenas not made yet.
JEMALLOC_CONF_VARIABLE = "JE_ARROW_MALLOC_CONF"
# Return freed pages at once: Arrow's release builds let them decay over a second of allocator activity,
# so a writer's or a reader's freed buffers stayed resident beside the next ones (twenty-first sitting).
JEMALLOC_CONF = "dirty_decay_ms:0,muzzy_decay_ms:0"
# What the CLI's process and the events process run Arrow with (a variable already set is kept).
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
    (nothing else: see map_large_blocks); True when glibc took it."""
    return bool(_LIBC.mallopt(_M_MMAP_THRESHOLD, threshold)) if _LIBC is not None else False


def map_large_blocks(threshold: int = LARGE_BLOCK_BYTES) -> bool:
    """Serve blocks of at least `threshold` bytes from their own mappings from now on, in this process
    (fixes glibc's otherwise rising threshold), Arrow's included, and every thread from one arena
    (call it before threads allocate); True when glibc took the settings."""
    if _LIBC is None:
        return False
    import pyarrow as pa

    pa.set_memory_pool(pa.system_memory_pool())
    return set_mmap_threshold(threshold) and one_arena()
