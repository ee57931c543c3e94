"""The configuration the simulator and the engine share: the KV pool, its allocator, the scheduler's limits.

`SimConfig` (simulator/config.py) and `EngineConfig` (gpu_backend/engine/engine_config.py) both extend
`CacheConfig`, so each option is declared, defaulted and validated once, and `build_allocator` turns it
into the same allocator for both.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, fields

from simulator.core.allocator import KVAllocator
from simulator.core.contiguous import PLACEMENTS, ContiguousAllocator
from simulator.core.errors import ConfigError
from simulator.core.paged import BlockManager
from simulator.core.scheduler import PREEMPTION_MODES, SchedulerConfig

# Allocator name -> contiguous reservation policy (None: the paged BlockManager). A plain dict registry.
ALLOCATORS: dict[str, str | None] = {
    "paged": None,
    "contiguous-max": "max",
    "contiguous-pow2": "pow2",
    "contiguous-oracle": "oracle",
}


DEFAULT_SWAP_SPACE_GB = 4.0  # vLLM's --swap-space


def _is_bool(value) -> bool:
    # numpy's bool (named bool_ before numpy 2), recognised without importing numpy
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in
                                       ("bool", "bool_"))


# A numeric or boolean field's declared type -> the test of a value (numpy's pass: sweeps hand them
# down) and what it should be.
_KINDS = {"int": (lambda v: isinstance(v, numbers.Integral) and not _is_bool(v), "an integer"),
          "float": (lambda v: isinstance(v, numbers.Real) and not _is_bool(v), "a number"),
          "bool": (_is_bool, "True or False")}


@dataclass(frozen=True)
class CacheConfig:
    """KV pool size, allocator and batching limits (frozen, validated without I/O).

    Pool size, first match wins: `capacity_tokens` (slots), then `kv_memory_gb`, then what the embedding
    config derives (a GPU preset in the simulator, measured free memory in the engine).
    """

    allocator: str = "paged"
    block_size: int = 16
    kv_memory_gb: float | None = None
    capacity_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None  # default: the model's
    placement: str = "buddy"
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = False
    preemption_mode: str = "recompute"
    swap_space_gb: float | None = DEFAULT_SWAP_SPACE_GB
    enable_prefix_caching: bool = True
    watermark: float = 0.01
    seed: int = 0
    debug: bool = False  # run the allocator's invariant checks after every mutation (slow)

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ConfigError("; ".join(problems))

    def unset_numbers(self) -> dict[str, str]:
        """The numeric fields holding None although their type has no None (a subclass may drop it, as
        SimConfig's swap_space_gb does), with their type."""
        return {f.name: f.type for f in fields(self)
                if f.type in ("int", "float") and getattr(self, f.name) is None}

    def mistyped(self) -> list[str]:
        """A message for each field holding a value of another kind than its type says (a bool is not a
        count, a string not a number): the range checks could not compare it."""
        out = []
        for f in fields(self):
            value, kind = getattr(self, f.name), str(f.type).split(" | ")[0]
            if value is not None and kind in _KINDS and not _KINDS[kind][0](value):
                out.append(f"{f.name} must be {_KINDS[kind][1]}, got {value!r}")
        return out

    def problems(self) -> list[str]:
        """Every invalid option, as one message each (empty when the config is valid)."""
        unset = self.unset_numbers()
        if unset:  # the checks below read None as "not given" where a field allows it, or cannot compare it
            return [f"{name} must be {'an integer' if kind == 'int' else 'a number'}, got None"
                    for name, kind in unset.items()]
        mistyped = self.mistyped()
        if mistyped:
            return mistyped
        out = []
        if self.allocator not in ALLOCATORS:
            out.append(f"allocator must be one of {', '.join(ALLOCATORS)}, got {self.allocator!r}")
        if self.placement not in PLACEMENTS:
            out.append(f"placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            out.append(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                       f"got {self.preemption_mode!r}")
        positive = (("block_size", self.block_size), ("capacity_tokens", self.capacity_tokens),
                    ("kv_memory_gb", self.kv_memory_gb), ("max_model_len", self.max_model_len),
                    ("max_num_seqs", self.max_num_seqs),
                    ("max_num_batched_tokens", self.max_num_batched_tokens))
        out += [f"{name} must be > 0, got {value}" for name, value in positive
                if value is not None and not value > 0]
        # inf passes `> 0` but would size an endless pool; nan fails it above.
        sizes = (("kv_memory_gb", self.kv_memory_gb), ("swap_space_gb", self.swap_space_gb))
        out += [f"{name} must be a finite number, got {value}" for name, value in sizes
                if value is not None and value == float("inf")]
        if not 0 < self.gpu_memory_utilization <= 1:
            out.append(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.swap_space_gb is not None and not self.swap_space_gb >= 0:
            out.append(f"swap_space_gb must be >= 0, got {self.swap_space_gb}")
        if not 0 <= self.watermark < 1:
            out.append(f"watermark must be in [0, 1), got {self.watermark}")
        if self.seed < 0:  # numpy's generators take only non-negative seeds
            out.append(f"seed must be >= 0, got {self.seed}")
        return out

    @property
    def is_paged(self) -> bool:
        """Whether the pool is managed by the BlockManager (else by a ContiguousAllocator)."""
        return ALLOCATORS.get(self.allocator) is None

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The shared scheduler's limits, with `max_model_len` resolved against the model."""
        return SchedulerConfig(max_num_seqs=self.max_num_seqs,
                               max_num_batched_tokens=self.max_num_batched_tokens,
                               max_model_len=max_model_len,
                               enable_chunked_prefill=self.enable_chunked_prefill,
                               preemption_mode=self.preemption_mode)


def check_pool(config: CacheConfig, capacity: int, *, layout=None, num_blocks: int | None = None) -> None:
    """Refuse a paged pool that holds no block, as `build_allocator` would, without building it."""
    if ALLOCATORS[config.allocator] is not None:
        return
    if layout is not None and not num_blocks:
        raise ConfigError(f"the KV pool holds no block of {layout.block_bytes:,} bytes (a page in each of "
                          f"{layout.group_size} layers); give a larger pool")
    if layout is None and capacity < config.block_size:
        raise ConfigError(f"a KV pool of {capacity} slots holds no block of {config.block_size} tokens; "
                          "give a larger pool")


# The CPU swap pool keeps lists of its blocks' state (~70 bytes a block, made up front): past this many
# blocks it would take gigabytes, for a pool far beyond what a run swaps.
MAX_CPU_BLOCKS = 1 << 24


def num_cpu_blocks(config: CacheConfig, cpu_bytes: int, bytes_per_token: int, layout=None) -> int:
    """Blocks of a paged pool's CPU swap space of `cpu_bytes`; refuse more than MAX_CPU_BLOCKS."""
    num = cpu_bytes // layout.block_bytes if layout is not None else \
        cpu_bytes // bytes_per_token // config.block_size
    if num > MAX_CPU_BLOCKS:
        raise ConfigError(f"a CPU swap pool of {num:,} blocks is more than the {MAX_CPU_BLOCKS:,} a run "
                          "keeps: lower swap_space_gb (kv_offloading_size where a CPU tier sizes it)")
    return num


def swap_pool_bytes(swap_space_gb: float | None, kv_offloading_size: float | None) -> int:
    """Bytes of the CPU swap pool, for the simulator and the engine alike: the CPU tier's budget when there
    is one (swapped blocks take their room from it), else `swap_space_gb` (vLLM's 4 GiB when None)."""
    gb = swap_space_gb if kv_offloading_size is None else kv_offloading_size
    return int((DEFAULT_SWAP_SPACE_GB if gb is None else gb) * (1 << 30))


def build_allocator(config: CacheConfig, capacity: int, *, cpu_bytes: int, bytes_per_token: int,
                    max_model_len: int, record_events: bool = False, layout=None,
                    num_blocks: int | None = None) -> KVAllocator:
    """The configured allocator over `capacity` slots (the one factory of the simulator and the engine),
    with a CPU swap pool of `cpu_bytes` (`swap_pool_bytes`); with `record_events` it logs its allocations
    (`allocator.events`). A paged pool given a `layout` of several KV cache groups
    (simulator/core/kv_layout.py) is `num_blocks` blocks shared by the groups."""
    check_pool(config, capacity, layout=layout, num_blocks=num_blocks)
    try:
        return _build(config, capacity, cpu_bytes, bytes_per_token, max_model_len, record_events, layout,
                      num_blocks)
    except MemoryError:  # the pool's per-block state is kept in lists: this size cannot be held at all
        raise ConfigError(f"a KV pool of {capacity:,} slots does not fit in this machine's memory (the "
                          "simulator keeps per-block state); give a smaller pool") from None


def _build(config: CacheConfig, capacity: int, cpu_bytes: int, bytes_per_token: int, max_model_len: int,
           record_events: bool, layout, num_blocks: int | None) -> KVAllocator:
    cpu_tokens = cpu_bytes // bytes_per_token
    policy = ALLOCATORS[config.allocator]
    if policy is None and layout is not None:
        from simulator.core.paged.kv_groups import GroupedBlockManager  # loaded by grouped pools only

        chunk = config.scheduler_config(max_model_len).token_budget if config.enable_chunked_prefill else None
        return GroupedBlockManager(num_blocks, layout,
                                   num_cpu_blocks=num_cpu_blocks(config, cpu_bytes, bytes_per_token, layout),
                                   enable_prefix_caching=config.enable_prefix_caching,
                                   watermark=config.watermark, debug=config.debug,
                                   record_events=record_events, prefill_chunk=chunk)
    if policy is None:
        return BlockManager.from_capacity(
            capacity, config.block_size, num_cpu_blocks=num_cpu_blocks(config, cpu_bytes, bytes_per_token),
            enable_prefix_caching=config.enable_prefix_caching, watermark=config.watermark,
            debug=config.debug, record_events=record_events)
    return ContiguousAllocator(capacity, policy, config.placement, max_model_len=max_model_len,
                               cpu_capacity_tokens=cpu_tokens, debug=config.debug,
                               record_events=record_events)
