"""Rank output from Spark executors to the driver, through the job's rendezvous service.

A rank runs inside a Spark task on some executor; its stdout and stderr would end in that
executor's log. The task forwards them instead: ``RemoteOutput`` collects the already prefixed
lines (``[rank]<stdout>:...``) and ships them in small batches (``protocol.SparkOutputBatch``)
with a signed ``PUT`` under ``spark_output/<rank>.<n>``; on the driver, ``OutputPump`` reads the
batches in order straight from the service's store (no network hop) and writes them to the
``stdout``/``stderr`` streams the caller gave ``horovod.spark.run`` (default: the driver's own).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from horovod.common.exceptions import HorovodInternalError
from horovod.common.protocol import SPARK_OUTPUT_SCOPE, SparkOutputBatch, spark_output_key

__all__ = ["RemoteOutput", "OutputPump"]

_BATCH_SECONDS = 0.1
_BATCH_BYTES = 256 * 1024


class _Stream:
    """A text stream (``write``/``flush``) whose lines go to ``RemoteOutput`` as one stream."""

    def __init__(self, owner: RemoteOutput, name: str) -> None:
        self.owner, self.name = owner, name

    def write(self, text: str) -> int:
        self.owner.add(self.name, text)
        return len(text)

    def flush(self) -> None:
        pass


class RemoteOutput:
    """Task side: batch the lines of one ``source`` (a rank, or an elastic agent) and send them
    with ``put(scope, key, bytes)`` to the driver.

    A background thread sends whatever has collected every 0.1 s (sooner past 256 KiB); ``close()``
    sends the rest. A failed send is dropped after one retry: output must never fail a rank.
    """

    def __init__(self, put: Callable[[str, str, bytes], None], source: int | str) -> None:
        self.put, self.source = put, source
        self.stdout, self.stderr = _Stream(self, "stdout"), _Stream(self, "stderr")
        self._items: list[tuple[str, str]] = []
        self._size = 0
        self._seq = 0
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="hvd-spark-output")
        self._thread.start()

    def add(self, stream: str, text: str) -> None:
        with self._lock:
            self._items.append((stream, text))
            self._size += len(text)
            big = self._size >= _BATCH_BYTES
        if big:
            self._wake.set()

    def _send(self) -> None:
        with self._send_lock:
            with self._lock:
                items, self._items, self._size = self._items, [], 0
            if not items:
                return
            key = spark_output_key(self.source, self._seq)
            self._seq += 1
            body = SparkOutputBatch(tuple(items)).encode()
            for _ in range(2):
                try:
                    self.put(SPARK_OUTPUT_SCOPE, key, body)
                    return
                except Exception:  # noqa: BLE001 - the driver may be gone; output is best effort
                    time.sleep(0.2)

    def _loop(self) -> None:
        while not self._closed:
            self._wake.wait(_BATCH_SECONDS)
            self._wake.clear()
            self._send()

    def close_batch(self) -> None:
        """Send what has collected now (a worker ended: its last lines go before its exit)."""
        self._send()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=5)
        self._send()


class OutputPump:
    """Driver side: write every rank's batches, in order, to ``stdout``/``stderr``.

    ``get(scope, key)`` and ``pop(scope, key)`` read the rendezvous store in process. Call
    ``pump()`` periodically (it returns at once when nothing is new) and once more at the end.
    ``fmt(source, stream, text)``, when given, formats each line on the driver (elastic workers
    change rank between rounds, so only the driver knows the prefix); by default the lines come
    prefixed already. A malformed batch raises ``HorovodInternalError`` naming its key.
    """

    def __init__(self, get: Callable[[str, str], bytes | None],
                 pop: Callable[[str, str], Any], stdout: IO[str] | None = None,
                 stderr: IO[str] | None = None,
                 fmt: Callable[[str, str, str], str] | None = None) -> None:
        self.get, self.pop, self.fmt = get, pop, fmt
        self.out, self.err = stdout, stderr
        self._next: dict[str, int] = {}
        self._lock = threading.Lock()

    def pump(self, sources: list[int] | list[str]) -> None:
        with self._lock:
            for source in map(str, sources):
                seq = self._next.get(source, 0)
                while True:
                    key = spark_output_key(source, seq)
                    raw = self.get(SPARK_OUTPUT_SCOPE, key)
                    if raw is None:
                        break
                    self.pop(SPARK_OUTPUT_SCOPE, key)
                    seq += 1
                    try:
                        batch = SparkOutputBatch.decode(raw)
                    except HorovodInternalError as exc:
                        raise HorovodInternalError(f"{SPARK_OUTPUT_SCOPE}/{key} (from rank or agent {source}): "
                                                   f"{exc}") from exc
                    for stream, text in batch.lines:
                        if self.fmt is not None:
                            text = self.fmt(source, stream, text)
                        target = (self.err or sys.stderr) if stream == "stderr" else (self.out or sys.stdout)
                        try:
                            target.write(text)
                            target.flush()
                        except (OSError, ValueError):
                            pass
                self._next[source] = seq
