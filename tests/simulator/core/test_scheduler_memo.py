"""Property test: the Scheduler's memo of what the waiting head's lengths decide (too long, prompt tokens,
`can_ever_allocate`) changes no decision.

Two schedulers run the same requests step by step: the real one, and one that forgets the memo before
every admission decision, so it works everything out again each time. Sequences of unknown final length
grow until they stop or outgrow the pool, so groups are preempted (recompute or swap), re-queued longer
than before and rejected: every step's admissions, rejections, preemptions and scheduled work must be the
same in both.
"""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulator import BlockManager, Sequence, SequenceGroup
from simulator.core.scheduler import Admission, Scheduler, SchedulerConfig


class _AskEveryTime(Scheduler):
    """The reference: no memo."""

    def head_admission(self, room: int):
        self._head = None
        return super().head_admission(room)


def _build(cls, num_blocks: int, mode: str, max_num_seqs: int, max_model_len: int) -> Scheduler:
    bm = BlockManager(num_blocks, 2, num_cpu_blocks=32, debug=True)
    return cls(SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len, preemption_mode=mode,
                               max_num_batched_tokens=max_model_len + max_num_seqs), bm)


def _outcome(out) -> tuple:
    ids = lambda groups: [g.request_id for g in groups]  # noqa: E731
    return (ids(out.admitted), ids(out.rejected), ids(out.preempted), ids(out.swapped_in),
            [(sg.group.request_id, sg.num_new_tokens, sg.is_prefill) for sg in out.scheduled])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(3, 12), mode=st.sampled_from(["recompute", "swap"]),
       max_num_seqs=st.integers(1, 3), max_model_len=st.integers(8, 24),
       requests=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 20), st.integers(1, 16)),
                         min_size=1, max_size=12))
def test_memo_changes_no_decision(num_blocks, mode, max_num_seqs, max_model_len, requests):
    """requests: (arrival step, prompt length, tokens generated before it stops)."""
    pair = [_build(cls, num_blocks, mode, max_num_seqs, max_model_len) for cls in (Scheduler, _AskEveryTime)]
    stops = [{} for _ in pair]
    for step in range(60):
        outcomes = []
        for sch, stop in zip(pair, stops, strict=True):
            for rid, (arrive, prompt, gen) in enumerate(requests):
                if arrive == step:
                    stop[rid] = gen
                    sch.add_request(SequenceGroup(rid, [Sequence(rid, prompt, None, request_id=rid)]))
            out = sch.schedule()
            sch.commit(out)
            for sg in out.scheduled:
                if sg.is_prefill and not sg.completes_prefill:
                    continue
                for s in sg.group.live_seqs():
                    s.append_token()
                    if s.num_generated >= stop[s.request_id]:
                        sch.finish_seq(s)
            sch.remove_finished()
            outcomes.append(_outcome(out))
        assert outcomes[0] == outcomes[1], f"step {step}"
    assert [len(s.waiting) for s in pair] == [len(pair[1].waiting)] * 2


def test_a_group_pushed_to_the_front_is_judged_by_its_own_lengths():
    """A preempted group goes back to the front of the queue ahead of the memoized head: the memo must
    not answer for it (here the old head waits for a seat, the new one is too long for the model)."""
    sch = _build(Scheduler, num_blocks=12, mode="recompute", max_num_seqs=1, max_model_len=16)
    sch.add_request(SequenceGroup(0, [Sequence(0, 4, None, request_id=0)]))
    sch.commit(sch.schedule())  # request 0 takes the only seat
    sch.add_request(SequenceGroup(1, [Sequence(1, 6, None, request_id=1)]))
    assert sch.head_admission(room=64) is Admission.WAIT  # no seat; memoized
    sch.waiting.appendleft(SequenceGroup(2, [Sequence(2, 20, None, request_id=2)]))
    assert sch.head_admission(room=64) is Admission.REJECT
