"""The events table's seq_id: the sequence that acquired each tenure (a request of n samples or beams holds
blocks through several sequences)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from simulator.config import SimConfig
from simulator.core.decode import append_blocks as _append_blocks
from simulator.loop import simulate
from simulator.output import RunFolder, Sizes
from traces import SyntheticConfig, generate_trace


def _trace(n: int = 1, beam_width: int = 1, prompt_len: int = 40, output_len: int = 60) -> pd.DataFrame:
    return generate_trace(SyntheticConfig(num_requests=40, rate=20.0, lengths="fixed", prompt_len=prompt_len,
                                          output_len=output_len, n=n, beam_width=beam_width, seed=2))


def _owners(ev: pd.DataFrame) -> pd.Series:
    """Each sequence's request (fails the test when a sequence shows up under two requests)."""
    per_seq = ev.groupby("seq_id")["request_id"]
    assert (per_seq.nunique() == 1).all()
    return per_seq.first()


@pytest.mark.parametrize("allocator", ["paged", "contiguous-max"])
@pytest.mark.parametrize("mode", ["fast", "step"])
def test_each_sample_of_a_request_holds_tenures_of_its_own(allocator, mode):
    ev = simulate(_trace(n=3), SimConfig(allocator=allocator, mode=mode, capacity_tokens=30_000)).events
    assert ev["seq_id"].dtype == np.int64
    owners = _owners(ev)
    # Every sample writes its own decode tokens (paged: into blocks it takes; contiguous: its own region).
    assert (owners.value_counts() == 3).all() and len(owners) == 3 * 40
    # The samples share the prompt's blocks: the tenure of a shared block stays its acquirer's.
    shared = ev[ev["max_ref_count"] > 1]
    assert (len(shared) > 0) == (allocator == "paged")
    assert shared["seq_id"].isin(ev.groupby("request_id")["seq_id"].min()).all()


def test_beams_forked_from_one_another_stay_within_their_request():
    ev = simulate(_trace(beam_width=3), SimConfig(capacity_tokens=30_000)).events
    owners = _owners(ev)
    assert owners.value_counts().min() >= 2  # beams forked into sequences of their own took blocks


@pytest.mark.parametrize("in_child", [False, True])
def test_a_decode_runs_folder_records_the_sequences_of_the_in_memory_result(tmp_path, monkeypatch, in_child):
    import simulator.core.decode as decode

    trace = _trace(prompt_len=8, output_len=300)  # one short prompt block, then decode blocks
    trace.loc[:3, "n"] = 2  # the first requests sample twice: sequence ids run ahead of request ids
    bulk = []  # sequences given blocks by the decode batch's bulk path

    def counted(bm, seqs, *times):
        bulk.extend(seqs)
        _append_blocks(bm, seqs, *times)

    monkeypatch.setattr(decode, "append_blocks", counted)
    cfg = SimConfig(capacity_tokens=30_000)
    here = simulate(trace, cfg).events
    sizes = dataclasses.replace(Sizes(), child_min_requests=0) if in_child else Sizes()
    simulate(trace, cfg, RunFolder(tmp_path, num_requests=len(trace), sizes=sizes))
    folder = pd.read_parquet(tmp_path / "events.parquet")
    assert len(bulk) > 36 * 300 // 16 // 2
    owners = _owners(here)
    assert len(owners) == 44 and (owners.index - owners.to_numpy() > 1).any()
    pd.testing.assert_frame_equal(folder, here)
