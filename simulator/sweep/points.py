"""One sweep point: its identity (config hash), its run folder, running it, and reusing a finished one.

A point's folder is a normal run folder (docs/run-format.md) with one allocator, written atomically, so a
folder that exists is complete: an interrupted sweep leaves either the whole point or nothing.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from pagelab.run_format import SWEEP_POINTS_DIR as POINTS_DIR
from simulator.config import SimConfig
from simulator.sweep.axes import labelled_axes, short_name

# Options added after sweep folders existed, at the value that leaves a point's result as before: left out
# of the hash there, so the points of an existing sweep folder are still found and reused.
UNHASHED_DEFAULTS = {"kv_cache_dtype": "auto"}


def trace_fingerprint(trace: pd.DataFrame) -> str:
    """A content hash of the trace, so a point is never reused across different traces."""
    frame = trace.reset_index(drop=True)
    # A column of lists (prefix keys) cannot be hashed as it is: each row's keys are hashed as their text.
    frame = frame.assign(**{c: frame[c].map(_keys_text) for c in frame.columns if frame[c].dtype == object})
    hashed = pd.util.hash_pandas_object(frame, index=False).to_numpy()
    return hashlib.sha256(hashed.tobytes() + ",".join(map(str, trace.columns)).encode()).hexdigest()[:16]


def _keys_text(value) -> object:
    """A row's list of keys as text ("1,2,3"); anything else as it is."""
    if isinstance(value, (list, tuple, np.ndarray)):
        return ",".join(map(str, map(int, value)))
    return value


def input_files_digest(sim: SimConfig) -> dict[str, str]:
    """A digest of each file a configuration names and reads (a fitted latency profile, a local model
    folder's config.json), so that a point is run again when one of them changes."""
    files = {"latency": Path(sim.latency) if sim.latency != "roofline" else None,
             "model": Path(sim.model) / "config.json" if Path(sim.model).is_dir() else None}
    return {name: _file_digest(str(path)) for name, path in files.items()
            if path is not None and path.is_file()}


def _file_digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


@dataclass(frozen=True)
class PointSpec:
    """A configuration at one rate: everything that decides a point's result, plus its hash."""

    config: tuple  # (axis, value) pairs, allocator first
    rate: float
    sim: SimConfig  # the full simulator configuration (extra labels excluded from the hash)
    trace_hash: str

    @property
    def config_dict(self) -> dict:
        """The configuration as a dict."""
        return dict(self.config)

    @functools.cached_property
    def key(self) -> str:
        """The point's config hash: the simulator config, the rate and the trace content."""
        sim = {k: v for k, v in dataclasses.asdict(self.sim).items()
               if k != "extra" and (k not in UNHASHED_DEFAULTS or UNHASHED_DEFAULTS[k] != v)}
        point = {"sim": sim, "rate": self.rate, "trace": self.trace_hash}
        files = input_files_digest(self.sim)
        if files:  # a fitted profile or a local model folder: their content, not only their path
            point["files"] = files
        blob = json.dumps(point, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    @property
    def folder_name(self) -> str:
        """'paged-bs16-r1.25-<hash>': readable, and unique through the hash."""
        parts = [str(self.config[0][1])] + [f"{short_name(k)}{v}"
                                             for k, v in labelled_axes(self.config_dict).items()]
        return "-".join(parts + [f"r{self.rate:g}", self.key]).replace("/", "_").replace(" ", "_")


@dataclass(frozen=True)
class PointFailed:
    """A point that could not finish, and why (e.g. the worker process running it died twice)."""

    cause: str


def point_folder(out: Path, spec: PointSpec) -> Path:
    """Where a point's run folder lives inside the sweep folder: under its name, or under another name
    ending in its hash (a label's wording may change; the point is the same), found first."""
    path = out / POINTS_DIR / spec.folder_name
    if not path.is_dir():
        same = sorted(p for p in (out / POINTS_DIR).glob(f"*-{spec.key}") if p.is_dir())
        if same:
            return same[0]
    return path


def finished_summary(out: Path, spec: PointSpec) -> dict | None:
    """The summary of an already finished point with the same hash, or None (query only)."""
    path = point_folder(out, spec) / "summary.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if data.get("trace", {}).get("point_hash") != spec.key:
        return None
    allocator = spec.sim.allocator
    return data.get("allocators", {}).get(allocator)


def run_point(trace: pd.DataFrame, spec: PointSpec, source: str):
    """Simulate one point: the trace rescaled to the point's mean rate (burstiness kept)."""
    from simulator.loop import simulate
    from traces import rescale_rate
    from traces.stats import trace_info

    df = rescale_rate(trace, spec.rate)
    sim = dataclasses.replace(spec.sim, extra={**spec.sim.extra, "trace": source, "rate": spec.rate,
                                                  "point_hash": spec.key})
    result = simulate(df, sim)
    info = {"source": source, **trace_info(df), "rate_override": spec.rate, "point_hash": spec.key,
            "sweep_config": spec.config_dict}
    return info, result


def execute_point(trace: pd.DataFrame, spec: PointSpec, source: str, out: Path | None):
    """Run a point; with `out`, write its folder there and return only the summary (small to send back).

    Without `out` (a remote worker that may not share the file system) return the info and the result so
    the driver writes the folder.
    """
    info, result = run_point(trace, spec, source)
    if out is None:
        return info, result
    write_point(out, spec, info, result)
    return result.summary


def write_point(out: Path, spec: PointSpec, info: dict, result) -> Path:
    """Write a point's run folder atomically (a normal run folder with one allocator)."""
    from pagelab.run_folder import write_run

    return write_run(point_folder(out, spec), info, {spec.sim.allocator: result})
