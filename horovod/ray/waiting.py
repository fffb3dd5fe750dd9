"""Waiting for every rank's call on a Ray job, and the error that names the ranks that failed
(shared by ``RayExecutor``'s static and elastic adapters)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from horovod.common import exceptions as errors

__all__ = ["FAILURE_GRACE_SECONDS", "failure_error", "wait_all", "ranks_by_cause"]

log = logging.getLogger("horovod.ray")

# After the first rank fails, how long the others get to finish or fail in turn (a dead peer
# makes their collectives fail within a second) before the job is declared stuck.
FAILURE_GRACE_SECONDS = 5.0


def wait_all(refs: list[Any], describe: Callable[[int], str], what: str,
             grace: float = FAILURE_GRACE_SECONDS, times: dict[int, float] | None = None,
             ) -> tuple[list[Any], dict[int, tuple[Any, ...]], list[int]]:
    """Wait for every rank's ``execute_reported`` call.

    Returns (values by rank, failures by rank as ``("error", exc, tb)`` or ``("died", exc)``,
    ranks still running ``grace`` seconds after the first failure). ``times`` (when given)
    receives when each failure was seen (seconds since the epoch).
    """
    import ray
    import ray.exceptions

    pending = {ref: rank for rank, ref in enumerate(refs)}
    values: list[Any] = [None] * len(refs)
    failures: dict[int, tuple[Any, ...]] = {}
    first_failure: float | None = None
    while pending:
        timeout = 1.0 if first_failure is None else max(0.0, first_failure + grace - time.monotonic())
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
        for ref in ready:
            rank = pending.pop(ref)
            try:
                out = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                failures[rank] = ("died", exc)
            except ray.exceptions.RayError as exc:
                failures[rank] = ("error", exc, str(exc))
            else:
                if out[0] == "ok":
                    values[rank] = out[1]
                elif out[0] == "exit":
                    failures[rank] = ("error", SystemExit(out[1]), f"SystemExit({out[1]})")
                else:
                    failures[rank] = out
            if rank in failures and times is not None:
                times[rank] = time.time()
        if failures and first_failure is None:
            first_failure = time.monotonic()
            log.debug("%s: %s failed; waiting up to %g s for the other ranks", what,
                      describe(min(failures)), grace)
        if first_failure is not None and time.monotonic() >= first_failure + grace:
            break
    return values, failures, sorted(pending.values())


def failure_error(what: str, failures: dict[int, tuple[Any, ...]], stuck: list[int],
                  describe: Callable[[int], str], tail: str = "",
                  times: dict[int, float] | None = None) -> Exception:
    """The ``WorkerFailedError`` for failed ranks: the root cause first, by the rule of every
    launcher (``horovod.runner.failures.root_cause``: a rank's own error before errors that only
    say a peer left, then the earliest, a dead actor before a rank that raised at the same
    moment), then the other ranks; each rank named with its node. ``times``: when each failure
    was seen (``wait_all``); without it they count as simultaneous."""
    ordered = ranks_by_cause(failures, times or {})
    root = ordered[0]
    f = failures[root]
    if f[0] == "died":
        first = (f"{describe(root)} died: {str(f[1]).strip().splitlines()[0]} (its actor's process "
                 "ended: killed, out of memory, or its node was lost)")
        exc: BaseException = f[1]
        tb = ""
    else:
        exc, tb = f[1], f[2]
        first = f"{describe(root)} raised {type(exc).__name__}: {exc}"
    lines = [f"{what}: {first}"]
    for rank in ordered[1:]:
        g = failures[rank]
        lines.append(f"  also {describe(rank)}: "
                     + ("died" if g[0] == "died" else f"{type(g[1]).__name__}: {g[1]}"))
    if stuck:
        lines.append(f"  {', '.join(describe(r) for r in stuck)} did not finish within "
                     f"{FAILURE_GRACE_SECONDS:g} s of the failure (waiting for the failed rank "
                     "in a collective)")
    if tail:
        lines.append(tail)
    if tb:
        lines.append(f"Traceback of rank {root}:\n{tb}")
    return errors.WorkerFailedError("\n".join(lines), rank=root, exception=exc,
                                    ranks=ordered, stuck_ranks=stuck)


def ranks_by_cause(failures: dict[int, tuple[Any, ...]], times: dict[int, float]) -> list[int]:
    """The failed ranks, the root cause first (``failures.root_cause`` over their exits: a dead
    actor as killed by SIGKILL, a raised exception with the record it makes), then by rank."""
    import signal

    from horovod.runner.failures import RankExit, exception_record, root_cause

    exits = []
    for rank, f in failures.items():
        t = times.get(rank, 0.0)
        if f[0] == "died":
            exits.append(RankExit(rank, "", None, int(signal.SIGKILL), t))
        else:
            exits.append(RankExit.with_record(exception_record(f[1], t), rank, "", 1, None, t))
    first = root_cause(exits)
    root = first.rank if first is not None and first.rank is not None else min(failures)
    return [root] + sorted(r for r in failures if r != root)
