"""Unit tests of the shared Scheduler: admission, preemption, swapping, rejection, and the prefix cache
under chunked prefill (a block is a hit only once computed)."""
from __future__ import annotations

import copy

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simulator import AllocStatus, BlockManager, Sequence, SequenceGroup
from simulator.core.scheduler import Scheduler, SchedulerConfig
from simulator.core.sequence import RunningGroups, SequenceStatus


def _group(rid: int, prompt_len: int, final_len: int | None = None, *, tokens: list[int] | None = None,
           n: int = 1) -> SequenceGroup:
    seqs = [Sequence(rid * 100 + i, prompt_len, final_len, request_id=rid,
                     token_ids=None if tokens is None else list(tokens)) for i in range(n)]
    return SequenceGroup(rid, seqs, n=n)


def _sched(num_blocks=16, block_size=4, *, num_cpu_blocks=0, watermark=0.0, **cfg) -> Scheduler:
    cfg.setdefault("max_model_len", 64)
    bm = BlockManager(num_blocks, block_size, num_cpu_blocks=num_cpu_blocks, watermark=watermark, debug=True)
    return Scheduler(SchedulerConfig(**cfg), bm)


def _step(sch: Scheduler, token: int = 7):
    """Schedule, commit, and give every group that sampled one token; return the output."""
    out = sch.schedule()
    sch.commit(out)
    for sg in out.scheduled:
        if not sg.is_prefill or sg.completes_prefill:
            for s in sg.group.live_seqs():
                s.append_token(None if s.token_ids is None else token)
    return out


def _ids(groups) -> list[int]:
    return [g.request_id for g in groups]


# ----------------------------------------------------------------- admission
def test_admission_is_first_come_first_served():
    sch = _sched(8, 4)
    big, small = _group(1, 30, 32), _group(2, 4, 6)
    first = _group(0, 8, 12)
    for g in (first, big, small):
        sch.add_request(g)
    out = sch.schedule()
    # The second request (8 blocks) does not fit next to the first; the third would, but must wait.
    assert _ids(out.admitted) == [0]
    assert _ids(sch.waiting) == [1, 2]


def test_watermark_keeps_blocks_back_from_admission():
    sch = _sched(10, 4, watermark=0.2)  # 2 blocks held back
    sch.add_request(_group(0, 32, 32))  # 8 blocks: leaves exactly the watermark
    sch.add_request(_group(1, 4, 5))
    out = sch.schedule()
    assert _ids(out.admitted) == [0]
    assert sch.allocator.can_allocate(sch.waiting[0]) is AllocStatus.LATER


def test_max_num_seqs_caps_the_running_batch():
    sch = _sched(64, 4, max_num_seqs=2)
    for rid in range(3):
        sch.add_request(_group(rid, 4, 8))
    out = sch.schedule()
    assert _ids(out.admitted) == [0, 1] and len(sch.waiting) == 1


def test_whole_prompts_must_fit_the_token_budget_without_chunking():
    sch = _sched(64, 4, max_num_batched_tokens=16, max_model_len=16, max_num_seqs=4)
    sch.add_request(_group(0, 10, 12))
    sch.add_request(_group(1, 10, 12))
    out = sch.schedule()
    assert _ids(out.admitted) == [0] and out.num_batched_tokens == 10
    sch.commit(out)
    g0 = sch.running[0]
    g0.seqs[0].append_token()
    out = sch.schedule()
    # Next step: one decode token for request 0 leaves room for request 1's whole prompt.
    assert _ids(out.admitted) == [1] and out.num_batched_tokens == 11


def test_chunked_prefill_splits_a_prompt_over_steps():
    sch = _sched(64, 4, max_num_batched_tokens=4, max_num_seqs=2, enable_chunked_prefill=True)
    g = _group(0, 10, 12)
    sch.add_request(g)
    chunks = []
    for _ in range(3):
        out = _step(sch)
        sg = out.scheduled[0]
        chunks.append((sg.num_new_tokens, sg.is_prefill, sg.completes_prefill))
    assert chunks == [(4, True, False), (4, True, False), (2, True, True)]
    assert g.seqs[0].num_generated == 1 and not sch.prefill_left
    out = _step(sch)
    assert [(sg.num_new_tokens, sg.is_prefill) for sg in out.scheduled] == [(1, False)]


def test_prompt_longer_than_max_model_len_is_rejected():
    sch = _sched(64, 4, max_model_len=16)
    g = _group(0, 20, 22)
    sch.add_request(g)
    out = sch.schedule()
    assert out.rejected == [g] and g.is_finished and not sch.has_unfinished()


def test_request_larger_than_the_pool_is_rejected_and_the_next_admitted():
    sch = _sched(4, 4)
    too_big, ok = _group(0, 12, 20), _group(1, 4, 6)  # 5 blocks at the end, the pool has 4
    sch.add_request(too_big)
    sch.add_request(ok)
    out = sch.schedule()
    assert out.rejected == [too_big] and _ids(out.admitted) == [1]


# ----------------------------------------------------------------- preemption
def _full_pool(mode: str, num_cpu_blocks: int = 0) -> tuple[Scheduler, list[SequenceGroup]]:
    """Three running requests filling a 6-block pool, each about to need a new block."""
    sch = _sched(6, 4, num_cpu_blocks=num_cpu_blocks, preemption_mode=mode)
    groups = [_group(rid, 8, 12) for rid in range(3)]
    for g in groups:
        sch.add_request(g)
    _step(sch)  # all three admitted: 2 blocks each, every last block full
    return sch, groups


def test_recompute_preempts_the_most_recently_admitted_group_first():
    sch, groups = _full_pool("recompute")
    out = _step(sch)
    assert out.preempted == [groups[2]]
    assert _ids(sch.waiting) == [2] and groups[2].seqs[0].status is SequenceStatus.WAITING
    assert groups[2].seqs[0].block_table == []  # its blocks were freed for recomputation
    assert _ids(sch.running) == [0, 1] and sch.num_preemptions == 1


def test_swap_preemption_moves_the_group_to_the_cpu_and_brings_it_back_first():
    sch, groups = _full_pool("swap", num_cpu_blocks=8)
    out = _step(sch)
    assert out.preempted == [groups[2]] and list(sch.swapped) == [groups[2]]
    assert len(out.blocks_to_swap_out) == 2 and groups[2].seqs[0].status is SequenceStatus.SWAPPED
    late = _group(9, 4, 6)
    sch.add_request(late)
    sch.finish_seq(groups[0].seqs[0])
    sch.remove_finished()
    out = _step(sch)
    # Swapped groups come back before any waiting one is admitted.
    assert out.swapped_in == [groups[2]] and len(out.blocks_to_swap_in) == 2
    assert late in sch.waiting and not out.admitted


def test_waiting_requests_wait_while_a_group_is_swapped_out():
    sch, groups = _full_pool("swap", num_cpu_blocks=8)
    _step(sch)
    sch.add_request(_group(9, 1, 1))  # would fit in no time, but swapped groups come first
    out = sch.schedule()
    assert not out.admitted and sch.swapped


def test_swapped_group_that_outgrew_the_pool_is_rejected():
    sch = _sched(4, 4, num_cpu_blocks=8, preemption_mode="swap", max_num_seqs=4)
    g = _group(0, 4, 9, n=2)  # two samples: one shared block, then a block each
    sch.add_request(g)
    for _ in range(5):
        _step(sch)  # both samples decode up to 8 slots: 3 blocks, last ones full
    assert all(s.num_tokens == 8 for s in g.seqs)
    out = sch.schedule()  # each needs a new block: it preempts itself
    assert out.preempted == [g] and list(sch.swapped) == [g]
    out = sch.schedule()  # 3 blocks back + 2 next tokens > 4 blocks, ever: drop it, freeing its CPU blocks
    assert out.rejected == [g] and g.is_finished and not sch.swapped
    assert sch.allocator.num_free_cpu_blocks == 8


def test_mid_prefill_preemption_recomputes_even_in_swap_mode():
    sch = _sched(10, 4, num_cpu_blocks=16, preemption_mode="swap", max_num_batched_tokens=8,
                 max_num_seqs=4, enable_chunked_prefill=True)
    g1 = _group(1, 4, 12, tokens=[1, 2, 3, 4])
    g2 = _group(2, 33, 40, tokens=list(range(100, 133)))
    sch.add_request(g1)
    sch.add_request(g2)
    _step(sch)
    out = _step(sch)
    assert out.preempted == [g2] and _ids(sch.waiting) == [2] and not sch.swapped


# ----------------------------------------------------------------- prefix cache under chunked prefill
def test_preempted_chunked_prefill_leaves_no_uncomputed_hits():
    """A preempted chunked prefill, re-admitted, may hit only the blocks its first attempt computed."""
    bm = BlockManager(10, 4)
    sch = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64,
                                    enable_chunked_prefill=True), bm)
    g1 = SequenceGroup(1, [Sequence(1, 4, 12, token_ids=[1, 2, 3, 4])])
    g2 = SequenceGroup(2, [Sequence(2, 33, 40, token_ids=list(range(100, 133)))])
    sch.add_request(g1)
    sch.add_request(g2)
    o = sch.schedule()
    sch.commit(o)  # g2 computed 4 of 33 tokens
    assert [sg.num_new_tokens for sg in o.scheduled] == [4, 4]
    g1.seqs[0].append_token(7)
    o = sch.schedule()
    sch.commit(o)
    assert o.preempted == [g2]
    sch.finish_seq(g1.seqs[0])
    sch.remove_finished()
    o = sch.schedule()
    assert g2.seqs[0].num_cached_tokens == 4  # the one block it computed, not the 8 it was given
    assert sch.prefill_left[2] == 29 and o.scheduled[0].num_new_tokens == 8
    # vLLM v1 counts a re-admitted request's lookup apart from new requests' (both 4 + 33 tokens asked)
    assert (bm.stats.prefix_hit_tokens, bm.stats.preempted_hit_tokens) == (0, 4)
    assert (bm.stats.prefix_query_tokens, bm.stats.preempted_query_tokens) == (4 + 33, 33)


def test_later_chunks_publish_their_blocks_when_scheduled():
    sch = _sched(32, 4, max_num_batched_tokens=6, max_num_seqs=2, enable_chunked_prefill=True)
    prompt = list(range(20))
    a = _group(0, 20, 22, tokens=prompt)
    sch.add_request(a)
    _step(sch)  # tokens 0-5 computed: block 0
    b = _group(1, 20, 22, tokens=prompt)
    assert sch.allocator.prefix_cache.lookup(b.seqs[0]) == a.seqs[0].block_table[:1]
    _step(sch)  # tokens 6-11: blocks 1 and 2
    assert sch.allocator.prefix_cache.lookup(b.seqs[0]) == a.seqs[0].block_table[:3]


# ----------------------------------------------------------------- queries
def _snapshot(sch: Scheduler):
    bm = sch.allocator
    state = {k: copy.deepcopy(v) for k, v in vars(bm.pool).items() if k not in ("stats", "events")}
    state["cpu"] = {k: copy.deepcopy(getattr(bm.swap, k)) for k in ("ref", "filled", "key", "free")}
    state["internal"] = bm.num_internal_slots
    state["seqs"] = sorted(bm.seqs), sorted(bm.swap.seqs)
    state["stats"] = bm.stats.as_dict()
    queues = (_ids(sch.waiting), _ids(sch.running), _ids(sch.swapped), dict(sch.prefill_left),
              sch.num_preemptions)
    tables = [(s.seq_id, list(s.block_table), list(s.cpu_block_table), s.num_tokens, s.status)
              for g in list(sch.waiting) + sch.running + list(sch.swapped) for s in g.seqs]
    return state, queues, tables


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_queries_change_nothing(mode):
    sch, groups = _full_pool(mode, num_cpu_blocks=8)
    _step(sch)  # one group preempted
    sch.add_request(_group(7, 4, 6, tokens=[1, 2, 3, 4]))
    before = _snapshot(sch)
    bm = sch.allocator
    for g in groups + [sch.waiting[-1]]:
        live = g.live_seqs()
        if g in sch.swapped:
            bm.can_swap_in(g)
        elif any(s.seq_id in bm.seqs for s in live):
            bm.can_append(live)
            bm.can_swap_out(g)
            for s in live:
                bm.can_append([s], 3)
        else:
            bm.can_allocate(g)
    bm.breakdown(sch.waiting[0] if sch.waiting else None)
    sch.has_unfinished()
    assert _snapshot(sch) == before


# ----------------------------------------------------------------- running groups
@given(st.lists(st.tuples(st.sampled_from(["append", "remove", "clear"]), st.integers(0, 9)), max_size=60))
def test_running_groups_match_a_list_under_any_sequence_of_operations(make_group_ops):
    groups = [_Group(i) for i in range(10)]
    model: list[_Group] = []
    running = RunningGroups()
    for op, i in make_group_ops:
        g = groups[i]
        if op == "append":
            if g in model:
                with pytest.raises(ValueError, match="already running"):
                    running.append(g)
                continue
            model.append(g)
            running.append(g)
        elif op == "remove":
            if g not in model:
                with pytest.raises(ValueError, match="not running"):
                    running.remove(g)
                continue
            model.remove(g)
            running.remove(g)
        else:
            model.clear()
            running.clear()
        assert list(running) == model and len(running) == len(model) and bool(running) == bool(model)
        assert list(reversed(running)) == model[::-1]
        assert all((x in running) == (x in model) for x in groups)
        if model:
            assert running[0] is model[0] and running[-1] is model[-1] and running[1:] == model[1:]
        assert running + [groups[0]] == [*model, groups[0]]


def test_running_order_is_admission_order_and_survives_rebuilding():
    a, b, c = _Group(1), _Group(2), _Group(3)
    running = RunningGroups([a, b, c])
    running.remove(b)
    running.append(b)
    assert list(running) == [a, c, b]
    assert list(RunningGroups(g for g in running if g is not c)) == [a, b]


class _Group:
    """Stands in for a SequenceGroup: identity is all RunningGroups uses, plus the id for messages."""

    def __init__(self, request_id: int) -> None:
        self.request_id = request_id


def test_a_diverged_groups_prefill_chunks_attend_to_a_growing_context():
    from simulator.loop.step import prefill_context

    sch = _sched(64, 4, enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=8)
    group = _group(1, 10, 30, n=3)
    for s in group.seqs:
        s.num_generated = 5  # re-admitted after a recompute: 15 tokens each, 8 of them the shared prompt
    sch.add_request(group)
    assert sch.prefill_tokens(group.live_seqs()) == 15 + 2 * 7
    contexts = []
    while not contexts or sch.prefill_left.get(1, 0):
        out = sch.schedule()
        contexts += [prefill_context(sch, sg) for sg in out.scheduled if sg.is_prefill]
        sch.commit(out)
    assert contexts == [8, 16, 24, 29]
