"""The held-out validation's cheap parts: cutting the trace, naming repeats, the table and the verdicts."""
from __future__ import annotations

import pytest

from bench.calibration import PARTS, held_out_part, markdown_table, run_names, summary_row, verdict_lines
from traces import load_trace


def test_parts_are_the_documented_slices_shifted_to_start_at_zero():
    trace = load_trace("azure-conv")
    for start in sorted({s for s, _ in PARTS.values()}):
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


def test_targets_are_judged_per_run_on_the_issue_thresholds():
    rows = {"A": summary_row(_comparison(0.10, -0.05)), "B": summary_row(_comparison(0.101, 0.01)),
            "C": summary_row(_comparison(0.02, 0.051))}
    lines = verdict_lines(rows)
    assert lines[0] == "e2e median |err| <= 10%: met on 2 of 3 held-out runs, NOT met on B"
    assert lines[1] == "|throughput err| <= 5%: met on 2 of 3 held-out runs, NOT met on C"
    table = markdown_table(rows).splitlines()
    assert len(table) == 5
    assert table[2].startswith("| A | 10.0% | 20.0% |") and table[2].endswith("| met | met |")
    assert "| -5.0% |" in table[2] and table[3].endswith("| NOT met | met |")
