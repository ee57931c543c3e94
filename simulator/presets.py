"""GPU presets, and the KV capacity in token slots that a model (simulator/core/models.py) has on one."""
from __future__ import annotations

from dataclasses import dataclass

from simulator.core.errors import ConfigError
from simulator.core.models import ModelSpec, get_model

GIB = 2**30
# Activations, CUDA graphs and allocator slack that vLLM finds by a profiling run; we cannot profile a
# simulated GPU, so a flat reserve stands in for it (docs/design.md).
DEFAULT_ACTIVATION_RESERVE_BYTES = 1 * GIB


@dataclass(frozen=True)
class GPUSpec:
    """Datasheet figures of one GPU plus the step-latency coefficients calibrated for it."""

    name: str
    memory_bytes: int
    hbm_bandwidth: float  # bytes/s, datasheet peak
    peak_flops: float  # dense fp16/bf16 tensor-core FLOP/s (no sparsity)
    pcie_bandwidth: float  # bytes/s, one direction, host <-> device
    flops_efficiency: float  # achievable fraction of peak_flops in large GEMMs (assumption)
    bandwidth_efficiency: float  # achievable fraction of hbm_bandwidth when streaming weights (assumption)
    step_overhead_s: float  # scheduler, launch and sampling time per step outside both terms (assumption)


# Datasheet figures (NVIDIA A100 / H100 / H200 datasheets, SXM form factor). Memory is the marketed
# capacity read as GiB, which is what nvidia-smi reports as total (40960 / 81920 MiB); bf16 peak is the
# dense figure (half the "with sparsity" one); PCIe is one direction of an x16 link (Gen4 32 GB/s,
# Gen5 64 GB/s). The last three fields are our assumptions (docs/design.md).
GPUS: dict[str, GPUSpec] = {
    "a100-40gb": GPUSpec(
        name="a100-40gb", memory_bytes=40 * GIB, hbm_bandwidth=1.555e12, peak_flops=312e12,
        pcie_bandwidth=32e9, flops_efficiency=0.6, bandwidth_efficiency=0.8, step_overhead_s=2e-3,
    ),
    "a100-80gb": GPUSpec(
        name="a100-80gb", memory_bytes=80 * GIB, hbm_bandwidth=2.039e12, peak_flops=312e12,
        pcie_bandwidth=32e9, flops_efficiency=0.6, bandwidth_efficiency=0.8, step_overhead_s=2e-3,
    ),
    "h100-80gb": GPUSpec(
        name="h100-80gb", memory_bytes=80 * GIB, hbm_bandwidth=3.35e12, peak_flops=989.4e12,
        pcie_bandwidth=64e9, flops_efficiency=0.5, bandwidth_efficiency=0.8, step_overhead_s=1.5e-3,
    ),
    "h200": GPUSpec(
        name="h200", memory_bytes=141 * GIB, hbm_bandwidth=4.8e12, peak_flops=989.4e12,
        pcie_bandwidth=64e9, flops_efficiency=0.5, bandwidth_efficiency=0.8, step_overhead_s=1.5e-3,
    ),
    # The CPU the engine's CPU replays run on (this project's 2-vCPU EPYC guest): rough figures, only the
    # roofline would use them; simulations of CPU replays should use a fitted profile (cpu-tiny).
    "cpu": GPUSpec(
        name="cpu", memory_bytes=24 * GIB, hbm_bandwidth=20e9, peak_flops=100e9,
        pcie_bandwidth=10e9, flops_efficiency=0.3, bandwidth_efficiency=0.5, step_overhead_s=2e-3,
    ),
}


def get_gpu(name: str) -> GPUSpec:
    """Look up a GPU preset by name."""
    try:
        return GPUS[name]
    except KeyError:
        raise ConfigError(f"unknown gpu {name!r}; valid gpus: {', '.join(sorted(GPUS))}") from None


def kv_bytes_for(
    model: ModelSpec | str,
    gpu: GPUSpec | str | None = None,
    gpu_memory_utilization: float = 0.9,
    kv_memory_gb: float | None = None,
    activation_reserve_bytes: int = DEFAULT_ACTIVATION_RESERVE_BYTES,
) -> float:
    """Bytes available to the KV cache: `kv_memory_gb` GiB if given, else what the GPU has left."""
    model = get_model(model) if isinstance(model, str) else model
    if kv_memory_gb is not None:
        # An explicit KV budget (the paper's "12 GB") overrides the GPU arithmetic entirely.
        if not kv_memory_gb > 0:
            raise ConfigError(f"kv_memory_gb must be positive, got {kv_memory_gb}")
        return kv_memory_gb * GIB
    if gpu is None:
        raise ConfigError("give either a gpu or kv_memory_gb to size the KV cache")
    gpu = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if not 0 < gpu_memory_utilization <= 1:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if activation_reserve_bytes < 0:
        raise ConfigError(f"activation_reserve_bytes must be >= 0, got {activation_reserve_bytes}")
    budget = gpu.memory_bytes * gpu_memory_utilization
    kv_bytes = budget - model.weight_bytes - activation_reserve_bytes
    if kv_bytes <= 0:
        raise ConfigError(
            f"{model.name} does not fit on {gpu.name}: {model.weight_bytes / GIB:.2f} GiB of weights + "
            f"{activation_reserve_bytes / GIB:.2f} GiB activation reserve > {budget / GIB:.2f} GiB "
            f"({gpu_memory_utilization:g} of {gpu.memory_bytes / GIB:.0f} GiB); use a larger GPU, a higher "
            "gpu_memory_utilization, or kv_memory_gb"
        )
    return kv_bytes


def kv_capacity_tokens(
    model: ModelSpec | str,
    gpu: GPUSpec | str | None = None,
    gpu_memory_utilization: float = 0.9,
    kv_memory_gb: float | None = None,
    activation_reserve_bytes: int = DEFAULT_ACTIVATION_RESERVE_BYTES,
) -> int:
    """KV capacity C in token slots: floor(kv_bytes / bytes_per_token)."""
    model = get_model(model) if isinstance(model, str) else model
    kv_bytes = kv_bytes_for(model, gpu, gpu_memory_utilization, kv_memory_gb, activation_reserve_bytes)
    capacity = int(kv_bytes // model.bytes_per_token)
    if capacity < 1:
        raise ConfigError(
            f"{kv_bytes:.0f} bytes of KV memory hold no token of {model.name} "
            f"({model.bytes_per_token} bytes per token)"
        )
    return capacity
