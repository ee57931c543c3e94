"""CUDA graphs for decode steps, one per batch-size bucket (as vLLM and nano-vllm capture them).

A decode step's forward launches a few hundred kernels (per layer: norms, projections, rotary, store,
attention, MLP); on a small model the launches, not the math, set the step time. A graph replays them
all with one launch. Graphs need fixed shapes and addresses, so the runner owns static input buffers
sized for the largest bucket; a step of n sequences copies its inputs into the first n rows, pads the
rest up to the bucket (slot -1: nothing stored; context 0: attention returns zeros; table row 0), and
replays the bucket's graph; only the first n logits rows are read. Padding rows cost a little compute
and change nothing else, so tokens are identical to eager (tests/gpu_backend/test_cuda_graph.py).

The attention backend must not synchronise or read device values on the host inside the forward: the
Triton backend qualifies when given `max_context_len`; the torch backend does not (it sizes tiles on
the host), so graphs are only used with Triton. The split-K plan is fixed at capture for the longest
context the engine allows (max_model_len).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from gpu_backend.model_input import AttentionMetadata, ModelInput


def decode_graphs_apply(device_type: str, backend: str, enforce_eager: bool) -> bool:
    """Whether the engine runs decode steps as CUDA graphs (prefill steps never are): on CUDA, with the
    Triton backend (the module docstring says why), unless --enforce-eager."""
    return device_type == "cuda" and backend == "triton" and not enforce_eager


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Captured buckets: 1, 2, 4, 8, then every multiple of 16 up to max_num_seqs (vLLM's spacing)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] < max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= num_seqs (None: larger than every bucket, run eagerly)."""
    for size in sizes:
        if size >= num_seqs:
            return size
    return None


@dataclass
class DecodeBuffers:
    """Static inputs of the captured graphs, sized for the largest bucket (padding values pre-set).

    Each KV cache group has its own slot mapping and block tables (`groups`, one for a single pool; the
    first is `slot_mapping` and `block_tables`); with several (`layer_group`: each layer's group) each
    layer's metadata views its group's.
    """

    input_ids: torch.Tensor  # [S] int64
    positions: torch.Tensor  # [S] int64
    slot_mapping: torch.Tensor  # [S] int64, -1 = store nothing
    block_tables: torch.Tensor  # [S, W] int64 (W = max blocks per sequence, or 1 for region starts)
    context_lens: torch.Tensor  # [S] int64, 0 = empty context (attention output 0)
    arange: torch.Tensor  # [S + 1] int64: logits rows and (decode) cu_seqlens_q
    layer_group: tuple[int, ...] | None = None
    groups: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()  # (slot_mapping, block_tables) per group
    first_layers: tuple[int, ...] = (0,)  # the first layer of each group (whose metadata a batch holds)

    @classmethod
    def create(cls, max_seqs: int, width: int, device,
               layer_group: tuple[int, ...] | None = None) -> DecodeBuffers:
        """Buffers holding an all-padding batch."""
        def full(shape, value):
            return torch.full(shape, value, dtype=torch.int64, device=device)
        num_groups = 1 if layer_group is None else max(layer_group) + 1
        groups = tuple((full((max_seqs,), -1), full((max_seqs, width), 0)) for _ in range(num_groups))
        first = (0,) if layer_group is None else tuple(layer_group.index(g) for g in range(num_groups))
        return cls(full((max_seqs,), 0), full((max_seqs,), 0), *groups[0], full((max_seqs,), 0),
                   torch.arange(max_seqs + 1, dtype=torch.int64, device=device), layer_group, groups, first)

    def load(self, batch: ModelInput, size: int) -> None:
        """Copy a decode batch of n <= size sequences into rows [0, n) and pad rows [n, size)."""
        meta = batch.attn_metadata
        n = meta.num_seqs
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.context_lens[:n].copy_(meta.context_lens, non_blocking=True)
        self.context_lens[n:size].zero_()
        for (slots, tables), layer in zip(self.groups, self.first_layers, strict=True):
            _load_tables(slots, tables, meta.for_layer(layer), n, size)

    def view(self, size: int, max_context_len: int, contiguous: bool) -> ModelInput:
        """The first `size` rows as a decode ModelInput (views: the graph reads these addresses)."""
        metas = [AttentionMetadata(
            slot_mapping=slots[:size], block_tables=tables[:size], context_lens=self.context_lens[:size],
            cu_seqlens_q=self.arange[:size + 1], logits_indices=self.arange[:size], max_q_len=1,
            max_context_len=max_context_len, contiguous=contiguous) for slots, tables in self.groups]
        meta = metas[0] if self.layer_group is None else replace(
            metas[0], layer_metadata=tuple(metas[g] for g in self.layer_group))
        return ModelInput(self.input_ids[:size], self.positions[:size], meta)


def _load_tables(slots: torch.Tensor, tables: torch.Tensor, meta: AttentionMetadata, n: int,
                 size: int) -> None:
    """One group's slot mapping and block tables into rows [0, n) of its buffers, padding to `size`."""
    width = meta.block_tables.shape[1]
    if width > tables.shape[1]:
        raise ValueError(f"block table width {width} exceeds the captured {tables.shape[1]}")
    slots[:n].copy_(meta.slot_mapping, non_blocking=True)
    tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
    tables[:n, width:].zero_()
    slots[n:size].fill_(-1)


class DecodeGraphRunner:
    """Runs decode-only steps through per-bucket CUDA graphs (or, with capture=False, the same padded
    static buffers eagerly: what the graphs compute, testable on a CPU).

    `buffers` are the static inputs: by default its own DecodeBuffers (per KV cache group with
    `layer_group`); the engine passes its persistent InputBuffers (input_buffers.py), whose decode steps
    are written in place and replayed with `replay`.
    """

    def __init__(self, forward: Callable[[ModelInput], torch.Tensor], max_num_seqs: int, table_width: int,
                 max_model_len: int, contiguous: bool, device, capture: bool = True, buffers=None,
                 layer_group: tuple[int, ...] | None = None):
        self.forward = forward
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.contiguous = contiguous
        self.buffers = buffers if buffers is not None else DecodeBuffers.create(
            self.sizes[-1], 1 if contiguous else table_width, device, layer_group)
        self.capture = capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def _capture_all(self) -> None:
        pool = None
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            step = self.buffers.view(size, self.max_model_len, self.contiguous)
            self.forward(step)  # warm up (Triton compiles, allocator settles) outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.forward(step)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def can_run(self, batch: ModelInput) -> bool:
        """Decode-only, and no larger than the largest bucket."""
        meta = batch.attn_metadata
        return meta.is_decode_only and meta.contiguous == self.contiguous and \
            bucket_for(meta.num_seqs, self.sizes) is not None

    def bucket(self, num_seqs: int) -> int | None:
        """The captured size a decode step of `num_seqs` sequences pads to (None: run it eagerly)."""
        return bucket_for(num_seqs, self.sizes)

    def run(self, batch: ModelInput) -> torch.Tensor:
        """Logits [n, vocab] of a decode batch of n sequences, through the bucket's graph."""
        n = batch.attn_metadata.num_seqs
        size = bucket_for(n, self.sizes)
        self.buffers.load(batch, size)
        return self.replay(n, batch.attn_metadata.max_context_len)

    def replay(self, num_seqs: int, max_context_len: int | None = None) -> torch.Tensor:
        """Logits [n, vocab] of the decode step whose inputs already fill the buffers' first rows, padded to
        its bucket (`max_context_len`: the eager stand-in's plan; a graph keeps the one it captured)."""
        size = bucket_for(num_seqs, self.sizes)
        if self.capture:
            self.graphs[size].replay()
            return self.outputs[size][:num_seqs]
        longest = self.max_model_len if max_context_len is None else max_context_len
        return self.forward(self.buffers.view(size, longest, self.contiguous))[:num_seqs]
