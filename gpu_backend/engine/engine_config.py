"""Engine configuration: the shared CacheConfig plus what only the engine has (frozen, no I/O)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from gpu_backend.engine.params import EngineInputError
from simulator.core.config import CacheConfig
from simulator.core.errors import ConfigError
from simulator.tier_config import TIER_FIELDS, tier_problems

# KV pool size on a CPU when neither num_blocks nor kv_memory_gb is given: a GPU-sized pool makes no sense
# in host memory, and 0.25 GiB holds 64k tokens of the tiny preset (fp32) - far more than a demo needs.
DEFAULT_CPU_KV_MEMORY_GB = 0.25


@dataclass(frozen=True)
class EngineConfig(CacheConfig):
    """The KV pool, allocator and scheduler limits of an engine (the model is given separately).

    Pool size, first match wins: `capacity_tokens` (slots), `num_blocks` (x block_size slots),
    `kv_memory_gb`, else measured free GPU memory (CUDA) or DEFAULT_CPU_KV_MEMORY_GB (CPU).
    `allocator` is "paged" or "contiguous-max|pow2|oracle"; the contiguous baselines reserve one region
    per sequence in a linear slot space of the same capacity.
    """

    num_blocks: int | None = None
    swap_space_gb: float | None = None  # default: 4 GiB (vLLM's); ignored beside a CPU tier (swap_pool_bytes)
    # CUDA graphs for decode steps (CUDA + Triton backend only; see engine/cuda_graph.py); True turns
    # them off, as vLLM's --enforce-eager does.
    enforce_eager: bool = False
    # vLLM's --disable-hybrid-kv-cache-manager, as the simulator's: a model mixing sliding-window and full
    # layers keeps every token on every layer, in one group (engine/kv_groups.py).
    disable_hybrid_kv_cache_manager: bool = False
    # KV tiers below the GPU holding real KV data (gpu_backend/kv_tiers.py): SimConfig's options, checked
    # and sized by simulator/tier_config.py; none unless a size is given.
    kv_offloading_size: float | None = None  # GiB of CPU memory
    kv_offloading_disk_size: float | None = None  # GiB of local disk
    kv_offloading_block_size: int | None = None  # tokens per tier block, a multiple of block_size
    kv_offloading_policy: str = "lru"
    kv_offloading_store: str = "lazy"  # lazy: store blocks the GPU evicts; eager: blocks as they are released
    cpu_offload_bandwidth_gbps: float | None = None  # load-time model only (default: the GPU preset's PCIe)
    disk_offload_bandwidth_gbps: float = 6.0
    kv_offloading_disk_path: str | None = None  # the disk tier's directory (default: a temporary one)

    def __post_init__(self) -> None:
        try:
            super().__post_init__()
        except ConfigError as exc:
            raise EngineInputError(f"engine config: {exc}") from None

    def problems(self) -> list[str]:
        """The shared checks plus the engine's own."""
        out = super().problems()
        if self.num_blocks is not None and not self.num_blocks > 0:
            out.append(f"num_blocks must be > 0, got {self.num_blocks}")
        out += tier_problems(self)
        return out

    @property
    def has_tiers(self) -> bool:
        """Whether a CPU or a disk tier backs the GPU pool."""
        return self.kv_offloading_size is not None or self.kv_offloading_disk_size is not None

    def to_dict(self) -> dict:
        """Plain-JSON view (the tier options only when there are tiers)."""
        d = asdict(self)
        if not self.disable_hybrid_kv_cache_manager:
            del d["disable_hybrid_kv_cache_manager"]  # only runs that set it record it
        if not self.has_tiers:
            for name in (*TIER_FIELDS, "kv_offloading_disk_path"):
                del d[name]
        return d
