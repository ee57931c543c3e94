"""The paper-reproduction script: saturated-window shares; the paper's orderings on the ShareGPT burst."""
from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

from bench.paper import (
    ALLOCATORS,
    BASE,
    TRACES,
    fig2_table,
    fig13_table,
    paged_free_causes,
    run_paper,
    saturated_time_share,
    window_shares,
)
from traces import SyntheticConfig, generate_trace


def _rows(dt, waiting, token, free):
    n = len(dt)
    return pd.DataFrame({"dt_s": dt, "num_waiting": waiting, "token_states": token, "reservation": [0.0] * n,
                         "internal_fragmentation": [0.0] * n, "external_fragmentation": [0.0] * n,
                         "free": free})


def test_saturated_window_leaves_out_the_drain():
    # Saturated for 3 s at 96 % tokens, then a 1 s drain at 40 % tokens and 60 % free.
    m = _rows([1.0, 2.0, 1.0], [5, 1, 0], [0.96, 0.96, 0.40], [0.04, 0.04, 0.60])
    assert window_shares(m, saturated=True)["token_states"] == pytest.approx(0.96)
    assert window_shares(m, saturated=False)["token_states"] == pytest.approx((3 * 0.96 + 0.40) / 4)
    assert window_shares(m, saturated=False)["free"] == pytest.approx((3 * 0.04 + 0.60) / 4)
    assert saturated_time_share(m) == pytest.approx(0.75)


@pytest.fixture(scope="module")
def sharegpt_burst():
    return run_paper({"sharegpt-burst": TRACES["sharegpt-burst"]}, BASE)["sharegpt-burst"]


def test_paper_ordering_of_token_share_and_batch(sharegpt_burst):
    # The paper's Fig. 2 / Fig. 13 order, Max < Pow2 < Oracle < paged (Pow2 regions capped at max_model_len).
    token = [window_shares(sharegpt_burst[a].memory, True)["token_states"] for a in ALLOCATORS]
    batch = [sharegpt_burst[a].summary["mean_batch_size"] for a in ALLOCATORS]
    assert token == sorted(token) and len(set(token)) == 4
    assert batch == sorted(batch) and len(set(batch)) == 4
    paged = sharegpt_burst["paged"].memory
    # The burst's drain phase (empty queue) is free memory the saturated window leaves out.
    assert window_shares(paged, True)["free"] < window_shares(paged, False)["free"]


def test_tables_name_every_allocator(sharegpt_burst):
    fig2 = fig2_table(sharegpt_burst, {a: 1.0 for a in ALLOCATORS})
    assert fig2.count("| whole run |") == 4 and fig2.count("| saturated (") == 4
    fig13 = fig13_table({"sharegpt-2rps": sharegpt_burst})
    assert "sharegpt-2rps, paper | 7.00 | 9.81 | 13.62 | 30.42" in fig13
    row = next(line for line in fig13.splitlines() if "pagelab" in line)
    assert row.count("|") == len(ALLOCATORS) + 2


def test_paged_free_causes_separates_watermark_and_head_of_line():
    trace = generate_trace(SyntheticConfig(num_requests=300, arrival="burst", lengths="sharegpt", seed=1))
    with_wm = paged_free_causes(trace, BASE)
    without = paged_free_causes(trace, dataclasses.replace(BASE, watermark=0.0))
    assert without["free_blocks_under_watermark"] == 0.0
    assert 0.0 < with_wm["free_blocks_under_watermark"] <= 9  # 1 % of 983 blocks
    for causes in (with_wm, without):
        # Under FCFS the pool admits whenever the head fits, so the head mostly does not.
        assert causes["head_does_not_fit_time_share"] > 0.5
        assert 0.0 < causes["head_preempted_time_share"] < 1.0
