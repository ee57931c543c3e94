"""Replays of a model with two KV cache groups: the engine's grouped pool makes the simulator's decisions.

The simulator reads the model from the same config.json the engine is built from (Gemma 3's layout:
16-token windows alternating with full layers), so both derive the same groups and block count.
"""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from gpu_backend.engine.engine_config import EngineConfig
from gpu_backend.model import CausalLM
from gpu_backend.model_config import ModelConfig
from gpu_backend.model_presets import init_random_weights
from gpu_backend.ops import get_backend
from gpu_backend.replay import ReplayConfig, replay
from simulator.config import SimConfig
from simulator.core.paged.kv_groups import GroupedBlockManager
from simulator.loop import simulate
from tests.gpu_backend.test_replay import COMPARED, PREFIX_TRACE, _burst

pytestmark = pytest.mark.usefixtures("single_thread")

CONFIG = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 256,
          "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256, "sliding_window": 16,
          "rms_norm_eps": 1e-6, "layer_types": ["sliding_attention", "full_attention"] * 2,
          "torch_dtype": "float32"}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """(the model's folder, the engine's model built from it)."""
    path = tmp_path_factory.mktemp("hybrid")
    (path / "config.json").write_text(json.dumps(CONFIG))
    model = CausalLM(ModelConfig.from_model_dir(path), backend=get_backend("torch", "cpu"))
    init_random_weights(model, seed=1)
    return path, model


@pytest.mark.parametrize("capacity,prefix,trace_kw,expect", [
    (400, False, {}, "num_preemptions"),  # a tight pool: recompute preemptions
    (2000, True, PREFIX_TRACE, "prefix_hits"),
], ids=["recompute", "prefix"])
def test_grouped_replay_memory_equals_simulation_step_for_step(hybrid, capacity, prefix, trace_kw, expect):
    path, model = hybrid
    trace = _burst(seed=3, **trace_kw)
    options = dict(allocator="paged", capacity_tokens=capacity, block_size=8, max_model_len=128,
                   enable_prefix_caching=prefix)
    sim = simulate(trace, SimConfig(model=str(path), mode="step", **options))
    engine_config = ReplayConfig(device="cpu", time_scale=0, engine=EngineConfig(**options))
    rep = replay(trace, engine_config, model=model)
    assert isinstance(SimConfig(model=str(path), **options).build_allocator(), GroupedBlockManager)
    assert len(rep.memory) == len(sim.memory) > 10
    np.testing.assert_allclose(rep.memory[COMPARED].to_numpy(float), sim.memory[COMPARED].to_numpy(float),
                               rtol=0, atol=1e-12)
    per_request = ["num_preemptions", "rejected", "prefix_hit_tokens", "output_len"]
    pd.testing.assert_frame_equal(rep.requests[per_request], sim.requests[per_request])
    for key in ("num_steps", "num_preemptions", "num_finished", "capacity_tokens", "num_blocks"):
        assert rep.summary[key] == sim.summary[key], key
    assert rep.summary["allocator_stats"] == sim.summary["allocator_stats"]
    ours = rep.summary.get(expect, rep.summary["allocator_stats"].get(expect))
    assert ours > 0  # the case exercises what it is meant to
