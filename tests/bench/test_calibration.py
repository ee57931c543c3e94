"""The held-out validation's parts: cutting the trace, naming repeats, the tables, the verdicts, the floor."""
from __future__ import annotations

import shutil

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from bench.calibration import (
    PARTS,
    floor_lines,
    floor_pairs,
    floor_row,
    floor_table,
    held_out_part,
    held_out_runs,
    judged_lines,
    markdown_table,
    noise_floor,
    part_floors,
    run_names,
    summary_row,
    verdict_lines,
)
from cli import app
from traces import SyntheticConfig, generate_trace, load_trace, save_trace


def test_parts_are_the_documented_slices_shifted_to_start_at_zero():
    assert {t for t, _, _ in PARTS.values()} == {"azure-conv", "azure-code"}  # another trace too
    trace = load_trace("azure-conv")
    for start in sorted({s for t, s, _ in PARTS.values() if t == "azure-conv"}):
        part = held_out_part(trace, start)
        assert len(part) == 40
        assert part["request_id"].tolist() == trace["request_id"].iloc[start: start + 40].tolist()
        assert part["arrival_s"].iloc[0] == 0.0
        gaps = trace["arrival_s"].iloc[start: start + 40].diff().iloc[1:].to_numpy()
        assert part["arrival_s"].diff().iloc[1:].to_numpy() == pytest.approx(gaps)
    # The spans docs/calibration.md gives for A, B and C.
    spans = [held_out_part(trace, s)["arrival_s"].iloc[-1] for s in (0, 40, 80)]
    assert spans == pytest.approx([24.1, 12.7, 7.3], abs=0.05)


def test_a_short_trace_is_refused():
    with pytest.raises(ValueError, match="short"):
        held_out_part(load_trace("azure-conv").iloc[:50], 40)


def test_repeats_get_their_own_folders_and_unknown_parts_are_refused():
    assert run_names(["A", "B"], ["B", "B"]) == [("A", "A"), ("B", "B"), ("B-repeat", "B"),
                                                 ("B-repeat2", "B")]
    with pytest.raises(ValueError, match="unknown part"):
        run_names(["D"], [])


def _comparison(e2e: float, throughput: float) -> dict:
    stats = {"median_abs": e2e, "p90_abs": 2 * e2e, "median": -e2e, "count": 40}
    return {"latency": {"e2e_s": stats, "ttft_s": stats, "tpot_s": stats},
            "throughput": {"rel_error": throughput},
            "step_time": {"median_abs": 0.05, "total_rel_error": -0.02}}


def test_targets_are_judged_per_run_on_the_target_thresholds():
    rows = {"A": summary_row(_comparison(0.10, -0.05)), "B": summary_row(_comparison(0.101, 0.01)),
            "C": summary_row(_comparison(0.02, 0.051))}
    lines = verdict_lines(rows)
    assert lines[0] == "e2e median |err| <= 10%: met on 2 of 3 held-out runs, NOT met on B"
    assert lines[1] == "|throughput err| <= 5%: met on 2 of 3 held-out runs, NOT met on C"
    table = markdown_table(rows).splitlines()
    assert len(table) == 5
    assert table[2].startswith("| A | 10.0% | 20.0% |") and table[2].endswith("| met | met |")
    assert "| -5.0% |" in table[2] and table[3].endswith("| NOT met | met |")


def test_each_repeat_is_paired_with_the_first_replay_of_its_part():
    runs = run_names(["A", "B", "C"], ["B", "A", "B"])
    assert floor_pairs(runs) == [("B-repeat", "B"), ("A-repeat", "A"), ("B-repeat2", "B")]
    assert floor_pairs(run_names(["A", "C"], [])) == []
    # A part named only in --repeat: its first replay is the plain name.
    assert floor_pairs(run_names(["A"], ["C", "C"])) == [("C-repeat", "C")]


def test_the_floor_says_which_parts_the_machine_repeats_within_the_targets():
    rows = {"B-repeat vs B": floor_row(_comparison(0.394, 0.147)),
            "A-repeat vs A": floor_row(_comparison(0.211, 0.034)),
            "C-repeat vs C": floor_row(_comparison(0.06, -0.047))}
    assert floor_lines(rows) == [
        "noise floor ABOVE a target on B (e2e 39.4%, throughput +14.7%), A (e2e 21.1%): this machine "
        "does not repeat those replays within the targets, so their verdicts cannot judge the model; "
        "C within both"]
    steady = {"A-repeat vs A": floor_row(_comparison(0.10, 0.05))}  # on the thresholds: within
    assert floor_lines(steady)[0].startswith("noise floor within both targets on every repeated part (A)")
    assert floor_lines({"C-repeat vs C": floor_row(_comparison(0.02, -0.0501))})[0].startswith(
        "noise floor ABOVE a target on C (throughput -5.0%)")
    assert "not measured" in floor_lines({})[0]
    table = floor_table(rows).splitlines()
    assert table[2] == "| B-repeat vs B | 39.4% | +14.7% | -2.0% |" and len(table) == 5


def test_only_runs_of_parts_the_machine_repeats_are_judged():
    runs = run_names(["A", "B", "C"], ["B", "A", "C"])
    rows = {"A": summary_row(_comparison(0.116, 0.006)), "B": summary_row(_comparison(0.108, -0.036)),
            "C": summary_row(_comparison(0.02, 0.108)), "B-repeat": summary_row(_comparison(0.028, 0.008)),
            "A-repeat": summary_row(_comparison(0.179, 0.019)),
            "C-repeat": summary_row(_comparison(0.01, 0.0))}
    floor = {"B-repeat vs B": floor_row(_comparison(0.099, -0.043)),
             "A-repeat vs A": floor_row(_comparison(0.09, -0.013)),
             "C-repeat vs C": floor_row(_comparison(0.066, 0.053))}  # C's throughput floor is over 5%
    assert judged_lines(rows, floor, runs) == [
        "judged runs (B, A and their repeats): e2e target met on 1 of 4, NOT met on A, B, A-repeat",
        "judged runs (B, A and their repeats): throughput target met on 4 of 4"]
    noisy = {"A-repeat vs A": floor_row(_comparison(0.4, 0.0))}
    assert judged_lines(rows, noisy, runs)[0].startswith("judged runs: none")
    assert judged_lines(rows, {}, runs) == []


def test_the_figure_gets_each_parts_largest_floor_over_its_repeats():
    floor = {"B-repeat vs B": floor_row(_comparison(0.05, -0.04)),
             "B-repeat2 vs B": floor_row(_comparison(0.12, 0.01)),
             "A-repeat vs A": floor_row(_comparison(0.03, 0.002))}
    assert part_floors(floor) == {"B": (0.12, -0.04), "A": (0.03, 0.002)}
    floor["A-repeat vs A"]["throughput diff"] = None  # no value in one comparison: no floor value
    assert part_floors(floor)["A"] == (0.03, None)
    assert part_floors({}) == {}


def test_the_figures_rows_carry_each_runs_verdicts_and_its_parts_floor():
    runs = run_names(["A", "B", "C"], ["B", "C"])
    rows = {"A": summary_row(_comparison(0.044, 0.005)), "B": summary_row(_comparison(0.123, -0.024)),
            "C": summary_row(_comparison(0.02, None)), "B-repeat": summary_row(_comparison(0.05, -0.061))}
    floor = {"B-repeat vs B": floor_row(_comparison(0.099, 0.025)),
             "C-repeat vs C": floor_row(_comparison(0.041, 0.062))}  # A not repeated; C's throughput over 5 %
    held = held_out_runs(rows, floor, runs)
    assert [r.name for r in held] == ["A", "B", "C", "B-repeat"]
    assert [r.e2e_met for r in held] == [True, False, True, True]
    assert [r.throughput_met for r in held] == [True, True, False, False]  # no value is no verdict
    assert [r.floor_e2e for r in held] == [None, 0.099, 0.041, 0.099]
    # Judged: only where the part was repeated within both targets (B), never A (no floor) or C.
    assert [r.judged for r in held] == [False, True, False, True]


@pytest.fixture(scope="module")
def two_replays(tmp_path_factory, single_thread):
    """The same tiny trace replayed twice on the CPU (wall clock: the two differ in timing), and a copy."""
    out = tmp_path_factory.mktemp("floor")
    trace = generate_trace(SyntheticConfig(num_requests=8, arrival="poisson", rate=40.0, lengths="uniform",
                                           prompt_range=(8, 60), output_range=(4, 24), max_model_len=256,
                                           seed=3))
    save_trace(trace, out / "trace.csv")
    for name in ("P", "P-repeat"):
        args = ["replay", out / "trace.csv", "--model", "tiny", "--device", "cpu", "--backend", "torch",
                "--num-blocks", 24, "--max-model-len", 256, "--out", out / name / "real"]
        result = CliRunner().invoke(app, [str(a) for a in args])
        assert result.exit_code == 0, result.output
    shutil.copytree(out / "P" / "real", out / "P-copy" / "real")
    return out


def _e2e(run) -> pd.Series:
    requests = pd.read_parquet(run / "real" / "paged" / "requests.parquet").set_index("request_id")
    return requests["finish_s"] - requests["arrival_s"]


def test_the_noise_floor_compares_each_repeat_with_its_first_replay(two_replays):
    out = two_replays
    rows = noise_floor(out, [("P-repeat", "P"), ("P-copy", "P")])
    assert list(rows) == ["P-repeat vs P", "P-copy vs P"]
    # A replay against an exact copy of itself: no difference at all, so within both targets.
    assert rows["P-copy vs P"] == {"e2e median |diff|": 0.0, "throughput diff": 0.0,
                                   "total busy time diff": 0.0}
    # Against the repeat: the median |relative e2e difference| over the requests, from the tables themselves.
    first, repeat = _e2e(out / "P"), _e2e(out / "P-repeat")
    expected = float(np.median(np.abs((repeat - first.loc[repeat.index]) / first.loc[repeat.index])))
    assert rows["P-repeat vs P"]["e2e median |diff|"] == pytest.approx(expected, rel=1e-9)
    assert (out / "P-repeat" / "floor" / "comparison.json").is_file()
