"""What a run records as it goes: pool-region tenures (for block maps); per-step memory rows are
simulator/memory_log.py's.

The recorder is an append-only log built for speed: the simulator records millions of block tenures, so it
keeps flat lists of raw acquire / release / share events (whole runs of blocks at a time) and
pairs them into tenures with numpy in batches, handing finished tenures to a sink (memory or a file).
"""
from __future__ import annotations

from collections.abc import Sequence as SeqLike
from concurrent.futures import Future, ThreadPoolExecutor

import pandas as pd

from simulator.core.allocator import RegionRecorder
from simulator.event_process import ProcessEventSink
from simulator.sinks import EVENT_DTYPES, EventSink, FrameSink
from simulator.tenures import ACQUIRE, PER_EVENT_RID, PER_EVENT_TIME, RELEASE, SHARE, RawRuns, TenurePairer

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
