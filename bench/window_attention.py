"""Sliding-window decode against full attention at the same number of KV blocks read.

For each (batch, blocks read N, block size) the sweep times two decode calls over the same pool:
full attention over a block table of N blocks (context N x block_size), and sliding-window attention
with window N x block_size over the whole, longer table of the same sequences (context `long_factor`
times longer, window start on a block boundary), so both read exactly the last N blocks of every
sequence and compute the same outputs; only the window logic differs. The target is a sliding/full time
ratio of at most 1.10 (Triton on a GPU). Timing is `bench.attention`'s: medians of interleaved rounds.

`python -m bench.window_attention [--device cuda] [--json FILE]`; without CUDA it runs the torch backend
at small sizes (the Triton kernels need a GPU or the interpreter, whose times mean nothing).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass

import numpy as np
import torch

from bench.attention import DTYPES, _median_times, machine_info
from gpu_backend.ops import get_backend
from gpu_backend.ops.cases import make_paged_case
from gpu_backend.ops.reference import relative_error

TARGET_RATIO = 1.10  # sliding time / full time at the same blocks read


@dataclass(frozen=True)
class WindowBenchConfig:
    """One sweep: batch x blocks read x block size, one head layout and dtype."""

    device: str = "cpu"
    backend: str = "torch"
    dtype: str = "float32"
    batches: tuple[int, ...] = (1, 8)
    blocks_read: tuple[int, ...] = (8, 32)
    block_sizes: tuple[int, ...] = (16,)
    long_factor: int = 4  # the sliding case's context is this many times the window
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    min_time_s: float = 0.2
    max_repeats: int = 30
    seed: int = 0


def default_config(device: str) -> WindowBenchConfig:
    """Sizes for the device: on CUDA the Triton kernels in bf16 from 1 to 64 sequences and 4 to 256 blocks
    (64 to 4096 tokens of window); elsewhere a small torch sweep (seconds)."""
    if torch.device(device).type == "cuda":
        return WindowBenchConfig(device=device, backend="triton", dtype="bfloat16", batches=(1, 16, 64),
                                 blocks_read=(4, 32, 256), block_sizes=(16, 64))
    return WindowBenchConfig(device=device, num_heads=8, num_kv_heads=2, head_dim=64)


def _shape(config: WindowBenchConfig, rng, batch: int, blocks: int, block_size: int) -> dict:
    """Time full and sliding decode reading `blocks` blocks per sequence; their outputs must agree."""
    device = torch.device(config.device)
    window = blocks * block_size
    long_ctx = config.long_factor * window
    case = make_paged_case(rng, [long_ctx] * batch, config.num_heads, config.num_kv_heads, config.head_dim,
                           block_size, dtype=DTYPES[config.dtype], device=device, share_blocks=False,
                           nan_fill=False)
    total = long_ctx // block_size
    last = case.block_tables[:, total - blocks: total].contiguous()  # the blocks the window covers
    backend = get_backend(config.backend, device)
    full_lens = torch.full((batch,), window, dtype=torch.int32, device=device)
    full_args = (case.q, case.k_cache, case.v_cache, last, full_lens, case.scale)
    slide_args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, case.scale)
    fns = {"full": lambda: backend.decode(*full_args, max_context_len=window),
           "sliding": lambda: backend.decode(*slide_args, max_context_len=long_ctx, window=window)}
    err = relative_error(fns["sliding"](), fns["full"]().double())
    times = _median_times(fns, device, config.min_time_s, config.max_repeats)
    return {"batch": batch, "blocks_read": blocks, "block_size": block_size, "window": window,
            "sliding_context": long_ctx, "full_ms": times["full"] * 1e3, "sliding_ms": times["sliding"] * 1e3,
            "ratio": times["sliding"] / times["full"], "rel_err": err}


def run_window_bench(config: WindowBenchConfig) -> dict:
    """Every shape of the sweep, the machine, and whether the worst ratio meets the target."""
    rng = np.random.default_rng(config.seed)
    rows = [_shape(config, rng, b, n, bs) for bs in config.block_sizes for b in config.batches
            for n in config.blocks_read]
    from bench.attention import copy_bandwidth_gbps

    device = torch.device(config.device)
    worst = max(r["ratio"] for r in rows)
    return {"machine": machine_info(device, copy_bandwidth_gbps(device, num_bytes=1 << 24)),
            "config": dataclasses.asdict(config), "rows": rows, "worst_ratio": worst,
            "target_ratio": TARGET_RATIO, "target_met": worst <= TARGET_RATIO}


def table(result: dict) -> str:
    """The sweep as a Markdown table."""
    lines = ["| batch | blocks read | block size | full ms | sliding ms | sliding / full |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['batch']} | {r['blocks_read']} | {r['block_size']} | {r['full_ms']:.3f} | "
                     f"{r['sliding_ms']:.3f} | {r['ratio']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line of `python -m bench.window_attention`."""
    ap = argparse.ArgumentParser(prog="python -m bench.window_attention", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="also write the result as JSON to this file")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.exit(2, f"{ap.prog}: error: --device {args.device}: CUDA is not available\n")
    result = run_window_bench(default_config(args.device))
    print(table(result))
    print(f"worst sliding / full: {result['worst_ratio']:.2f} (target <= {TARGET_RATIO})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
