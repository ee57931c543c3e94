"""Persistent step inputs of the decode batch: rewritten in place, sent in one host-to-device copy.

The engine's decode path (decode_step.py) writes each step's integer inputs into a staging buffer that
lives as long as the engine (pinned on CUDA, two of them in turn so that a step never overwrites a copy
still in flight), and one `copy_` moves them to a device buffer of the same layout; the model reads views
of it. Block tables are kept on both sides, [rows, max blocks]: the host table is the truth, and the cells
a step changed (a sequence's new block, a row written or moved) travel in the same copy as (flat index,
value) pairs that one `index_copy_` applies on the device, so a step sends O(what changed), not the tables.

Two layouts share the device buffer. A decode-only step uses fixed sections of `rows` entries each, ids,
positions, slots and contexts at offsets 0, R, 2R and 3R (R = rows, 16-byte aligned): a CUDA graph captured
for a bucket of size s reads the first s entries of each, and the step pads them up to s (slot -1: nothing
stored; context 0: attention returns zeros). A step with prefill chunks packs ids, positions and slots of
T tokens, then contexts, query offsets and logits rows of its N sequences, like `build_model_input`.

Without a mirror (the CPU engine) the staging buffer and the host table are what the model reads: nothing
is copied. `mirror=True` on the CPU runs the copying path, so tests exercise it without a GPU.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from gpu_backend.engine.input_batch import VIEW_ALIGN
from gpu_backend.model_input import AttentionMetadata, ModelInput


def _align(n: int) -> int:
    return -(-n // VIEW_ALIGN) * VIEW_ALIGN


class Packed(NamedTuple):
    """Host (numpy) views of one packed step's sections, to be filled before `send_packed`."""

    input_ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    context_lens: np.ndarray
    cu_seqlens: np.ndarray
    logits_indices: np.ndarray


class InputBuffers:
    """The staging and device buffers, and the block tables, of the engine's decode path."""

    def __init__(self, rows: int, table_width: int, max_tokens: int, device: torch.device | str,
                 mirror: bool | None = None, max_deltas: int | None = None):
        self.device = torch.device(device)
        self.rows = rows
        self.width = max(table_width, 1)
        self.mirror = self.device.type == "cuda" if mirror is None else mirror
        self.stride = _align(rows)  # the decode layout's section length
        self.max_deltas = max_deltas if max_deltas is not None else 8 * self.stride + 4096
        packed = 3 * _align(max_tokens) + 3 * _align(rows + 1)
        self.capacity = max(4 * self.stride, packed) + 2 * _align(self.max_deltas)
        # Table rows: the decode rows, then the prefill rows of a mixed step (more spill into a fresh table).
        self.table_rows = 2 * rows
        self.table = np.zeros((self.table_rows, self.width), dtype=np.int64)
        pinned = self.device.type == "cuda"
        count = 2 if self.mirror else 1
        self._staging = [torch.zeros(self.capacity, dtype=torch.int64, pin_memory=pinned)
                         for _ in range(count)]
        self._events: list = [None] * count
        self._turn = 0
        if self.mirror:
            self.flat = torch.zeros(self.capacity, dtype=torch.int64, device=self.device)
            self.device_table = torch.zeros((self.table_rows, self.width), dtype=torch.int64,
                                            device=self.device)
        else:
            self.flat = self._staging[0]
            self.device_table = torch.from_numpy(self.table)
        self.arange = torch.arange(rows + 1, dtype=torch.int64, device=self.device)
        self.flat[2 * self.stride: 3 * self.stride].fill_(-1)  # slots of an unused decode section
        self._idx: list[int] = []  # pending table cells (flat index into the table) and their values
        self._val: list[int] = []
        self._stale = False  # the device table no longer mirrors the host (see `load`)
        self._views: dict[int, tuple] = {}
        self._target = (self._staging[0], self.flat, True)  # (staging, device buffer, persistent) of a step
        self.host = self._staging[0].numpy()

    # ----------------------------------------------------------------- the tables
    def set_cell(self, row: int, col: int, value: int) -> None:
        """Table cell (row, col) = value, on the device with the next send."""
        self.table[row, col] = value
        if self.mirror:
            self._idx.append(row * self.width + col)
            self._val.append(value)

    def set_row(self, row: int, values) -> None:
        """The first len(values) cells of `row` (the rest are never read: contexts end before them)."""
        n = len(values)
        self.table[row, :n] = values
        if self.mirror and n:
            base = row * self.width
            self._idx.extend(range(base, base + n))
            self._val.extend(values)

    def mark_stale(self) -> None:
        """The device table was written by someone else (`load`): the next send uploads it whole."""
        self._stale = True

    # ----------------------------------------------------------------- staging
    def begin(self) -> np.ndarray:
        """The staging buffer of this step (waiting until the copy that last read it is done)."""
        event = self._events[self._turn]
        if event is not None:
            event.synchronize()
        self._target = (self._staging[self._turn], self.flat, True)
        self.host = self._staging[self._turn].numpy()
        return self.host

    def decode_sections(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Host views (ids, positions, slots, contexts) of the decode layout, `rows` entries each."""
        h, r = self.host, self.stride
        return h[:self.rows], h[r: r + self.rows], h[2 * r: 2 * r + self.rows], h[3 * r: 3 * r + self.rows]

    def packed_sections(self, num_tokens: int, num_seqs: int, num_logits: int) -> Packed:
        """Host views of a packed step's sections (ids, positions, slots, contexts, cu_seqlens, logits)."""
        sizes = (num_tokens, num_tokens, num_tokens, num_seqs, num_seqs + 1, num_logits)
        self._offsets = offs = _packed_offsets(sizes)
        self._sizes = sizes
        need = offs[-1] + 2 * _align(self.max_deltas)
        if need > self.capacity:
            # More tokens than the budget (diverged prefills each compute their own): this step gets
            # buffers of its own, so the persistent ones (and the graphs reading them) never move.
            host = torch.zeros(need, dtype=torch.int64, pin_memory=self.device.type == "cuda")
            device = torch.zeros(need, dtype=torch.int64, device=self.device) if self.mirror else host
            self._target = (host, device, False)
            self.host = host.numpy()
        h = self.host
        return Packed(*(h[o: o + n] for o, n in zip(offs, sizes, strict=False)))

    def send_decode(self, num_seqs: int, size: int) -> None:
        """Pad the decode sections from `num_seqs` to `size` rows and send them (one copy)."""
        ids, pos, slots, ctx = self.decode_sections()
        if size > num_seqs:
            ids[num_seqs:size] = 0
            pos[num_seqs:size] = 0
            slots[num_seqs:size] = -1
            ctx[num_seqs:size] = 0
        self._send(3 * self.stride + size)

    def send_packed(self) -> None:
        """Send the packed sections last handed out (one copy)."""
        self._send(self._offsets[-1])

    def decode_input(self, num_seqs: int, max_context_len: int, contiguous: bool) -> ModelInput:
        """The first `num_seqs` rows of the decode sections (after `send_decode`) as the model's input."""
        return self.view(num_seqs, max_context_len, contiguous)

    def packed_input(self, max_q_len: int, max_context_len: int, contiguous: bool,
                     tables: torch.Tensor | None = None) -> ModelInput:
        """The packed sections (after `send_packed`) as the model's input; `tables` replaces the table rows
        when the step's sequences did not fit in them."""
        f = self._target[1]
        o_ids, o_pos, o_slots, o_ctx, o_cu, o_log, _ = self._offsets
        num_tokens, _, _, num_seqs, _, num_logits = self._sizes
        meta = AttentionMetadata(
            slot_mapping=f[o_slots: o_slots + num_tokens],
            block_tables=self.device_table[:num_seqs] if tables is None else tables,
            context_lens=f[o_ctx: o_ctx + num_seqs], cu_seqlens_q=f[o_cu: o_cu + num_seqs + 1],
            logits_indices=f[o_log: o_log + num_logits], max_q_len=max_q_len,
            max_context_len=max_context_len, contiguous=contiguous)
        return ModelInput(f[o_ids: o_ids + num_tokens], f[o_pos: o_pos + num_tokens], meta)

    def _send(self, used: int) -> None:
        """Append the pending table cells after `used` entries, copy, and apply them on the device."""
        if not self.mirror:
            self._idx.clear()
            self._val.clear()
            return
        d = len(self._idx)
        if self._stale or d > self.max_deltas:
            self._upload_table()
            d = 0
        start = _align(used)
        if d:
            self.host[start: start + d] = self._idx
            self.host[start + d: start + 2 * d] = self._val
        end = start + 2 * d if d else used
        staging, flat, persistent = self._target
        # A one-off staging buffer is copied synchronously: nothing keeps it alive past this step.
        flat[:end].copy_(staging[:end], non_blocking=persistent)
        if d:
            self.device_table.view(-1).index_copy_(0, flat[start: start + d], flat[start + d: start + 2 * d])
        self._idx.clear()
        self._val.clear()
        if persistent and self.device.type == "cuda":
            event = self._events[self._turn] or torch.cuda.Event()
            event.record()
            self._events[self._turn] = event
        self._turn = (self._turn + 1) % len(self._staging)

    def _upload_table(self) -> None:
        """The whole host table to the device (after an outside write, or more changes than fit a send)."""
        self.device_table.copy_(torch.from_numpy(self.table))
        self._stale = False
        self._idx.clear()
        self._val.clear()

    # ----------------------------------------------------------------- CUDA graph buffers
    def view(self, size: int, max_context_len: int, contiguous: bool) -> ModelInput:
        """The first `size` rows of the decode sections as a decode ModelInput (the addresses a graph of
        that bucket reads)."""
        views = self._views.get(size)
        if views is None:  # the buffers never move, so neither do their views
            f, r = self.flat, self.stride
            views = self._views[size] = (f[:size], f[r: r + size], f[2 * r: 2 * r + size],
                                         self.device_table[:size], f[3 * r: 3 * r + size],
                                         self.arange[:size + 1], self.arange[:size])
        ids, pos, slots, tables, ctx, cu, logits = views
        return ModelInput(ids, pos, AttentionMetadata(slots, tables, ctx, cu, logits, 1, max_context_len,
                                                      contiguous))

    def load(self, batch: ModelInput, size: int) -> None:
        """Copy a decode batch built elsewhere (the engine's exact step) into the decode sections and the
        device table, padded to `size` rows, as `DecodeBuffers.load` does."""
        meta = batch.attn_metadata
        n, width = meta.num_seqs, meta.block_tables.shape[1]
        if width > self.width:
            raise ValueError(f"block table width {width} exceeds the captured {self.width}")
        f, r = self.flat, self.stride
        f[:n].copy_(batch.input_ids, non_blocking=True)
        f[r: r + n].copy_(batch.positions, non_blocking=True)
        f[2 * r: 2 * r + n].copy_(meta.slot_mapping, non_blocking=True)
        f[3 * r: 3 * r + n].copy_(meta.context_lens, non_blocking=True)
        self.device_table[:n, :width].copy_(meta.block_tables, non_blocking=True)
        f[2 * r + n: 2 * r + size].fill_(-1)
        f[3 * r + n: 3 * r + size].zero_()
        self._stale = True


def _packed_offsets(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """Start of each packed section (ids, positions, slots, contexts, cu_seqlens, logits) and the end."""
    offs = [0]
    for n in sizes:
        offs.append(offs[-1] + _align(n))
    return tuple(offs)
