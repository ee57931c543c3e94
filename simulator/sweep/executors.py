"""Where sweep points run: in this process, in local worker processes (default), or on a Ray cluster.

Every executor gets the trace once: local workers read it from the sweep folder's trace.parquet in their
initializer; Ray tasks share one `ray.put` copy in the object store. Each `run` yields (spec, summary) as
points finish, after the point's folder has been written, or (spec, PointFailed) for a point whose worker
died twice: a worker killed by the OS (out of memory) or a lost Ray node costs that point a retry, not the
sweep. A local point in flight when a worker died runs again alone, so a second death is its own.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import socket
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import pandas as pd

from simulator.sweep.axes import SweepError
from simulator.sweep.points import PointFailed, PointSpec, execute_point, write_point

# Test hook: a worker whose point's folder name contains this text kills itself with SIGKILL, as the
# kernel's out-of-memory killer would. "TEXT@FILE" kills only while FILE does not exist (it is made
# first), so the point dies once and its retry finishes. Only the tests set it.
KILL_POINT_ENV = "PAGELAB_TEST_KILL_POINT"
ATTEMPTS = 2  # a point whose worker dies is retried once

# The trace of a local worker process, loaded once by its initializer (per-process state by design:
# the pool calls a plain function for every point, and the trace must not travel with each call).
_WORKER_TRACE: pd.DataFrame | None = None


def _init_worker(trace_path: str) -> None:
    """Pool initializer: load the shared trace file once per worker. Ctrl-C is the main process's to
    handle (it ends the workers): a worker that took it too would die mid-point and hang the pool."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    global _WORKER_TRACE
    _WORKER_TRACE = pd.read_parquet(trace_path)


def _kill_hook(spec: PointSpec) -> None:
    """The KILL_POINT_ENV test hook (see there)."""
    hook = os.environ.get(KILL_POINT_ENV)
    if not hook:
        return
    text, _, once = hook.partition("@")
    if text not in spec.folder_name:
        return
    if once:
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
    os.kill(os.getpid(), signal.SIGKILL)


def _worker_point(spec: PointSpec, source: str, out: str) -> dict:
    """Pool task: run one point against the worker's trace and write its folder."""
    _kill_hook(spec)
    return execute_point(_WORKER_TRACE, spec, source, Path(out))


def death_cause(exit_codes: Iterable[int | None]) -> str:
    """How a pool's worker died, from the exit codes of its processes once the pool broke. The pool stops
    the others with SIGTERM (-15, or 143 where the CLI's SIGTERM handler turns it into an exit)."""
    stopped = (-signal.SIGTERM, 128 + signal.SIGTERM)
    codes = [c for c in exit_codes if c not in (None, 0)]
    code = next((c for c in codes if c not in stopped), codes[0] if codes else None)
    if code is None:
        return "its worker process died"
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
        oom = ", as the kernel's out-of-memory killer does" if code == -signal.SIGKILL else ""
        return f"its worker process was killed by {name}{oom}"
    return f"its worker process exited with code {code}"


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
    """A pool of worker processes on this machine, started once per sweep (and again after a worker died).

    At most `jobs` points are in flight, none queued behind them: a worker's death breaks the whole pool
    and every point in flight with it, and those points then run again one at a time (module docstring).
    """

    name = "local"

    def __init__(self, jobs: int, trace_path: Path):
        self.jobs = jobs
        self.trace_path = trace_path
        self.pool = self._new_pool()

    def _new_pool(self) -> cf.ProcessPoolExecutor:
        return cf.ProcessPoolExecutor(max_workers=self.jobs, initializer=_init_worker,
                                      initargs=(str(self.trace_path),))

    def run(self, specs: Iterable[PointSpec], source: str, out: Path
            ) -> Iterator[tuple[PointSpec, dict | PointFailed]]:
        """Run every point, yield them as they finish; cancel the rest if the caller stops early."""
        pending, alone = deque(specs), deque()  # `alone`: points in flight when a worker died
        attempts: dict[str, int] = {}
        running: dict[cf.Future, PointSpec] = {}
        try:
            while pending or alone or running:
                queue, room = (alone, 1) if alone else (pending, self.jobs)
                while queue and len(running) < room:
                    spec = queue.popleft()
                    attempts[spec.key] = attempts.get(spec.key, 0) + 1
                    running[self.pool.submit(_worker_point, spec, source, str(out))] = spec
                done, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
                if any(isinstance(f.exception(), BrokenProcessPool) for f in done):
                    done = list(running)  # the broken pool fails every point in flight
                    cf.wait(done)
                crashed = []
                for future in done:
                    spec = running.pop(future)
                    if isinstance(future.exception(), BrokenProcessPool):
                        crashed.append(spec)
                    else:
                        yield spec, future.result()
                if crashed:
                    cause = death_cause(self._restart())
                    for spec in crashed:
                        if attempts[spec.key] >= ATTEMPTS:
                            yield spec, PointFailed(f"{cause} (twice: the point was retried once)")
                        else:
                            alone.append(spec)
        finally:
            for future in running:
                future.cancel()

    def _restart(self) -> list[int | None]:
        """Replace the broken pool with a new one; the exit codes of the old one's processes."""
        processes = getattr(self.pool, "_processes", None) or {}  # private: the pool names no dead worker
        self.pool.shutdown(wait=True)  # once its processes are joined, their exit codes are known
        self.pool = self._new_pool()
        return [p.exitcode for p in processes.values()]

    def close(self) -> None:
        """Stop the workers once the points in flight finish (queued ones are cancelled)."""
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
        # Ray runs a task again when its worker process or node is lost (not when the task raises):
        # once, as the local executor does.
        self.task = ray.remote(max_retries=ATTEMPTS - 1)(_ray_point)

    def run(self, specs: Iterable[PointSpec], source: str, out: Path
            ) -> Iterator[tuple[PointSpec, dict | PointFailed]]:
        """Launch every point as a task; the driver writes each folder (workers may not share our disk)."""
        errors = self.ray.exceptions
        pending = {self.task.remote(self.trace_ref, spec, source): spec for spec in specs}
        try:
            while pending:
                ready, _ = self.ray.wait(list(pending), num_returns=1)
                spec = pending.pop(ready[0])
                try:
                    info, result = self.ray.get(ready[0])
                except errors.RayTaskError:
                    raise  # the point's own error (it raised): as in the other executors
                except errors.RayError as exc:  # its worker or node was lost, on the retry too
                    first = (str(exc).strip().splitlines() or [""])[0]
                    yield spec, PointFailed(f"its Ray worker was lost twice (the point was retried once): "
                                            f"{type(exc).__name__}: {first}")
                    continue
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
    _kill_hook(spec)
    return execute_point(trace, spec, source, None)
