"""The replay's clocks and steps table: the CPU-time clock jumps over idle gaps, steps match memory rows."""
from __future__ import annotations

import time

import numpy as np
import pytest

from gpu_backend.engine.engine_config import EngineConfig
from gpu_backend.engine.params import EngineInputError
from gpu_backend.model import CausalLM
from gpu_backend.model_config import ModelConfig
from gpu_backend.model_presets import init_random_weights
from gpu_backend.ops import get_backend
from gpu_backend.replay import STEP_COLUMNS, ReplayConfig, replay
from simulator.config import SimConfig
from simulator.loop import simulate
from simulator.timing.measured_steps import MeasuredSteps
from traces import SyntheticConfig, generate_trace

pytestmark = pytest.mark.usefixtures("single_thread")
SMALL = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    max_position_embeddings=256)


@pytest.fixture(scope="module")
def model() -> CausalLM:
    m = CausalLM(SMALL, backend=get_backend("torch", "cpu"))
    init_random_weights(m, seed=1)
    return m


def _trace(num: int = 12, gap: float = 0.0):
    trace = generate_trace(SyntheticConfig(num_requests=num, arrival="poisson", rate=200.0, lengths="uniform",
                                           prompt_range=(5, 60), output_range=(2, 30), max_model_len=128,
                                           seed=4))
    trace.loc[num // 2:, "arrival_s"] += gap
    return trace


def test_cpu_clock_jumps_over_idle_gaps_instead_of_sleeping(model):
    trace = _trace(gap=1000.0)  # a wall-clock replay would sleep for 1000 s
    engine = EngineConfig(num_blocks=64, max_model_len=128)
    wall0 = time.perf_counter()
    rep = replay(trace, ReplayConfig(device="cpu", clock="cpu", engine=engine), model=model)
    assert time.perf_counter() - wall0 < 120
    req = rep.requests
    late = req["arrival_s"] >= 1000
    assert late.sum() == 6 and (req.loc[late, "first_token_s"] > req.loc[late, "arrival_s"]).all()
    idle = rep.memory[rep.memory["num_steps"] == 0]
    assert len(idle) >= 1 and idle["dt_s"].max() > 900
    assert rep.config["clock"] == "cpu"
    # Busy time is CPU time: positive, and the whole run is the gap plus a little work.
    assert 0 < rep.steps["dt_s"].sum() < 60 and 1000 < rep.summary["sim_duration_s"] < 1060


def test_steps_table_matches_memory_rows_and_drives_an_equal_simulation(model):
    trace = _trace(num=16, gap=0.05)
    trace.loc[:7, "arrival_s"] = 0.0  # a burst fills the pool whatever the step times: preemptions
    engine = EngineConfig(capacity_tokens=240, block_size=16, max_model_len=128, enable_prefix_caching=False)
    rep = replay(trace, ReplayConfig(device="cpu", engine=engine), model=model)
    steps = rep.steps
    assert list(steps.columns) == list(STEP_COLUMNS)
    busy = rep.memory[rep.memory["num_steps"] == 1]
    assert len(steps) == len(busy) and (steps["dt_s"].to_numpy() == busy["dt_s"].to_numpy()).all()
    assert (steps["num_batched_tokens"].to_numpy() == busy["num_batched_tokens"].to_numpy()).all()
    assert (steps["num_prefill_tokens"] + steps["num_decode_seqs"] == steps["num_batched_tokens"]).all()
    assert rep.summary["num_preemptions"] > 0  # recompute preemptions make the retrace worth testing
    sim = simulate(trace, SimConfig(model="tiny", gpu="cpu", capacity_tokens=240, block_size=16,
                                    max_model_len=128, enable_prefix_caching=False),
                   step_times=MeasuredSteps.from_memory(rep.memory))
    cols = ["step", "num_steps", "token_states", "reservation", "internal_fragmentation",
            "external_fragmentation", "free", "block_occupancy", "num_running", "num_waiting", "num_swapped",
            "num_batched_tokens", "blocks_used"]
    a, b = sim.memory[sim.memory["num_steps"] == 1], busy
    np.testing.assert_array_equal(a[cols].to_numpy(float), b[cols].to_numpy(float))
    np.testing.assert_allclose(sim.requests["finish_s"], rep.requests["finish_s"], rtol=0, atol=1e-9)


def test_cpu_clock_is_refused_for_an_unknown_kind(model):
    with pytest.raises(EngineInputError, match="clock must be one of wall, cpu"):
        replay(_trace(num=2), ReplayConfig(device="cpu", clock="gpu"), model=model)
