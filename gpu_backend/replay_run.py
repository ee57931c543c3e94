"""A replay as a run folder: the per-allocator configs, run.json and the all-or-nothing write that
`pagelab replay` and the calibration tools (bench/replay_setup.py) share."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from gpu_backend.replay import ReplayConfig, replay
from pagelab.errors import PagelabError
from pagelab.run_folder import run_metadata, versions, write_run
from traces.loaders import trace_hash


class ReplayIncomplete(PagelabError):
    """A replay stopped early (the device ran out of memory); its run folder, if any, is marked incomplete."""


def replay_configs(names: list[str], template: ReplayConfig) -> dict[str, ReplayConfig]:
    """One config per allocator name: `template` with its engine's allocator set to that name."""
    return {name: dataclasses.replace(template, engine=dataclasses.replace(template.engine, allocator=name))
            for name in names}


def run_labels(source: str, limit: int | None, max_concurrency: int | None = None) -> dict:
    """The labels a replay's config.json records under `extra`: the trace and limit it ran (what `simulate
    --config-from` reloads), the concurrency cap and the pagelab version."""
    return {"trace": source, "limit": limit, "pagelab_version": versions()["pagelab"],
            "max_concurrency": max_concurrency}


def replay_metadata(configs: dict[str, ReplayConfig], source: str) -> dict:
    """run.json of a replay of `source`: the command line, versions, the trace's hash, every config."""
    return {**run_metadata("replay"), "trace_sha256": trace_hash(source),
            "config": {name: dataclasses.asdict(c) for name, c in configs.items()}}


def replay_to_dir(df, configs: dict, info: dict, out: Path | None, table_format: str = "parquet",
                  progress: Callable[[str, int, int], None] | None = None, *, metadata: dict | None = None,
                  before_write: Callable[[dict], dict] | None = None, write: Callable = write_run) -> dict:
    """Replay `df` once per allocator config, then write every result at once (all or nothing).

    A replay the device ran out of memory in ends the loop: what ran is written (with --out) as a folder
    marked incomplete (run.json and summary.json say where and why it stopped), then ReplayIncomplete.

    `before_write(results)` (e.g. printing the tables) returns extra top-level summary entries; `write`
    is `pagelab.run_folder.write_run` or a caller's wrapper of it (the CLI's turns a failed write into a
    one-line error).
    """
    results = {}
    for name, cfg in configs.items():
        report = None if progress is None else (lambda done, total, n=name: progress(n, done, total))
        results[name] = replay(df, cfg, progress=report)
        stopped = results[name].summary.get("incomplete")
        if stopped is not None:  # the device ran out of memory: the other allocators would not fare better
            marker = {"allocator": name, **stopped, "not_run": [n for n in configs if n not in results]}
            where = "nothing was written (no --out)"
            if out is not None:
                write(out, info, results, table_format, extra_summary={"incomplete": marker},
                      metadata={**(metadata or run_metadata("replay")), "incomplete": marker})
                where = f"wrote the steps so far to {out} (its run.json marks it incomplete)"
            raise ReplayIncomplete(f"the {name} replay stopped at step {stopped['num_steps']}: "
                                   f"{stopped['reason']}; {where}")
    extra = before_write(results) if before_write is not None else {}
    if out is not None:
        write(out, info, results, table_format, metadata=metadata, extra_summary=extra)
    return results
