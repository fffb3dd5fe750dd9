"""Chrome-trace timeline of every tensor's phases, written by rank 0.

Open the file in ``chrome://tracing`` or https://ui.perfetto.dev. Each tensor name is shown as a
process; its rows show negotiation (with one tick per rank as it reports ready) and processing
(with the activities inside: fusion-buffer copies and the transport call).

Events reach the file within ``FLUSH_SECONDS`` (50 ms): the engine thread only appends them to a
queue; a small writer thread of the timeline drains it on a timer, so a user tailing the trace of
a job that hangs sees everything up to the hang, and the engine's hot path never writes. Every
flush appends the events and a closing ``{}]`` in one write, then steps back over it: the file
parses as a JSON array between flushes, not only at the end.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from typing import IO, Any

__all__ = ["Timeline", "FLUSH_SECONDS"]

FLUSH_SECONDS = 0.05


class Timeline:
    """Writer of one timeline file. Only the engine thread emits events; start/stop may race."""

    def __init__(self, path: str, mark_cycles: bool = False) -> None:
        self.path = path
        self.mark_cycles = mark_cycles
        self._lock = threading.Lock()
        self._pids: dict[str, int] = {}
        # deque: append (engine thread) and popleft (writer thread) are atomic, nothing is lost;
        # events are serialized by the writer, off the engine thread
        self._pending: collections.deque[dict[str, Any]] = collections.deque()
        self._start = time.monotonic()
        # unbuffered: each flush is one write() of its bytes, so a reader sees it whole or not
        # at all (short of a torn read racing that one write)
        self._file: IO[bytes] | None = open(path, "wb", buffering=0)  # noqa: SIM115
        self._file.write(b"[\n")
        self._emit({"name": "process_name", "ph": "M", "pid": 0,
                    "args": {"name": "Horovod", "start_time_since_epoch_in_micros": int(time.time() * 1e6)}})
        self._emit({"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}})
        self.flush()
        self._closing = threading.Event()
        self._writer = threading.Thread(target=self._write_loop, name="horovod-timeline",
                                        daemon=True)
        self._writer.start()

    def _write_loop(self) -> None:
        while not self._closing.wait(FLUSH_SECONDS):
            if self._pending:
                self.flush()

    def _ts(self) -> int:
        return int((time.monotonic() - self._start) * 1e6)

    def _emit(self, event: dict[str, Any]) -> None:
        self._pending.append(event)

    def _pid(self, name: str) -> int:
        pid = self._pids.get(name)
        if pid is None:
            pid = self._pids[name] = len(self._pids) + 1
            self._emit({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
            self._emit({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        return pid

    def begin(self, name: str, phase: str, args: dict[str, Any] | None = None) -> None:
        ev: dict[str, Any] = {"ph": "B", "name": phase, "ts": self._ts(), "pid": self._pid(name)}
        if args:
            ev["args"] = args
        self._emit(ev)

    def end(self, name: str, args: dict[str, Any] | None = None) -> None:
        ev: dict[str, Any] = {"ph": "E", "ts": self._ts(), "pid": self._pid(name)}
        if args:
            ev["args"] = args
        self._emit(ev)

    def tick(self, name: str, label: str) -> None:
        self._emit({"ph": "X", "name": label, "ts": self._ts(), "pid": self._pid(name), "dur": 0})

    def cycle(self) -> None:
        if self.mark_cycles:
            self._emit({"ph": "i", "name": "CYCLE_START", "ts": self._ts(), "s": "g"})

    def maybe_flush(self) -> None:
        """Kept for callers: the writer thread flushes on its own timer."""

    def flush(self) -> None:
        """Write every queued event now (also called by the writer thread every 50 ms)."""
        with self._lock:
            if self._file is None:
                return
            pending, parts = self._pending, []
            while pending:
                parts.append(json.dumps(pending.popleft(), separators=(",", ":")) + ",\n")
            # Append the events, close the array, then step back over the closing bracket so the
            # next flush continues the array: the file parses as JSON after every flush.
            data = memoryview(("".join(parts) + "{}]").encode("utf-8"))
            while data:
                data = data[self._file.write(data) or 0:]
            self._file.seek(-3, os.SEEK_CUR)

    def close(self) -> None:
        closing = getattr(self, "_closing", None)
        if closing is not None:
            closing.set()
            if self._writer is not threading.current_thread():
                self._writer.join(5)
        self.flush()
        with self._lock:
            if self._file is not None:
                self._file.write(b"{}]\n")
                self._file.close()
                self._file = None
