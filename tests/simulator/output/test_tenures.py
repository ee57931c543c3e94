"""Pairing allocation events into tenures: the table a plain replay of the events gives."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pagelab.table_sinks import FrameSink
from simulator.core.allocator import EventLog
from simulator.output.tenures import EVENT_DTYPES, TenurePairer


def _reference_tenures(log: list[tuple]) -> list[tuple]:
    """Tenures from a plain replay of the event log with a dict (a release's last field: its prefix key)."""
    rows, open_rows = [], {}
    for kind, start, value, t, rid in log:
        if kind == "acquire":
            open_rows[start] = len(rows)
            rows.append([rid, start, value, t, None, 1, 0, 0])
        elif kind == "share":
            row = rows[open_rows[start]]
            row[5] = max(row[5], value)
        else:
            row = rows[open_rows.pop(start)]
            row[4], row[6], row[7] = t, value, rid
    return [tuple(r) for r in rows]


@given(ops=st.lists(st.tuples(st.sampled_from(["take", "share", "release"]), st.integers(0, 30),
                              st.integers(1, 4)), max_size=120),
       block_size=st.sampled_from([1, 16]), mode=st.sampled_from(["bulk", "region", "mixed"]),
       drain_every=st.sampled_from([1, 2, 5, 1 << 20]))
@example(ops=[("take", 2, 1), ("take", 1, 1), ("release", 2, 1), ("release", 1, 2)], block_size=16,
         mode="mixed", drain_every=1 << 20)  # block 2 and region 2 (slot 2): both open
@settings(max_examples=120, deadline=None)
def test_paired_tenures_are_those_of_a_plain_replay_of_the_events(ops, block_size, mode, drain_every):
    """Block runs and regions give the tenures of a plain replay of the same events, sorted by (release
    time, acquisition), however often the log is drained and paired, and with both kinds in one log
    (mixed: even keys are blocks, odd keys regions)."""
    rec = EventLog()
    sink = FrameSink(EVENT_DTYPES)
    pairer = TenurePairer(sink)
    log, held, refs = [], set(), {}
    for step, (kind, key, extra) in enumerate(ops):
        rec.now = float(step)
        if rec.num_acquired - rec.first_unread >= drain_every:
            pairer.process(*rec.take(), rec.now)
        bulk = mode == "bulk" or (mode == "mixed" and key % 2 == 0)
        start = key * block_size
        if not bulk and mode == "mixed" and block_size > 1:
            start = key + 1  # the same number as some block id (even), in slots: the units must not alias
        if kind == "take" and key not in held:
            held.add(key)
            refs[key] = 1
            rid, sid = 100 + step, 1000 + step
            if bulk:
                listed = extra % 2
                rec.acquire_blocks([key], block_size, [rid] if listed else rid, [sid] if listed else sid,
                                   [float(step)] if extra > 2 else None)
            else:
                rec.acquire_region(start, block_size, rid, sid)
            log.append(("acquire", start, block_size, float(step), rid))
        elif kind == "share" and key in held:
            refs[key] += 1
            if bulk:
                rec.share_block(key, block_size, refs[key])
            else:
                rec.share_block(start, 1, refs[key])
            log.append(("share", start, refs[key], float(step), None))
        elif kind == "release" and key in held:
            held.discard(key)
            prefix_key = key * 7 + 1 if bulk and extra % 2 else 0  # some releases carry a content key
            if bulk:
                rec.release_blocks([key], block_size, (extra,), (prefix_key,) if prefix_key else None)
            else:
                rec.release_region(start, extra)
            log.append(("release", start, extra, float(step), prefix_key))
    pairer.process(*rec.take(), None, 999.0)
    got = sink.frame()
    want = [(rid, start, size, t0, 999.0 if t1 is None else t1, ref, filled, key)
            for rid, start, size, t0, t1, ref, filled, key in _reference_tenures(log)]
    want = [w for _, w in sorted(enumerate(want), key=lambda iw: (iw[1][4], iw[0]))]
    assert [tuple(r)[:-1] for r in got.itertuples(index=False)] == want
    assert (got["seq_id"] == got["request_id"] + 900).all()  # each tenure keeps its acquirer's sequence
    assert list(got.dtypes) == [np.int32, np.int32, np.int32, np.float64, np.float64, np.int32, np.int32,
                                np.int64, np.int64]


def test_pairing_reports_a_release_of_a_free_block():
    """A release of a block that holds no tenure is an error, raised by the pairing that resolves it."""
    rec = EventLog()
    rec.release_blocks([5], 16, [3])
    with pytest.raises(KeyError, match="region key 5"):
        TenurePairer(FrameSink(EVENT_DTYPES)).process(*rec.take(), None, 1.0)
