"""Parsing sweep axes: rate grids, lists, bounds, typed --axis values, and the refusals."""
from __future__ import annotations

import pytest

from simulator.sweep.axes import (
    SweepAxes,
    SweepError,
    config_label,
    parse_axis,
    parse_axis_values,
    parse_rates,
)
from simulator.sweep.points import PointSpec


def test_rate_grid_includes_its_stop_and_has_exact_values():
    rates, bounds = parse_rates("0.5:4:0.25")
    assert len(rates) == 15 and rates[0] == 0.5 and rates[-1] == 4.0
    assert rates[3] == 1.25  # no 1.2500000000000002 from float accumulation
    assert bounds == (0.5, 4.0)


def test_rate_bounds_only_and_lists():
    assert parse_rates("0.5:4") == ((0.5, 4.0), (0.5, 4.0))
    assert parse_rates("3,1,2,1") == ((1.0, 2.0, 3.0), (1.0, 3.0))


@pytest.mark.parametrize("spec, words", [
    ("4:1:0.5", "empty or inverted"), ("1:1", "empty or inverted"), ("1:4:0", "STEP must be > 0"),
    ("1:4:-1", "STEP must be > 0"), ("1:2:100", "grid would hold START alone"), ("0:4:1", "must be > 0"),
    ("a:4", "not a number"),
    ("1:2:3:4", "use START:STOP"), ("", "empty value"), ("1,,2", "empty value"), ("-1,2", "must be > 0"),
    ("1:inf", "not a finite number"),
])
def test_bad_rate_specs_are_refused_with_a_reason(spec, words):
    with pytest.raises(SweepError, match=words):
        parse_rates(spec)


def test_axis_values_are_typed_like_the_config_field():
    assert parse_axis("max_num_seqs=128,256") == ("max_num_seqs", (128, 256))
    assert parse_axis("enable-prefix-caching=true,false") == ("enable_prefix_caching", (True, False))
    assert parse_axis("kv_memory_gb=12,24.5") == ("kv_memory_gb", (12.0, 24.5))
    assert parse_axis_values("block_size", "16,8,16", int) == (16, 8)


@pytest.mark.parametrize("spec, words", [
    ("colour=red", "unknown axis 'colour'"), ("rate=1,2", "use --rate"), ("max_num_seqs", "NAME=V1"),
    ("max_num_seqs=1.5", "not an integer"), ("enable_prefix_caching=maybe", "not true/false"),
])
def test_bad_axes_are_refused(spec, words):
    with pytest.raises(SweepError, match=words):
        parse_axis(spec)


def test_configs_are_the_cross_product_and_invalid_ones_fail_up_front():
    axes = SweepAxes((1.0,), (1.0, 1.0), ("paged", "contiguous-max"), {"block_size": (8, 16, 32)}, {})
    configs = axes.configs()
    # Contiguous allocators ignore the block size, so they run once (at the first one).
    assert configs == [{"allocator": "paged", "block_size": b} for b in (8, 16, 32)] + \
        [{"allocator": "contiguous-max", "block_size": 8}]
    both = SweepAxes((1.0,), (1.0, 1.0), ("paged",), {"block_size": (8, 16), "max_num_seqs": (64, 128)}, {})
    assert len(both.configs()) == 4 and len({tuple(c.items()) for c in both.configs()}) == 4
    bad = SweepAxes((1.0,), (1.0, 1.0), ("paged",), {"block_size": (16, 0)}, {})
    with pytest.raises(SweepError, match="block_size must be > 0"):
        bad.check()


def test_a_contiguous_configuration_is_labelled_and_named_without_a_block_size():
    axes = SweepAxes((1.0,), (1.0, 1.0), ("paged", "contiguous-max"), {"block_size": (8, 16)}, {})
    labels, folders = [], []
    for config in axes.configs():
        labels.append(config_label(config))
        spec = PointSpec(tuple(config.items()), 1.0, axes.sim_config(config), "trace")
        folders.append(spec.folder_name.rsplit("-", 1)[0])  # without the hash
    assert labels == ["paged bs=8", "paged bs=16", "contiguous-max"]
    assert folders == ["paged-bs8-r1", "paged-bs16-r1", "contiguous-max-r1"]
