"""Keep a long run's resident memory to what it holds (glibc's allocator; elsewhere these do nothing).

A simulation frees as much as it allocates (requests come and go, event batches are paired and written).
Seven allocator behaviours made its RSS grow with the run anyway, measured on the 10M-request trace:

- glibc's mmap threshold is dynamic: once a large block (a pairing batch's 8 MB numpy temporary) is
  freed, blocks up to that size come from the heap from then on. The pairing thread's batch-sized
  temporaries then left the heap fragmented: after 3M requests 340 MB of arena of which 290 MB free,
  while 30-60 MB was in use. A fixed threshold (`map_large_blocks`, 4 MiB) keeps big blocks in their own
  mappings, returned to the OS when freed: the arena stays at ~40 MB (15 MB free) and RSS at 0.3 GB.
- Freed chunks below the threshold stay in the arenas; `release_free_memory` (`malloc_trim(0)`, 7-20 ms
  on a long run's heap) returns their whole free pages: after reading the trace, after every 65,536
  request rows, and before the summary.
- Arrow's default pool (mimalloc) keeps what it freed: checking the 10M-row trace file alone left the
  process at 312 MB resident (139 MB after `release_unused`). `map_large_blocks` also moves Arrow to
  the system allocator, so Arrow's buffers follow the two rules above.
- Reading and checking a trace before the run (a 10M-row file: 153 batches of 65,536 rows, ~0.5 MB a
  column) left the heap at 67 MB with 41 MB free in holes (1M rows: 39 MB, 14 free); trimming returned
  the pages, but the loop then spread its working set over the holes and sat ~20 MB higher for the whole
  10M run. `map_large_blocks(READ_BLOCK_BYTES)` while the trace is read (the CLI does, then `simulate`
  sets 4 MiB for the loop) keeps those buffers out of the heap: 28 MB of heap at the first step for both
  traces, and a start-up peak of 161 MB instead of 198 MB at 10M.
- Each thread that allocates gets its own arena: the tenure-pairing thread's grew from 18 to 39 MB
  over a 4M-request run (about half of it free), beside a main arena with 20-27 MB free. One arena for
  all threads (`one_arena`, `M_ARENA_MAX` 1) lets each reuse the other's free space: a 3M-request run
  peaked at 243 MB instead of 252 MB (loop median 222 vs 232 MB), half the system time, the same wall
  time. The setting binds only threads without an arena, and importing numpy starts OpenBLAS threads
  that take one, so the CLI calls `one_arena` first thing (cli/__init__.py).
- The loop's two trace cursors (simulator/sim_state.py) go on reading the file: each new row group
  brings ~1 MB buffers and a dictionary page per column. Under the loop's 4 MiB threshold they came from
  the heap, between the loop's own allocations, and left it fragmented: reading the 10 row groups of
  the 10M-row trace's arrival column grew the heap 25 -> 32 MB (one row group: no growth), and the
  10M run's loop sat 6-9 MB above the 1M run's. `reading_blocks` serves a block read under the read
  threshold, then gives the loop its own back: the heap stays at 18 MB for both files.
- `pa.set_memory_pool` moves only what pyarrow's Python layer allocates: the Parquet reader's C++ code
  still takes Arrow's built-in default pool (mimalloc in pyarrow's wheels), which keeps freed pages for
  later reuse. Reading a 1M-row trace file with 16 row groups through both of the loop's cursors left
  67 MB of anonymous memory resident against 49 MB for one row group (the loop's cursors cross a row
  group every 65,536 requests of a file written with small groups). `arrow_pool_returns_memory` sets
  MIMALLOC_PURGE_DELAY=0 before pyarrow is imported (the CLI does first thing; the events process
  inherits it): mimalloc then returns freed pages at once, and the same reads leave 41 MB. (The system
  allocator for Arrow's C++ code too, ARROW_DEFAULT_MEMORY_POOL=system, left 33 MB but cost the
  simulation ~9% more CPU in five alternating 300k-request pairs.)
- Not the allocator's doing, but the same creep: a Parquet writer keeps every row group's footer entry
  until it closes (~13 MB over a 10M run's tables, placed a few kilobytes at a time among the loop's
  allocations); streamed tables start a new part file every 64 row groups (pagelab/parquet_parts.py).
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sys
from collections.abc import Iterator

_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8  # mallopt parameters (malloc.h)
LARGE_BLOCK_BYTES = 4 << 20  # for the loop
READ_BLOCK_BYTES = 256 << 10  # while a trace is read in batches, before the loop
SUMMARY_BLOCK_BYTES = 64 << 10  # after the loop, while the statistics read the request table back
MIMALLOC_PURGE_VARIABLE = "MIMALLOC_PURGE_DELAY"


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


def release_free_memory() -> bool:
    """Return free heap pages to the OS; True when glibc released something."""
    return bool(_LIBC.malloc_trim(0)) if _LIBC is not None else False


def arrow_pool_returns_memory() -> bool:
    """Have Arrow's default pool (mimalloc) return freed pages at once, in this process and the ones it
    starts (unless MIMALLOC_PURGE_DELAY is set already); True when it takes effect here (mimalloc reads
    the variable when pyarrow is first imported)."""
    os.environ.setdefault(MIMALLOC_PURGE_VARIABLE, "0")
    return "pyarrow" not in sys.modules


def one_arena() -> bool:
    """Serve every thread from one malloc arena; True when glibc took the setting. It binds only threads
    that have no arena yet: call it before numpy is imported (OpenBLAS's threads take one at import)."""
    return bool(_LIBC.mallopt(_M_ARENA_MAX, 1)) if _LIBC is not None else False


def map_large_blocks(threshold: int = LARGE_BLOCK_BYTES) -> bool:
    """Serve blocks of at least `threshold` bytes from their own mappings from now on, in this process
    (fixes glibc's otherwise rising threshold), Arrow's included, and every thread from one arena
    (call it before threads allocate); True when glibc took the settings."""
    if _LIBC is None:
        return False
    import pyarrow as pa

    pa.set_memory_pool(pa.system_memory_pool())
    took_threshold = _LIBC.mallopt(_M_MMAP_THRESHOLD, threshold)
    return bool(took_threshold) and one_arena()


@contextlib.contextmanager
def reading_blocks(read: int = READ_BLOCK_BYTES, loop: int = LARGE_BLOCK_BYTES) -> Iterator[None]:
    """Within the block, blocks of at least `read` bytes come from their own mappings; after it, those of
    at least `loop` bytes (what `map_large_blocks` set for the loop). Two `mallopt` calls: for reads
    that are rare next to the loop's own allocations (a trace block every few thousand requests)."""
    if _LIBC is None:
        yield
        return
    _LIBC.mallopt(_M_MMAP_THRESHOLD, read)
    try:
        yield
    finally:
        _LIBC.mallopt(_M_MMAP_THRESHOLD, loop)
