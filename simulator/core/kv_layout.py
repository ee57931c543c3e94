"""KV cache groups as vLLM v1 lays them out: each layer's KV format, layers grouped so that every group has
the same page size, one pool of equal blocks shared by all groups, and what that pool holds.

The rules follow vLLM at commit 001cabc1be16a59a70d720ed61a13b678c060a18 (main, the version this project
pins), `vllm/v1/kv_cache_interface.py` and `vllm/v1/core/kv_cache_utils.py`; each function names the one
it follows. Every layer of a registry model has the same KV width, so page sizes are always uniform and
`unify_kv_cache_spec_page_size` / `UniformTypeKVCacheSpecs` never come into play. Nothing here imports numpy.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from simulator.core.errors import ConfigError
from simulator.core.models import ModelSpec

# Per-layer KV formats: vLLM's FullAttentionSpec, MLAAttentionSpec (a full-attention spec caching one
# latent per token), SlidingWindowSpec and ChunkedLocalAttentionSpec.
KV_KINDS = ("full", "mla", "sliding_window", "chunked_local")
_KIND_OF_LAYER = {"full_attention": "full", "sliding_attention": "sliding_window",
                  "chunked_attention": "chunked_local"}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class LayerKV:
    """One layer's KV cache format (vLLM's KVCacheSpec): what a token costs and how many tokens it keeps."""

    kind: str  # one of KV_KINDS
    block_size: int  # tokens per block
    bytes_per_token: int  # this layer's bytes per token: K and V of every KV head, or MLA's latent
    window: int | None = None  # the sliding window or the attention chunk, in tokens

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of this layer (AttentionSpec.page_size_bytes)."""
        return self.block_size * self.bytes_per_token

    @property
    def slides(self) -> bool:
        """Whether tokens fall out of this layer's attention as a sequence grows."""
        return self.kind in ("sliding_window", "chunked_local")

    def max_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Blocks one request of max_model_len tokens can hold at once (`max_memory_usage_bytes` / page):
        full attention every token; a sliding window its last window-1 tokens plus one step's new tokens,
        one block more because the window need not start on a block boundary (SlidingWindowSpec); a chunk
        the chunk plus one step's tokens (ChunkedLocalAttentionSpec)."""
        if self.kind == "sliding_window":
            tokens = min(self.window - 1 + max_num_batched_tokens, max_model_len)
            return _cdiv(tokens, self.block_size) + 1
        if self.kind == "chunked_local":
            return _cdiv(min(self.window + max_num_batched_tokens, max_model_len), self.block_size)
        return _cdiv(max_model_len, self.block_size)

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """vLLM's `max_memory_usage_bytes` of this spec."""
        return self.max_blocks(max_model_len, max_num_batched_tokens) * self.page_size_bytes


@dataclass(frozen=True)
class KVGroup:
    """Layers that share one block table (vLLM's KVCacheGroupSpec)."""

    spec: LayerKV
    layers: tuple[int, ...]  # layer indices, in model order


@dataclass(frozen=True)
class KVLayout:
    """A model's KV cache groups and the pool arithmetic vLLM derives from them."""

    groups: tuple[KVGroup, ...]

    @property
    def group_size(self) -> int:
        """Layers per group: the pool is this many tensors, each holding one page per block."""
        return max(len(g.layers) for g in self.groups)

    @property
    def page_size_bytes(self) -> int:
        """One layer's page (`get_uniform_page_size`)."""
        return self.groups[0].spec.page_size_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes one block of the shared pool takes: a page in each of group_size tensors."""
        return self.page_size_bytes * self.group_size

    @property
    def block_size(self) -> int:
        """Tokens per block (the smallest over the groups, as `_report_kv_cache_config` counts)."""
        return min(g.spec.block_size for g in self.groups)

    def padding_layers(self, group: KVGroup) -> int:
        """Layer slots of `group` that hold no layer: memory every block of it wastes."""
        return self.group_size - len(group.layers)

    @property
    def num_padding_layers(self) -> int:
        """Padding layer slots over all groups."""
        return sum(self.padding_layers(g) for g in self.groups)

    @property
    def is_hybrid(self) -> bool:
        """Whether some group lets tokens slide out (then a token costs different groups differently)."""
        return any(g.spec.slides for g in self.groups)

    def num_blocks(self, available_bytes: int) -> int:
        """Blocks of the pool (`get_num_blocks`: available // page_size // num_layers, num_layers being
        the group size; `get_kv_cache_config_from_groups`)."""
        return max(int(available_bytes // self.page_size_bytes // self.group_size), 0)

    def num_tokens(self, num_blocks: int) -> int:
        """vLLM's "GPU KV cache size: N tokens" (`_report_kv_cache_config`: the blocks split evenly
        between the groups, times the block size)."""
        return num_blocks // len(self.groups) * self.block_size

    def blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Blocks one request of max_model_len tokens holds at most, over every group
        (`get_max_concurrency_for_kv_cache_config`: group_size x the specs' max memory, in blocks)."""
        usage = self.group_size * sum(g.spec.max_memory_usage_bytes(max_model_len, max_num_batched_tokens)
                                      for g in self.groups)
        return _cdiv(usage, self.block_bytes)

    def max_concurrency(self, num_blocks: int, max_model_len: int, max_num_batched_tokens: int) -> float:
        """vLLM's "Maximum concurrency for L tokens per request"
        (`get_max_concurrency_for_kv_cache_config`)."""
        return num_blocks / self.blocks_per_request(max_model_len, max_num_batched_tokens)

    def request_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """KV bytes one request of max_model_len tokens needs: its blocks in every group, each a page on
        all group_size layer slots, padding ones included (`_max_memory_usage_bytes_from_groups`, which
        vLLM's start-up check `_check_enough_kv_cache_memory` and its length estimate call)."""
        return self.blocks_per_request(max_model_len, max_num_batched_tokens) * self.block_bytes

    def longest_model_len(self, available_bytes: int, max_model_len: int, max_num_batched_tokens: int) -> int:
        """The longest max_model_len up to `max_model_len` whose one request fits in `available_bytes`, 0
        when not one token does (`_estimate_max_model_len_from_groups`: the same binary search)."""
        def fits(length: int) -> bool:
            return self.request_bytes(length, max_num_batched_tokens) <= available_bytes

        if not fits(1):
            return 0
        lo, hi, best = 1, max_model_len, 1
        while lo <= hi:
            mid = (lo + hi) // 2
            if fits(mid):
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        return best


def layer_kv_specs(model: ModelSpec, block_size: int, kv_dtype_bytes: int) -> tuple[LayerKV, ...]:
    """Each layer's KV format in a KV cache of `kv_dtype_bytes` bytes per element (the attention
    backends' `get_kv_cache_spec`: MLA layers one latent head, others K and V of every KV head)."""
    per_token = model.kv_elements_per_layer * kv_dtype_bytes
    windows = {"sliding_window": model.sliding_window, "chunked_local": model.attention_chunk_size}
    out = []
    for layer_type in model.attention_types:
        kind = _KIND_OF_LAYER[layer_type]
        if kind == "full" and model.is_mla:
            kind = "mla"
        out.append(LayerKV(kind, block_size, per_token, windows.get(kind)))
    return tuple(out)


def unify_hybrid(specs: Sequence[LayerKV]) -> tuple[LayerKV, ...]:
    """Every layer kept as full attention when a model mixes full with sliding or chunked layers
    (`unify_hybrid_kv_cache_specs`, vLLM's --disable-hybrid-kv-cache-manager): blocks for every token on
    every layer, one group. A model without full layers keeps its specs."""
    kinds = {s.kind for s in specs}
    if not (kinds & {"full", "mla"} and kinds & {"sliding_window", "chunked_local"}):
        return tuple(specs)
    return tuple(replace(s, kind="full", window=None) if s.slides else s for s in specs)


def kv_cache_groups(specs: Sequence[LayerKV], hybrid: bool = True) -> KVLayout:
    """The layers grouped as `get_kv_cache_groups` does: one group when every layer has the same spec
    (`_get_kv_cache_groups_uniform_spec`), else `_get_kv_cache_groups_uniform_page_size`. `hybrid=False`
    is vLLM's --disable-hybrid-kv-cache-manager (`unify_hybrid_kv_cache_specs` first)."""
    if not specs:
        raise ConfigError("a model without attention layers has no KV cache")
    if not hybrid:
        specs = unify_hybrid(specs)
    if len(set(specs)) == 1:
        return KVLayout((KVGroup(specs[0], tuple(range(len(specs)))),))
    if len({s.page_size_bytes for s in specs}) != 1:
        raise ConfigError("layers with different KV page sizes cannot share one pool")
    same_type: dict[LayerKV, list[int]] = {}
    for layer, spec in enumerate(specs):
        same_type.setdefault(spec, []).append(layer)
    # The smallest type's layer count is the group size (the "1" of an n:1 pattern), unless the largest
    # type has fewer than 1.5 times as many layers: then the largest, which pads less.
    counts = [len(layers) for layers in same_type.values()]
    group_size = max(counts) if max(counts) < min(counts) * 1.5 else min(counts)
    groups = []
    for spec, layers in same_type.items():
        num_groups = _cdiv(len(layers), group_size)
        # layers[i::num_groups] rather than consecutive runs, as vLLM assigns them (pipeline stages then
        # pad least), which spreads the type's padding over its groups.
        groups += [KVGroup(spec, tuple(layers[i::num_groups])) for i in range(num_groups)]
    return KVLayout(tuple(groups))


def model_kv_layout(model: ModelSpec, block_size: int, kv_dtype_bytes: int, hybrid: bool = True) -> KVLayout:
    """`model`'s KV cache groups for blocks of `block_size` tokens stored in `kv_dtype_bytes` per element."""
    return kv_cache_groups(layer_kv_specs(model, block_size, kv_dtype_bytes), hybrid)
