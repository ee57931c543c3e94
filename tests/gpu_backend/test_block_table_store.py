"""BlockTableStore: rows kept across steps always equal the allocator's tables (property test)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_backend.engine.block_table_store import BlockTableStore

# Operations on 6 sequences: append k blocks, copy-on-write of the last block, replace all
# (swap-in / re-admission, announced with forget), finish (forget).
OPS = st.lists(st.tuples(st.sampled_from(["append", "cow", "replace", "finish"]), st.integers(0, 5),
                         st.integers(1, 3)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_rows_track_appends_cow_and_replacement(ops):
    store = BlockTableStore(max_blocks=40, rows=2)  # tiny: growth is exercised too
    tables: dict[int, list[int]] = {}
    next_block = 1000
    for op, seq, k in ops:
        table = tables.setdefault(seq, [])
        if op == "append" and len(table) + k <= 40:
            table.extend(range(next_block, next_block + k))
            next_block += k
        elif op == "cow" and table:
            table[-1] = next_block
            next_block += 1
        elif op == "replace":
            tables[seq] = list(range(next_block, next_block + len(table)))
            next_block += len(table)
            store.forget([seq])
        elif op == "finish":
            del tables[seq]
            store.forget([seq])
            continue
        live = sorted(tables)
        rows = [store.row(s, tables[s]) for s in live]
        assert len(set(rows)) == len(rows)  # no two sequences share a row
        got, lens = store.gather(rows)
        for i, s in enumerate(live):
            assert lens[i] == len(tables[s])
            assert got[i, :lens[i]].tolist() == tables[s]


def test_retain_drops_rows_of_dead_sequences():
    store = BlockTableStore(max_blocks=4)
    for s in range(5):
        store.row(s, [s])
    store.retain({1, 3})
    assert sorted(store.rows) == [1, 3]
    assert store.gather([store.row(3, [3, 9])])[0].tolist() == [[3, 9]]
