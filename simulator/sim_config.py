"""Simulation configuration (frozen, passed down) and the allocator registry."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from simulator.core.allocator import KVAllocator, RegionRecorder
from simulator.core.contiguous.allocator import ContiguousAllocator
from simulator.core.errors import ConfigError
from simulator.core.paged.block_manager import BlockManager
from simulator.core.scheduler import SchedulerConfig
from simulator.specs import GIB, ModelSpec, get_gpu, get_model, kv_capacity_tokens

ALLOCATORS = {
    "paged": None,
    "contiguous-max": "max",
    "contiguous-pow2": "pow2",
    "contiguous-oracle": "oracle",
}
MODES = ("fast", "step")


@dataclass(frozen=True)
class SimConfig:
    """Everything one simulated run depends on (together with the trace)."""

    allocator: str = "paged"
    model: str = "llama-3-8b"
    gpu: str = "a100-80gb"
    kv_memory_gb: float | None = None
    capacity_tokens: int | None = None  # overrides both of the above
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    max_model_len: int | None = None  # default: the model's
    placement: str = "buddy"
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = False
    preemption_mode: str = "recompute"
    swap_space_gb: float = 4.0
    enable_prefix_caching: bool = True
    watermark: float = 0.01
    latency: str = "roofline"  # or the path of a fitted profile (JSON)
    beam_alpha: float = 0.5  # Dirichlet concentration of the beam fork/prune model
    seed: int = 0
    mode: str = "fast"
    record_events: bool = True
    debug: bool = False
    extra: dict = field(default_factory=dict, compare=False)  # free-form labels (e.g. the trace rate)

    def __post_init__(self) -> None:
        if self.allocator not in ALLOCATORS:
            raise ConfigError(f"unknown allocator {self.allocator!r}; choose from {', '.join(ALLOCATORS)}")
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}; choose from {', '.join(MODES)}")
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.beam_alpha <= 0:
            raise ConfigError(f"beam_alpha must be > 0, got {self.beam_alpha}")

    @property
    def model_spec(self) -> ModelSpec:
        """The model preset."""
        return get_model(self.model)

    @property
    def resolved_max_model_len(self) -> int:
        """max_model_len, defaulting to the model's."""
        return self.max_model_len or self.model_spec.max_model_len

    def capacity(self) -> int:
        """KV capacity C in token slots."""
        if self.capacity_tokens is not None:
            if self.capacity_tokens < 1:
                raise ConfigError(f"capacity_tokens must be >= 1, got {self.capacity_tokens}")
            return self.capacity_tokens
        return kv_capacity_tokens(self.model_spec, None if self.kv_memory_gb else get_gpu(self.gpu),
                                  self.gpu_memory_utilization, self.kv_memory_gb)

    def scheduler_config(self) -> SchedulerConfig:
        """The batching limits for the scheduler."""
        return SchedulerConfig(max_num_seqs=self.max_num_seqs,
                               max_num_batched_tokens=self.max_num_batched_tokens,
                               max_model_len=self.resolved_max_model_len,
                               enable_chunked_prefill=self.enable_chunked_prefill,
                               preemption_mode=self.preemption_mode)

    def to_dict(self) -> dict:
        """Plain-JSON view, with the derived values a reader needs."""
        d = asdict(self)
        d["capacity_tokens"] = self.capacity()
        d["max_model_len"] = self.resolved_max_model_len
        d["bytes_per_token"] = self.model_spec.bytes_per_token
        return d


def build_allocator(name: str, capacity: int, block_size: int, *, cpu_tokens: int, placement: str,
                    max_model_len: int, enable_prefix_caching: bool, watermark: float, debug: bool,
                    recorder: RegionRecorder | None = None,
                    block_manager_cls: type[BlockManager] = BlockManager) -> KVAllocator:
    """The allocator called `name` over `capacity` slots (shared by the simulator and the engine)."""
    if name not in ALLOCATORS:
        raise ConfigError(f"unknown allocator {name!r}; choose from {', '.join(ALLOCATORS)}")
    policy = ALLOCATORS[name]
    if policy is None:
        bm = block_manager_cls.from_capacity(
            capacity, block_size, num_cpu_blocks=cpu_tokens // block_size,
            enable_prefix_caching=enable_prefix_caching, watermark=watermark, debug=debug, recorder=recorder)
        if bm.num_blocks == 0:
            raise ConfigError(f"a KV pool of {capacity} slots holds no block of {block_size} tokens")
        return bm
    return ContiguousAllocator(capacity, policy, placement, max_model_len=max_model_len,
                               cpu_capacity_tokens=cpu_tokens, debug=debug, recorder=recorder)


def make_allocator(config: SimConfig, recorder: RegionRecorder | None = None) -> KVAllocator:
    """Build the configured allocator over the configured capacity."""
    return build_allocator(
        config.allocator, config.capacity(), config.block_size,
        cpu_tokens=int(config.swap_space_gb * GIB // config.model_spec.bytes_per_token),
        placement=config.placement, max_model_len=config.resolved_max_model_len,
        enable_prefix_caching=config.enable_prefix_caching, watermark=config.watermark, debug=config.debug,
        recorder=recorder)
