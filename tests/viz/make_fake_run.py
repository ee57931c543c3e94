"""Write a large synthetic run folder (docs/run-format.md) to measure figure speed by hand.

Not a simulator: requests are served FCFS at a fixed time per output token and admitted when their
whole final length fits, which is enough to give tables of realistic size and shape. Defaults give
about 20k requests and 1.5M paged tenures (Azure-conversation-like lengths).

    .venv/bin/python tests/viz/make_fake_run.py OUT_DIR [NUM_REQUESTS] [CAPACITY_TOKENS]
"""
from __future__ import annotations

import heapq
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from pagelab.run_format import MEMORY_STATES

STATES = MEMORY_STATES
ALLOCATORS = ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle")
TPOT_S, PREFILL_S, MAX_MODEL_LEN = 0.03, 0.1, 4096


class FirstFit:
    """First-fit placement over a linear slot space (free segments kept sorted)."""

    def __init__(self, capacity: int):
        self.free = [(0, capacity)]

    def alloc(self, size: int) -> int | None:
        for i, (start, length) in enumerate(self.free):
            if length >= size:
                self.free[i] = (start + size, length - size)
                if length == size:
                    del self.free[i]
                return start
        return None

    def release(self, start: int, size: int) -> None:
        self.free.append((start, size))
        self.free.sort()
        merged = [self.free[0]]
        for s, n in self.free[1:]:
            ps, pn = merged[-1]
            merged[-1:] = [(ps, pn + n)] if ps + pn == s else [(ps, pn), (s, n)]
        self.free = merged


def reservation(policy: str, length: int) -> int:
    """Slots a contiguous policy reserves for a request of final `length`."""
    if policy == "contiguous-max":
        return MAX_MODEL_LEN
    if policy == "contiguous-pow2":
        return 1 << int(np.ceil(np.log2(length)))
    return length


def serve(policy, arrival, prompt, output, capacity, bs):
    """FCFS service; returns admitted_s, finish_s and tenure rows."""
    n = len(arrival)
    length = prompt + output
    admitted = np.full(n, np.nan)
    finish = np.full(n, np.nan)
    rows: list[tuple] = []
    free_blocks = list(range(capacity // bs - 1, -1, -1))
    space = FirstFit(capacity)
    running: list[tuple[float, int, list]] = []
    now, head = 0.0, 0
    while head < n or running:
        nxt = arrival[head] if head < n else np.inf
        if running and running[0][0] <= max(now, nxt):
            now, i, held = heapq.heappop(running)
            if policy == "paged":
                free_blocks.extend(held)
            else:
                space.release(*held)
            continue
        now = max(now, nxt)
        i = head
        if policy == "paged":
            need = -(-int(length[i]) // bs)
            if need > len(free_blocks):
                if not running:
                    raise RuntimeError("request larger than the pool")
                now = running[0][0]
                continue
            held = free_blocks[-need:]
            del free_blocks[-need:]
        else:
            size = reservation(policy, int(length[i]))
            start = space.alloc(size)
            if start is None:
                if not running:
                    raise RuntimeError("request larger than the pool")
                now = running[0][0]
                continue
            held = (start, size)
        head += 1
        admitted[i] = now
        first = now + PREFILL_S
        finish[i] = first + (output[i] - 1) * TPOT_S
        heapq.heappush(running, (finish[i], i, held))
        if policy == "paged":
            for k, block in enumerate(held):
                t0 = now if k * bs < prompt[i] else first + (k * bs - prompt[i]) * TPOT_S
                fill = min(bs, int(length[i]) - k * bs)
                ref = 2 if (i % 50 == 0 and k == 0) else 1
                rows.append((i, block * bs, bs, t0, finish[i], ref, fill))
        else:
            rows.append((i, held[0], held[1], now, finish[i], 1, int(length[i])))
    return admitted, finish, rows


def active_sum(t, t0, t1, weight):
    """Sum of `weight` over intervals [t0, t1) containing each time in t (vectorized)."""
    o0, o1 = np.argsort(t0), np.argsort(t1)
    c0 = np.concatenate([[0.0], np.cumsum(weight[o0])])
    c1 = np.concatenate([[0.0], np.cumsum(weight[o1])])
    return c0[np.searchsorted(t0[o0], t, "right")] - c1[np.searchsorted(t1[o1], t, "right")]


def memory_rows(policy, t, req, events, capacity, bs):
    """Approximate per-step memory fractions from the request timings."""
    arrival, adm, first, fin = (req[c].to_numpy(float) for c in
                                ("arrival_s", "admitted_s", "first_token_s", "finish_s"))
    prompt, out = req["prompt_len"].to_numpy(float), req["output_len"].to_numpy(float)
    running = active_sum(t, adm, fin, np.ones(len(adm)))
    waiting = active_sum(t, arrival, adm, np.ones(len(adm)))
    # tokens(t) = prompt before the first token, then prompt + (t - first) / TPOT.
    tokens = active_sum(t, adm, first, prompt) + active_sum(t, first, fin, prompt - first / TPOT_S) \
        + t * active_sum(t, first, fin, np.full(len(adm), 1.0 / TPOT_S))
    held = active_sum(t, events["t_start_s"].to_numpy(float), events["t_end_s"].to_numpy(float),
                      events["size"].to_numpy(float))
    if policy == "paged":
        final = active_sum(t, adm, fin, prompt + out)
        blocks = active_sum(t, adm, fin, np.ceil((prompt + out) / bs) * bs)
        internal = np.maximum(blocks - final, 0) * np.minimum(1.0, held / np.maximum(blocks, 1))
        ext = np.full(len(t), capacity % bs, dtype=float)
    else:
        final = active_sum(t, adm, fin, prompt + out)
        internal = np.maximum(held - final, 0)
        ext = np.where(waiting > 0, capacity - held, 0.0)
    token = np.minimum(tokens, held)
    reserve = np.maximum(held - token - internal, 0)
    free = np.maximum(capacity - held - ext, 0)
    frac = np.column_stack([token, reserve, internal, ext, free]) / capacity
    frac /= frac.sum(axis=1, keepdims=True)
    return frac, running, waiting, held


def write_allocator(folder, policy, arrival, prompt, output, capacity, bs, num_rows, seed):
    """Serve the trace with one policy and write its five files; returns its SUMMARY."""
    folder.mkdir(parents=True)
    admitted, finish, rows = serve(policy, arrival, prompt, output, capacity, bs)
    first = admitted + PREFILL_S
    req = pd.DataFrame({"request_id": np.arange(len(arrival), dtype=np.int64), "arrival_s": arrival,
                        "prompt_len": prompt, "output_len": output, "n": 1, "beam_width": 1,
                        "admitted_s": admitted, "first_token_s": first, "finish_s": finish,
                        "num_preemptions": 0, "rejected": False, "prefix_hit_tokens": 0})
    req["queueing_s"] = admitted - arrival
    req["ttft_s"] = first - arrival
    req["tpot_s"] = (finish - first) / np.maximum(output - 1, 1)
    req["e2e_s"] = finish - arrival
    req["normalized_latency_s"] = req["e2e_s"] / output
    cols = ["request_id", "start", "size", "t_start_s", "t_end_s", "max_ref_count", "filled"]
    events = pd.DataFrame(rows, columns=cols)
    duration = float(np.nanmax(finish))
    t = np.linspace(0.0, duration, num_rows, endpoint=False)
    dt = np.full(num_rows, duration / num_rows)
    frac, running, waiting, held = memory_rows(policy, t, req, events, capacity, bs)
    mem = pd.DataFrame(frac, columns=list(STATES))
    mem.insert(0, "dt_s", dt)
    mem.insert(0, "t_s", t)
    mem.insert(0, "num_steps", np.ones(num_rows, dtype=np.int64))
    mem.insert(0, "step", np.arange(num_rows, dtype=np.int64))
    mem["cached_free"] = 0.0
    mem["token_occupancy"] = mem["token_states"]
    mem["block_occupancy"] = held / capacity
    mem["num_running"] = running.round().astype(np.int64)
    mem["num_waiting"] = waiting.round().astype(np.int64)
    mem["num_swapped"] = np.zeros(num_rows, dtype=np.int64)
    mem["num_batched_tokens"] = mem["num_running"]
    mem["blocks_used"] = (held // bs).astype(np.int64)
    req.to_parquet(folder / "requests.parquet")
    mem.to_parquet(folder / "memory.parquet")
    events.to_parquet(folder / "events.parquet")

    def stats(col):
        v = req[col].dropna().to_numpy(float)
        return {"mean": float(v.mean()), **{f"p{q}": float(np.percentile(v, q)) for q in (50, 90, 99)}}
    fractions = {s: float(np.average(mem[s], weights=dt)) for s in STATES}
    summary = {"capacity_tokens": capacity, "block_size": bs, "num_blocks": capacity // bs,
               "num_requests": len(req), "num_finished": len(req), "num_rejected": 0, "num_preemptions": 0,
               "sim_duration_s": duration, "wall_s": 0.0,
               "mean_batch_size": float(np.average(mem["num_running"], weights=dt)),
               "throughput_tokens_per_s": float(output.sum() / duration),
               "normalized_latency_s_per_token": float(req["normalized_latency_s"].mean()),
               "ttft_s": stats("ttft_s"), "tpot_s": stats("tpot_s"), "e2e_s": stats("e2e_s"),
               "memory": {**fractions, "cached_free": 0.0}, "token_occupancy": fractions["token_states"],
               "block_occupancy": float(np.average(mem["block_occupancy"], weights=dt)),
               "prefix_cache_hit_rate": 0.0 if policy == "paged" else None}
    config = {"seed": seed, "pagelab_version": "fake", "source": "simulate", "allocator": policy,
              "capacity_tokens": capacity, "block_size": bs, "max_model_len": MAX_MODEL_LEN}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "summary.json").write_text(json.dumps(summary))
    return summary


def write_fake_run(out: Path, num_requests: int = 20_000, capacity: int = 65_536, block_size: int = 16,
                   rate: float = 5.0, num_memory_rows: int = 100_000, seed: int = 0,
                   allocators: tuple[str, ...] = ALLOCATORS) -> Path:
    """Write the run folder `out` (must not exist) and return it."""
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1.0 / rate, num_requests))
    prompt = np.clip(rng.lognormal(np.log(800), 0.8, num_requests), 4, 3000).astype(np.int64)
    output = np.clip(rng.lognormal(np.log(180), 0.9, num_requests), 2, MAX_MODEL_LEN - 3000).astype(np.int64)
    out = Path(out)
    out.mkdir(parents=True)
    top = {"trace": {"name": "fake-azure-like", "num_requests": num_requests, "rate": rate}, "allocators": {}}
    for policy in allocators:
        top["allocators"][policy] = write_allocator(out / policy, policy, arrival, prompt, output,
                                                    capacity, block_size, num_memory_rows, seed)
    (out / "summary.json").write_text(json.dumps(top))
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args:
        raise SystemExit(__doc__)
    write_fake_run(Path(args[0]), *(int(a) for a in args[1:3]))
