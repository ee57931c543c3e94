"""What a run records as it goes: pool-region tenures (for block maps) and per-step memory rows.

Both are append-only logs built for speed: the simulator records millions of block tenures, so the
recorder keeps flat lists of raw acquire / release / share events (whole runs of blocks at a time) and
pairs them into tenures with numpy in batches, handing finished tenures to a sink (memory or a file).
"""
from __future__ import annotations

import struct
from collections.abc import Callable
from collections.abc import Sequence as SeqLike
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pandas as pd
from numpy.lib.recfunctions import structured_to_unstructured

from simulator.core.allocator import MemoryBreakdown, RegionRecorder
from simulator.event_process import ProcessEventSink
from simulator.sinks import EVENT_DTYPES, TABLE_CHUNK_ROWS, EventSink, FrameSink, TableSink, columns_of_chunks
from simulator.tenures import ACQUIRE, PER_EVENT_RID, PER_EVENT_TIME, RELEASE, SHARE, RawRuns, TenurePairer

MEMORY_COLUMNS = ("step", "num_steps", "t_s", "dt_s", "token_states", "reservation",
                  "internal_fragmentation", "external_fragmentation", "free", "cached_free",
                  "token_occupancy", "block_occupancy", "num_running", "num_waiting", "num_swapped",
                  "num_batched_tokens", "blocks_used")
_INT_COLUMNS = ("step", "num_steps", "num_running", "num_waiting", "num_swapped", "num_batched_tokens",
                "blocks_used")
MEMORY_DTYPES = {c: np.dtype(np.int64 if c in _INT_COLUMNS else np.float64) for c in MEMORY_COLUMNS}
# One memory row packed: the step, then the floats, then the counts as int32 (a step's counts and blocks
# never reach 2^31; `struct` raises if one did). `token_occupancy` is `token_states` and is not packed
# twice. 104 bytes instead of 17 float64 values (136): a flush holds a batch of these (~2^14 rows) while
# the request batch's are written, and those held rows are the loop's RSS peaks
# (docs/simulator-performance.md, twentieth sitting). Appending a packed row costs a third of
# `array.extend` with the tuple, which converts and grows the array value by value (one row a step).
_PACKED_FLOATS = ("t_s", "dt_s", "token_states", "reservation", "internal_fragmentation",
                  "external_fragmentation", "free", "cached_free", "block_occupancy")
_PACKED_COUNTS = ("num_steps", "num_running", "num_waiting", "num_swapped", "num_batched_tokens",
                  "blocks_used")
_ROW = struct.Struct(f"=q{len(_PACKED_FLOATS)}d{len(_PACKED_COUNTS)}i")
_pack_row = _ROW.pack
_ROW_DTYPE = np.dtype([("step", "=i8"), *((c, "=f8") for c in _PACKED_FLOATS),
                       *((c, "=i4") for c in _PACKED_COUNTS)])
_PACKED_DTYPES = {c: MEMORY_DTYPES[c] for c in _ROW_DTYPE.names}
_DT = _PACKED_FLOATS.index("dt_s")
EVENT_COLUMNS = tuple((c, str(t)) for c, t in EVENT_DTYPES.items())
# Acquisitions paired per batch (at most): a batch's numpy temporaries and its Parquet write are the
# peaks of a long run's RSS (docs/simulator-performance.md, fourth to sixth passes): 2^20 took ~150 MB;
# on the 1M-request run 2^18 peaked at 338-344 MB, 2^16 at 298 MB, for the same CPU time. Later, with the
# other peaks gone, 2^16 -> 2^14 took the loop's median RSS from 222 to 200 MB; 2^12 cost 15% more CPU.
PAIR_BATCH_ROWS = 1 << 14


class EventRecorder(RegionRecorder):
    """Collects pool-region tenures: who held which region of the pool, from when to when.

    `now` is the simulated clock (the simulator sets it). Events come in runs: the bulk calls
    (`acquire_blocks`, `release_blocks`, `share_block`) log paged blocks, named by block id with unit =
    block size, a whole run per call; the per-region calls of the RegionRecorder interface log one region,
    named by its first slot (unit 1). Each tenure is numbered in acquisition order. A call only appends to
    flat lists (one C-level `extend` per run, no per-key Python work; tenures.py `RawRuns`). Every
    `flush_rows` acquisitions the log is handed, as one `RawRuns` batch, to a background thread that
    pairs it into tenures with numpy (simulator/tenures.py `TenurePairer`) and writes the finished ones
    to `sink` (default: a FrameSink kept in memory). With `background` (the simulator's choice) that
    happens while the simulation goes on: numpy and the Parquet encoder release the GIL, so on two cores
    that work mostly leaves the simulation's critical path. Batches are processed one at a time in order
    (the next waits for the previous), so the output is the same as pairing them inline, and at most two
    batches exist at once. Without it (a replay, whose step times are measured) they are paired inline.
    With a `ProcessEventSink` (simulator/event_process.py) the batches go to a child process that pairs
    and writes them there, off the GIL.
    """

    def __init__(self, sink: EventSink | None = None, flush_rows: int | None = None,
                 background: bool = False) -> None:
        self.now = 0.0
        self.num_acquired = 0  # tenures started so far (the next number)
        self.sink = sink if sink is not None else FrameSink()
        self.flush_rows = flush_rows or min(self.sink.batch_rows, PAIR_BATCH_ROWS)
        # A ProcessEventSink pairs in its own process: batches go to it as they are, never to a thread.
        in_process = isinstance(self.sink, ProcessEventSink)
        self._pairer = self.sink if in_process else TenurePairer(self.sink)
        self._base = 0  # first acquisition not yet handed to the pairer
        self._background = background and not in_process
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._reset_runs()

    def _reset_runs(self) -> None:
        self._raw = raw = RawRuns()
        self._e_keys, self._e_n, self._e_kind, self._e_unit = raw.e_keys, raw.e_n, raw.e_kind, raw.e_unit
        self._a_size, self._a_rid, self._a_t, self._a_flags = raw.a_size, raw.a_rid, raw.a_t, raw.a_flags
        self._a_rids, self._a_times = raw.a_rids, raw.a_times
        self._r_t, self._r_filled, self._s_ref = raw.r_t, raw.r_filled, raw.s_ref

    # ----------------------------------------------------------------- per-region API
    def acquire(self, start: int, size: int, request_id: int) -> None:
        """A region was taken."""
        self._e_keys.append(start)
        self._e_n.append(1)
        self._e_kind.append(ACQUIRE)
        self._e_unit.append(1)
        self._a_size.append(size)
        self._a_rid.append(request_id)
        self._a_t.append(self.now)
        self._a_flags.append(0)
        self.num_acquired += 1
        if self.num_acquired - self._base >= self.flush_rows:
            self._flush(self._background)

    def share(self, start: int, ref_count: int) -> None:
        """A region gained another owner."""
        self.share_block(start, 1, ref_count)

    def release(self, start: int, filled: int) -> None:
        """A region was given back."""
        self._e_keys.append(start)
        self._e_n.append(1)
        self._e_kind.append(RELEASE)
        self._e_unit.append(1)
        self._r_t.append(self.now)
        self._r_filled.append(filled)

    # ----------------------------------------------------------------- bulk block API
    def acquire_blocks(self, block_ids: SeqLike[int], block_size: int, request_id: int | SeqLike[int],
                       times: SeqLike[float] | None = None) -> None:
        """Blocks were taken, by one request or one request per block, now or at `times` (one per block)."""
        n = len(block_ids)
        if not n:
            return
        self._e_keys.extend(block_ids)
        self._e_n.append(n)
        self._e_kind.append(ACQUIRE)
        self._e_unit.append(block_size)
        self._a_size.append(block_size)
        if isinstance(request_id, int):
            self._a_rid.append(request_id)
            flags = 0
        else:
            self._a_rid.append(0)
            self._a_rids.extend(request_id)
            flags = PER_EVENT_RID
        if times is None:
            self._a_t.append(self.now)
        else:
            self._a_t.append(0.0)
            self._a_times.extend(times)
            flags |= PER_EVENT_TIME
        self._a_flags.append(flags)
        self.num_acquired += n
        if self.num_acquired - self._base >= self.flush_rows:
            self._flush(self._background)

    def share_block(self, block_id: int, block_size: int, ref_count: int) -> None:
        """A block gained another owner."""
        self._e_keys.append(block_id)
        self._e_n.append(1)
        self._e_kind.append(SHARE)
        self._e_unit.append(block_size)
        self._s_ref.append(ref_count)

    def release_blocks(self, block_ids: SeqLike[int], block_size: int, filled: SeqLike[int]) -> None:
        """Blocks were given back now, holding `filled` tokens each."""
        n = len(block_ids)
        if not n:
            return
        self._e_keys.extend(block_ids)
        self._e_n.append(n)
        self._e_kind.append(RELEASE)
        self._e_unit.append(block_size)
        self._r_t.append(self.now)
        self._r_filled.extend(filled)

    # ----------------------------------------------------------------- pairing and output
    def _wait(self) -> None:
        """Let the batch in the background finish (re-raising what it raised)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _flush(self, background: bool) -> None:
        """Hand the batch recorded since the last flush to the pairer (in the background thread, or now)."""
        self._wait()
        raw, base, now = self._raw, self._base, self.now
        self._reset_runs()
        self._base = self.num_acquired
        if not background:
            self._pairer.process(raw, base, now)
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="pagelab-events")
        self._pending = self._executor.submit(self._pairer.process, raw, base, now)

    def flush(self) -> None:
        """Hand the sink every tenure released before now (a release at `now` waits: see tenures.py);
        returns when the sink has them."""
        self._flush(False)
        if isinstance(self._pairer, ProcessEventSink):
            self._pairer.sync()

    def finish(self, end_s: float) -> EventSink:
        """Hand the sink everything (regions still held end at `end_s`), close it and return it."""
        try:
            self._wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown()
                self._executor = None
        raw, base = self._raw, self._base
        self._reset_runs()
        self._base = self.num_acquired
        self._pairer.process(raw, base, None, end_s)
        self.sink.close()
        return self.sink

    def abort(self) -> None:
        """Stop the background thread (after the batch it is on) or the events process, and drop what is
        left: the run failed."""
        self._pending = None
        if isinstance(self._pairer, ProcessEventSink):
            self._pairer.abort()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def to_frame(self, end_s: float) -> pd.DataFrame:
        """The tenures as a table sorted by (t_end_s, acquisition) (regions still held end at `end_s`);
        only for the default in-memory sink."""
        sink = self.finish(end_s)
        if not isinstance(sink, FrameSink):
            raise TypeError("to_frame needs the in-memory FrameSink; this recorder streams to a file")
        return sink.frame()


class MemoryLog:
    """Per-step (or per-span) memory rows, kept packed (104 bytes a row, `_ROW`).

    With a `sink` (a run folder's memory table), the rows go to it as a batch at every `flush` (the
    simulation flushes halfway through each request batch) and at the latest every `sink.batch_rows` rows,
    and the log keeps only the time-weighted sums the summary needs (`weighted_means`), so a long run's
    memory does not grow with its steps.
    """

    def __init__(self, sink: TableSink | None = None, chunk_rows: int = TABLE_CHUNK_ROWS) -> None:
        self._packed = bytearray()  # the rows after `_chunks`
        self.sink = sink
        # With a sink, rows are kept in chunks (simulator/sinks.py, TABLE_CHUNK_ROWS); `_limit`: the
        # bytes that end the current chunk (never, without a sink).
        self._chunks: list[bytearray] = []
        self._chunk_bytes = chunk_rows * _ROW.size
        self._batch_bytes = sink.batch_rows * _ROW.size if sink is not None else float("inf")
        self._limit = min(self._chunk_bytes, self._batch_bytes) if sink is not None else float("inf")
        self._num_flushed = 0
        self._wsum = np.zeros(len(_PACKED_FLOATS))  # sum of value * dt_s over the rows handed to the sink
        self._dt = 0.0

    def __len__(self) -> int:
        return self._num_flushed + (sum(map(len, self._chunks)) + len(self._packed)) // _ROW.size

    def add_row(self, step: int, num_steps: int, t_s: float, dt_s: float, token_states: float,
                reservation: float, internal: float, external: float, free: float, cached_free: float,
                block_occupancy: float, counts: tuple[int, int, int], num_batched_tokens: int,
                blocks_used: int) -> None:
        """Append one row from fractions of capacity already computed (a span's time-weighted means)."""
        packed = self._packed
        packed += _pack_row(step, t_s, dt_s, token_states, reservation, internal, external, free, cached_free,
                            block_occupancy, num_steps, counts[0], counts[1], counts[2], num_batched_tokens,
                            blocks_used)
        if len(packed) >= self._limit:  # inline: one call less per row
            self._next_chunk()

    def add_slots(self, step: int, num_steps: int, t_s: float, dt_s: float, slots: tuple,
                  counts: tuple[int, int, int], num_batched_tokens: int, block_size: int) -> None:
        """Append one row from a breakdown given as (capacity, token_states, reservation, internal, external,
        free, cached_free, allocated) slots (the allocators' `breakdown_slots`)."""
        cap, tokens, resv, internal, external, free, cached, allocated = slots
        packed = self._packed
        packed += _pack_row(step, t_s, dt_s, tokens / cap, resv / cap, internal / cap, external / cap,
                            free / cap, cached / cap, allocated / cap, num_steps, counts[0], counts[1],
                            counts[2], num_batched_tokens, allocated // block_size)
        if len(packed) >= self._limit:  # inline: one call less per row
            self._next_chunk()

    def add_breakdown(self, step: int, t_s: float, dt_s: float, b: MemoryBreakdown,
                      counts: tuple[int, int, int], num_batched_tokens: int, block_size: int,
                      num_steps: int = 1) -> None:
        """Append a row from an instantaneous breakdown."""
        slots = (b.capacity, b.token_states, b.reservation, b.internal_fragmentation,
                 b.external_fragmentation, b.free, b.cached_free, b.allocated)
        self.add_slots(step, num_steps, t_s, dt_s, slots, counts, num_batched_tokens, block_size)

    def _next_chunk(self) -> None:
        """The rows so far become a chunk; a batch of chunks goes to the sink once it holds the sink's
        `batch_rows` (a batch's last chunk may be shorter; `flush` ends a batch sooner)."""
        self._chunks.append(self._packed)
        self._packed = bytearray()
        chunked = sum(map(len, self._chunks))
        if chunked >= self._batch_bytes:
            self.flush()  # which starts the next batch's limit
        else:
            self._limit = min(self._chunk_bytes, self._batch_bytes - chunked)

    @staticmethod
    def _columns(chunks: list, each: Callable[[np.ndarray], None] | None = None) -> dict[str, np.ndarray]:
        """The table's columns, in MEMORY_COLUMNS order, of the packed rows in `chunks` (which it empties)."""
        packed = columns_of_chunks(chunks, _ROW_DTYPE, _PACKED_DTYPES, each)
        packed["token_occupancy"] = packed["token_states"]
        return {c: packed[c] for c in MEMORY_COLUMNS}

    def flush(self) -> None:
        """Hand the rows kept so far to the sink (keeping their time-weighted sums)."""
        if self.sink is None:
            return
        chunks = [*self._chunks, self._packed] if self._packed else self._chunks
        self._chunks, self._packed = [], bytearray()
        self._limit = min(self._chunk_bytes, self._batch_bytes)  # a batch starts here, whoever flushed
        if not chunks:
            return
        columns = self._columns(chunks, self._add_sums)
        self._num_flushed += len(columns["step"])
        self.sink.write(columns)

    def _add_sums(self, rows: np.ndarray) -> None:
        """Add a chunk's rows to the time-weighted sums."""
        floats = structured_to_unstructured(rows[list(_PACKED_FLOATS)], copy=False)  # a view: no copy
        self._wsum += floats[:, _DT] @ floats
        self._dt += float(floats[:, _DT].sum())

    def finish(self) -> None:
        """Hand the sink the last rows and close it (nothing to do without a sink)."""
        if self.sink is not None:
            self.flush()
            self.sink.close()

    def weighted_means(self) -> tuple[dict, float, float] | None:
        """With a sink (after `finish`): what `simulator.results.memory_summary` computes, from the sums."""
        if self.sink is None:
            return None
        if self._dt <= 0:
            nan = float("nan")
            return {**{s: nan for s in MemoryBreakdown.STATES}, "cached_free": nan}, nan, nan
        m = {c: float(v / self._dt) for c, v in zip(_PACKED_FLOATS, self._wsum, strict=True)}
        mean = {s: m[s] for s in (*MemoryBreakdown.STATES, "cached_free")}
        return mean, m["token_states"], m["block_occupancy"]

    def to_frame(self) -> pd.DataFrame | None:
        """The rows as a table with the documented dtypes (None when they went to a sink)."""
        if self.sink is not None:
            return None
        columns = self._columns([self._packed] if self._packed else [])
        columns["token_occupancy"] = columns["token_occupancy"].copy()  # a column of its own in a frame
        return pd.DataFrame(columns, copy=False)
