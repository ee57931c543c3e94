"""The CPU tier's load time on the device: N blocks copied from pinned host slots into the device pool by
the engine's own code (gpu_backend/kv_tiers.py), against what the latency model's `load_time` charges a
simulated step for them (the roofline model, the GPU preset's PCIe bandwidth, the CPU tier's latency),
and beside them one plain copy of the same bytes (what the link gives)."""
from __future__ import annotations

import statistics
import time


def tier_copy(device: str, model: str, dtype: str, block_size: int = 16, num_blocks: int = 256,
              repeats: int = 5) -> dict:
    """Median seconds of one engine step's load of `num_blocks` blocks, the model's seconds, their ratio."""
    import torch

    from gpu_backend.engine.kv_tier_setup import gpu_preset
    from gpu_backend.kv_cache import KVCache
    from gpu_backend.kv_tiers import TierData
    from gpu_backend.model_config import resolve_dtype
    from gpu_backend.model_presets import PRESETS
    from simulator.core.paged.tier import TierSpec
    from simulator.core.paged.tier_log import TierLog
    from simulator.core.paged.tiers import Tiers
    from simulator.presets import get_gpu
    from simulator.tier_config import CPU_LATENCY_S
    from simulator.timing.step_latency import make_latency_model

    cfg, dt, dev = PRESETS[model], resolve_dtype(dtype), torch.device(device)
    per_token = cfg.kv_bytes_per_token(dt)
    gpu = gpu_preset(dev)
    bandwidth = get_gpu(gpu).pcie_bandwidth
    cache = KVCache(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
                    dtype=dt, device=dev)
    tiers = Tiers([TierSpec("cpu", num_blocks, 1, "lru", bandwidth, CPU_LATENCY_S)], "lazy", block_size,
                  per_token)
    log = TierLog()
    data = TierData(cache, tiers, log)
    slots = data.slots["cpu"]
    for h in range(num_blocks):
        slots.take(h)
    slots.data.uniform_()

    def queue_loads():
        log.ops = [["load", "cpu", h, num_blocks - 1 - h] for h in range(num_blocks)]

    measured = _median_s(data.run, dev, repeats, before=queue_loads)
    if not torch.equal(cache.v[-1][0].cpu(), slots.data[num_blocks - 1, -1, 1]):
        raise AssertionError("the loaded block differs from its tier slot")
    target = torch.empty_like(slots.data, device=dev)  # one plain copy: what the link gives
    raw = _median_s(lambda: target.copy_(slots.data, non_blocking=slots.data.is_pinned()), dev, repeats)
    latency = make_latency_model("roofline", model, gpu, kv_bytes_per_token=per_token)
    modelled = latency.load_time(num_blocks * block_size, bandwidth, CPU_LATENCY_S)
    nbytes = num_blocks * block_size * per_token
    return {"device": str(dev), "gpu_preset": gpu, "blocks": num_blocks, "block_size": block_size,
            "mib": nbytes / 2**20, "pinned": bool(slots.data.is_pinned()), "repeats": repeats,
            "measured_s": measured, "model_s": modelled, "ratio": measured / modelled,
            "gb_per_s": nbytes / measured / 1e9, "one_copy_gb_per_s": nbytes / raw / 1e9}


def _median_s(run, dev, repeats: int, before=lambda: None) -> float:
    """Median seconds of `run()` (device work synchronised) over `repeats` runs after one warm-up;
    `before()` runs untimed ahead of each."""
    import torch

    times = []
    for _ in range(repeats + 1):
        before()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        begin = time.perf_counter()
        run()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - begin)
    return statistics.median(times[1:])
