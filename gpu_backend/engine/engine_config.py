"""Engine configuration: pool size, allocator, batching limits (frozen, validated without I/O)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from gpu_backend.engine.params import EngineInputError
from simulator.core.contiguous.placement import PLACEMENTS
from simulator.core.scheduler import PREEMPTION_MODES, SchedulerConfig
from simulator.sim_config import ALLOCATORS

# KV pool size on a CPU when neither num_blocks nor kv_memory_gb is given: a GPU-sized pool makes no sense
# in host memory, and 0.25 GiB holds 64k tokens of the tiny preset (fp32) - far more than a demo needs.
DEFAULT_CPU_KV_MEMORY_GB = 0.25
# vLLM's default CPU swap space; never more than the device pool by default, since a small model's pool
# would otherwise come with millions of CPU blocks of bookkeeping it can hardly use.
DEFAULT_SWAP_SPACE_GB = 4.0


@dataclass(frozen=True)
class EngineConfig:
    """Everything about the engine except the model: KV pool, allocator, scheduler limits.

    Pool size, first match wins: `capacity_tokens` (slots), `num_blocks` (x block_size slots),
    `kv_memory_gb`, else measured free GPU memory (CUDA) or DEFAULT_CPU_KV_MEMORY_GB (CPU).
    `allocator` is "paged" or "contiguous-max|pow2|oracle"; the contiguous baselines reserve one region
    per sequence in a linear slot space of the same capacity.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_memory_gb: float | None = None
    capacity_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    allocator: str = "paged"
    placement: str = "buddy"
    max_model_len: int | None = None  # default: the model's
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = False
    preemption_mode: str = "recompute"
    swap_space_gb: float | None = None  # default: DEFAULT_SWAP_SPACE_GB, at most the device pool's size
    watermark: float = 0.01
    seed: int = 0
    debug: bool = False  # run the allocator's invariant checks after every mutation (slow)
    # CUDA graphs for decode steps (CUDA + Triton backend only; see engine/cuda_graph.py); True turns
    # them off, as vLLM's --enforce-eager does.
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        problems = []
        if self.allocator not in ALLOCATORS:
            problems.append(f"allocator must be one of {', '.join(ALLOCATORS)}, got {self.allocator!r}")
        if self.placement not in PLACEMENTS:
            problems.append(f"placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            problems.append(f"preemption_mode must be one of {PREEMPTION_MODES}, "
                            f"got {self.preemption_mode!r}")
        positive = (("block_size", self.block_size), ("num_blocks", self.num_blocks),
                    ("capacity_tokens", self.capacity_tokens), ("kv_memory_gb", self.kv_memory_gb),
                    ("max_model_len", self.max_model_len), ("max_num_seqs", self.max_num_seqs))
        problems += [f"{name} must be > 0, got {value}" for name, value in positive
                     if value is not None and value <= 0]
        if not 0 < self.gpu_memory_utilization <= 1:
            problems.append(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.swap_space_gb is not None and self.swap_space_gb < 0:
            problems.append(f"swap_space_gb must be >= 0, got {self.swap_space_gb}")
        if not 0 <= self.watermark < 1:
            problems.append(f"watermark must be in [0, 1), got {self.watermark}")
        if problems:
            raise EngineInputError("engine config: " + "; ".join(problems))

    @property
    def is_paged(self) -> bool:
        """Whether the pool is managed by the BlockManager (else by a ContiguousAllocator)."""
        return self.allocator == "paged"

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The shared scheduler's limits, with `max_model_len` resolved against the model."""
        return SchedulerConfig(max_num_seqs=self.max_num_seqs,
                               max_num_batched_tokens=self.max_num_batched_tokens,
                               max_model_len=max_model_len,
                               enable_chunked_prefill=self.enable_chunked_prefill,
                               preemption_mode=self.preemption_mode)

    def to_dict(self) -> dict:
        """Plain-JSON view."""
        return asdict(self)
