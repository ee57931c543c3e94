"""RunningGroups behaves as the list it replaced: same order, same reads, same errors, O(1) removal."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simulator.core.scheduler import RunningGroups


@given(st.lists(st.tuples(st.sampled_from(["append", "remove", "clear"]), st.integers(0, 9)), max_size=60))
def test_it_matches_a_list_under_any_sequence_of_operations(make_group_ops):
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
        assert running + [groups[0]] == [*model, groups[0]] and [groups[0]] + running == [groups[0], *model]


def test_order_is_admission_order_and_survives_rebuilding():
    a, b, c = _Group(1), _Group(2), _Group(3)
    running = RunningGroups([a, b, c])
    running.remove(b)
    running.append(b)
    assert list(running) == [a, c, b]
    assert list(RunningGroups(g for g in running if g is not c)) == [a, b]
    assert repr(running) == "RunningGroups([1, 3, 2])"


class _Group:
    """Stands in for a SequenceGroup: identity is all RunningGroups uses, plus the id for messages."""

    def __init__(self, request_id: int) -> None:
        self.request_id = request_id
