"""The prefix-cache counters as vLLM v1 keeps them: a request's first lookup counts in `prefix_query_tokens`
and `prefix_hit_tokens` (with the tiers' `hit_tokens`), a re-admitted request's lookups in the
`preempted_*` counters, so the hit rate is the first admissions' alone."""
from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from simulator.config import SimConfig
from simulator.loop.simulate import simulate
from traces.multiturn import MultiTurnConfig, generate_multiturn


def _chat(num: int, seed: int):
    # Long answers on a small pool: requests are preempted and recomputed, hitting their own blocks.
    return generate_multiturn(MultiTurnConfig(num_requests=num, first_prompt_len=200, user_len=60,
                                              output_len=300, mean_turns=4, think_time_s=0.5, rate=20,
                                              system_prompt_len=64, prefix_block_size=16, seed=seed))


@settings(max_examples=20, deadline=None)
@example(seed=0, model="tiny-hybrid", capacity_blocks=40, tiers=False, mode="fast")  # admitted, then rejected
@given(seed=st.integers(0, 10_000), model=st.sampled_from(["llama-2-7b", "tiny-hybrid"]),
       capacity_blocks=st.integers(40, 120), tiers=st.booleans(), mode=st.sampled_from(["fast", "step"]))
def test_first_admissions_and_readmissions_are_counted_apart(seed, model, capacity_blocks, tiers, mode):
    trace = _chat(40, seed)
    tier_options = {"kv_offloading_size": 0.02, "kv_offloading_disk_size": 0.05} if tiers else {}
    run = simulate(trace, SimConfig(model=model, capacity_tokens=16 * capacity_blocks, block_size=16,
                                    max_model_len=4096, mode=mode, **tier_options))
    stats, req = run.summary["allocator_stats"], run.requests
    tier_hits = sum(t["hit_tokens"] for name, t in run.summary.get("kv_tiers", {}).items()
                    if name in ("cpu", "disk"))
    # A first admission asks for its whole prompt once; what it found is the request row's hit. (A request
    # admitted, preempted, then found too long for the pool when it comes back counts too.)
    admitted = req[req["admitted_s"].notna()]
    assert stats["prefix_query_tokens"] == admitted["prompt_len"].sum()
    assert stats["prefix_hit_tokens"] + tier_hits == admitted["prefix_hit_tokens"].sum()
    # vLLM's hit rate: in tokens, of first admissions alone
    assert run.summary["prefix_cache_hit_rate"] == stats["prefix_hit_tokens"] / stats["prefix_query_tokens"]
    # Only recomputed requests look up again, and they ask at least their prompt.
    assert 0 <= stats["preempted_hit_tokens"] <= stats["preempted_query_tokens"]
    served = req[~req["rejected"].astype(bool)]
    recomputed = served[served["num_preemptions"] > 0]
    if recomputed.empty:
        assert stats["preempted_query_tokens"] == 0
    else:
        assert stats["preempted_query_tokens"] >= recomputed["prompt_len"].sum()
