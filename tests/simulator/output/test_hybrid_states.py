"""The parts of states a pool split into KV cache groups wastes (pagelab/run_format.py HYBRID_STATES): every
row keeps each inside the state it is part of, one-group runs lack the columns, and a run folder (written
here or by the child process, as Parquet or CSV) reads back equal to the table kept in memory."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagelab.run_format import HYBRID_MEMORY_COLUMNS, HYBRID_STATES, MEMORY_COLUMNS
from simulator.config import SimConfig
from simulator.loop import simulate
from simulator.output import RunFolder, Sizes
from simulator.output.memory_rows import HYBRID_DTYPES
from traces import SyntheticConfig, generate_trace

# gemma-3-27b pads (7 groups of 10 layer slots, 8 of them padding); gpt-oss-20b has a 128-token window
# and no padding; mistral-7b-v0.1 is one sliding group.
HYBRID_MODELS = ("gemma-3-27b", "gpt-oss-20b", "mistral-7b-v0.1")
EPS = 1e-12


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> str:
    """A checkpoint folder of gpt-oss-20b's attention (its registry entry leaves the weight bytes the
    roofline needs unknown; a folder's parameter count is estimated from its shape)."""
    from simulator.core.models import get_model

    m = get_model("gpt-oss-20b")
    folder = tmp_path_factory.mktemp("gpt-oss-20b")
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window", "torch_dtype")
    config = {f: getattr(m, f) for f in fields}
    (folder / "config.json").write_text(json.dumps({**config, "architectures": [m.architecture],
                                                    "layer_types": list(m.layer_types)}))
    return str(folder)


def _config(model: str, **kw) -> SimConfig:
    return SimConfig(model=model, gpu="h100-80gb", kv_memory_gb=kw.pop("kv_memory_gb", 0.5),
                     max_model_len=2048, record_events=False, **kw)


def _trace(seed: int, num: int, prefix_fraction: float = 0.5, prefix_len: int = 300) -> pd.DataFrame:
    """Requests sharing `prefix_len`-token prefixes (past gemma's 1024-token window at 1100: its first
    blocks leave the window while the prefix cache keeps them)."""
    shared = {"num_prefix_groups": 2, "prefix_len": prefix_len, "prefix_fraction": prefix_fraction} \
        if prefix_fraction else {}
    return generate_trace(SyntheticConfig(num_requests=num, rate=20.0, lengths="uniform", seed=seed,
                                          prompt_range=(20, 600), output_range=(5, 200), **shared))


def _check_parts(memory: pd.DataFrame) -> None:
    pad, internal = memory["padding"].to_numpy(), memory["internal_fragmentation"].to_numpy()
    window, cached = memory["window_cached"].to_numpy(), memory["cached_free"].to_numpy()
    free = memory["free"].to_numpy()
    assert (pad >= 0).all() and (window >= 0).all()
    assert (pad <= internal + EPS).all(), memory.loc[pad > internal + EPS].head()
    assert (window <= cached + EPS).all(), memory.loc[window > cached + EPS].head()
    assert (cached <= free + EPS).all()


@pytest.mark.parametrize("model", HYBRID_MODELS)
@given(seed=st.integers(0, 10_000), prefix_fraction=st.sampled_from([0.0, 0.5, 1.0]),
       prefix_len=st.sampled_from([300, 1100]),
       preemption=st.sampled_from(["recompute", "swap"]), kv_memory_gb=st.sampled_from([0.15, 0.5]))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_every_row_keeps_padding_and_window_blocks_inside_their_states(gpt_oss, model, seed, prefix_fraction,
                                                                      prefix_len, preemption, kv_memory_gb):
    trace = _trace(seed, 16, prefix_fraction, prefix_len)
    res = simulate(trace, _config(gpt_oss if model == "gpt-oss-20b" else model, kv_memory_gb=kv_memory_gb,
                                  preemption_mode=preemption, swap_space_gb=0.2))
    assert tuple(res.memory.columns) == tuple(HYBRID_MEMORY_COLUMNS)
    _check_parts(res.memory)
    mean = res.summary["memory"]
    assert mean["padding"] <= mean["internal_fragmentation"] + EPS
    assert mean["window_cached"] <= mean["cached_free"] + EPS


def _past_the_window(window: int) -> pd.DataFrame:
    """Requests sharing prefixes longer than `window`: their first blocks leave it, still cached."""
    return generate_trace(SyntheticConfig(num_requests=20, rate=20.0, lengths="uniform", seed=1,
                                          prompt_range=(50, 400), output_range=(10, 100),
                                          max_model_len=window + 600, num_prefix_groups=2,
                                          prefix_len=window + 64, prefix_fraction=1.0))


def test_padding_and_window_blocks_show_where_the_layout_has_them():
    gemma = simulate(_past_the_window(1024), _config("gemma-3-27b", kv_memory_gb=1)).memory
    mistral = simulate(_past_the_window(4096), SimConfig(model="mistral-7b-v0.1", gpu="h100-80gb",
                                                         kv_memory_gb=2, record_events=False)).memory
    # gemma: 8 padding slots in every 70 layer slots of held blocks; mistral has no padding layer.
    busy = gemma["block_occupancy"] > 0
    np.testing.assert_allclose(gemma.loc[busy, "padding"] / gemma.loc[busy, "block_occupancy"], 8 / 70,
                               rtol=0.2)
    assert (mistral["padding"] == 0).all()
    assert gemma["window_cached"].max() > 0 and mistral["window_cached"].max() > 0


@pytest.mark.parametrize("config", [dict(model="llama-3.1-8b"),
                                    dict(model="gemma-3-27b", disable_hybrid_kv_cache_manager=True)])
def test_one_group_runs_carry_neither_column(config):
    res = simulate(_trace(2, 12), _config(**config))
    assert tuple(res.memory.columns) == tuple(MEMORY_COLUMNS)
    assert not set(HYBRID_STATES) & set(res.summary["memory"])


@pytest.mark.parametrize(("fmt", "child"), [("parquet", False), ("csv", False), ("parquet", True)])
def test_a_hybrid_run_folder_reads_back_equal_to_the_table_in_memory(tmp_path, fmt, child):
    trace = _trace(4, 30)
    cfg = _config("gemma-3-27b", kv_memory_gb=0.3)
    mem = simulate(trace, cfg)
    sizes = Sizes(child_min_requests=1 if child else Sizes.child_min_requests, memory_group_rows=64,
                  memory_min_group_rows=16)
    out = RunFolder(tmp_path, fmt, num_requests=len(trace), record_events=True, sizes=sizes)
    streamed = simulate(trace, dataclasses.replace(cfg, record_events=True), out)
    assert out.in_child == child
    path = tmp_path / f"memory.{fmt}"
    back = pd.read_parquet(path) if fmt == "parquet" else pd.read_csv(path).astype(HYBRID_DTYPES)
    assert dict(back.dtypes) == HYBRID_DTYPES
    pd.testing.assert_frame_equal(back, mem.memory, check_exact=fmt == "parquet")
    assert streamed.summary["memory"] == pytest.approx(mem.summary["memory"], rel=1e-12)
    assert list(streamed.summary["memory"])[-2:] == list(HYBRID_STATES)


def test_a_hybrid_runs_capacity_is_in_tokens_as_vllm_reports_it_and_its_block_map_spans_every_slot(tmp_path):
    from typer.testing import CliRunner

    from cli import app
    from traces import save_trace
    from viz.load import load_run

    save_trace(_trace(4, 30), tmp_path / "t.csv")
    result = CliRunner().invoke(app, ["simulate", str(tmp_path / "t.csv"), "--model", "gemma-3-27b", "--gpu",
                                      "h100-80gb", "--kv-memory-gb", "0.3", "--max-model-len", "2048", "-a",
                                      "paged", "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    alloc = load_run(tmp_path / "run").allocators["paged"]
    s = alloc.summary
    assert f"GPU KV cache size: {s['capacity_tokens']:,} tokens" in result.output
    assert s["capacity_slots"] == s["num_blocks"] * s["block_size"] > s["capacity_tokens"]
    assert alloc.capacity_slots == s["capacity_slots"]
    # The block map spans every block: tenures reach past capacity_tokens slots.
    ends = alloc.events["start"] + alloc.events["size"]
    assert s["capacity_tokens"] < ends.max() <= alloc.capacity_slots
