"""Micro-benchmark workloads for the memory core (driven by `pagelab bench core` and pytest-benchmark)."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from simulator.core.paged.block_manager import BlockManager
from simulator.core.sequence import Sequence, SequenceGroup


@dataclass(frozen=True)
class DecodeWorkload:
    """A decode-heavy workload: `num_seqs` sequences decoding `num_tokens` tokens in total."""

    num_seqs: int = 256
    num_tokens: int = 1_000_000
    block_size: int = 16
    prompt_len: int = 100
    chunk: int = 64  # tokens per bulk call

    def __post_init__(self) -> None:
        # Each sequence decodes num_tokens // num_seqs tokens: zero would time empty loops.
        if self.num_tokens < self.num_seqs:
            raise ValueError(f"num_tokens ({self.num_tokens}) must be >= num_seqs ({self.num_seqs})")


def _setup(w: DecodeWorkload) -> tuple[BlockManager, list[Sequence]]:
    per_seq = -(-w.num_tokens // w.num_seqs)
    blocks = w.num_seqs * (-(-(w.prompt_len + per_seq) // w.block_size))
    bm = BlockManager(blocks, w.block_size, enable_prefix_caching=False)
    seqs = []
    for i in range(w.num_seqs):
        seq = Sequence(i, w.prompt_len, w.prompt_len + per_seq)
        bm.allocate(SequenceGroup(i, [seq]))
        seqs.append(seq)
    return bm, seqs


def run_single(w: DecodeWorkload) -> float:
    """Decode token by token with `append_slot`, round-robin like a batch; return seconds."""
    bm, seqs = _setup(w)
    append = bm.append_slot
    steps = w.num_tokens // w.num_seqs
    t0 = time.perf_counter()
    for _ in range(steps):
        for seq in seqs:
            append(seq)
    return time.perf_counter() - t0


def run_bulk(w: DecodeWorkload) -> float:
    """Advance every sequence `chunk` tokens at a time with `append_slot(seq, chunk)`; return seconds."""
    bm, seqs = _setup(w)
    steps = w.num_tokens // w.num_seqs
    t0 = time.perf_counter()
    done = 0
    while done < steps:
        k = min(w.chunk, steps - done)
        for seq in seqs:
            bm.append_slot(seq, k)
        done += k
    return time.perf_counter() - t0


def bench_core(w: DecodeWorkload = DecodeWorkload(), repeat: int = 5) -> dict[str, float]:
    """Median-of-`repeat` rates for the single-token and bulk paths, in tokens per second (the runs
    alternate, so a drift of the machine's speed reaches both alike)."""
    tokens = (w.num_tokens // w.num_seqs) * w.num_seqs
    singles, bulks = [], []
    for _ in range(repeat):
        singles.append(run_single(w))
        bulks.append(run_bulk(w))
    single, bulk = statistics.median(singles), statistics.median(bulks)
    return {"tokens": tokens, "single_s": single, "bulk_s": bulk,
            "single_tokens_per_s": tokens / single, "bulk_tokens_per_s": tokens / bulk,
            "bulk_speedup_per_token": single / bulk}
