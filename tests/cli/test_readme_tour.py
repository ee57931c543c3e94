"""README's Quick tour runs as written: every command, in order, in one empty folder.

Commands whose comment starts with "slow:" (minutes on a 2-core CPU: the real engine, the engine and
attention benchmarks) run only with PAGELAB_TOUR_SLOW=1, so the default suite stays about a minute.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ACTIVATE = ". .venv/bin/activate"  # the tour's first line; the test runs the CLI with this interpreter
SLOW_PREFIX = "slow:"
RUN_SLOW = os.environ.get("PAGELAB_TOUR_SLOW") == "1"
TIMEOUT_S = 600
MAX_REJECTED_PCT = 5.0  # a tour line that refuses more of its requests gives no meaningful result


def tour_commands(readme: str) -> list[tuple[list[str], bool]]:
    """(argv, slow) for each command of the bash block under "## Quick tour" (continuations joined)."""
    section = readme.split("## Quick tour", 1)
    if len(section) < 2:
        raise ValueError("README has no '## Quick tour' section")
    block = re.search(r"```bash\n(.*?)```", section[1], re.S)
    if block is None:
        raise ValueError("the Quick tour has no ```bash block")
    commands, pending = [], ""
    for raw in block.group(1).splitlines():
        line = pending + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if not line or line.startswith("#") or line == ACTIVATE:
            continue
        comment = line.split(" #", 1)[1].strip() if " #" in line else ""
        commands.append((shlex.split(line, comments=True), comment.startswith(SLOW_PREFIX)))
    return commands


def _option(argv: list[str], *names: str) -> str | None:
    """The value after the last of `names` in argv, or None."""
    value = None
    for i, arg in enumerate(argv[:-1]):
        if arg in names:
            value = argv[i + 1]
    return value


def expected_outputs(argv: list[str]) -> list[str]:
    """Files and folders a command promises by its own options (--out, --plot, plot's default folder)."""
    out = _option(argv, "--out", "-o")
    paths = [out] if out else []
    if argv[1:3] == ["trace", "info"] and _option(argv, "--plot"):
        paths.append(_option(argv, "--plot"))
    if argv[1] == "simulate" and out and "--plot" in argv:
        paths.append(f"{out}/figures/breakdown.png")
    if argv[1] == "plot" and not out:
        paths.append(f"{argv[2]}/figures")
    return paths


def rejected_shares(stderr: str) -> list[float]:
    """The rejected share (%) of every allocator a command warned about ("N of M requests (X%) were
    rejected")."""
    return [float(x) for x in re.findall(r"requests \(([\d.]+)%\) were rejected", stderr)]


def test_rejected_shares_are_read_from_the_warnings():
    stderr = ("warning: paged: 519 of 1,000 requests (51.9%) were rejected (519 longer than ...)\n"
              "warning: contiguous-max: 3 of 1,000 requests (0.3%) were rejected (3 need more ...)\n")
    assert rejected_shares(stderr) == [51.9, 0.3]
    assert rejected_shares("simulating paged: 1,000/1,000 (100%)") == []


def test_parser_joins_continuations_and_reads_slow_marks():
    readme = ("intro\n## Quick tour\n\n```bash\n" + ACTIVATE + "\n"
              "pagelab simulate --limit 5   # a comment\n"
              "pagelab simulate x.parquet \\\n    --out runs/x --plot\n"
              "pagelab replay --limit 2   # slow: the engine\n```\n## Next\n```bash\nignored\n```\n")
    assert tour_commands(readme) == [
        (["pagelab", "simulate", "--limit", "5"], False),
        (["pagelab", "simulate", "x.parquet", "--out", "runs/x", "--plot"], False),
        (["pagelab", "replay", "--limit", "2"], True),
    ]
    simulate = ["pagelab", "simulate", "t", "--out", "r", "--plot"]
    assert expected_outputs(simulate) == ["r", "r/figures/breakdown.png"]
    assert expected_outputs(["pagelab", "trace", "info", "azure-conv", "--plot", "o.png"]) == ["o.png"]
    assert expected_outputs(["pagelab", "plot", "runs/x"]) == ["runs/x/figures"]


def test_tour_draws_the_readme_lead_figure():
    readme = (ROOT / "README.md").read_text()
    outputs = [p for argv, _ in tour_commands(readme) for p in expected_outputs(argv)]
    assert re.search(r"!\[[^\]]*\]\(docs/images/breakdown[^)]*\)", readme), "README lost its lead figure"
    drawn = [p for p in outputs if p.endswith("/figures/breakdown.png")]
    intro = readme.split("## Quick tour", 1)[0]
    assert any(p in intro for p in drawn), "the text above the tour must name the file the tour draws"


@pytest.mark.slow
def test_quick_tour_runs_as_written(tmp_path):
    commands = tour_commands((ROOT / "README.md").read_text())
    assert len(commands) >= 8
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ran = 0
    for argv, slow in commands:
        assert argv[0] == "pagelab", f"tour line is not a pagelab command: {shlex.join(argv)}"
        if slow and not RUN_SLOW:
            continue
        cli = [sys.executable, "-c", "from cli import main; main()", *argv[1:]]
        proc = subprocess.run(cli, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        shown = shlex.join(argv)
        output = proc.stdout[-2000:] + proc.stderr[-2000:]
        assert proc.returncode == 0, f"{shown}: exit {proc.returncode}\n{output}"
        assert (proc.stdout + proc.stderr).strip(), f"{shown}: printed nothing"
        assert all(share < MAX_REJECTED_PCT for share in rejected_shares(proc.stderr)), f"{shown}:\n{output}"
        for path in expected_outputs(argv):
            target = tmp_path / path
            assert target.exists(), f"{shown}: did not write {path}"
            assert target.is_file() or any(target.iterdir()), f"{shown}: {path} is empty"
        ran += 1
    assert ran >= 6
