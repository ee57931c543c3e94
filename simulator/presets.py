"""GPU presets, and the KV capacity that a model (simulator/core/models.py) has on one.

`kv_capacity` is the one computation of a KV pool's size: bytes per token in the KV cache dtype, the pool
in bytes, token slots and blocks, and how many requests of max_model_len tokens it holds at once, as
vLLM computes and words them at start-up ("GPU KV cache size: N tokens", "Maximum concurrency for L
tokens per request: X.XXx").
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from simulator.core.errors import ConfigError
from simulator.core.models import DEFAULT_DTYPE, ModelSpec, get_model

if TYPE_CHECKING:
    from simulator.core.kv_layout import KVLayout

GIB = 2**30
# Activations, CUDA graphs and allocator slack that vLLM finds by a profiling run; we cannot profile a
# simulated GPU, so a flat reserve stands in for it (docs/design.md).
DEFAULT_ACTIVATION_RESERVE_BYTES = 1 * GIB

# vLLM's --kv-cache-dtype names -> bytes per element; "auto" is the model's serving dtype. float32 is no
# vLLM choice: it is what the engine's CPU replays store.
KV_CACHE_DTYPES: dict[str, int | None] = {"auto": None, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1,
                                          "fp8_e5m2": 1, "float32": 4}
KV_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}
# Tokens one step may compute, when a plan is not told: vLLM's default for its OpenAI server on a GPU of
# 70 GiB or more other than an A100 (vllm/engine/arg_utils.py); 2048 on the others. Only sliding-window
# and chunked layers' per-request memory depends on it.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
SMALL_GPU_MAX_NUM_BATCHED_TOKENS = 2048


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
        if kv_memory_gb * GIB == float("inf"):  # inf, or so large that its bytes overflow a float
            raise ConfigError(f"kv_memory_gb {kv_memory_gb:g} GiB is too large")
        return kv_memory_gb * GIB
    if gpu is None:
        raise ConfigError("give either a gpu or kv_memory_gb to size the KV cache")
    gpu = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if not 0 < gpu_memory_utilization <= 1:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if activation_reserve_bytes < 0:
        raise ConfigError(f"activation_reserve_bytes must be >= 0, got {activation_reserve_bytes}")
    if model.num_params is None:  # the field alone: the CLI names it as its option (cli.common._as_options)
        raise ConfigError(f"{model.name or 'the model'}: its weight bytes are unknown (num_params), so the "
                          "GPU cannot size its KV pool; give its size (kv_memory_gb)")
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


def kv_dtype_bytes(model: ModelSpec, kv_cache_dtype: str = "auto") -> int:
    """Bytes per KV element in `kv_cache_dtype`."""
    return KV_CACHE_DTYPES.get(kv_dtype_name(kv_cache_dtype, model)) or model.dtype_bytes


def kv_bytes_per_token(model: ModelSpec, kv_cache_dtype: str = "auto") -> int:
    """KV of one token over all layers (K and V, or MLA's latent), stored in `kv_cache_dtype`."""
    return model.num_hidden_layers * model.kv_elements_per_layer * kv_dtype_bytes(model, kv_cache_dtype)


def default_max_num_batched_tokens(gpu: GPUSpec | str | None) -> int:
    """vLLM's OpenAI-server step budget for `gpu` (8192 when no GPU is named)."""
    gpu = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if gpu is None or (gpu.memory_bytes >= 70 * GIB and "a100" not in gpu.name):
        return DEFAULT_MAX_NUM_BATCHED_TOKENS
    return SMALL_GPU_MAX_NUM_BATCHED_TOKENS


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
    layout: KVLayout | None = None  # the KV cache groups (None: one full-attention group)
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS  # sliding layers' per-request memory

    @property
    def grouped(self) -> bool:
        """Whether the layout is more than one full-attention group (then reports name the groups)."""
        return self.layout is not None and (len(self.layout.groups) > 1 or self.layout.is_hybrid)

    @property
    def num_tokens(self) -> int:
        """The paged pool in tokens: vLLM's "GPU KV cache size" (blocks split evenly between groups)."""
        if self.grouped:
            return self.layout.num_tokens(self.num_blocks)
        return self.num_blocks * self.block_size

    @property
    def blocks_per_request(self) -> int:
        """Blocks a request of max_model_len tokens holds at most, over every group."""
        if self.grouped:
            return self.layout.blocks_per_request(self.max_model_len, self.max_num_batched_tokens)
        return -(-self.max_model_len // self.block_size)

    @property
    def max_concurrency(self) -> float:
        """Requests of max_model_len tokens the paged pool holds at once (vLLM's "Maximum concurrency")."""
        return self.num_blocks / self.blocks_per_request

    @property
    def request_bytes(self) -> int:
        """KV bytes one request of max_model_len tokens needs: what vLLM's start-up check asks of the pool."""
        return self.layout.request_bytes(self.max_model_len, self.max_num_batched_tokens)

    @property
    def fits_max_model_len(self) -> bool:
        """Whether one request of max_model_len tokens fits the pool, without which vLLM refuses to start
        (`_check_enough_kv_cache_memory`)."""
        return self.request_bytes <= self.pool_bytes

    def longest_model_len(self) -> int:
        """The longest max_model_len (up to this one) whose one request fits the pool (vLLM's
        `_estimate_max_model_len_from_groups`)."""
        return self.layout.longest_model_len(self.pool_bytes, self.max_model_len, self.max_num_batched_tokens)

    def group_rows(self) -> list[dict]:
        """Each KV cache group: its kind, window, layers, padding layers and bytes per token and page."""
        layout = self.layout
        if layout is None:
            return []
        return [{"group": i, "kind": g.spec.kind, "window": g.spec.window, "layers": len(g.layers),
                 "padding_layers": layout.padding_layers(g),
                 "bytes_per_token": g.spec.bytes_per_token * len(g.layers),
                 "block_bytes": layout.block_bytes,
                 "max_blocks_per_request": g.spec.max_blocks(self.max_model_len, self.max_num_batched_tokens)}
                for i, g in enumerate(layout.groups)]

    def to_dict(self) -> dict:
        """Plain JSON, with the derived numbers (and the groups, where there are several)."""
        out = {k: v for k, v in asdict(self).items() if k not in ("layout", "max_num_batched_tokens")}
        fits = self.fits_max_model_len
        out.update(num_tokens=self.num_tokens, max_concurrency=self.max_concurrency,
                   request_kv_bytes=self.request_bytes, fits_max_model_len=fits,
                   estimated_max_model_len=None if fits else self.longest_model_len())
        if self.grouped:
            out.update(max_num_batched_tokens=self.max_num_batched_tokens, kv_groups=self.group_rows(),
                       padding_layers=self.layout.num_padding_layers, block_bytes=self.layout.block_bytes,
                       blocks_per_request=self.blocks_per_request)
        return out

    def group_lines(self) -> list[str]:
        """The groups in one line: how many of each kind, their layers and padding, and a block's bytes."""
        if not self.grouped:
            return []
        layout, kinds = self.layout, {}
        for row in self.group_rows():
            name = row["kind"] + (f" {row['window']}" if row["window"] else "")
            n, layers, pad = kinds.get(name, (0, 0, 0))
            kinds[name] = (n + 1, layers + row["layers"], pad + row["padding_layers"])
        parts = [f"{n} x {name} ({layers} layers{f' + {pad} padding' if pad else ''})"
                 for name, (n, layers, pad) in kinds.items()]
        return [f"KV cache groups: {', '.join(parts)}; a block is {layout.group_size} layers x "
                f"{layout.page_size_bytes / 1024:g} KiB = {layout.block_bytes / 1024:g} KiB"]

    def lines(self) -> list[str]:
        """The start-up report: model and dtype, the pool's arithmetic, vLLM's lines, its refusal if any."""
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
            size = f"{gib:.2f} GiB" if gib >= 0.1 else f"{self.pool_bytes / 2**20:.2f} MiB"  # a tiny CPU pool
            pool = f"KV pool: {size}, as given ({self.sized_by})"
        blocks = f"{self.num_blocks:,} blocks of {self.block_size}"
        # What a sliding window holds per request depends on the tokens a step computes: say which.
        steps = f" (steps of {self.max_num_batched_tokens:,} tokens)" if self.grouped and any(
            g.spec.slides for g in self.layout.groups) else ""
        return [head, *self.group_lines(), pool,
                f"{self.device} KV cache size: {self.num_tokens:,} tokens ({blocks})",
                f"Maximum concurrency for {self.max_model_len:,} tokens per request: "
                f"{self.max_concurrency:.2f}x{steps}", *self.startup_lines()]

    def startup_lines(self) -> list[str]:
        """vLLM's refusal to start, worded as its error, when one request of max_model_len tokens does not
        fit the pool; nothing when it does."""
        if self.fits_max_model_len:
            return []
        longest = self.longest_model_len()
        hint = (f" Based on the available memory, the estimated maximum model length is {longest:,}."
                if longest else "")
        return [f"vLLM would not start: to serve one request of max_model_len {self.max_model_len:,} tokens, "
                f"{self.request_bytes / GIB:.2f} GiB of KV cache is needed, more than the "
                f"{self.pool_bytes / GIB:.2f} GiB available.{hint}"]


def kv_capacity(model: ModelSpec | str, gpu: GPUSpec | str | None = None, *,
                gpu_memory_utilization: float = 0.9, kv_memory_gb: float | None = None,
                capacity_tokens: int | None = None, kv_cache_dtype: str = "auto", block_size: int = 16,
                max_model_len: int | None = None, pool_tokens: int | None = None,
                activation_reserve_bytes: int = DEFAULT_ACTIVATION_RESERVE_BYTES,
                sized_by: str | None = None, device: str | None = None,
                max_num_batched_tokens: int | None = None, hybrid: bool = True) -> KVCapacity:
    """The KV pool of `model`: `capacity_tokens` slots of every layer if given, else `pool_tokens` tokens
    as vLLM reports the pool ("GPU KV cache size": with several KV cache groups, that many in each
    group), else `kv_memory_gb` GiB, else what `gpu_memory_utilization` of the GPU leaves after the
    weights and the activation reserve.

    Slots are floor(pool bytes / bytes per token), blocks floor(slots / block_size); max_model_len
    defaults to the model's. `sized_by` overrides the recorded source (a replay's measured pool), `device`
    the word the report starts with (default: CPU for the cpu preset, else GPU).

    A model with several KV cache groups (simulator/core/kv_layout.py: sliding-window and full layers)
    has floor(pool bytes / block bytes) blocks, a block being one page in each of group_size layers;
    `hybrid=False` keeps every token on every layer (vLLM's --disable-hybrid-kv-cache-manager).
    `max_num_batched_tokens` (default: vLLM's for the GPU) bounds what a sliding window holds per request.
    """
    model = get_model(model) if isinstance(model, str) else model
    gpu_label = gpu.name if isinstance(gpu, GPUSpec) else gpu
    if not (isinstance(block_size, int) and block_size > 0):
        raise ConfigError(f"block_size must be a positive integer, got {block_size!r}")
    per_token = kv_bytes_per_token(model, kv_cache_dtype)
    from simulator.core.kv_layout import model_kv_layout  # loaded when a pool is sized, not by the CLI

    layout = model_kv_layout(model, block_size, kv_dtype_bytes(model, kv_cache_dtype), hybrid)
    weights = reserve = None
    if capacity_tokens is None and pool_tokens is not None and len(layout.groups) > 1:
        kv_bytes = int(pool_tokens) // layout.block_size * len(layout.groups) * layout.block_bytes
        slots, source = int(kv_bytes // per_token), "capacity_tokens"
    elif capacity_tokens is not None or pool_tokens is not None:
        slots, source = int(pool_tokens if capacity_tokens is None else capacity_tokens), "capacity_tokens"
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
    # One group keeps every token on every layer: slots // block_size, the same number as
    # `get_num_blocks` but free of float rounding; several groups share blocks of block_bytes.
    num_blocks = slots // block_size if len(layout.groups) == 1 else layout.num_blocks(int(kv_bytes))
    # vLLM's default step budget follows the GPU it runs on, even where the pool's size is given.
    budget = max_num_batched_tokens or default_max_num_batched_tokens(gpu_label)
    return KVCapacity(model=model.name, gpu=gpu_name, kv_cache_dtype=kv_dtype_name(kv_cache_dtype, model),
                      bytes_per_token=per_token, sized_by=sized_by or source,
                      gpu_memory_utilization=gpu_memory_utilization, weight_bytes=weights,
                      reserve_bytes=reserve, pool_bytes=int(kv_bytes), capacity_tokens=slots,
                      block_size=block_size, num_blocks=num_blocks,
                      max_model_len=max_model_len or model.max_model_len,
                      device=device or ("CPU" if gpu_label == "cpu" else "GPU"), layout=layout,
                      max_num_batched_tokens=budget)
