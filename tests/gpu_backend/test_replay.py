"""Replays on the real engine: the same decisions and memory as the simulator, and the same run folder."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from cli import app
from gpu_backend.engine.engine_config import EngineConfig
from gpu_backend.model import CausalLM
from gpu_backend.model_config import ModelConfig
from gpu_backend.model_presets import build_preset, init_random_weights
from gpu_backend.ops import get_backend
from gpu_backend.replay import ReplayConfig, clip_prompts, make_prompts, replay
from gpu_backend.replay_run import replay_to_dir
from pagelab.run_folder import write_run
from simulator.config import SimConfig
from simulator.loop import simulate
from simulator.timing.measured_steps import MeasuredSteps
from traces import SyntheticConfig, generate_trace, save_trace
from traces.schema import TraceWarning

pytestmark = pytest.mark.usefixtures("single_thread")

# Every column of memory.parquet except the clock (simulated vs measured) and cached_free (the engine
# knows every full block's tokens and keeps them cached; the simulator knows only trace prefix blocks).
COMPARED = ["step", "num_steps", "token_states", "reservation", "internal_fragmentation",
            "external_fragmentation", "free", "token_occupancy", "block_occupancy", "num_running",
            "num_waiting", "num_swapped", "num_batched_tokens", "blocks_used"]
SMALL = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    max_position_embeddings=256)


@pytest.fixture(scope="module")
def model() -> CausalLM:
    m = CausalLM(SMALL, backend=get_backend("torch", "cpu"))
    init_random_weights(m, seed=1)
    return m


def _burst(seed: int, **kw) -> pd.DataFrame:
    """All requests at t=0, so simulated and measured clocks cannot order arrivals differently."""
    base = dict(num_requests=16, arrival="burst", lengths="uniform", prompt_range=(5, 60),
                output_range=(2, 40), max_model_len=128, seed=seed)
    return generate_trace(SyntheticConfig(**{**base, **kw}))


def _both(trace: pd.DataFrame, model, allocator: str, capacity: int, block_size: int, prefix: bool, **kw):
    sim = simulate(trace, SimConfig(allocator=allocator, capacity_tokens=capacity, block_size=block_size,
                                    max_model_len=128, mode="step", enable_prefix_caching=prefix, **kw))
    engine = EngineConfig(allocator=allocator, capacity_tokens=capacity, block_size=block_size,
                          max_model_len=128, enable_prefix_caching=prefix, **kw)
    return sim, replay(trace, ReplayConfig(device="cpu", time_scale=0, engine=engine), model=model)


PREFIX_TRACE = {"num_prefix_groups": 2, "prefix_len": 32, "prefix_fraction": 0.8, "prompt_range": (5, 40)}


@pytest.mark.parametrize("allocator,capacity,block_size,prefix,trace_kw,options,expect", [
    ("paged", 400, 16, False, {}, {}, "num_preemptions"),  # a tight pool: recompute preemptions
    ("paged", 300, 8, False, {}, {"preemption_mode": "swap", "watermark": 0.1}, "swapped_out_blocks"),
    ("paged", 2000, 8, True, PREFIX_TRACE, {}, "prefix_hits"),
    ("contiguous-max", 500, 16, False, {}, {}, None),
    ("contiguous-pow2", 500, 16, False, {}, {}, None),
    ("contiguous-oracle", 300, 16, False, {}, {"max_num_seqs": 5}, None),
], ids=["paged-recompute", "paged-swap", "paged-prefix", "contiguous-max", "contiguous-pow2",
        "contiguous-oracle"])
def test_replay_memory_equals_simulation_step_for_step(model, allocator, capacity, block_size, prefix,
                                                       trace_kw, options, expect):
    trace = _burst(seed=3, **trace_kw)
    sim, rep = _both(trace, model, allocator, capacity, block_size, prefix, **options)
    assert len(rep.memory) == len(sim.memory) > 10
    np.testing.assert_allclose(rep.memory[COMPARED].to_numpy(float), sim.memory[COMPARED].to_numpy(float),
                               rtol=0, atol=1e-12)
    per_request = ["num_preemptions", "rejected", "prefix_hit_tokens", "output_len"]
    pd.testing.assert_frame_equal(rep.requests[per_request], sim.requests[per_request])
    for key in ("num_steps", "num_preemptions", "num_finished", "capacity_tokens", "num_blocks"):
        assert rep.summary[key] == sim.summary[key], key
    if expect is not None:  # the case exercises what it is meant to
        ours = rep.summary.get(expect, rep.summary["allocator_stats"].get(expect))
        theirs = sim.summary.get(expect, sim.summary["allocator_stats"].get(expect))
        assert ours == theirs > 0


def test_a_step_that_only_swaps_out_is_one_row_of_no_steps_in_both_runs(model):
    # Three samples per request in a pool of 24 blocks: a group that cannot grow swaps itself out in a step
    # that computes nothing, and both runs log that step's copies as a row of no steps. Both CPU pools are
    # ample.
    trace = _burst(seed=3, n=3, prompt_range=(5, 40), output_range=(2, 12))
    pool = dict(allocator="paged", capacity_tokens=48, block_size=2, max_model_len=128,
                enable_prefix_caching=False, preemption_mode="swap", max_num_seqs=5)
    sim = simulate(trace, SimConfig(mode="step", **pool))
    engine = EngineConfig(swap_space_gb=2**-10, **pool)  # 1 MiB: thousands of the small model's slots
    rep = replay(trace, ReplayConfig(device="cpu", time_scale=0, engine=engine), model=model)
    swaps = sim.memory["num_steps"] == 0
    assert swaps.sum() > 0 and (rep.memory["num_steps"] == 0).sum() == swaps.sum()
    np.testing.assert_allclose(rep.memory[COMPARED].to_numpy(float), sim.memory[COMPARED].to_numpy(float),
                               rtol=0, atol=1e-12)
    assert rep.summary["allocator_stats"] == sim.summary["allocator_stats"]
    timed = simulate(trace, SimConfig(mode="step", **pool), step_times=MeasuredSteps.from_memory(rep.memory))
    np.testing.assert_allclose(timed.memory[COMPARED].to_numpy(float), rep.memory[COMPARED].to_numpy(float),
                               rtol=0, atol=1e-12)


def test_swapping_beside_a_cpu_tier_draws_on_its_budget_in_both_runs():
    # swap_space_gb 0 is set aside for the CPU tier's 1 MiB (32 blocks of the tiny preset): both runs
    # swap into it. (Tiers need prefix caching; the trace has no prefixes to hit.)
    trace = _burst(seed=3, output_range=(20, 60))
    pool = dict(allocator="paged", capacity_tokens=300, block_size=8, max_model_len=128,
                enable_prefix_caching=True, preemption_mode="swap", watermark=0.1, swap_space_gb=0.0,
                kv_offloading_size=2**-10)
    sim = simulate(trace, SimConfig(model="tiny", mode="step", **pool))
    rep = replay(trace, ReplayConfig(model="tiny", device="cpu", time_scale=0, engine=EngineConfig(**pool)),
                 model=build_preset("tiny", device="cpu"))
    np.testing.assert_allclose(rep.memory[COMPARED].to_numpy(float), sim.memory[COMPARED].to_numpy(float),
                               rtol=0, atol=1e-12)
    # (The engine also caches decode blocks, so its swap-ins find more of them on the device.)
    swapped = rep.summary["allocator_stats"]["swapped_out_blocks"]
    assert swapped == sim.summary["allocator_stats"]["swapped_out_blocks"] > 0


def test_replay_names_requests_by_row_in_events_and_transitions(model):
    """As in a simulation: the request table keeps the trace's ids in arrival order, and the events and
    transitions tables name a request by its row there."""
    trace = _burst(seed=3)
    trace = trace.assign(arrival_s=np.arange(len(trace)) * 1e-3, request_id=900 - 7 * np.arange(len(trace)))
    trace = trace.iloc[np.random.default_rng(1).permutation(len(trace))]  # a file out of arrival order
    with pytest.warns(TraceWarning, match="sorted by arrival"):
        sim, rep = _both(trace.reset_index(drop=True), model, "paged", 400, 16, False)
    req, tr = rep.requests, rep.transitions
    assert req["request_id"].tolist() == list(900 - 7 * np.arange(len(trace)))
    counts = np.bincount(tr.loc[tr["kind"] != 2, "request_id"].to_numpy(), minlength=len(req))
    assert counts.sum() > 0 and counts.tolist() == req["num_preemptions"].tolist()
    assert sorted(set(rep.events["request_id"])) == list(range(len(req)))
    # Each row holds as many blocks over the run as the simulated request of that row (which blocks may
    # differ: the engine hands freed blocks out in another order).
    held = lambda r: r.events["request_id"].value_counts().sort_index().tolist()  # noqa: E731
    assert held(rep) == held(sim)


def test_replay_writes_the_simulate_run_schema(model, tmp_path):
    trace = _burst(seed=5, num_requests=6)
    sim, rep = _both(trace, model, "paged", 2000, 16, True)
    for name in ("requests", "memory", "events"):
        ours, theirs = getattr(rep, name), getattr(sim, name)
        assert list(ours.columns) == list(theirs.columns), name
        assert ours.dtypes.to_dict() == theirs.dtypes.to_dict(), name
    assert set(sim.summary) <= set(rep.summary)
    assert rep.config["source"] == "replay" and rep.config["allocator"] == "paged"
    measured = rep.summary["measured"]
    assert measured["kv_pool_bytes"] == 2000 // 16 * 16 * SMALL.kv_bytes_per_token(model.dtype)
    assert measured["step_time_s"]["total"] > 0 and measured["num_forward_tokens"] > 0
    assert len(rep.events) > 0 and (rep.events["t_end_s"] >= rep.events["t_start_s"]).all()
    write_run(tmp_path / "run", {"source": "test"}, {"paged": rep})
    from viz.load import load_run
    run = load_run(tmp_path / "run")
    assert run.allocators["paged"].config["source"] == "replay"
    assert abs(sum(run.allocators["paged"].memory_fractions().values()) - 1) < 1e-9


def test_arrivals_are_honoured_after_scaling(model):
    trace = _burst(seed=6, num_requests=3, output_range=(2, 4))
    trace["arrival_s"] = [0.0, 1.0, 2.0]
    config = ReplayConfig(device="cpu", time_scale=0.1, engine=EngineConfig(num_blocks=64))
    rep = replay(trace, config, model=model)
    req = rep.requests
    assert (req["arrival_s"].to_numpy() == [0.0, 0.1, 0.2]).all()
    assert (req["admitted_s"] >= req["arrival_s"]).all()
    assert (req["first_token_s"] > req["admitted_s"]).all()
    assert (req["finish_s"] >= req["first_token_s"]).all()


def test_prompts_are_clipped_to_max_model_len_and_prefixes_share_tokens():
    trace = pd.DataFrame({"prompt_len": [10, 300, 40], "output_len": [5, 20, 200], "arrival_s": 0.0})
    lens, clipped = clip_prompts(trace, 128)
    assert lens.tolist() == [10, 109, 40] and clipped == 1  # the last request cannot be saved: rejected
    shared = pd.DataFrame({"prompt_len": [40, 35], "prefix_blocks": [[7, 8], [7, 9]],
                           "prefix_block_size": [16, 16]})
    a, b = make_prompts(shared, np.array([40, 35]), 256, seed=0)
    assert a[:16] == b[:16] and a[16:32] != b[16:32] and (len(a), len(b)) == (40, 35)
    # A block keyed 0 is not the prompts' own stream; a recorded block the prompt covers in part gives
    # it its first tokens (the simulator keys every full block inside it).
    keyed_zero = pd.DataFrame({"prompt_len": [32, 32], "prefix_blocks": [None, [0]], "prefix_block_size": 16})
    first, keyed = make_prompts(keyed_zero, np.array([32, 32]), 256, seed=0)
    assert first[:16] != keyed[:16]
    c, d = make_prompts(pd.DataFrame({"prompt_len": [50, 64], "prefix_blocks": [[3, 4], [3, 4]],
                                      "prefix_block_size": [32, 32]}), np.array([50, 64]), 256, seed=0)
    assert c == d[:50]


class _Interrupt(KeyboardInterrupt):
    pass


def test_an_interrupted_replay_leaves_no_run_folder(model, tmp_path):
    trace = _burst(seed=7, num_requests=6)
    steps = []

    def interrupt(name, done, total):
        steps.append(done)
        if len(steps) == 3:
            raise _Interrupt

    cfg = ReplayConfig(device="cpu", time_scale=0, engine=EngineConfig(num_blocks=64))
    configs = {"paged": cfg, "contiguous-max": ReplayConfig(
        device="cpu", time_scale=0, engine=EngineConfig(allocator="contiguous-max", capacity_tokens=1024))}
    out = tmp_path / "run"
    with pytest.raises(_Interrupt):
        replay_to_dir(trace, configs, {}, out, progress=interrupt)
    assert not out.exists() and list(tmp_path.iterdir()) == []

    class Broken:  # the write itself fails half way: atomic_dir must remove the partial folder
        config, summary, requests, memory = {}, {}, pd.DataFrame({"a": [1]}), pd.DataFrame({"a": [1]})

        @property
        def events(self):
            raise _Interrupt

    with pytest.raises(_Interrupt):
        write_run(out, {}, {"paged": Broken()})
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_cli_replay_writes_a_run_folder(tmp_path):
    trace = _burst(seed=8, num_requests=4, prompt_range=(5, 30), output_range=(2, 6))
    path = tmp_path / "trace.csv"
    save_trace(trace, path)
    out = tmp_path / "run"
    args = ["replay", str(path), "--device", "cpu", "--time-scale", "0", "--num-blocks", "64", "-a", "paged",
            "-a", "contiguous-oracle", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["contiguous-oracle", "paged", "run.json", "summary.json"]
    assert "paged" in result.output and "contiguous-oracle" in result.output


@pytest.mark.parametrize("args,match", [
    (["--allocator", "buddy"], "unknown allocator"),
    (["--limit", "0"], "--limit"),
    (["--device", "tpu"], "unknown device"),
    (["--model", "no-such-model"], "neither a preset"),
])
def test_cli_replay_bad_input_is_a_one_line_error(tmp_path, args, match):
    result = CliRunner().invoke(app, ["replay", "--time-scale", "0", "--out", str(tmp_path / "x"), *args])
    assert result.exit_code == 2, result.output
    assert match in result.output
    assert not (tmp_path / "x").exists()
