"""The simulation loop: the paper's mechanisms show (fast == step lives in test_simulate_fast.py)."""
from __future__ import annotations

import dataclasses
import gc
import weakref

import numpy as np
import pandas as pd
import pytest
from fresh_process import run_script

from simulator.config import SimConfig
from simulator.core.errors import ConfigError
from simulator.loop import simulate
from simulator.timing.step_latency import make_latency_model
from traces import SyntheticConfig, generate_trace, load_trace
from traces.errors import TraceError


def _trace(**kw) -> pd.DataFrame:
    return generate_trace(SyntheticConfig(**kw))


def test_memory_rows_sum_to_one_and_counts_are_sane():
    trace = _trace(num_requests=200, rate=20, lengths="sharegpt", seed=1)
    res = simulate(trace, SimConfig(allocator="contiguous-pow2", model="opt-13b", kv_memory_gb=12,
                                    max_model_len=2048))
    m = res.memory
    states = ["token_states", "reservation", "internal_fragmentation", "external_fragmentation", "free"]
    total = m[states].sum(axis=1)
    np.testing.assert_allclose(total, 1.0, atol=1e-9)
    assert (m["dt_s"] > 0).all()
    assert res.summary["num_finished"] + res.summary["num_rejected"] == 200
    r = res.requests.dropna(subset=["finish_s"])
    assert (r["first_token_s"] >= r["admitted_s"]).all() and (r["finish_s"] >= r["first_token_s"]).all()
    assert (r["admitted_s"] >= r["arrival_s"]).all()


def test_a_finished_run_state_is_freed_without_the_cyclic_collector():
    # The statistics after the loop should reuse the run's memory, not sit beside it: the state (its
    # scheduler, block tables, trace cursors) must go by reference counting as simulate() returns.
    states = []

    def observe(run):
        if not states:
            states.append(weakref.ref(run))

    trace = _trace(num_requests=60, rate=20, lengths="sharegpt", seed=3)
    enabled = gc.isenabled()
    gc.disable()
    try:
        res = simulate(trace, SimConfig(allocator="paged"), observer=observe)
        assert states and states[0]() is None
    finally:
        if enabled:
            gc.enable()
    assert res.summary["num_finished"] == 60
    assert list(res.summary)[14:18] == ["normalized_latency_s_per_token", "ttft_s", "tpot_s", "e2e_s"]
    assert res.summary["ttft_s"]["p50"] == float(np.median(res.requests["ttft_s"]))


def test_orca_max_holds_exactly_seven_requests_under_load():
    trace = _trace(num_requests=300, arrival="burst", lengths="sharegpt", seed=0)
    # A token budget of 4096 keeps long prompts from blocking admission (a separate effect).
    res = simulate(trace, SimConfig(allocator="contiguous-max", model="opt-13b", kv_memory_gb=12,
                                    max_model_len=2048, max_num_batched_tokens=4096))
    m = res.memory
    assert m["num_running"].max() == 7
    assert (m.loc[m["num_waiting"] > 0, "num_running"] == 7).all()  # full whenever someone waits
    assert res.summary["memory"]["external_fragmentation"] == pytest.approx(0.0885, abs=0.002)


def test_paged_batches_more_requests_than_contiguous_under_load():
    trace = _trace(num_requests=300, arrival="burst", lengths="sharegpt", seed=0)
    batch = {}
    for name in ("contiguous-max", "contiguous-pow2", "contiguous-oracle", "paged"):
        res = simulate(trace, SimConfig(allocator=name, model="opt-13b", kv_memory_gb=12, max_model_len=2048))
        batch[name] = res.summary["mean_batch_size"]
    assert batch["contiguous-max"] < batch["contiguous-pow2"] < batch["contiguous-oracle"] < batch["paged"]


def test_requests_that_never_fit_are_rejected_not_crashed():
    trace = pd.DataFrame({"request_id": [0, 1, 2], "arrival_s": [0.0, 0.1, 0.2],
                          "prompt_len": [100, 5000, 100], "output_len": [10, 10, 10]})
    for name in ("paged", "contiguous-max", "contiguous-oracle"):
        res = simulate(trace, SimConfig(allocator=name, model="opt-13b", capacity_tokens=4096,
                                        max_model_len=2048))
        assert res.requests["rejected"].tolist() == [False, True, False]
        assert res.summary["num_finished"] == 2


def test_parallel_sampling_and_beams_share_blocks():
    trace = _trace(num_requests=30, rate=5, lengths="alpaca", seed=2)
    used = {}
    for label, kw in (("n1", {}), ("n4", {"n": 4}), ("beam4", {"beam_width": 4})):
        t = trace.copy()
        for col, v in kw.items():
            t[col] = v
        res = simulate(t, SimConfig(allocator="paged", model="opt-13b", kv_memory_gb=12, max_model_len=2048,
                                    enable_prefix_caching=False))
        assert res.summary["num_finished"] == 30
        used[label] = res
    assert used["n4"].summary["allocator_stats"]["cow_copies"] > 0
    assert used["beam4"].summary["allocator_stats"]["cow_copies"] > 0


def test_same_seed_same_result_and_seed_matters_for_beams():
    trace = _trace(num_requests=20, rate=5, lengths="alpaca", beam_width=4, seed=5)
    cfg = SimConfig(allocator="paged", model="opt-13b", kv_memory_gb=12, max_model_len=2048)
    a, b = simulate(trace, cfg), simulate(trace, cfg)
    pd.testing.assert_frame_equal(a.requests, b.requests)
    pd.testing.assert_frame_equal(a.memory.drop(columns=[]), b.memory)
    c = simulate(trace, dataclasses.replace(cfg, seed=99))
    assert c.summary["allocator_stats"] != a.summary["allocator_stats"]


_EVENTS_DIGEST = """
import hashlib, pandas as pd
from simulator.config import SimConfig
from simulator.loop import simulate
from traces import load_trace
config = SimConfig(model="llama-3-8b", max_model_len=131072)
ev = simulate(load_trace("mooncake-conv").iloc[:30], config).events
digest = hashlib.sha256(pd.util.hash_pandas_object(ev, index=False).values.tobytes()).hexdigest()
print(int((ev.prefix_key != 0).sum()), digest)
"""


def test_two_processes_write_the_same_events_prefix_keys_included():
    # Content hashes must not depend on the process: hashing None would (its hash is its address before
    # Python 3.12), and the events table's prefix_key is a block's chained content hash.
    first, second = run_script(_EVENTS_DIGEST), run_script(_EVENTS_DIGEST)
    assert int(first.split()[0]) > 0  # some released blocks carry a prefix key
    assert first == second


def test_events_cover_allocations():
    trace = load_trace("azure-conv").iloc[:100].reset_index(drop=True)
    res = simulate(trace, SimConfig(allocator="paged"))
    ev = res.events
    assert len(ev) == res.summary["allocator_stats"]["allocated_blocks"]
    assert (ev["t_end_s"] >= ev["t_start_s"]).all()
    assert (ev["size"] == 16).all()


def test_request_whose_final_length_never_fits_is_rejected_not_livelocked():
    # The prompt fits the pool, but prompt + output does not: it would preempt itself forever.
    trace = pd.DataFrame({"request_id": [0, 1], "arrival_s": [0.0, 0.0],
                          "prompt_len": [100, 100], "output_len": [2000, 50]})
    res = simulate(trace, SimConfig(allocator="paged", model="opt-13b", capacity_tokens=1024, block_size=16,
                                    max_model_len=4096, watermark=0.0))
    assert res.requests["rejected"].tolist() == [True, False]
    assert res.summary["num_finished"] == 1


@pytest.mark.parametrize(("model", "kv_memory_gb"), [("gemma-3-27b", 0.5), ("llama-3-8b", 0.05)])
def test_samples_outgrowing_the_pool_together_are_dropped_not_stalled(model, kv_memory_gb):
    # n=2 samples on a small pool (Gemma 3's KV cache groups, and one group): a request readmitted alone
    # that still cannot take a decode step would be recomputed forever; it is dropped, alike in both modes.
    trace = generate_trace(SyntheticConfig(num_requests=16, rate=20.0, lengths="sharegpt", seed=0))
    trace = trace.assign(n=2)
    runs = [simulate(trace, SimConfig(model=model, gpu="h100-80gb", kv_memory_gb=kv_memory_gb,
                                      max_model_len=2048, record_events=False, mode=mode))
            for mode in ("fast", "step")]
    for res in runs:
        assert res.summary["num_finished"] + int(res.requests["rejected"].sum()) == 16
        assert res.requests["rejected"].any()
    pd.testing.assert_frame_equal(runs[0].requests, runs[1].requests)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("mode", ["fast", "step"])
def test_a_group_that_preempts_itself_comes_back_without_waiting_for_the_next_arrival(preemption, mode):
    # Four samples share one partly filled block of a 4-block pool: their first decode asks for more blocks
    # than are free, so the only running group preempts itself; the next request arrives 100 s later.
    trace = pd.DataFrame({"request_id": [0, 1], "arrival_s": [0.0, 100.0], "prompt_len": [9, 9],
                          "output_len": [3, 3], "n": [4, 1]})
    config = SimConfig(model="opt-13b", capacity_tokens=64, block_size=16, max_model_len=256, watermark=0.0,
                       preemption_mode=preemption, swap_space_gb=1.0, mode=mode)
    res = simulate(trace, config)
    assert res.summary["num_preemptions"] == 1
    assert res.requests["finish_s"].iloc[0] < 1.0
    # Swapped out, its one block crosses PCIe before it comes back: an idle row of exactly that time.
    finish = res.requests["finish_s"].iloc[0]
    idle = res.memory.loc[(res.memory["num_steps"] == 0) & (res.memory["t_s"] < finish), "dt_s"].tolist()
    latency = make_latency_model("roofline", config.model, config.gpu,
                                 kv_bytes_per_token=config.bytes_per_token)
    assert idle == pytest.approx([latency.swap_time(16, 1)] if preemption == "swap" else [], rel=1e-9)


@pytest.mark.parametrize("chunked", [False, True])
def test_swap_preemption_on_a_tiny_pool_never_overcommits(chunked):
    # Tiny pool, swap preemption (and chunked prefill): swapped groups must come back with room to decode.
    trace = _trace(num_requests=40, arrival="burst", lengths="uniform", prompt_range=(8, 60),
                   output_range=(5, 60), max_model_len=256, seed=7)
    for mode in ("fast", "step"):
        res = simulate(trace, SimConfig(allocator="paged", model="opt-13b", capacity_tokens=72, block_size=8,
                                        max_model_len=256, preemption_mode="swap", swap_space_gb=1.0,
                                        watermark=0.0, enable_chunked_prefill=chunked,
                                        max_num_batched_tokens=64 if chunked else None, max_num_seqs=16,
                                        debug=True, mode=mode))
        assert res.summary["num_finished"] + res.summary["num_rejected"] == 40
        assert res.summary["num_preemptions"] > 0


def test_sharing_savings_order_like_the_paper():
    from simulator.sharing import sharing_saving
    cfg = SimConfig(allocator="paged", model="opt-13b", kv_memory_gb=12, max_model_len=2048,
                    enable_prefix_caching=False)
    saving = {}
    for label, kw in (("single", {}), ("n4", {"n": 4}), ("beam4", {"beam_width": 4})):
        trace = _trace(num_requests=80, arrival="burst", lengths="alpaca", seed=4, **kw)
        saving[label] = sharing_saving(trace, cfg)["saving"]
    assert saving["single"] == 0.0  # nothing is shared without samples, beams or prefix hits
    assert 0.0 < saving["n4"] < saving["beam4"] < 1.0


def _samples(prompt_len: list[int], output_len: list[int], n: list[int]) -> pd.DataFrame:
    num = len(n)
    return pd.DataFrame({"request_id": range(num), "arrival_s": [0.0] * num, "prompt_len": prompt_len,
                         "output_len": output_len, "n": n, "beam_width": [1] * num})


def test_samples_recomputed_after_diverging_each_need_room_for_their_own_tokens():
    # Eight samples of 100 + 300 tokens share 6 prompt blocks but need 8 x 19 of their own at the end: a
    # recompute re-admits them with their own generated tokens, so 500 slots never hold them together.
    trace = _samples([100], [300], [8])
    tight = simulate(trace, SimConfig(model="opt-13b", capacity_tokens=500, debug=True)).summary
    assert tight["num_preemptions"] >= 1 and tight["num_finished"] == 0 and tight["num_rejected"] == 1
    roomy = simulate(trace, SimConfig(model="opt-13b", capacity_tokens=100_000)).summary
    assert roomy["num_finished"] == 1 and roomy["num_preemptions"] == 0


def test_recomputed_samples_longer_than_a_steps_budget_need_chunked_prefill():
    # The four samples, preempted at ~1,340 tokens each by the longer request, recompute ~5,000 tokens:
    # more than one step computes without chunking (refused, not waited for), fine chunk by chunk.
    trace = _samples([100, 100], [1900, 1400], [1, 4])
    cfg = SimConfig(model="opt-13b", capacity_tokens=6400, max_model_len=2048, debug=True)
    whole = simulate(trace, cfg).requests
    assert whole["num_preemptions"].tolist() == [0, 1] and whole["rejected"].tolist() == [False, True]
    chunked = simulate(trace, dataclasses.replace(cfg, enable_chunked_prefill=True,
                                                  max_num_batched_tokens=512)).requests
    assert chunked["num_preemptions"].tolist() == [0, 1] and not chunked["rejected"].any()


def test_swapped_groups_wider_than_the_token_budget_come_back():
    # Two groups of six samples admitted in one step outgrow the pool together; the later one is swapped
    # out. Six samples decode together whatever the budget of 4 tokens, so it comes back into an otherwise
    # empty step (waiting for a step with room for six would wait forever).
    trace = _samples([2, 2], [200, 200], [6, 6])
    cfg = SimConfig(model="opt-13b", capacity_tokens=1600, max_model_len=1024, enable_chunked_prefill=True,
                    max_num_batched_tokens=4, max_num_seqs=4, preemption_mode="swap", swap_space_gb=2.0,
                    debug=True)
    summary = simulate(trace, cfg).summary
    assert summary["num_finished"] == 2 and summary["num_preemptions"] == 1


def test_prefix_keys_the_block_size_cannot_reuse_are_refused_before_the_first_step():
    trace = pd.DataFrame({"request_id": [0, 1], "arrival_s": [0.0, 1000.0], "prompt_len": [64, 64],
                          "output_len": [4, 4], "prefix_blocks": [[], [1, 2]], "prefix_block_size": [32, 32]})
    steps = []
    with pytest.raises(TraceError, match=r"request 1: block_size 48 cannot reuse prefix keys recorded at 32.*"
                                         r"\(or run without prefix caching\)"):
        simulate(trace, SimConfig(model="opt-13b", capacity_tokens=4096, max_model_len=256, block_size=48),
                 observer=lambda run: steps.append(run.step))
    assert steps == []
    # Sizes it can reuse (dividing or multiples of the recorded size) run.
    for block_size in (16, 64):
        config = SimConfig(model="opt-13b", capacity_tokens=4096, max_model_len=256, block_size=block_size)
        assert simulate(trace, config).summary["num_finished"] == 2
    # Without prefix caching the keys are not read, so any block size runs (and equals a run without keys).
    plain = trace.drop(columns=["prefix_blocks", "prefix_block_size"])
    for kw in ({"enable_prefix_caching": False}, {"allocator": "contiguous-max"}):
        config = SimConfig(model="opt-13b", capacity_tokens=4096, max_model_len=256, block_size=48, **kw)
        with_keys, without = (simulate(t, config).summary for t in (trace, plain))
        assert {**with_keys, "wall_s": 0} == {**without, "wall_s": 0}


def test_arguments_of_the_wrong_kind_are_named(tmp_path):
    from simulator.output import RunFolder

    trace = pd.DataFrame({"arrival_s": [0.0], "prompt_len": [10], "output_len": [5]})
    with pytest.raises(TypeError, match="config must be a SimConfig, got dict"):
        simulate(trace, {"allocator": "paged"})
    with pytest.raises(TypeError, match=r"output must be a RunOutput \(InMemory or RunFolder\), got str"):
        simulate(trace, SimConfig(), "folder")
    with pytest.raises(ValueError, match="table_format must be 'parquet' or 'csv', got 'xlsx'"):
        RunFolder(tmp_path, "xlsx")


def test_a_pool_too_large_to_hold_is_a_config_error():
    trace = pd.DataFrame({"arrival_s": [0.0], "prompt_len": [10], "output_len": [5]})
    with pytest.raises(ConfigError, match="slots does not fit in this machine's memory"):
        simulate(trace, SimConfig(allocator="paged", capacity_tokens=2**40))  # 550 GB of block state
