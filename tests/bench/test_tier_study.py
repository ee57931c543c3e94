"""bench.tier_study: one trace under each tier setting, its table and figure."""
from __future__ import annotations

from bench import tier_study
from traces.multiturn import MultiTurnConfig, generate_multiturn


def test_each_tier_setting_reports_shares_that_add_up(tmp_path, monkeypatch):
    trace = generate_multiturn(MultiTurnConfig(num_requests=60, first_prompt_len=2000, rate=2, seed=4))
    results = {"chat": {label: tier_study.run_one(trace, extra) for label, extra in tier_study.TIERS.items()}}
    for row in results["chat"].values():
        assert abs(sum(row["share"].values()) - 1) < 1e-9 and row["finished"] == 60
    assert results["chat"]["GPU only"]["share"]["cpu_hit"] == 0
    lines = tier_study.table(results).splitlines()
    assert len(lines) == 2 + len(tier_study.TIERS) and all(line.count("|") == 10 for line in lines)
    assert tier_study.figure(results, tmp_path / "tiers.png").stat().st_size > 0
