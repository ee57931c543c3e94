"""The sweep's tables: one row per point (sweep.parquet) and one row per configuration (max_rates.parquet).

Rows come from the run summaries only (no wall times, no executor names), so the same sweep gives the
same tables whichever executor ran it.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from simulator.slo import Limit
from simulator.sweep.points import PointSpec, point_folder
from simulator.sweep.search import SearchState


def point_row(spec: PointSpec, summary: dict, kind: str, slo: Limit, out: Path) -> dict:
    """One row of sweep.parquet."""
    ttft, tpot, e2e = (summary.get(k) or {} for k in ("ttft_s", "tpot_s", "e2e_s"))
    row = {**spec.config_dict, "rate": spec.rate}
    row.setdefault("block_size", summary.get("block_size"))
    row.update({
        "kind": kind,
        "slo_value": slo.summary_value(summary),
        "met_slo": slo.met(summary),
        "normalized_latency_s": summary.get("normalized_latency_s_per_token"),
        "ttft_p50_s": ttft.get("p50"), "ttft_p99_s": ttft.get("p99"),
        "tpot_p50_s": tpot.get("p50"), "tpot_p99_s": tpot.get("p99"),
        "e2e_p99_s": e2e.get("p99"),
        "throughput_tokens_per_s": summary.get("throughput_tokens_per_s"),
        "mean_batch_size": summary.get("mean_batch_size"),
        "num_requests": summary.get("num_requests"),
        "num_finished": summary.get("num_finished"),
        "num_preemptions": summary.get("num_preemptions"),
        "capacity_tokens": summary.get("capacity_tokens"),
        "folder": point_folder(out, spec).relative_to(out).as_posix(),  # relative to the sweep folder
        "point_hash": spec.key,
        "error": None,
    })
    return row


def failed_row(spec: PointSpec, cause: str, kind: str) -> dict:
    """The row of a point that did not finish: no results, no folder, the cause in `error`."""
    row = {**spec.config_dict, "rate": spec.rate}
    row.setdefault("block_size", spec.sim.block_size)
    row.update({"kind": kind, "met_slo": False, "folder": None, "point_hash": spec.key, "error": cause})
    return row


def points_table(rows: list[dict], config_columns: list[str]) -> pd.DataFrame:
    """All points, sorted by configuration then rate (a failed point's results are missing values)."""
    df = pd.DataFrame(rows)
    return df.sort_values([*config_columns, "rate"], kind="stable").reset_index(drop=True)


def max_rate_rows(configs: list[dict], states: list[SearchState], runs: list[int], search_runs: list[int]
                  ) -> list[dict]:
    """One row per configuration: the maximum sustainable rate and the paged allocator's advantage."""
    rows = []
    for config, state, n, s in zip(configs, states, runs, search_runs, strict=True):
        rows.append({**config, "max_rate": state.low, "first_miss_rate": state.high,
                     "status": state.status, "monotone": state.monotone, "runs": n, "search_runs": s})
    for row in rows:
        paged = next((r for r in rows if r["allocator"] == "paged" and
                      all(r[k] == v for k, v in row.items() if k in configs[0] and k != "allocator")), None)
        # A search that stopped on a failed point has no final rate: no ratio against it (nor from it).
        final = all(r is not None and r["status"] != "point_failed" for r in (paged, row))
        ok = final and paged["max_rate"] and row["max_rate"]
        row["paged_advantage"] = paged["max_rate"] / row["max_rate"] if ok else None
    return rows
