"""Turn raw worker output into prefixed lines: incremental UTF-8 decoding, line splitting on
``\\n``, ``\\r\\n`` and ``\\r`` (progress bars), and parsing of mpirun's per-rank tags."""

from __future__ import annotations

import codecs
import re
import time
from typing import IO

from horovod.common.protocol import ERROR_MARKER, EXIT_MARKER

__all__ = ["LineSplitter", "TagParser", "prefix_line", "write_line", "MARKER", "ERROR_MARKER"]

# The markers are spelled in horovod.common.protocol (with strip_markers, the one reader); kept here
# under their former names.
MARKER = EXIT_MARKER

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


_OMPI_TAG = re.compile(r"\[(\d+),(\d+)\]<(stdout|stderr|stddiag)>: ?")
_HYDRA_TAG = re.compile(r"^\[(\d+)\] ?")

Segment = tuple[int | None, str, str, str]


class TagParser:
    """Find the rank (and stream) of lines written by ``mpirun --tag-output`` or ``mpiexec -l``.

    Open MPI tags each chunk of a rank's output once, at its start. Text after a ``\r`` inside a
    tagged line arrives here as a separate untagged line, so it inherits the tag of the line it
    continues. Unterminated last lines of several ranks arrive glued together
    (``[1,0]<stdout>: a[1,1]<stdout>: b``), so a tag inside a line starts a new segment.
    """

    def __init__(self, style: str) -> None:
        self.style = style
        self._last: tuple[int, str] | None = None
        self._continues = False

    def parse(self, text: str, terminator: str, stream: str) -> list[Segment]:
        """Split one line into (rank or None for mpirun's own text, stream, text, terminator)."""
        segments: list[Segment] = []
        if self.style == "openmpi":
            tags = list(_OMPI_TAG.finditer(text))
            head = text[:tags[0].start()] if tags else text
            if head or not tags:
                rank, out = (self._last if self._continues and self._last else (None, stream))
                segments.append((rank, out, head, "\n" if tags else terminator))
            for i, m in enumerate(tags):
                end = tags[i + 1].start() if i + 1 < len(tags) else len(text)
                out = "stderr" if m.group(3) != "stdout" else "stdout"
                last = i + 1 == len(tags)
                segments.append((int(m.group(2)), out, text[m.end():end],
                                 terminator if last else "\n"))
        else:
            hydra = _HYDRA_TAG.match(text)
            if hydra:
                segments.append((int(hydra.group(1)), stream, text[hydra.end():], terminator))
            else:
                rank, out = (self._last if self._continues and self._last else (None, stream))
                segments.append((rank, out, text, terminator))
        rank, out, _, _ = segments[-1]
        if rank is not None:
            self._last = (rank, out)
        self._continues = terminator == "\r" and rank is not None
        return segments


def prefix_line(rank: int | None, stream: str, text: str, timestamp: bool = False) -> str:
    """``[rank]<stream>:text`` (upstream's format), optionally preceded by ``time.asctime()``."""
    prefix = time.asctime() if timestamp else ""
    if rank is None:
        return prefix + text
    return f"{prefix}[{rank}]<{stream}>:{text}"


def write_line(target: IO[str], line: str) -> None:
    """Write and flush ``line``; a stream the user closed (or a broken pipe) drops it."""
    try:
        target.write(line)
        target.flush()
    except (OSError, ValueError):
        pass
