"""A numeric option set to None where its type has none is refused when the config is made, naming the
field, instead of passing validation and failing in the run's arithmetic."""
from __future__ import annotations

import pandas as pd
import pytest

from gpu_backend.engine.engine_config import EngineConfig
from simulator.config import SimConfig
from simulator.core.errors import ConfigError
from simulator.loop import simulate


@pytest.mark.parametrize("name,expected", [
    ("swap_space_gb", "a number"), ("block_size", "an integer"), ("max_num_seqs", "an integer"),
    ("gpu_memory_utilization", "a number"), ("watermark", "a number"), ("seed", "an integer"),
    ("beam_alpha", "a number"), ("disk_offload_bandwidth_gbps", "a number"),
])
@pytest.mark.parametrize("allocator", ["paged", "contiguous-max"])
def test_none_for_a_number_is_refused_naming_the_field(name, expected, allocator):
    with pytest.raises(ConfigError, match=f"^{name} must be {expected}, got None$"):
        SimConfig(allocator=allocator, capacity_tokens=4096, max_model_len=512, **{name: None})


def test_every_field_left_none_is_named_at_once():
    message = "^swap_space_gb must be a number, got None; seed must be an integer, got None$"
    with pytest.raises(ConfigError, match=message):
        SimConfig(swap_space_gb=None, seed=None)


def test_none_where_the_type_allows_it_still_means_the_default():
    trace = pd.DataFrame({"arrival_s": [0.0], "prompt_len": [10], "output_len": [5]})
    config = SimConfig(capacity_tokens=4096, max_model_len=512, kv_memory_gb=None,
                       max_num_batched_tokens=None)
    assert simulate(trace, config).summary["num_finished"] == 1
    assert EngineConfig(swap_space_gb=None).swap_space_gb is None  # the engine's: its default pool


@pytest.mark.parametrize("name,value,expected", [
    ("capacity_tokens", "1000", "an integer"), ("capacity_tokens", True, "an integer"),
    ("block_size", 16.0, "an integer"), ("seed", 1.5, "an integer"), ("kv_memory_gb", "2", "a number"),
    ("enable_prefix_caching", "no", "True or False"), ("record_events", 1, "True or False"),
])
def test_a_value_of_another_kind_is_refused_naming_the_field(name, value, expected):
    with pytest.raises(ConfigError, match=f"^{name} must be {expected}, got {value!r}$"):
        SimConfig(**{name: value})


def test_numpy_numbers_and_bools_are_numbers_and_bools():
    import numpy as np

    config = SimConfig(block_size=np.int64(32), kv_memory_gb=np.float64(2.0), capacity_tokens=np.int32(4096),
                       enable_prefix_caching=np.bool_(False))
    assert (config.block_size, config.capacity_tokens) == (32, 4096)
    assert not config.enable_prefix_caching
