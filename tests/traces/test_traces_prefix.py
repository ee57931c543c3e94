"""block_keys: recorded prefix keys mapped onto the simulator's block size."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from traces import TraceError, load_trace
from traces.prefix import block_keys


def reference(keys: list[int], recorded: int, block: int, prompt_len: int) -> list[tuple]:
    """Slow, obviously right model: a block's identity is the tuple of recorded (key, offset) it covers.

    Every token position t of the prompt that a recorded key covers gets the label (keys[t // recorded],
    t % recorded); a full block is identified by the labels of its tokens, which (prefix semantics)
    collapse to the label of its last token.
    """
    covered = min(prompt_len, len(keys) * recorded)
    out = []
    for start in range(0, prompt_len - block + 1, block):
        end = start + block
        if end > covered:
            break
        last = end - 1
        out.append((keys[last // recorded], last % recorded))
    return out


def same_pattern(a: list, b: list) -> bool:
    """Whether two key lists induce the same equalities (a bijection between their values)."""
    return len(a) == len(b) and len(set(zip(a, b, strict=True))) == len(set(a)) == len(set(b))


def test_same_block_size_keeps_keys_of_full_blocks():
    assert block_keys([7, 8, 9], 16, 16, 48) == [7, 8, 9]
    assert block_keys([7, 8, 9], 16, 16, 47) == [7, 8]  # the last block is partial
    assert block_keys([7, 8, 9], 16, 16, 15) == []


def test_smaller_block_size_splits_each_recorded_block():
    keys = block_keys([5, 6], 512, 128, 1000)  # 1000 // 128 = 7 full blocks
    assert len(keys) == 7
    assert len(set(keys)) == 7
    assert keys[:4] == block_keys([5, 99], 512, 128, 1000)[:4]  # same first key, same sub-blocks
    assert set(keys[4:]).isdisjoint(block_keys([5, 99], 512, 128, 1000)[4:])


def test_larger_block_size_groups_recorded_blocks():
    assert block_keys([1, 2, 3, 4, 5], 16, 32, 80) == [2, 4]  # the fifth recorded block has no partner
    assert block_keys([1, 2, 3, 4], 16, 64, 64) == [4]
    assert block_keys([1, 2, 3, 4], 16, 64, 63) == []


def test_only_recorded_blocks_get_keys():
    # A trace may record keys for a shared system prompt only; the rest of the prompt is private.
    assert block_keys([1, 2], 16, 16, 200) == [1, 2]
    assert len(block_keys([1, 2], 16, 8, 200)) == 4
    assert block_keys([1, 2, 3], 16, 32, 200) == [2]


@pytest.mark.parametrize(("recorded", "block"), [(512, 24), (16, 24), (512, 0), (0, 16), (48, 32)])
def test_incompatible_block_sizes_are_refused(recorded, block):
    with pytest.raises(TraceError, match="block"):
        block_keys([1, 2], recorded, block, 1000)


def test_mooncake_keys_at_native_size():
    df = load_trace("mooncake-conv").iloc[:200]
    for row in df.itertuples():
        full = row.prompt_len // 512
        assert block_keys(row.prefix_blocks, 512, 512, row.prompt_len) == row.prefix_blocks[:full]


@given(
    rows=st.lists(st.tuples(st.lists(st.integers(0, 6), min_size=0, max_size=6), st.integers(1, 400)),
                  min_size=1, max_size=6),
    recorded=st.sampled_from([8, 16, 32]),
    block=st.sampled_from([2, 4, 8, 16, 32, 64, 128]),
)
def test_keys_induce_the_same_sharing_as_the_token_model(rows, recorded, block):
    ours, ref = [], []
    for keys, prompt_len in rows:
        keys = keys[: -(-prompt_len // recorded)]
        got = block_keys(keys, recorded, block, prompt_len)
        want = reference(keys, recorded, block, prompt_len)
        assert len(got) == len(want)
        ours += got
        ref += want
    assert same_pattern(ours, ref)
