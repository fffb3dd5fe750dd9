"""Turn raw worker output into prefixed lines: incremental UTF-8 decoding, line splitting on
``\\n``, ``\\r\\n`` and ``\\r`` (progress bars), and parsing of mpirun's per-rank tags."""

from __future__ import annotations

import codecs
import re
import time

__all__ = ["LineSplitter", "TagParser", "prefix_line", "MARKER"]

# Written by the worker shim as the last stderr line of a rank; see _shim.py.
MARKER = "__HOROVOD_RUNNER_EXIT__ "

_SPLIT = re.compile(r"(\r\n|\n|\r)")


class LineSplitter:
    """Split a byte stream into ``(text, terminator)`` lines as bytes arrive.

    Bytes are decoded as UTF-8 incrementally (a character split across reads is kept whole;
    invalid bytes become U+FFFD). ``\\r\\n`` counts as one ``\\n``. A line without a terminator is
    held until its end arrives or ``flush()`` is called.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""

    def feed(self, data: bytes) -> list[tuple[str, str]]:
        text = self._pending + self._decoder.decode(data)
        # A trailing \r may be the first half of \r\n: wait for the next byte to decide.
        hold = ""
        if text.endswith("\r"):
            text, hold = text[:-1], "\r"
        parts = _SPLIT.split(text)
        lines = []
        for i in range(0, len(parts) - 1, 2):
            term = parts[i + 1]
            lines.append((parts[i], "\n" if term == "\r\n" else term))
        self._pending = parts[-1] + hold
        return lines

    def flush(self) -> list[tuple[str, str]]:
        text = self._pending + self._decoder.decode(b"", final=True)
        self._pending = ""
        if not text:
            return []
        if text.endswith("\r"):
            return [(text[:-1], "\r")]
        return [(text, "")]


_OMPI_TAG = re.compile(r"^\[(\d+),(\d+)\]<(stdout|stderr|stddiag)>: ?")
_HYDRA_TAG = re.compile(r"^\[(\d+)\] ?")


class TagParser:
    """Find the rank (and stream) of lines written by ``mpirun --tag-output`` or ``mpiexec -l``.

    Open MPI tags a line once, at its start; text after a ``\\r`` inside that line arrives as a
    separate untagged line here, so it inherits the tag of the line it continues.
    """

    def __init__(self, style: str) -> None:
        self.style = style
        self._last: tuple[int, str | None] | None = None
        self._continues = False

    def parse(self, text: str, terminator: str, stream: str) -> tuple[int | None, str, str]:
        """Return (rank or None for mpirun's own lines, stream, text without the tag)."""
        rank: int | None = None
        out_stream = stream
        if self.style == "openmpi":
            m = _OMPI_TAG.match(text)
            if m:
                rank = int(m.group(2))
                out_stream = "stderr" if m.group(3) != "stdout" else "stdout"
                text = text[m.end():]
        else:
            m = _HYDRA_TAG.match(text)
            if m:
                rank = int(m.group(1))
                text = text[m.end():]
        if rank is None and self._continues and self._last is not None:
            rank, out_stream = self._last[0], self._last[1] or stream
        if rank is not None:
            self._last = (rank, out_stream)
        self._continues = terminator == "\r" and rank is not None
        return rank, out_stream, text


def prefix_line(rank: int | None, stream: str, text: str, timestamp: bool = False) -> str:
    """``[rank]<stream>:text`` (upstream's format), optionally preceded by ``time.asctime()``."""
    prefix = time.asctime() if timestamp else ""
    if rank is None:
        return prefix + text
    return f"{prefix}[{rank}]<{stream}>:{text}"
