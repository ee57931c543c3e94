"""Map recorded prefix-block keys onto the simulator's block size.

A recorded key identifies the whole prompt prefix up to and including its block (Mooncake semantics), so
two requests with equal keys at position i can share that block. At another block size B (the recorded
size being R):

- B == R: the recorded keys of the prompt's full blocks, unchanged;
- B divides R (m = R // B): recorded block i splits into sub-blocks j = 0..m-1 with key h_i * m + j,
  a unique int standing for the pair (h_i, j); two keys are equal exactly when their pairs are;
- B is a multiple of R (k = B // R): k consecutive recorded blocks form one block whose key is the last
  of the k keys (by the semantics above it already identifies the whole prefix);
- anything else is refused.

Only blocks that lie entirely inside the prompt and are entirely covered by recorded keys get a key;
the caller treats the prompt's remaining blocks as private to the request.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from traces.errors import TraceError

if TYPE_CHECKING:
    import pandas as pd


def _ratio(recorded_block_size: int, block_size: int) -> tuple[int, int]:
    """(m, k): sub-blocks per recorded block and recorded blocks per block; one of them is 1."""
    if block_size < 1 or recorded_block_size < 1:
        raise TraceError(f"block sizes must be >= 1 (block_size={block_size}, "
                         f"recorded prefix_block_size={recorded_block_size})")
    if recorded_block_size % block_size == 0:
        return recorded_block_size // block_size, 1
    if block_size % recorded_block_size == 0:
        return 1, block_size // recorded_block_size
    raise TraceError(f"block_size {block_size} cannot reuse prefix keys recorded at {recorded_block_size} "
                     f"tokens per block: it must divide {recorded_block_size} or be a multiple of it")


def block_keys(prefix_blocks: Sequence[int], recorded_block_size: int, block_size: int,
               prompt_len: int) -> list[int]:
    """Content keys of the prompt's full blocks at `block_size` that the recorded keys cover."""
    m, k = _ratio(int(recorded_block_size), int(block_size))
    num_full = int(prompt_len) // block_size
    if m == 1 and k == 1:
        return [int(h) for h in prefix_blocks[:num_full]]
    if k > 1:
        count = min(num_full, len(prefix_blocks) // k)
        return [int(h) for h in prefix_blocks[k - 1:count * k:k]]
    count = min(num_full, len(prefix_blocks) * m)
    covered = -(-count // m)
    return [int(h) * m + j for h in prefix_blocks[:covered] for j in range(m)][:count]


def check_block_size(trace: pd.DataFrame, block_size: int) -> None:
    """Refuse before a run starts a canonical trace whose recorded keys `block_size` cannot reuse, naming
    the first request that has such keys (the run would stop there)."""
    sizes = trace["prefix_block_size"]
    for size in sizes.unique():
        try:
            _ratio(int(size), block_size)
        except TraceError as exc:
            keyed = trace["prefix_blocks"].map(len).to_numpy() > 0
            rows = np.flatnonzero((sizes.to_numpy() == size) & keyed)
            if len(rows):
                raise TraceError(f"request {trace['request_id'].iat[rows[0]]}: {exc} (or run without prefix "
                                 "caching)") from None
