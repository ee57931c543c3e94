"""Tenure pairing and the events file in a second process: the simulation's other core, without the GIL.

In a thread, pairing cost a long run ~10% of its wall time although numpy and the Parquet encoder release
the GIL: the pairer's Python between those calls waits for the GIL, which the simulation loop (pure
Python) gives up only when the interpreter forces it every 5 ms, and the loop then waited for the pairer
at the next batch (docs/simulator-performance.md, ninth sitting). `ProcessEventSink` moves the pairer and
the sink into a child process: the recorder hands it each batch of raw runs (`RawRuns`, flat
lists), the child pairs them in the same order with the same `TenurePairer`, so the
events file is byte for byte what the thread writes. The child is `python -m simulator.event_process`
on a socket (no multiprocessing start method: spawn would re-import the CLI's `__main__`, fork a process
with OpenBLAS and Arrow threads). It runs without pandas (`NoPandas`): ~45 MB less resident.

The child also writes the run folder's memory and request tables (`host`, simulator/hosted_tables.py).

Failure: an exception in the child comes back and is raised at the next batch or at `close`; a child that
died raises RuntimeError; the child exits when the parent's end of the socket closes (the parent died).
"""
from __future__ import annotations

import contextlib
import importlib.abc
import os
import pickle
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import TYPE_CHECKING

from pagelab.memory import (
    ARROW_ENV,
    LARGE_BLOCK_BYTES,
    PAIRING_BLOCK_BYTES,
    map_large_blocks,
    one_arena,
    peak_rss_mib,
    release_free_memory,
    set_mmap_threshold,
)

if TYPE_CHECKING:  # not imported here: the child sets its malloc arenas before numpy is imported
    from simulator.sinks import Batches, EventSink

# The parent's socket send buffer. With the default (~208 KB) a raw batch (~250 KB pickled) did not fit:
# the simulation blocked in `send` whenever the child was busy writing a row group, and a 1M-request run
# spent seconds there (the CLI process's most frequent frame in a 2 ms sampler). With 4 MiB the batches
# wait in the kernel (not in either process's RSS) and the child catches up: four alternating pairs of 1M
# runs, 54.8-58.7 s against 59.0-64.6 s, the same peaks (docs/simulator-performance.md, twenty-third
# sitting).
SEND_BUFFER_BYTES = 4 << 20
# Messages to the child are pickled straight into the socket, a frame (<= 64 KiB) at a time, and read
# back from it the same way: `Connection.send` pickled each raw batch whole first (180-265 KB on a 150k
# trace), the CLI process's largest transient block, met at every batch (twenty-fourth sitting).
STREAM_BUFFER_BYTES = 1 << 16
# The child returns its free heap pages every this many batches of hosted tables (pagelab/memory.py).
TRIM_BATCHES = 8


class ProcessEventSink:
    """An events sink that lives in a child process, with the tenure pairer in front of it.

    `open_sink` makes the real sink there (it must pickle: a module-level function or a
    functools.partial of one, e.g. `partial(open_event_sink, stem, "parquet")`; pandas cannot be
    imported there). The EventRecorder calls
    `process` with each raw batch instead of pairing it itself; `close` returns when the file is complete
    and sets `num_rows` and `path`.
    """

    def __init__(self, open_sink: Callable[[], EventSink], batch_rows: int = 1 << 20) -> None:
        self.open_sink = open_sink
        self.batch_rows = batch_rows
        self.num_rows = 0
        self.path: Path | None = None
        self.peak_rss_mib: float | None = None  # the child's own peak, known once it has closed
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None  # the child's replies come back framed by Connection
        self._out = None  # a buffered writer on the same socket: messages to the child, pickled into it
        self.tables: list = []  # the tables the child writes too (simulator/hosted_tables.py, `host`)

    def post(self, msg: tuple) -> None:
        """Send a message to the child (starting it first); raise what it raised so far.

        Sent at once, also while the child is still starting (~0.2 s): messages wait in the socket,
        not in this process (a backlog of raw batches kept here until the child said it was ready was
        the CLI process's highest moment, twenty-fourth sitting)."""
        if self._proc is None:
            self._start()
        if self._conn.poll():  # the child speaks unasked only to report an error
            self._receive("error")
        self._send(msg)

    def ask(self, msg: tuple, answer: str) -> tuple:
        """Send `msg` once everything before it is sent, and return the child's `answer`."""
        if self._proc is None:
            self._start()
        self._send(msg)
        return self._receive(answer)

    def _start(self) -> None:
        parent, child = socket.socketpair()
        # Room for ~16 raw batches in the kernel (Linux caps it at net.core.wmem_max; a request, not a need).
        parent.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        root = str(Path(__file__).resolve().parents[1])  # the directory holding the simulator package
        # Arrow's pool as in the CLI (pagelab/memory.py `choose_arrow_pool`), simulate() as a library too.
        env = {**ARROW_ENV, **os.environ,
               "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
        self._proc = subprocess.Popen([sys.executable, "-m", "simulator.event_process", str(child.fileno())],
                                      pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL)
        child.close()
        self._conn = Connection(parent.detach())
        self._out = open(self._conn.fileno(), "wb", buffering=STREAM_BUFFER_BYTES,  # noqa: SIM115 - _end
                         closefd=False)
        self._send(("open", self.open_sink))

    def process(self, raw, first_row: int, before: float | None, end_s: float = 0.0) -> None:
        """Send one batch to the child (what `TenurePairer.process` does, done there)."""
        self.post(("batch", raw, first_row, before, end_s))

    def sync(self) -> None:
        """Return when the child has processed every batch sent so far."""
        if self._proc is None:
            return
        self.ask(("sync",), "synced")

    def close(self) -> None:
        """Finish the file in the child and wait for it to exit (an empty table still gets its file)."""
        if self._conn is None and self._proc is not None:
            return  # closed already
        self.num_rows, path, self.peak_rss_mib = self.ask(("close",), "closed")[1:]
        self.path = Path(path) if path is not None else None
        self._end()

    def abort(self) -> None:
        """Stop the child now and drop what it had (the run failed; its folder is thrown away)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        self._end()
        for table in self.tables:
            table.discard_spools()

    def write(self, columns) -> None:
        """Not a table sink: the recorder hands raw batches to `process`."""
        raise TypeError("ProcessEventSink takes raw batches (EventRecorder.process), not tenure tables")

    def _end(self) -> None:
        if self._out is not None:
            with contextlib.suppress(OSError, ValueError):  # a child that died leaves a broken pipe
                self._out.close()
            self._out = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            self._proc.wait()

    def _send(self, msg: tuple) -> None:
        try:
            ForkingPickler(self._out, pickle.HIGHEST_PROTOCOL).dump(msg)
            self._out.flush()
        except (BrokenPipeError, ConnectionResetError):
            self._died()

    def _receive(self, expected: str) -> tuple:
        """The child's next message, which should be `expected`; an error it reports is raised here."""
        try:
            msg = self._conn.recv()
        except (EOFError, ConnectionResetError):
            self._died()
        if msg[0] == "error":
            self.abort()
            raise msg[1]
        if msg[0] != expected:
            self.abort()
            raise RuntimeError(f"events process: expected {expected!r}, got {msg[0]!r}")
        return msg

    def _died(self):
        try:
            msg = self._conn.recv() if self._conn.poll() else None  # it may have said why before it went
        except (EOFError, OSError):
            msg = None
        if msg is not None and msg[0] == "error":
            self._end()
            raise msg[1]
        code = self._proc.wait() if self._proc is not None else None
        self._end()
        raise RuntimeError(f"the events process exited early (exit code {code}): the events table is "
                           "incomplete")


def _read_spool(batches: Batches, path: str) -> None:
    """Hand `batches` a spool file's rows (simulator/hosted_tables.py) in chunks of TABLE_CHUNK_ROWS (their
    columns replace them chunk by chunk, simulator/sinks.py), and delete the file."""
    from simulator.sinks import TABLE_CHUNK_ROWS

    with open(path, "rb") as f:
        while chunk := f.read(batches.row_bytes * TABLE_CHUNK_ROWS):
            batches.add_chunk(chunk)
    os.unlink(path)


class NoPandas(importlib.abc.MetaPathFinder):
    """Refuses to import pandas. pyarrow imports it on its first `pa.array(ndarray)` if it can (to ask
    whether the array is a pandas Series), and pandas' import makes ~45 MB resident, a third of the events
    process, which never uses it; refused, pyarrow carries on without (its pandas shim takes ImportError)."""

    def find_spec(self, name, path=None, target=None):
        """ImportError for pandas and its submodules; None (ask the next finder) for the rest."""
        if name == "pandas" or name.startswith("pandas."):
            raise ImportError(f"{name}: not imported in the events process (simulator/event_process.py)")
        return None


def _reply_error(conn: Connection, exc: BaseException) -> None:
    try:
        conn.send(("error", exc))
    except (pickle.PicklingError, TypeError, AttributeError):
        conn.send(("error", RuntimeError(f"events process: {type(exc).__name__}: {exc}")))


def _serve(conn: Connection) -> None:
    """The child: open the sink, then pair and write batches until told to close (or the parent is gone)."""
    one_arena()  # before numpy starts its threads (pagelab/memory.py)
    map_large_blocks(PAIRING_BLOCK_BYTES)
    # The parent's messages, read as they were written: pickled in frames (STREAM_BUFFER_BYTES).
    with open(conn.fileno(), "rb", buffering=STREAM_BUFFER_BYTES, closefd=False) as messages:
        _pair_and_write(conn, messages)


def _pair_and_write(conn: Connection, messages) -> None:
    """The child's loop: messages from `messages` (the parent's pickles), replies to `conn`."""
    from simulator.tenures import TenurePairer  # numpy: after `one_arena` (see _serve)

    try:
        _, open_sink = pickle.load(messages)
        sink = open_sink()
        pairer = TenurePairer(sink)
        tables: dict[int, Batches] = {}  # the hosted tables' writing ends
        num_batches = 0
        pairing = True  # which mmap threshold is set
        while True:
            msg = pickle.load(messages)
            if (msg[0] == "batch") != pairing:
                # The tables' spool chunks and batch columns (100-400 KB each) as in the simulation's
                # process: mappings of their own, returned when freed, not holes among the heap's
                # pairing temporaries.
                pairing = not pairing
                set_mmap_threshold(PAIRING_BLOCK_BYTES if pairing else LARGE_BLOCK_BYTES)
            if msg[0] == "batch":
                pairer.process(*msg[1:])
            elif msg[0] == "end_batch":
                _read_spool(tables[msg[1]], msg[2])
                tables[msg[1]].end_batch()
                num_batches += 1
                if num_batches % TRIM_BATCHES == 0:
                    release_free_memory()
            elif msg[0] == "open_table":
                _, key, make, open_table = msg
                tables[key] = make(open_table())
            elif msg[0] == "close_table":
                batches = tables.pop(msg[1])
                result = batches.close()
                table = batches.sink
                path = getattr(table, "path", None)
                conn.send(("table_closed", msg[1], table.num_rows, str(path) if path else None, result))
            elif msg[0] == "sync":
                conn.send(("synced",))
            elif msg[0] == "close":
                sink.close()
                path = getattr(sink, "path", None)
                conn.send(("closed", sink.num_rows, str(path) if path is not None else None, peak_rss_mib()))
                return
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the parent is gone (or aborted): nothing to report to
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # else nobody is left to tell
            _reply_error(conn, exc)


if __name__ == "__main__":
    sys.meta_path.insert(0, NoPandas())  # before anything imports pyarrow (the class's docstring)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it closes us
    _serve(Connection(int(sys.argv[1])))


# Below this many requests a run is over before the child's start (~1 s) pays for itself: pair in a thread.
PROCESS_MIN_REQUESTS = 100_000


def open_events_sink(path_stem: str | Path, table_format: str, num_requests: int,
                     min_requests: int = PROCESS_MIN_REQUESTS) -> EventSink | ProcessEventSink:
    """The run folder's events sink (simulator.sinks.open_event_sink): in a child process for a run of at
    least `min_requests` requests, else in this one (paired in the recorder's thread)."""
    from functools import partial

    from simulator.sinks import open_event_sink

    if num_requests >= min_requests:
        return ProcessEventSink(partial(open_event_sink, Path(path_stem), table_format))
    return open_event_sink(path_stem, table_format)
