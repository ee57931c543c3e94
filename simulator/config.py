"""Simulation configuration: the shared CacheConfig plus the model, GPU, latency model and loop options."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from simulator.core.allocator import KVAllocator
from simulator.core.config import (
    ALLOCATORS,
    CacheConfig,
    build_allocator,
    check_pool,
    num_cpu_blocks,
    swap_pool_bytes,
)
from simulator.core.errors import ConfigError
from simulator.core.models import ModelSpec, get_model
from simulator.core.paged.kv_group_tiers import attach_groups
from simulator.core.paged.tiers import attach
from simulator.presets import (
    KV_CACHE_DTYPES,
    KV_DTYPE_ALIASES,
    KVCapacity,
    kv_bytes_per_token,
    kv_capacity,
)
from simulator.tier_config import TIER_FIELDS, build_group_tiers, build_tiers, tier_problems

MODES = ("fast", "step")

__all__ = ["ALLOCATORS", "MODES", "SimConfig"]


@dataclass(frozen=True)
class SimConfig(CacheConfig):
    """Everything one simulated run depends on (together with the trace).

    Pool size: `capacity_tokens` (the paged pool's tokens as vLLM reports them), else `kv_memory_gb`, else
    `gpu_memory_utilization` of the GPU preset's memory minus the model's weights (`kv_capacity`,
    simulator/presets.py). `model` is a registry name, an alias or Hugging Face id of one, or a local
    folder with a config.json.
    """

    model: str = "llama-3-8b"
    gpu: str = "a100-80gb"
    kv_cache_dtype: str = "auto"  # vLLM's --kv-cache-dtype: auto (the model's dtype), fp8, bfloat16...
    swap_space_gb: float = 4.0
    latency: str = "roofline"  # or the path of a fitted profile (JSON)
    beam_alpha: float = 0.5  # Dirichlet concentration of the beam fork/prune model
    mode: str = "fast"
    # vLLM's --disable-hybrid-kv-cache-manager: every layer keeps every token, in one group.
    disable_hybrid_kv_cache_manager: bool = False
    record_events: bool = True
    extra: dict = field(default_factory=dict, compare=False)  # free-form labels (e.g. the trace rate)
    # KV tiers below the GPU (simulator/core/paged/tiers.py); none unless a size is given.
    kv_offloading_size: float | None = None  # GiB of CPU memory (vLLM's --kv-offloading-size); swap uses it
    kv_offloading_disk_size: float | None = None  # GiB of local disk
    kv_offloading_block_size: int | None = None  # tokens per tier block, a multiple of block_size
    kv_offloading_policy: str = "lru"  # eviction in each tier: lru, lfu or s3fifo
    kv_offloading_store: str = "lazy"  # lazy: store blocks the GPU evicts; eager: blocks as they are released
    cpu_offload_bandwidth_gbps: float | None = None  # CPU -> GPU GB/s (default: the GPU preset's PCIe)
    disk_offload_bandwidth_gbps: float = 6.0  # disk -> GPU GB/s (an NVMe SSD)

    def problems(self) -> list[str]:
        """The shared checks plus the simulator's own."""
        out = super().problems()
        if self.unset_numbers() or self.mistyped():  # reported above; the checks below would compare them
            return out
        if self.mode not in MODES:
            out.append(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not self.beam_alpha > 0:
            out.append(f"beam_alpha must be > 0, got {self.beam_alpha}")
        out += tier_problems(self)
        if KV_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype) not in KV_CACHE_DTYPES:
            out.append(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                       f"got {self.kv_cache_dtype!r}")
        return out

    @property
    def has_tiers(self) -> bool:
        """Whether a CPU or a disk tier backs the GPU pool."""
        return self.kv_offloading_size is not None or self.kv_offloading_disk_size is not None

    @property
    def model_spec(self) -> ModelSpec:
        """The model preset."""
        return get_model(self.model)

    @property
    def resolved_max_model_len(self) -> int:
        """max_model_len, defaulting to the model's."""
        return self.max_model_len or self.model_spec.max_model_len

    def kv_capacity(self) -> KVCapacity:
        """The KV pool: its size in bytes, slots and blocks, and the concurrency it allows."""
        return kv_capacity(self.model_spec, self.gpu, gpu_memory_utilization=self.gpu_memory_utilization,
                           kv_memory_gb=self.kv_memory_gb, pool_tokens=self.capacity_tokens,
                           kv_cache_dtype=self.kv_cache_dtype, block_size=self.block_size,
                           max_model_len=self.resolved_max_model_len,
                           max_num_batched_tokens=self._step_budget(),
                           hybrid=not self.disable_hybrid_kv_cache_manager)

    def _step_budget(self) -> int | None:
        """Tokens one simulated step computes (what a sliding window holds per request depends on it);
        None when the batching limits are invalid (the scheduler reports that)."""
        try:
            return self.scheduler_config().token_budget
        except ConfigError:
            return None

    def kv_layout(self):
        """The KV cache groups a paged pool is split into (simulator/core/kv_layout.py), or None where it
        is one group of full-attention layers."""
        if not self.is_paged:
            return None
        capacity = self.kv_capacity()
        return capacity.layout if capacity.grouped else None

    def capacity(self) -> int:
        """KV capacity C in token slots of every layer (what a contiguous allocator uses)."""
        return self.kv_capacity().capacity_tokens

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token in the KV cache dtype."""
        return kv_bytes_per_token(self.model_spec, self.kv_cache_dtype)

    def scheduler_config(self, max_model_len: int | None = None):
        """The batching limits for the scheduler (max_model_len defaults to the resolved one)."""
        return super().scheduler_config(max_model_len or self.resolved_max_model_len)

    def check_runnable(self) -> None:
        """Raise the ConfigError that building the scheduler or the pool would raise, without building
        them (a sweep checks every configuration before it writes anything)."""
        self.scheduler_config()
        self._check_slots()
        layout = self.kv_layout() if self.is_paged else None
        check_pool(self, self.capacity(), layout=layout,
                   num_blocks=None if layout is None else self.kv_capacity().num_blocks)
        if self.is_paged:
            num_cpu_blocks(self, swap_pool_bytes(self.swap_space_gb, self.kv_offloading_size),
                           self.bytes_per_token, layout)

    def _check_slots(self) -> None:
        if self.capacity() < 1:
            raise ConfigError(f"the KV pool holds {self.capacity()} token slots; give a larger pool")

    def build_allocator(self) -> KVAllocator:
        """The configured allocator over the configured capacity (logging its allocations when
        `record_events`)."""
        self._check_slots()
        layout = self.kv_layout()
        common = dict(cpu_bytes=swap_pool_bytes(self.swap_space_gb, self.kv_offloading_size),
                      bytes_per_token=self.bytes_per_token, max_model_len=self.resolved_max_model_len,
                      record_events=self.record_events)
        if layout is not None:
            alloc = build_allocator(self, self.capacity(), **common, layout=layout,
                                    num_blocks=self.kv_capacity().num_blocks)
            if self.has_tiers:
                attach_groups(alloc, build_group_tiers(self, alloc))
            return alloc
        alloc = build_allocator(self, self.capacity(), **common)
        if self.has_tiers:
            attach(alloc, build_tiers(self))
        return alloc

    def to_dict(self) -> dict:
        """Plain-JSON view, with the derived values a reader needs."""
        d = asdict(self)
        if not self.has_tiers:  # a run without tiers keeps the configuration it always had
            for name in TIER_FIELDS:
                del d[name]
        # A pool of several KV cache groups records its tokens as its summary and vLLM report them.
        d["capacity_tokens"] = self.capacity() if self.kv_layout() is None else self.kv_capacity().num_tokens
        d["max_model_len"] = self.resolved_max_model_len
        d["bytes_per_token"] = self.bytes_per_token
        if not self.disable_hybrid_kv_cache_manager:
            del d["disable_hybrid_kv_cache_manager"]  # only runs that set it record it
        return d
