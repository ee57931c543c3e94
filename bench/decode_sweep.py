"""The Triton decode kernel's launch configurations swept on a GPU: `python -m bench.decode_sweep`.

For each shape it times the kernel alone (calls captured in a CUDA graph and replayed, as the engine's
decode runs them, so no Python launch cost is counted) at every (BLOCK_N, num_warps, num_stages,
num_splits), beside the current default launch and dense SDPA on the same values; the median over
replays. It writes one JSON (after every shape, so a run stopped from outside keeps what it measured).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

# (batch, context, num_heads, num_kv_heads, head_dim): llama-1b-shape's decode at the batch limits the GPU
# check steps, then the attention targets' shapes.
SHAPES = ((64, 1024, 32, 8, 64), (256, 1024, 32, 8, 64), (16, 1024, 32, 8, 128), (64, 1024, 32, 8, 128),
          (1, 32768, 32, 8, 128))
BLOCK_NS = (32, 64, 128)
WARPS = (2, 4, 8)
STAGES = (2, 3, 4)
SPLITS = (1, 2, 4)


def graph_ms(fn, calls: int = 20, replays: int = 15) -> float:
    """Median milliseconds of one call of `fn`, `calls` of them captured in a CUDA graph and replayed
    (bench.attention's graph_times over one copy of the inputs)."""
    from bench.attention import graph_times

    return 1e3 * graph_times([{"fn": fn}], float("inf"), replays, calls)["fn"]


def sweep_shape(shape: tuple[int, ...], deadline: float, seed: int = 0, dtype: str = "bfloat16",
                device: str = "cuda", time_fn=graph_ms) -> dict:
    """Every launch configuration of one shape (until the deadline), the default launch and SDPA."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from gpu_backend.ops import get_backend
    from gpu_backend.ops.cases import make_paged_case
    from gpu_backend.ops.triton_decode import paged_decode

    batch, context, hq, hkv, head_dim = shape
    case = make_paged_case(np.random.default_rng(seed), [context] * batch, hq, hkv, head_dim, 16,
                           dtype=getattr(torch, dtype), device=device, share_blocks=False, nan_fill=False)
    table = case.block_tables[:, : -(-context // 16)].long()
    k_dense = case.k_cache[table].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    v_dense = case.v_cache[table].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    q_folded = case.q.view(batch, hkv, hq // hkv, head_dim)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, case.scale)
    reference = F.scaled_dot_product_attention(q_folded, k_dense, v_dense, scale=case.scale)
    reference = reference.reshape(case.q.shape)
    kv_bytes = 2 * batch * context * hkv * head_dim * case.k_cache.element_size()
    backend = get_backend("triton", device)
    rows = {"sdpa": time_fn(lambda: F.scaled_dot_product_attention(q_folded, k_dense, v_dense,
                                                                   scale=case.scale)),
            "default": time_fn(lambda: backend.decode(*args, max_context_len=context))}
    configs = {}
    for block_n, warps, stages, splits in itertools.product(BLOCK_NS, WARPS, STAGES, SPLITS):
        if time.perf_counter() > deadline:
            break
        name = f"n{block_n}-w{warps}-s{stages}-k{splits}"
        def fn(b=block_n, w=warps, s=stages, k=splits):
            return paged_decode(*args, k, context, block_n=b, num_warps=w, num_stages=s)
        try:
            err = float((fn().float() - reference.float()).norm() / reference.float().norm())
            configs[name] = {"ms": time_fn(fn), "rel_err": err}
        except Exception as exc:  # a configuration the compiler refuses (registers, shared memory)
            configs[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    timed = {k: v["ms"] for k, v in configs.items() if "ms" in v and v["rel_err"] < 2e-2}
    best = min(timed, key=timed.get) if timed else None
    names = ("batch", "context", "num_heads", "num_kv_heads", "head_dim")
    return {"shape": dict(zip(names, shape, strict=True)),
            "kv_mb": kv_bytes / 1e6, **{f"{k}_ms": v for k, v in rows.items()},
            "best": best, "best_ms": timed.get(best), "configs": configs,
            "default_gb_per_s": kv_bytes / rows["default"] / 1e6,
            "best_gb_per_s": kv_bytes / timed[best] / 1e6 if best else None}


def main(argv: list[str] | None = None) -> int:
    """Command line of `python -m bench.decode_sweep`."""
    ap = argparse.ArgumentParser(prog="python -m bench.decode_sweep", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/decode-sweep.json"), help="the JSON written")
    ap.add_argument("--budget-s", type=float, default=120.0, help="seconds for the whole sweep; shapes and "
                    "configurations past it are left out (default 120)")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        ap.exit(2, f"{ap.prog}: error: needs a CUDA device\n")
    end = time.perf_counter() + args.budget_s
    report = {"device": torch.cuda.get_device_name(), "shapes": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for i, shape in enumerate(SHAPES):
        now = time.perf_counter()
        if now > end:
            break
        row = sweep_shape(shape, now + (end - now) / (len(SHAPES) - i))  # an equal share of what is left
        report["shapes"].append(row)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        tmp.replace(args.out)
        print(f"{shape}: sdpa {row['sdpa_ms']:.4f} ms, default {row['default_ms']:.4f} ms, "
              f"best {row['best']} {row['best_ms']} ms ({len(row['configs'])} configs)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
