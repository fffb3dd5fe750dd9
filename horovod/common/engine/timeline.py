"""Chrome-trace timeline of every tensor's phases, written by rank 0.

Open the file in ``chrome://tracing`` or https://ui.perfetto.dev. Each tensor name is shown as a
process; its rows show negotiation (with one tick per rank as it reports ready) and processing
(with the activities inside: fusion-buffer copies and the transport call). The file is a valid
JSON array after every flush, not only at the end.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import IO, Any

__all__ = ["Timeline"]

_FLUSH_SECONDS = 0.2


class Timeline:
    """Writer of one timeline file. Only the engine thread writes events; start/stop may race."""

    def __init__(self, path: str, mark_cycles: bool = False) -> None:
        self.path = path
        self.mark_cycles = mark_cycles
        self._lock = threading.Lock()
        self._pids: dict[str, int] = {}
        self._pending: list[str] = []
        self._start = time.monotonic()
        self._last_flush = 0.0
        self._file: IO[bytes] | None = open(path, "wb")  # noqa: SIM115
        self._file.write(b"[\n")
        self._emit({"name": "process_name", "ph": "M", "pid": 0,
                    "args": {"name": "Horovod", "start_time_since_epoch_in_micros": int(time.time() * 1e6)}})
        self._emit({"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}})
        self.flush()

    def _ts(self) -> int:
        return int((time.monotonic() - self._start) * 1e6)

    def _emit(self, event: dict[str, Any]) -> None:
        self._pending.append(json.dumps(event, separators=(",", ":")))

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
        if self._pending and time.monotonic() - self._last_flush > _FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            if self._file is None:
                return
            body = "".join(e + ",\n" for e in self._pending)
            self._pending.clear()
            # Append the events, close the array, then step back over the closing bracket so the
            # next flush continues the array: the file parses as JSON after every flush.
            self._file.write((body + "{}]").encode("utf-8"))
            self._file.flush()
            self._file.seek(-3, os.SEEK_CUR)
            self._last_flush = time.monotonic()

    def close(self) -> None:
        self.flush()
        with self._lock:
            if self._file is not None:
                self._file.write(b"{}]\n")
                self._file.close()
                self._file = None
