"""The shape a reader meets: the modules one simulation runs through, and what the CLI loads to start one.

A module "runs" when one of its functions is called (not while it is imported). A call back into a module
that is still running further down the stack is a return: the path doubles back on itself there.
"""
from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path

import simulator.output
from simulator.config import SimConfig
from simulator.loop import simulate
from simulator.output import RunFolder
from traces import load_trace
from traces.batches import FrameBatches

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pagelab", "simulator", "traces", "viz", "gpu_backend", "cli", "bench")
MAX_MODULES = 28  # the target is 20: docs/design.md says what would have to merge to get there; one of
# the 28 is pagelab.writes, the layer every written file goes through (a full disk is reported there),
# another simulator.core.kv_layout, vLLM's KV cache grouping rules that size every pool
MAX_RETURNS = 5
MAX_CLI_IMPORTS = 40


def _module(code, cache: dict) -> str | None:
    name = cache.get(code.co_filename, 0)
    if name == 0:
        try:
            parts = Path(code.co_filename).resolve().relative_to(ROOT).with_suffix("").parts
            dotted = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            name = dotted if parts[0] in PACKAGES else None
        except ValueError:
            name = None
        cache[code.co_filename] = name
    return name


def trace_modules(run) -> tuple[list[str], set[tuple[str, str]]]:
    """The project modules whose functions `run()` calls, in the order first entered, and the returns
    (caller module, callee module already on the stack below the caller)."""
    cache: dict = {}
    order: list[str] = []
    returns: set[tuple[str, str]] = set()

    def profile(frame, event, arg):
        if event != "call" or frame.f_code.co_name == "<module>":
            return
        module = _module(frame.f_code, cache)
        if module is None:
            return
        stack: list[str] = []
        caller = frame.f_back
        while caller is not None and caller.f_code.co_name != "<module>":
            name = _module(caller.f_code, cache)
            if name is not None and (not stack or stack[-1] != name):
                stack.append(name)
            caller = caller.f_back
        if not stack:  # the test itself
            return
        if module not in order:
            order.append(module)
        if stack[0] != module and module in stack[1:]:
            returns.add((stack[0], module))

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return order, returns


def test_a_simulation_into_a_run_folder_runs_through_few_modules_in_the_documented_order(tmp_path):
    # A validated trace read in batches, as `simulate --out` reads a Parquet trace.
    trace = FrameBatches(load_trace("azure-conv").iloc[:2000].reset_index(drop=True))
    config, output = SimConfig(), RunFolder(tmp_path, num_requests=trace.num_rows)
    order, returns = trace_modules(lambda: simulate(trace, config, output))
    assert len(order) <= MAX_MODULES, order
    assert len(returns) <= MAX_RETURNS, returns
    documented = re.findall(r"[a-z_]+(?:\.[a-z_]+)+", simulator.output.__doc__.split("compares):")[1])
    assert order == documented, " -> ".join(order)


def test_starting_the_simulate_command_loads_few_project_modules():
    code = f"import sys, cli.simulate; print(sum(m.split('.')[0] in {set(PACKAGES)} for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert int(out.stdout) <= MAX_CLI_IMPORTS
