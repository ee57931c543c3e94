"""Model and GPU presets, and the KV capacity in token slots that follows from them."""
from __future__ import annotations

from dataclasses import dataclass

from simulator.core.errors import ConfigError

GIB = 2**30
# Activations, CUDA graphs and allocator slack that vLLM finds by a profiling run; we cannot profile a
# simulated GPU, so a flat reserve stands in for it (documented in docs/latency-model.md).
DEFAULT_ACTIVATION_RESERVE_BYTES = 1 * GIB


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a decoder-only transformer, as far as memory and FLOPs need it."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_params: int
    max_model_len: int
    dtype_bytes: int = 2

    @property
    def bytes_per_token(self) -> int:
        """KV-cache bytes one token occupies across all layers (K and V)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights in the serving dtype."""
        return self.num_params * self.dtype_bytes


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


# Numbers below are the fields of each model's Hugging Face config.json (num_hidden_layers, hidden_size,
# num_attention_heads, num_key_value_heads, head_dim or hidden_size / heads, intermediate_size (OPT: ffn_dim),
# vocab_size, max_position_embeddings); num_params is the exact parameter count of the checkpoint
# (tests/test_presets.py recomputes it from the architecture).
MODELS: dict[str, ModelSpec] = {
    # facebook/opt-13b: MHA, learned positions, biases everywhere, tied LM head.
    "opt-13b": ModelSpec(
        name="opt-13b", num_layers=40, hidden_size=5120, num_heads=40, num_kv_heads=40, head_dim=128,
        intermediate_size=20480, vocab_size=50272, num_params=12_853_473_280, max_model_len=2048,
    ),
    # meta-llama/Llama-2-7b-hf: MHA, untied LM head.
    "llama-2-7b": ModelSpec(
        name="llama-2-7b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=32, head_dim=128,
        intermediate_size=11008, vocab_size=32000, num_params=6_738_415_616, max_model_len=4096,
    ),
    # meta-llama/Meta-Llama-3-8B: GQA with 8 KV heads, untied LM head.
    "llama-3-8b": ModelSpec(
        name="llama-3-8b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
        intermediate_size=14336, vocab_size=128256, num_params=8_030_261_248, max_model_len=8192,
    ),
    # Qwen/Qwen2.5-7B: GQA with 4 KV heads, QKV biases, untied LM head. config.json allows 131,072
    # positions, but the model card says beyond 32,768 needs YaRN scaling, so we cap at 32,768.
    "qwen2.5-7b": ModelSpec(
        name="qwen2.5-7b", num_layers=28, hidden_size=3584, num_heads=28, num_kv_heads=4, head_dim=128,
        intermediate_size=18944, vocab_size=152064, num_params=7_615_616_512, max_model_len=32768,
    ),
    # meta-llama/Llama-3.2-1B: GQA with 8 KV heads of dim 64, tied LM head; small enough for GPU runs.
    "llama-3.2-1b": ModelSpec(
        name="llama-3.2-1b", num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8, head_dim=64,
        intermediate_size=8192, vocab_size=128256, num_params=1_235_814_400, max_model_len=131072,
    ),
    # The engine's `tiny` preset (gpu_backend/model_presets.py), fp32 on a CPU: lets the simulator stand
    # for CPU replays (calibrated profile simulator/timing/profiles/cpu-tiny.json).
    "tiny": ModelSpec(
        name="tiny", num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
        intermediate_size=688, vocab_size=1024, num_params=3_426_560, max_model_len=4096, dtype_bytes=4,
    ),
}

# Engine model presets whose shape is a simulator preset under another name (a fitted profile of a replay
# on `llama-1b-shape` applies to simulations of `llama-3.2-1b`).
ENGINE_MODEL_ALIASES: dict[str, str] = {"llama-1b-shape": "llama-3.2-1b"}

# Datasheet figures (NVIDIA A100 / H100 / H200 datasheets, SXM form factor). Memory is the marketed
# capacity read as GiB, which is what nvidia-smi reports as total (40960 / 81920 MiB); bf16 peak is the
# dense figure (half the "with sparsity" one); PCIe is one direction of an x16 link (Gen4 32 GB/s,
# Gen5 64 GB/s). The last three fields are our assumptions, see docs/latency-model.md.
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


def sim_model_name(engine_model: str) -> str:
    """The simulator preset that stands for an engine model preset (same name unless aliased)."""
    return ENGINE_MODEL_ALIASES.get(engine_model, engine_model)


def get_model(name: str) -> ModelSpec:
    """Look up a model preset by name."""
    try:
        return MODELS[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}; valid models: {', '.join(sorted(MODELS))}") from None


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
