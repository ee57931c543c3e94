"""Where sweep points run: in this process, in local worker processes (default), or on a Ray cluster.

Every executor gets the trace once: local workers read it from the sweep folder's trace.parquet in their
initializer; Ray tasks share one `ray.put` copy in the object store. Each `run` yields (spec, summary) as
points finish, after the point's folder has been written.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import socket
from collections.abc import Iterable, Iterator
from pathlib import Path

import pandas as pd

from simulator.sweep.axes import SweepError
from simulator.sweep.points import PointSpec, execute_point, write_point

# The trace of a local worker process, loaded once by its initializer (per-process state by design:
# the pool calls a plain function for every point, and the trace must not travel with each call).
_WORKER_TRACE: pd.DataFrame | None = None


def _init_worker(trace_path: str) -> None:
    """Pool initializer: load the shared trace file once per worker."""
    global _WORKER_TRACE
    _WORKER_TRACE = pd.read_parquet(trace_path)


def _worker_point(spec: PointSpec, source: str, out: str) -> dict:
    """Pool task: run one point against the worker's trace and write its folder."""
    return execute_point(_WORKER_TRACE, spec, source, Path(out))


class SerialExecutor:
    """Run points one after another in this process (--jobs 1; no start-up cost)."""

    name = "serial"

    def __init__(self, trace: pd.DataFrame):
        self.trace = trace

    def run(self, specs: Iterable[PointSpec], source: str, out: Path) -> Iterator[tuple[PointSpec, dict]]:
        """Run each point and yield its summary."""
        for spec in specs:
            yield spec, execute_point(self.trace, spec, source, out)

    def close(self) -> None:
        """Nothing to release."""


class LocalExecutor:
    """A pool of worker processes on this machine, started once per sweep."""

    name = "local"

    def __init__(self, jobs: int, trace_path: Path):
        self.jobs = jobs
        self.pool = cf.ProcessPoolExecutor(max_workers=jobs, initializer=_init_worker,
                                           initargs=(str(trace_path),))

    def run(self, specs: Iterable[PointSpec], source: str, out: Path) -> Iterator[tuple[PointSpec, dict]]:
        """Submit every point, yield them as they finish; cancel the rest if the caller stops early."""
        futures = {self.pool.submit(_worker_point, spec, source, str(out)): spec for spec in specs}
        try:
            for future in cf.as_completed(futures):
                yield futures[future], future.result()
        finally:
            for future in futures:
                future.cancel()

    def close(self) -> None:
        """Stop the workers (cancelling queued points)."""
        self.pool.shutdown(wait=True, cancel_futures=True)


def default_jobs() -> int:
    """All cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def probe_address(address: str, timeout_s: float = 3.0) -> None:
    """Fail fast (SweepError) when a 'host:port' or 'ray://host:port' address does not accept connections."""
    target = address.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        if address in ("auto", "local"):
            return
        raise SweepError(f"--address {address!r}: use HOST:PORT, ray://HOST:PORT or auto")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise SweepError(f"Ray cluster at {address} does not answer ({exc.strerror or exc})") from None


class RayExecutor:
    """Tasks on a Ray cluster: an existing one at `address`, the one this process already joined, or a
    fresh local instance when neither is given."""

    name = "ray"

    def __init__(self, trace: pd.DataFrame, address: str | None = None, num_cpus: int | None = None):
        try:
            import ray
        except ImportError:
            raise SweepError("--executor ray needs Ray: pip install 'pagelab[ray]'") from None
        self.ray = ray
        self.started = False
        if not ray.is_initialized():
            if address is not None:
                probe_address(address)
            try:
                ray.init(address=address, num_cpus=None if address else num_cpus,
                         include_dashboard=False, log_to_driver=False)
            except (ConnectionError, RuntimeError) as exc:
                raise SweepError(f"cannot join the Ray cluster at {address or 'a new local instance'}: "
                                 f"{str(exc).splitlines()[0]}") from None
            self.started = True
        self.trace_ref = ray.put(trace)  # once: every task reads the same object-store copy
        self.task = ray.remote(_ray_point)

    def run(self, specs: Iterable[PointSpec], source: str, out: Path) -> Iterator[tuple[PointSpec, dict]]:
        """Launch every point as a task; the driver writes each folder (workers may not share our disk)."""
        pending = {self.task.remote(self.trace_ref, spec, source): spec for spec in specs}
        try:
            while pending:
                ready, _ = self.ray.wait(list(pending), num_returns=1)
                spec = pending.pop(ready[0])
                info, result = self.ray.get(ready[0])
                write_point(out, spec, info, result)
                yield spec, result.summary
        finally:
            for ref in pending:
                self.ray.cancel(ref)

    def close(self) -> None:
        """Leave the cluster if this executor joined it."""
        if self.started:
            self.ray.shutdown()


def _ray_point(trace: pd.DataFrame, spec: PointSpec, source: str):
    """Ray task: run one point and send the tables back to the driver."""
    return execute_point(trace, spec, source, None)
