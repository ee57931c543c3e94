"""A long run's tables written by a child process: tenure pairing and encoding off the simulation's core.

The simulation loop is pure Python and holds the GIL; pairing tenures (numpy) and encoding Parquet in a
thread of the same process kept waiting for it. `ChildTables` starts `python -m simulator.output.child`
on a socket and sends it, in order: each drained batch of raw events (`tenures`, paired there with the
same `TenurePairer`, so the events file is byte for byte what pairing in this process writes), and for the
memory and request tables the name of a spool file holding each row group's packed rows (`SpoolWriter`:
the log appends its batches to the file; the child reads it back, makes the columns, writes the row group
and deletes the file). So the simulation's process holds at most one batch of each table's rows, and no
columns or encoder buffers. The child runs without pandas (`NoPandas`: ~45 MB less resident).

Failure: an exception in the child comes back and is raised at the next message or at `close`; a child that
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

from pagelab.malloc import (
    ARROW_ENV,
    LARGE_ALLOCATION_BYTES,
    PAIRING_ALLOCATION_BYTES,
    map_large_allocations,
    one_arena,
    peak_rss_mib,
    release_free_memory,
    set_mmap_threshold,
)
from pagelab.writes import drop_open_files, open_out

# Room for ~16 raw-event batches in the kernel's socket buffer (Linux caps it at net.core.wmem_max): the
# simulation does not block in `send` while the child writes a row group.
SEND_BUFFER_BYTES = 4 << 20
# Messages are pickled straight into the socket a frame at a time, and read back the same way: pickling a
# raw batch whole first was the simulation process's largest transient block.
STREAM_BUFFER_BYTES = 1 << 16
TRIM_GROUPS = 8  # the child returns its free heap pages every this many row groups of the tables


class ChildTables:
    """The child process that pairs a run's tenures and writes its tables.

    `open_events` makes the events sink there (it must pickle: a module-level function or a
    functools.partial of one). `tenures` sends it each drained batch of raw events; `table` adds a table
    fed by spool files; `close` returns when every file is complete.
    """

    def __init__(self, open_events: Callable[[], object]) -> None:
        self.open_events = open_events
        self.num_events = 0
        self.events_path: Path | None = None
        self.peak_rss_mib: float | None = None  # the child's own peak, known once it has closed
        self.spools: list[SpoolWriter] = []
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None  # the child's replies come back framed by Connection
        self._out = None  # a buffered writer on the same socket: messages to the child, pickled into it

    def post(self, msg: tuple) -> None:
        """Send a message to the child (starting it first); raise what it raised so far. Sent at once, also
        while the child is still starting: messages wait in the socket, not in this process."""
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
        parent.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        root = str(Path(__file__).resolve().parents[2])  # the directory holding the simulator package
        # Arrow's pool as in the CLI (pagelab/malloc.py `choose_arrow_pool`), simulate() as a library too.
        env = {**ARROW_ENV, **os.environ,
               "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
        self._proc = subprocess.Popen([sys.executable, "-m", "simulator.output.child", str(child.fileno())],
                                      pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL)
        child.close()
        self._conn = Connection(parent.detach())
        self._out = open(self._conn.fileno(), "wb", buffering=STREAM_BUFFER_BYTES,  # noqa: SIM115 - _end
                         closefd=False)
        self._send(("open", self.open_events))

    def tenures(self, raw, first_row: int, before: float | None, end_s: float = 0.0) -> None:
        """Pair one batch of raw events there (what `TenurePairer.process` does here)."""
        self.post(("batch", raw, first_row, before, end_s))

    def table(self, make_writer: type, open_sink: Callable[[], object], spool: Path) -> SpoolWriter:
        """A table the child writes with `make_writer(open_sink())`, fed through spool files named after
        `spool`."""
        writer = SpoolWriter(self, len(self.spools), spool)
        self.spools.append(writer)
        self.post(("open_table", writer.key, make_writer, open_sink))
        return writer

    def close(self) -> None:
        """Finish the events file in the child and wait for it to exit (an empty table still gets a file)."""
        if self._conn is None and self._proc is not None:
            return  # closed already
        self.num_events, path, self.peak_rss_mib = self.ask(("close",), "closed")[1:]
        self.events_path = Path(path) if path is not None else None
        self._end()

    def abort(self) -> None:
        """Stop the child now and drop what it had (the run failed; its folder is thrown away)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        self._end()
        for spool in self.spools:
            spool.discard()

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
            raise RuntimeError(f"table writer process: expected {expected!r}, got {msg[0]!r}")
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
        raise RuntimeError(f"the table writer process exited early (exit code {code}): the run's tables are "
                           "incomplete")


class SpoolWriter:
    """A table's writing end in this process: a row group's batches go to a spool file (`spool` with a
    row-group number and `.rows` appended), which the child writes when the row group ends."""

    def __init__(self, child: ChildTables, key: int, spool: Path) -> None:
        self.child, self.key, self.spool = child, key, Path(spool)
        self.num_rows = 0
        self.path: Path | None = None
        self._num_groups = 0
        self._file = None

    def add_batch(self, batch: bytes | bytearray) -> None:
        """Append one batch of packed rows to the row group's spool file."""
        if self._file is None:
            self._file = open_out(self._spool_path())  # unbuffered; open until end_group
        self._file.write(batch)

    def _spool_path(self) -> str:
        # A str, not a Path: pathlib interns each new part of a path, and a long run's thousands of spool
        # names would grow the interpreter's interned-string table.
        return f"{self.spool}.{self._num_groups}.rows"

    def end_group(self) -> None:
        """The child writes the row group from its spool file (and deletes the file)."""
        if self._file is None:
            return
        self._close_file()
        self.child.post(("end_group", self.key, self._spool_path()))
        self._num_groups += 1

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def close(self) -> object:
        """The child writes the last row group and closes the table; what its writer's `close` returned."""
        self.end_group()
        _, _, self.num_rows, path, result = self.child.ask(("close_table", self.key), "table_closed")
        self.path = Path(path) if path is not None else None
        return result

    def discard(self) -> None:
        """Delete the spool files the child did not get to (the run was aborted)."""
        self._close_file()
        for path in self.spool.parent.glob(f"{self.spool.name}.*.rows"):
            path.unlink(missing_ok=True)


class NoPandas(importlib.abc.MetaPathFinder):
    """Refuses to import pandas. pyarrow imports it on its first `pa.array(ndarray)` if it can (to ask
    whether the array is a pandas Series), and pandas' import makes ~45 MB resident, a third of the child,
    which never uses it; refused, pyarrow carries on without (its pandas shim takes ImportError)."""

    def find_spec(self, name, path=None, target=None):
        """ImportError for pandas and its submodules; None (ask the next finder) for the rest."""
        if name == "pandas" or name.startswith("pandas."):
            raise ImportError(f"{name}: not imported in the table writer process")
        return None


def _reply_error(conn: Connection, exc: BaseException) -> None:
    try:
        conn.send(("error", exc))
    except (pickle.PicklingError, TypeError, AttributeError):
        conn.send(("error", RuntimeError(f"table writer process: {type(exc).__name__}: {exc}")))


def _serve(conn: Connection) -> None:
    """The child: open the events sink, then pair and write until told to close (or the parent is gone)."""
    one_arena()  # before numpy starts its threads (pagelab/malloc.py)
    map_large_allocations(PAIRING_ALLOCATION_BYTES)
    with open(conn.fileno(), "rb", buffering=STREAM_BUFFER_BYTES, closefd=False) as messages:
        _pair_and_write(conn, messages)


def _pair_and_write(conn: Connection, messages) -> None:
    """The child's loop: messages from `messages` (the parent's pickles), replies to `conn`."""
    from simulator.output.tenures import TenurePairer  # numpy: after `one_arena` (see _serve)

    try:
        _, open_events = pickle.load(messages)
        sink = open_events()
        pairer = TenurePairer(sink)
        tables: dict[int, object] = {}  # the tables' writers, by key
        num_groups = 0
        pairing = True  # which mmap threshold is set
        while True:
            msg = pickle.load(messages)
            if (msg[0] == "batch") != pairing:
                # A table's packed rows and columns (100-400 KB each) as in the simulation's process:
                # mappings of their own, returned when freed, not holes among the pairing temporaries.
                pairing = not pairing
                set_mmap_threshold(PAIRING_ALLOCATION_BYTES if pairing else LARGE_ALLOCATION_BYTES)
            if msg[0] == "batch":
                pairer.process(*msg[1:])
            elif msg[0] == "end_group":
                writer = tables[msg[1]]
                with open(msg[2], "rb") as f:
                    while batch := f.read(writer.row_bytes * 4096):
                        writer.add_batch(batch)
                os.unlink(msg[2])
                writer.end_group()
                num_groups += 1
                if num_groups % TRIM_GROUPS == 0:
                    release_free_memory()
            elif msg[0] == "open_table":
                _, key, make_writer, open_sink = msg
                tables[key] = make_writer(open_sink())
            elif msg[0] == "close_table":
                writer = tables.pop(msg[1])
                result = writer.close()
                path = writer.sink.path
                conn.send(("table_closed", msg[1], writer.sink.num_rows, str(path) if path else None, result))
            elif msg[0] == "close":
                sink.close()
                conn.send(("closed", sink.num_rows, str(sink.path) if sink.path is not None else None,
                           peak_rss_mib()))
                return
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the parent is gone (or aborted): nothing to report to
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        drop_open_files()  # the tables are thrown away: their writers write nothing more at exit
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # else nobody is left to tell
            _reply_error(conn, exc)


if __name__ == "__main__":
    sys.meta_path.insert(0, NoPandas())  # before anything imports pyarrow (the class's docstring)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it closes us
    _serve(Connection(int(sys.argv[1])))
