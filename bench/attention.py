"""Decode-attention benchmark: paged (Triton, torch) vs contiguous SDPA on a dense cache.

Library side of `pagelab bench attention`: builds inputs, times each implementation and returns
records; the CLI prints them. On a GPU the kernels and SDPA are timed as the engine runs decode: calls
captured in a CUDA graph, over copies of the inputs that exceed the L2 cache (graph_times); the torch
reference and everything on a CPU, call by call. Bytes counted per call are the K and V actually read
(batch x context x kv heads x head_dim x 2) plus the queries and the outputs — the same for every
implementation.
"""
from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from gpu_backend.ops import get_backend
from gpu_backend.ops.cases import make_paged_case
from gpu_backend.ops.checks import KernelInputError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Timed in CUDA graphs on a GPU, as the engine runs decode; the torch reference runs call by call (it is
# not written to be captured).
GRAPHED = ("paged-triton", "paged-triton-1pass", "region-triton", "sdpa-dense")


@dataclass(frozen=True)
class AttentionBenchConfig:
    """One benchmark grid: batch x context x (heads, kv heads) x head_dim."""

    device: str = "cpu"
    dtype: str = "float32"
    batches: tuple[int, ...] = (1, 16)
    contexts: tuple[int, ...] = (256, 1024)
    heads: tuple[tuple[int, int], ...] = ((32, 8),)
    head_dims: tuple[int, ...] = (128,)
    block_size: int = 16
    impls: tuple[str, ...] = ("paged-triton", "paged-torch", "region-torch", "sdpa-dense")
    min_time_s: float = 0.3  # per implementation and shape
    max_repeats: int = 50
    seed: int = 0


def default_config(device: str) -> AttentionBenchConfig:
    """Grid sized for the device: small on CPU (< 1 min); on CUDA, bf16 up to batch 64 and 32k context."""
    if torch.device(device).type == "cuda":
        return AttentionBenchConfig(device=device, dtype="bfloat16", batches=(1, 16, 64),
                                    contexts=(1024, 4096, 32768),
                                    impls=("paged-triton", "paged-triton-1pass", "region-triton",
                                           "paged-torch", "sdpa-dense"))
    return AttentionBenchConfig(device=device)


@dataclass(frozen=True)
class AttentionRecord:
    """Timing of one implementation on one shape."""

    impl: str
    batch: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    device: str
    time_ms: float
    bytes: int
    gb_per_s: float
    copy_bw_fraction: float | None  # gb_per_s / measured device copy bandwidth
    vs_sdpa: float | None  # time / sdpa-dense time on the same shape
    rel_err_vs_sdpa: float | None  # ||out - sdpa|| / ||sdpa||: both must compute the same attention


@dataclass(frozen=True)
class AttentionBenchResult:
    """All records plus the machine they were measured on."""

    machine: dict
    records: list[AttentionRecord] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"machine": self.machine, "records": [asdict(r) for r in self.records]}


def _sync(device: torch.device) -> None:
    """Wait for queued device work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth_gbps(device: torch.device, num_bytes: int = 1 << 28, repeats: int = 9) -> float:
    """Measured device memory copy bandwidth: (read + write bytes) / median time of a large copy."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * num_bytes / statistics.median(times[1:]) / 1e9


def machine_info(device: torch.device, copy_gbps: float) -> dict:
    """Where the numbers come from."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = _cpu_model() or platform.processor() or platform.machine()
    return {"device": str(device), "name": name, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "copy_gb_per_s": round(copy_gbps, 1)}


def _cpu_model() -> str | None:
    """CPU model name and logical core count from /proc/cpuinfo (Linux)."""
    try:
        with open("/proc/cpuinfo") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    models = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")]
    return f"{models[0]} ({len(models)} logical cores)" if models else None


def _median_times(fns: dict, device: torch.device, min_time_s: float, max_repeats: int) -> dict[str, float]:
    """Median seconds per call of each function, timed in interleaved rounds (fair under background load)."""
    if not fns:
        return {}
    first = {}
    for name, fn in fns.items():
        fn()  # warm-up: compilation, allocator
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        first[name] = time.perf_counter() - start
    repeats = int(min(max_repeats, max(3, min_time_s / max(max(first.values()), 1e-6))))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def _num_copies(config: AttentionBenchConfig, device: torch.device, shape: tuple[int, ...]) -> int:
    """Copies of a shape's inputs that together span three times the L2 cache, so that back-to-back calls
    read from memory as the engine's layers do (each layer reads its own KV), not from the cache."""
    batch, context, _, num_kv_heads, head_dim = shape
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * DTYPES[config.dtype].itemsize
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return max(1, -(-3 * l2 // kv_bytes))


def graph_times(copies: list[dict], min_time_s: float, max_rounds: int, calls: int = 20) -> dict[str, float]:
    """Median seconds per call of each implementation, its calls captured in a CUDA graph and replayed.

    The engine replays decode in CUDA graphs, so what counts is the kernels' time, not Python's launch
    cost. copies[i][name] is the call on the i-th copy of the inputs; a graph cycles through the copies.
    Graphs are replayed in interleaved rounds, timed with CUDA events.
    """
    calls = len(copies) * -(-calls // len(copies))
    graphs = {}
    for name in copies[0]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for fns in copies:  # compile and warm the allocator outside the capture
                fns[name]()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                copies[i % len(copies)][name]()
        graph.replay()
        graphs[name] = graph
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for graph in graphs.values():
        graph.replay()
    torch.cuda.synchronize()
    rounds = int(min(max_rounds, max(3, min_time_s / max(time.perf_counter() - begin, 1e-6))))
    samples: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, graph in graphs.items():
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples[name].append(begin.elapsed_time(end) / 1e3 / calls)
    return {name: statistics.median(s) for name, s in samples.items()}


def _shape_fns(config: AttentionBenchConfig, device: torch.device, rng, batch: int, context: int,
               num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[dict, dict]:
    """Callables per implementation for one shape, and their outputs (for the cross-check)."""
    dtype = DTYPES[config.dtype]
    case = make_paged_case(rng, [context] * batch, num_heads, num_kv_heads, head_dim, config.block_size,
                           dtype=dtype, device=device, share_blocks=False, nan_fill=False)
    group = num_heads // num_kv_heads
    # Dense cache [B, Hkv, L, D] holding the same values, as a contiguous-allocation engine keeps them.
    table = case.block_tables[:, : context // config.block_size + (context % config.block_size > 0)].long()
    k_dense = case.k_cache[table].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    v_dense = case.v_cache[table].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    q_folded = case.q.view(batch, num_kv_heads, group, head_dim)  # GQA folded into the query axis
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, case.scale)
    # Contiguous regions (what the contiguous allocators hand the kernels): sequence b owns slots
    # [b * context, (b + 1) * context) of a linear [num_slots, 1, Hkv, D] pool, passed as (start, length).
    k_region = case.k_cache[table].flatten(1, 2)[:, :context].reshape(-1, 1, num_kv_heads, head_dim)
    v_region = case.v_cache[table].flatten(1, 2)[:, :context].reshape(-1, 1, num_kv_heads, head_dim)
    starts = (torch.arange(batch, device=device, dtype=torch.int64) * context)[:, None]
    region_args = (case.q, k_region, v_region, starts, case.context_lens, case.scale)
    # The engine passes the longest context it knows on the host; so does the benchmark.
    known = {"max_context_len": context}
    fns = {}
    for impl in config.impls:
        if impl == "sdpa-dense":
            fns[impl] = lambda: F.scaled_dot_product_attention(q_folded, k_dense, v_dense, scale=case.scale)
        elif impl == "paged-torch":
            backend = get_backend("torch", device)
            fns[impl] = lambda b=backend: b.decode(*args, **known)
        elif impl.startswith("paged-triton") and device.type == "cuda":
            backend = get_backend("triton", device)
            splits = 1 if impl.endswith("1pass") else None
            fns[impl] = lambda b=backend, s=splits: b.decode(*args, num_splits=s, **known)
        elif impl == "region-torch":
            backend = get_backend("torch", device)
            fns[impl] = lambda b=backend: b.decode(*region_args, contiguous=True, **known)
        elif impl == "region-triton" and device.type == "cuda":
            backend = get_backend("triton", device)
            fns[impl] = lambda b=backend: b.decode(*region_args, contiguous=True, **known)
    outputs = {name: fn().reshape(batch, num_heads, head_dim) for name, fn in fns.items()}
    return fns, outputs


def run_attention_bench(config: AttentionBenchConfig) -> AttentionBenchResult:
    """Time every implementation over the grid; Triton entries are skipped off CUDA."""
    if config.dtype not in DTYPES:
        raise KernelInputError(f"bench dtype must be one of {', '.join(DTYPES)}, got {config.dtype!r}")
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise KernelInputError("bench device 'cuda' requested but CUDA is not available")
    copy_gbps = copy_bandwidth_gbps(device)
    records: list[AttentionRecord] = []
    rng = np.random.default_rng(config.seed)
    for num_heads, num_kv_heads in config.heads:
        if num_heads % num_kv_heads:
            raise KernelInputError(f"bench heads {num_heads}:{num_kv_heads}: not a multiple (GQA)")
        for head_dim in config.head_dims:
            for batch in config.batches:
                for context in config.contexts:
                    shape = (batch, context, num_heads, num_kv_heads, head_dim)
                    fns, outputs = _shape_fns(config, device, rng, *shape)
                    graphed = [k for k in fns if device.type == "cuda" and k in GRAPHED]
                    times = _median_times({k: f for k, f in fns.items() if k not in graphed}, device,
                                          config.min_time_s, config.max_repeats)
                    if graphed:
                        copies = [fns] + [_shape_fns(config, device, rng, *shape)[0]
                                          for _ in range(_num_copies(config, device, shape) - 1)]
                        copies = [{k: c[k] for k in graphed} for c in copies]
                        times.update(graph_times(copies, config.min_time_s, config.max_repeats))
                        del copies
                    times = {k: times[k] for k in fns}
                    records.extend(_records(config, device, shape, times, outputs, copy_gbps))
                    del fns, outputs
    return AttentionBenchResult(machine=machine_info(device, copy_gbps), records=records)


def _records(config, device, shape, times: dict, outputs: dict, copy_gbps: float) -> list[AttentionRecord]:
    """Turn one shape's timings into records (bytes, bandwidth, ratio and error vs SDPA)."""
    batch, context, num_heads, num_kv_heads, head_dim = shape
    elem = torch.empty((), dtype=DTYPES[config.dtype]).element_size()
    num_bytes = (2 * batch * context * num_kv_heads * head_dim + 2 * batch * num_heads * head_dim) * elem
    sdpa_time, sdpa_out = times.get("sdpa-dense"), outputs.get("sdpa-dense")
    records = []
    for impl, seconds in times.items():
        rate = num_bytes / seconds / 1e9
        err = None
        if sdpa_out is not None and impl != "sdpa-dense":
            diff = (outputs[impl].double() - sdpa_out.double()).norm()
            err = float(diff / sdpa_out.double().norm())
        records.append(AttentionRecord(
            impl=impl, batch=batch, context=context, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, dtype=config.dtype, device=str(device), time_ms=seconds * 1e3,
            bytes=num_bytes, gb_per_s=rate, copy_bw_fraction=rate / copy_gbps if copy_gbps else None,
            vs_sdpa=seconds / sdpa_time if sdpa_time else None, rel_err_vs_sdpa=err))
    return records
