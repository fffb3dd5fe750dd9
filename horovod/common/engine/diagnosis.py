"""What a rank says about itself when asked: where its main thread is, and its flight record.

A rank's engine thread stays alive while the main thread is stuck in user code (waiting on a
data loader, a lock, a pipe), so the thread that drives the engine's rounds can answer for the
whole process: ``sys._current_frames()`` gives the main thread's Python stack from any thread.
The answers travel through the engine's own rounds (``StallObserver.agreed``: a flag in the round's
bit vector, then one broadcast and one gather on the controller, as the straggler exchange does),
so they reach rank 0 under every transport alike. Everything here is plain data
(``horovod.common.plain``).
"""

from __future__ import annotations

import linecache
import os
import sys
import sysconfig
import threading
from types import FrameType
from typing import Any

__all__ = ["thread_stack", "main_stack", "user_frame", "format_stack", "answer", "thread_stacks"]

_HOROVOD = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
_STDLIB = tuple({os.path.realpath(p) + os.sep for p in (sysconfig.get_paths()["stdlib"],)}
                | {sysconfig.get_paths()["stdlib"] + os.sep})
STACK_LIMIT = 40


def _frames(frame: FrameType | None, limit: int) -> list[list[Any]]:
    """``[file, line, function, source line]`` per frame, outermost first (at most ``limit``,
    the innermost ones)."""
    out: list[list[Any]] = []
    while frame is not None and len(out) < limit:
        code = frame.f_code
        line = frame.f_lineno or 0
        out.append([code.co_filename, line, code.co_name,
                    linecache.getline(code.co_filename, line).strip()])
        frame = frame.f_back
    return out[::-1]


def thread_stack(ident: int | None, limit: int = STACK_LIMIT) -> list[list[Any]] | None:
    """The Python stack of thread ``ident``, outermost first; None if it has no Python frame."""
    if ident is None:
        return None
    frame = sys._current_frames().get(ident)
    return None if frame is None else _frames(frame, limit)


def main_stack(limit: int = STACK_LIMIT) -> list[list[Any]] | None:
    """The main thread's stack (whichever thread asks)."""
    return thread_stack(threading.main_thread().ident, limit)


def thread_stacks(limit: int = STACK_LIMIT) -> list[tuple[str, list[list[Any]]]]:
    """Every thread's stack, the main thread first: (thread name, stack)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    out = []
    for ident, frame in sorted(sys._current_frames().items(), key=lambda kv: kv[0] != main):
        out.append((names.get(ident, f"thread {ident:#x}"), _frames(frame, limit)))
    return out


def _library(path: str) -> bool:
    return path.startswith(_HOROVOD) or path.startswith(_STDLIB) or "site-packages" in path


def user_frame(stack: list[list[Any]] | None) -> str:
    """``load_batch (train.py:12)``: the innermost frame outside Horovod and the standard library
    (the innermost frame when every frame is)."""
    if not stack:
        return "no Python frame"
    chosen = next((f for f in reversed(stack) if not _library(str(f[0]))), stack[-1])
    return f"{chosen[2]} ({os.path.basename(str(chosen[0]))}:{chosen[1]})"


def format_stack(stack: list[list[Any]] | None, indent: str = "  ") -> list[str]:
    """A stack as traceback-style lines, most recent call last; frames inside Horovod below the
    caller's last frame are folded into one line."""
    if not stack:
        return [f"{indent}(no Python frame)"]
    frames = list(stack)
    inner = 0
    while len(frames) > 1 and str(frames[-1][0]).startswith(_HOROVOD):
        frames.pop()
        inner += 1
    lines = []
    for path, line, func, text in frames:
        lines.append(f'{indent}File "{path}", line {line}, in {func}')
        if text:
            lines.append(f"{indent}  {text}")
    if inner:
        lines.append(f"{indent}... {inner} frame(s) inside Horovod")
    return lines


def answer(rank: int, host: str, record: dict[str, Any], stack: bool) -> dict[str, Any]:
    """This rank's answer: host, pid, where its main thread is, its flight record (and its main
    thread's whole stack when ``stack``)."""
    frames = main_stack()
    return {"rank": rank, "host": host, "pid": os.getpid(), "where": user_frame(frames),
            "stack": frames if stack else None, **record}
