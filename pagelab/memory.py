"""Give freed heap memory back to the operating system (glibc), so a long run's RSS follows what it holds.

A simulation frees as much as it allocates (requests come and go, event batches are paired and written),
but glibc keeps freed chunks in its arenas, and with the pairing thread's batch-sized numpy temporaries
that retained memory grew with the run: measured on the 1M-request trace, 420 MB resident of which
160 MB was free (`malloc_trim` brought it to 260 MB). Calling `malloc_trim(0)` once per batch of
requests or tenures (every few seconds, ~1 ms) keeps the run's resident memory flat from 1M to 10M
requests. Elsewhere than glibc this does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util


def _load_trim():
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows)
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _load_trim()


def release_free_memory() -> bool:
    """Return free heap pages to the OS; True when glibc released something."""
    return bool(_TRIM(0)) if _TRIM is not None else False
