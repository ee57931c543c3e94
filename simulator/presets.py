"""GPU presets, and the KV capacity that a model (simulator/core/models.py) has on one.

`kv_capacity` is the one computation of a KV pool's size: bytes per token in the KV cache dtype, the pool
in bytes, token slots and blocks, and how many requests of max_model_len tokens it holds at once, as
vLLM computes and words them at start-up ("GPU KV cache size: N tokens", "Maximum concurrency for L
tokens per request: X.XXx").
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from simulator.core.errors import ConfigError
from simulator.core.models import DEFAULT_DTYPE, ModelSpec, get_model

GIB = 2**30
# Activations, CUDA graphs and allocator slack that vLLM finds by a profiling run; we cannot profile a
# simulated GPU, so a flat reserve stands in for it (docs/design.md).
DEFAULT_ACTIVATION_RESERVE_BYTES = 1 * GIB

# vLLM's --kv-cache-dtype names -> bytes per element; "auto" is the model's serving dtype. float32 is no
# vLLM choice: it is what the engine's CPU replays store.
KV_CACHE_DTYPES: dict[str, int | None] = {"auto": None, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1,
                                          "fp8_e5m2": 1, "float32": 4}
KV_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}


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


def kv_dtype_name(kv_cache_dtype: str, model: ModelSpec) -> str:
    """The KV cache dtype `kv_cache_dtype` means for `model` ("auto": its serving dtype)."""
    name = KV_DTYPE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} (or bf16, fp16), got "
                          f"{kv_cache_dtype!r}")
    return (model.torch_dtype or DEFAULT_DTYPE) if name == "auto" else name


def kv_bytes_per_token(model: ModelSpec, kv_cache_dtype: str = "auto") -> int:
    """K and V of one token over all layers, stored in `kv_cache_dtype`."""
    name = kv_dtype_name(kv_cache_dtype, model)
    size = KV_CACHE_DTYPES.get(name) or model.dtype_bytes
    return 2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim * size


@dataclass(frozen=True)
class KVCapacity:
    """The KV pool of one configuration: how it was sized and what it holds."""

    model: str
    gpu: str | None  # None when the pool was given directly (kv_memory_gb, capacity_tokens)
    kv_cache_dtype: str  # resolved: bfloat16, float16, fp8...
    bytes_per_token: int  # K and V of one token over all layers
    sized_by: str  # "gpu_memory_utilization", "kv_memory_gb" or "capacity_tokens" (or a replay's source)
    gpu_memory_utilization: float
    weight_bytes: int | None  # subtracted from the GPU's budget (None when the GPU did not size the pool)
    reserve_bytes: int | None  # activation reserve subtracted likewise
    pool_bytes: int  # bytes given to the KV cache
    capacity_tokens: int  # token slots (a contiguous allocator uses every one)
    block_size: int
    num_blocks: int  # whole blocks of the paged pool
    max_model_len: int
    device: str = "GPU"  # the word vLLM's report starts with ("CPU" for a CPU pool)

    @property
    def num_tokens(self) -> int:
        """The paged pool in tokens: vLLM's "GPU KV cache size"."""
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """Requests of max_model_len tokens the paged pool holds at once (vLLM's "Maximum concurrency")."""
        return self.num_blocks / -(-self.max_model_len // self.block_size)

    def to_dict(self) -> dict:
        """Plain JSON, with the derived numbers."""
        return {**asdict(self), "num_tokens": self.num_tokens, "max_concurrency": self.max_concurrency}

    def lines(self) -> list[str]:
        """The start-up report: model and dtype, the pool's arithmetic, then vLLM's two lines."""
        on = f" on {self.gpu}" if self.gpu else ""
        head = (f"Model {self.model}{on}, KV cache in {self.kv_cache_dtype} "
                f"({self.bytes_per_token / 1024:g} KiB per token)")
        gib = self.pool_bytes / GIB
        if self.weight_bytes is not None:
            total = self.pool_bytes + self.weight_bytes + (self.reserve_bytes or 0)
            share, memory = self.gpu_memory_utilization, total / self.gpu_memory_utilization / GIB
            pool = (f"KV pool: {share:g} x {memory:.0f} GiB - {self.weight_bytes / GIB:.1f} GiB weights - "
                    f"{(self.reserve_bytes or 0) / GIB:g} GiB activations = {gib:.2f} GiB")
        else:
            pool = f"KV pool: {gib:.2f} GiB, as given ({self.sized_by})"
        blocks = f"{self.num_blocks:,} blocks of {self.block_size}"
        return [head, pool, f"{self.device} KV cache size: {self.num_tokens:,} tokens ({blocks})",
                f"Maximum concurrency for {self.max_model_len:,} tokens per request: "
                f"{self.max_concurrency:.2f}x"]


def kv_capacity(model: ModelSpec | str, gpu: GPUSpec | str | None = None, *,
                gpu_memory_utilization: float = 0.9, kv_memory_gb: float | None = None,
                capacity_tokens: int | None = None, kv_cache_dtype: str = "auto", block_size: int = 16,
                max_model_len: int | None = None,
                activation_reserve_bytes: int = DEFAULT_ACTIVATION_RESERVE_BYTES,
                sized_by: str | None = None, device: str | None = None) -> KVCapacity:
    """The KV pool of `model`: `capacity_tokens` slots if given, else `kv_memory_gb` GiB, else what
    `gpu_memory_utilization` of the GPU leaves after the weights and the activation reserve.

    Slots are floor(pool bytes / bytes per token), blocks floor(slots / block_size); max_model_len
    defaults to the model's. `sized_by` overrides the recorded source (a replay's measured pool), `device`
    the word the report starts with (default: CPU for the cpu preset, else GPU).
    """
    model = get_model(model) if isinstance(model, str) else model
    gpu_label = gpu.name if isinstance(gpu, GPUSpec) else gpu
    if not (isinstance(block_size, int) and block_size > 0):
        raise ConfigError(f"block_size must be a positive integer, got {block_size!r}")
    per_token = kv_bytes_per_token(model, kv_cache_dtype)
    weights = reserve = None
    if capacity_tokens is not None:
        slots, source = int(capacity_tokens), "capacity_tokens"
        kv_bytes = slots * per_token
    else:
        gpu = None if kv_memory_gb is not None else get_gpu(gpu) if isinstance(gpu, str) else gpu
        kv_bytes = kv_bytes_for(model, gpu, gpu_memory_utilization, kv_memory_gb, activation_reserve_bytes)
        slots = int(kv_bytes // per_token)
        source = "kv_memory_gb" if kv_memory_gb is not None else "gpu_memory_utilization"
        if gpu is not None:
            weights, reserve = model.weight_bytes, activation_reserve_bytes
    if slots < 1:
        raise ConfigError(f"the KV pool holds no token of {model.name or 'the model'} ({per_token} bytes per "
                          "token); give a larger pool")
    gpu_name = gpu.name if isinstance(gpu, GPUSpec) else gpu if source == "gpu_memory_utilization" else None
    return KVCapacity(model=model.name, gpu=gpu_name, kv_cache_dtype=kv_dtype_name(kv_cache_dtype, model),
                      bytes_per_token=per_token, sized_by=sized_by or source,
                      gpu_memory_utilization=gpu_memory_utilization, weight_bytes=weights,
                      reserve_bytes=reserve, pool_bytes=int(kv_bytes), capacity_tokens=slots,
                      block_size=block_size, num_blocks=slots // block_size,
                      max_model_len=max_model_len or model.max_model_len,
                      device=device or ("CPU" if gpu_label == "cpu" else "GPU"))
