"""Fast mode (decode batch, fast steps, spans) makes step mode's decisions bit for bit, events included."""
from __future__ import annotations

import dataclasses
import gc

import numpy as np
import pandas as pd
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from simulator import BlockManager, Sequence, SequenceGroup
from simulator.core.scheduler import Scheduler, SchedulerConfig
from simulator.memory_log import MEMORY_DTYPES, MemoryLog
from simulator.recorder import EventRecorder
from simulator.config import SimConfig
from simulator.loop import simulate
from simulator.sinks import FrameSink
from traces import SyntheticConfig, generate_trace, load_trace

EXACT = ["admitted_s", "first_token_s", "finish_s", "num_preemptions", "rejected", "prefix_hit_tokens"]


def _trace(**kw) -> pd.DataFrame:
    return generate_trace(SyntheticConfig(**kw))


def assert_identical(fast, step):
    """Same decisions, same times to the last bit, same block tenures (ids included), same summary."""
    for col in EXACT:
        np.testing.assert_array_equal(fast.requests[col].to_numpy(), step.requests[col].to_numpy(),
                                      err_msg=col)
    pd.testing.assert_frame_equal(fast.events, step.events)
    assert fast.summary["num_steps"] == step.summary["num_steps"]
    assert fast.summary["allocator_stats"] == step.summary["allocator_stats"]
    for state, value in fast.summary["memory"].items():
        assert value == pytest.approx(step.summary["memory"][state], rel=1e-9, abs=1e-12), state


def run_both(trace, **kw):
    cfg = SimConfig(**kw)
    return simulate(trace, cfg), simulate(trace, dataclasses.replace(cfg, mode="step"))


CASES = {
    "memory pressure, recompute": (dict(num_requests=40, arrival="burst", lengths="sharegpt", seed=3),
                                   dict(model="opt-13b", capacity_tokens=3000, max_model_len=2048)),
    "memory pressure, swap": (dict(num_requests=40, arrival="burst", lengths="sharegpt", seed=3),
                              dict(model="opt-13b", capacity_tokens=3000, max_model_len=2048,
                                   preemption_mode="swap", swap_space_gb=1.0)),
    "prefix cache with evictions": (dict(num_requests=50, rate=20, lengths="sharegpt", num_prefix_groups=3,
                                         prefix_len=200, prefix_fraction=0.7, seed=1),
                                    dict(model="opt-13b", capacity_tokens=3000, max_model_len=2048)),
    "chunked prefill": (dict(num_requests=30, rate=30, lengths="sharegpt", seed=5),
                        dict(model="opt-13b", capacity_tokens=5000, max_model_len=2048,
                             enable_chunked_prefill=True, max_num_batched_tokens=256)),
    "parallel sampling": (dict(num_requests=40, rate=5, lengths="alpaca", n=2, seed=2),
                          dict(model="opt-13b", capacity_tokens=3000, max_model_len=2048)),
    "beam search": (dict(num_requests=20, rate=5, lengths="alpaca", beam_width=3, seed=2),
                    dict(model="opt-13b", capacity_tokens=3000, max_model_len=2048)),
    "first-fit placement": (dict(num_requests=40, rate=20, lengths="sharegpt", seed=4),
                            dict(model="opt-13b", capacity_tokens=4000, max_model_len=2048,
                                 placement="first-fit")),
}


@pytest.mark.parametrize("allocator", ["paged", "contiguous-pow2"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fast_is_step_bit_for_bit_with_invariant_checks(case, allocator):
    trace_kw, sim_kw = CASES[case]
    # debug=True runs the allocator's invariant checker after every mutation, in both modes.
    fast, step = run_both(_trace(**trace_kw), allocator=allocator, debug=True, **sim_kw)
    assert_identical(fast, step)
    assert fast.summary["num_finished"] + fast.summary["num_rejected"] == trace_kw["num_requests"]


def test_pressure_cases_really_preempt_and_evict():
    """The cases above exercise what they claim (so the equality is not vacuous)."""
    trace_kw, sim_kw = CASES["memory pressure, recompute"]
    assert simulate(_trace(**trace_kw), SimConfig(**sim_kw)).summary["num_preemptions"] > 0
    trace_kw, sim_kw = CASES["prefix cache with evictions"]
    stats = simulate(_trace(**trace_kw), SimConfig(**sim_kw)).summary["allocator_stats"]
    assert stats["evictions"] > 0 and stats["prefix_hits"] > 0


@pytest.mark.parametrize("allocator", ["paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle"])
def test_fast_is_step_bit_for_bit_on_azure(allocator):
    trace = load_trace("azure-conv").iloc[:500].reset_index(drop=True)
    fast, step = run_both(trace, allocator=allocator)
    assert len(fast.memory) < len(step.memory) / 2  # most steps were batched
    assert_identical(fast, step)


@given(seed=st.integers(0, 10_000), cap=st.integers(900, 8000), bs=st.sampled_from([1, 5, 7, 16]),
       allocator=st.sampled_from(["paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle"]),
       rate=st.floats(0.5, 80), max_num_seqs=st.sampled_from([4, 16, 64]), n=st.sampled_from([1, 1, 2]))
@settings(max_examples=30, deadline=None)
def test_fast_is_step_bit_for_bit_on_random_traces(seed, cap, bs, allocator, rate, max_num_seqs, n):
    trace = _trace(num_requests=40, rate=rate, lengths="uniform", prompt_range=(1, 300),
                   output_range=(1, 200), max_model_len=512, n=n, seed=seed)
    fast, step = run_both(trace, allocator=allocator, model="opt-13b", capacity_tokens=cap, block_size=bs,
                          max_model_len=512, max_num_seqs=max_num_seqs)
    assert_identical(fast, step)


def test_fast_is_step_bit_for_bit_with_real_prefix_hits_and_chunked_prefill():
    trace = load_trace("mooncake-conv").iloc[:60].reset_index(drop=True)
    fast, step = run_both(trace, allocator="paged", model="llama-3-8b", capacity_tokens=400_000,
                          max_model_len=131072, enable_chunked_prefill=True, max_num_batched_tokens=2048)
    assert fast.summary["prefix_cache_hit_rate"] > 0.02
    assert (fast.requests["prefix_hit_tokens"] > 0).any()
    assert_identical(fast, step)


def test_events_off_changes_nothing_else():
    trace = load_trace("azure-conv").iloc[:200].reset_index(drop=True)
    on = simulate(trace, SimConfig())
    off = simulate(trace, SimConfig(record_events=False))
    assert len(off.events) == 0 and len(on.events) > 0
    pd.testing.assert_frame_equal(on.requests, off.requests)
    pd.testing.assert_frame_equal(on.memory, off.memory)


# ----------------------------------------------------------------- pieces
def _reference_tenures(log: list[tuple]) -> list[tuple]:
    """Tenures from a plain replay of the event log with a dict (what the recorder used to do)."""
    rows, open_rows = [], {}
    for kind, start, value, t, rid in log:
        if kind == "acquire":
            open_rows[start] = len(rows)
            rows.append([rid, start, value, t, None, 1, 0])
        elif kind == "share":
            row = rows[open_rows[start]]
            row[5] = max(row[5], value)
        else:
            row = rows[open_rows.pop(start)]
            row[4], row[6] = t, value
    return [tuple(r) for r in rows]


@given(ops=st.lists(st.tuples(st.sampled_from(["take", "share", "release"]), st.integers(0, 30),
                              st.integers(1, 4)), max_size=120),
       block_size=st.sampled_from([1, 16]), mode=st.sampled_from(["bulk", "region", "mixed"]),
       flush_rows=st.sampled_from([1, 2, 5, 1 << 20]), background=st.booleans())
@example(ops=[("take", 2, 1), ("take", 1, 1), ("release", 2, 1), ("release", 1, 2)], block_size=16,
         mode="mixed", flush_rows=1 << 20, background=False)  # block 2 and region 2 (slot 2): both open
@settings(max_examples=120, deadline=None)
def test_event_recorder_pairs_tenures_like_a_replay(ops, block_size, mode, flush_rows, background):
    """Bulk (block) calls and per-region calls give the tenures of a plain replay of the same events,
    sorted by (release time, acquisition), however often the recorder flushes finished tenures, paired
    inline or in the background thread, and with both kinds of call in one recorder (mixed: even keys
    are blocks, odd keys regions)."""
    rec = EventRecorder(flush_rows=flush_rows, background=background)
    log, held, refs = [], set(), {}
    for step, (kind, key, extra) in enumerate(ops):
        rec.now = float(step)
        bulk = mode == "bulk" or (mode == "mixed" and key % 2 == 0)
        start = key * block_size
        if not bulk and mode == "mixed" and block_size > 1:
            start = key + 1  # the same number as some block id (even), in slots: the units must not alias
        if kind == "take" and key not in held:
            held.add(key)
            refs[key] = 1
            rid = 100 + step
            if bulk:
                rec.acquire_blocks([key], block_size, [rid] if extra % 2 else rid,
                                   [float(step)] if extra > 2 else None)
            else:
                rec.acquire(start, block_size, rid)
            log.append(("acquire", start, block_size, float(step), rid))
        elif kind == "share" and key in held:
            refs[key] += 1
            if bulk:
                rec.share_block(key, block_size, refs[key])
            else:
                rec.share(start, refs[key])
            log.append(("share", start, refs[key], float(step), None))
        elif kind == "release" and key in held:
            held.discard(key)
            if bulk:
                rec.release_blocks([key], block_size, (extra,))
            else:
                rec.release(start, extra)
            log.append(("release", start, extra, float(step), None))
    got = rec.to_frame(end_s=999.0)
    want = [(rid, start, size, t0, 999.0 if t1 is None else t1, ref, filled)
            for rid, start, size, t0, t1, ref, filled in _reference_tenures(log)]
    want = [w for _, w in sorted(enumerate(want), key=lambda iw: (iw[1][4], iw[0]))]
    assert [tuple(r) for r in got.itertuples(index=False)] == want
    assert list(got.dtypes) == [np.int32, np.int32, np.int32, np.float64, np.float64, np.int32, np.int32]


@pytest.mark.parametrize("background", [False, True])
def test_event_recorder_reports_a_release_of_a_free_block(background):
    """A release of a block that holds no tenure is an error, raised by the flush that resolves it (in
    the background thread: by the next flush or `finish`, so it is never lost)."""
    rec = EventRecorder(flush_rows=1, background=background)
    rec.release_blocks([5], 16, [3])
    with pytest.raises(KeyError, match="region key 5"):
        rec.acquire_blocks([1], 16, 0)  # the flush it triggers resolves the bad release
        rec.finish(1.0)


def test_simulate_restores_the_cyclic_collector():
    """The loop runs without the cyclic GC; it is back on afterwards, after a failed run too."""
    trace = pd.DataFrame({"request_id": [0, 1], "arrival_s": [0.0, 0.1], "prompt_len": [5, 7],
                          "output_len": [3, 4], "n": [1, 1], "beam_width": [1, 1]})
    assert gc.isenabled()
    simulate(trace, SimConfig(record_events=True))
    assert gc.isenabled()

    def boom(run):
        raise RuntimeError("observer failed")

    with pytest.raises(RuntimeError, match="observer failed"):
        simulate(trace, SimConfig(record_events=True), observer=boom)
    assert gc.isenabled()


def test_memory_log_round_trips_rows():
    log = MemoryLog()
    log.add_row(0, 3, 0.5, 0.25, 0.1, 0.2, 0.3, 0.15, 0.25, 0.05, 0.6, (7, 2, 1), 9, 11)
    log.add_slots(3, 1, 0.75, 0.1, (100, 10, 20, 30, 15, 25, 5, 60), (8, 1, 0), 12, 4)
    df = log.to_frame()
    assert len(log) == 2 and df["num_steps"].tolist() == [3, 1] and df["blocks_used"].tolist() == [11, 15]
    assert df.loc[1, "token_states"] == df.loc[1, "token_occupancy"] == 0.1
    assert df.loc[1, ["reservation", "internal_fragmentation", "free", "cached_free"]].tolist() == \
        [0.2, 0.3, 0.25, 0.05]
    assert df["step"].dtype == np.int64 and df["t_s"].dtype == np.float64


def test_memory_log_keeps_counts_up_to_int32_and_steps_past_it():
    """Counts are packed as int32 and the step as int64: both round-trip at their limits."""
    big = 2**31 - 1
    log = MemoryLog()
    log.add_row(2**40, big, 1.0, 0.5, 0.1, 0.2, 0.3, 0.15, 0.25, 0.05, 0.6, (big, big - 1, 0), big, big)
    row = log.to_frame().iloc[0]
    assert row["step"] == 2**40 and row["num_steps"] == row["num_running"] == row["blocks_used"] == big
    assert row["num_waiting"] == big - 1 and row["num_batched_tokens"] == big
    assert row["token_occupancy"] == row["token_states"] == 0.1 and row["block_occupancy"] == 0.6


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 40), st.integers(1, 9), st.integers(1, 5))
def test_memory_log_hands_a_sink_every_row_in_batches_of_its_size(num, batch, chunk):
    """Rows kept in chunks reach the sink in order, in batches of exactly the sink's size (the last one
    shorter), with the time-weighted sums of the rows."""
    rng = np.random.default_rng(num * 100 + batch * 10 + chunk)
    sink = FrameSink(batch_rows=batch, dtypes=MEMORY_DTYPES)
    logs = [MemoryLog(), MemoryLog(sink, chunk_rows=chunk)]
    for i in range(num):
        f = rng.random(8)
        for log in logs:
            log.add_row(i, 1 + i % 3, float(i), float(f[0]), *map(float, f[1:8]), (i, 1, 0), i % 5, 2 * i)
    logs[1].finish()
    assert len(logs[1]) == num
    sizes = [len(b["step"]) for b in sink._batches]
    assert sizes == [batch] * (num // batch) + ([num % batch] if num % batch else [])
    expected = logs[0].to_frame()
    pd.testing.assert_frame_equal(sink.frame(), expected, check_exact=True)
    means, token_occupancy, _ = logs[1].weighted_means()
    dt = expected["dt_s"].to_numpy()
    if num:
        want = (expected["token_occupancy"] * dt).sum() / dt.sum()
        assert token_occupancy == pytest.approx(want, rel=1e-12)
        assert means["free"] == pytest.approx((expected["free"] * dt).sum() / dt.sum(), rel=1e-12)


def test_decode_blocks_in_bulk_equal_append_slot_one_by_one():
    """The decode batch's block helpers leave the manager exactly as per-token `append_slot` does."""
    def setup():
        bm = BlockManager(64, 4, recorder=EventRecorder(), debug=False)
        seqs = []
        for i, p in enumerate((3, 4, 9, 1)):
            s = Sequence(i, p, p + 20, request_id=i)
            bm.allocate(SequenceGroup(i, [s]))
            seqs.append(s)
        return bm, seqs

    ref_bm, ref_seqs = setup()
    for _ in range(11):
        for s in ref_seqs:
            ref_bm.append_slot(s)
    bm, seqs = setup()
    for step in range(11):  # lazily: blocks at boundaries only, counts settled at the end
        due = [s for s in seqs if (s.num_tokens + step) % 4 == 0]
        bm.append_decode_blocks(due)
        bm.add_decode_tokens(len(seqs))
    for s in seqs:
        bm.set_num_tokens(s, s.num_tokens + 11)
    bm.check_invariants()
    assert [s.block_table for s in seqs] == [s.block_table for s in ref_seqs]
    assert bm.breakdown() == ref_bm.breakdown()
    assert bm._filled == ref_bm._filled and bm._ref == ref_bm._ref


def test_admit_after_decode_equals_schedule_when_nobody_is_preempted():
    def setup():
        bm = BlockManager(200, 4)
        sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64), bm)
        for i, p in enumerate((5, 9, 30, 20, 40, 70, 6)):
            sched.add_request(SequenceGroup(i, [Sequence(i, p, p + 10, request_id=i)]))
        out = sched.schedule()  # admits the first ones
        sched.commit(out)
        for sg in out.scheduled:
            sg.group.seqs[0].append_token()
        return bm, sched

    bm_a, a = setup()
    bm_b, b = setup()
    out_a = a.schedule()
    running = list(b.running)
    for g in running:
        bm_b.append_slot(g.seqs[0])
    out_b = b.admit_after_decode(len(running))
    assert [g.request_id for g in out_b.admitted] == [g.request_id for g in out_a.admitted] != []
    assert [g.request_id for g in out_b.rejected] == [g.request_id for g in out_a.rejected] == [5]
    assert out_b.num_batched_tokens == out_a.num_batched_tokens
    assert [(sg.group.request_id, sg.num_new_tokens) for sg in out_b.scheduled] == \
        [(sg.group.request_id, sg.num_new_tokens) for sg in out_a.scheduled if sg.is_prefill]
    assert [g.request_id for g in b.running] == [g.request_id for g in a.running]
    assert bm_b.breakdown() == bm_a.breakdown()
