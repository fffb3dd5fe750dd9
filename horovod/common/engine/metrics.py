"""Per-rank counters of the engine and the straggler rule. PURE (no I/O, no threads).

``Counters`` is written by whichever thread drives the engine's rounds and read as a snapshot
(``hvd.metrics()``, the monitor reporter). What it records per rank:

* per operation kind: collectives (tensors), bytes this rank submitted, seconds in the transport;
* wait seconds: wall time during which this rank had submitted tensors that could not run yet
  because some other rank had not submitted them (measured from each round that completes work);
* steps: a step ends whenever this rank's last in-flight operation completes (the training
  thread then goes on to compute the next one); the last step times are kept;
* per completing round: how long ago this rank submitted its latest tensor of that round
  (``late``: small for the rank the others waited for) and the time since its previous completing
  round. Rounds are collective, so round numbers agree on every rank; the window of these
  records goes to the coordinator about once a second (``MetricsObserver.exchange``, observers.py), where
  ``StragglerDetector`` compares ranks round by round. Only durations measured on one host are
  compared, so clocks need not agree across hosts.

The straggler rule (``StragglerDetector``): in a round, the rank whose latest submission was the
most recent is the one the others waited for; its lateness is the median of the other ranks'
``late`` minus its own. The round counts as a *hit* for that rank when the lateness is at least
``min_relative`` (0.25) of the round's period (the median time between completing rounds: a
relative measure, so steps of any length are judged alike), at least ``min_seconds``, and the
next-latest rank was ahead of it by at least ``min_gap`` (half) of that lateness (a round in which
two ranks came late together, a descheduled core shared by both, is nobody's hit). The period
includes the collective's own time, which the transport sets: a Gloo round over TCP takes
10-20 ms where MPI's takes 2-4 ms on a loaded 2-core machine, so a rank 50 ms late in a ~60 ms
MPI step (relative 0.9) is only 0.45 of a ~90 ms Gloo step; the former threshold of 0.6 flagged
it under MPI and missed it under Gloo (issue 45). The separation test, not a high threshold, is
what keeps a job without a straggler unflagged. A rank is flagged
when it has ``flag_hits`` hits among the last ``flag_window`` completing rounds, and unflagged when
it has at most ``release_hits`` hits among the last ``release_window``: consistent lateness flags
within a few steps; a rank that is late once (descheduled, a page fault) is not flagged, and a
flagged rank does not flap.
"""

from __future__ import annotations

import collections
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["Counters", "StragglerDetector", "MAX_WINDOW_ROUNDS"]

# Rounds kept between two exchanges (older ones are dropped: the rule only needs recent rounds).
MAX_WINDOW_ROUNDS = 256
_RECORD = np.dtype([("round", "<i8"), ("late", "<f4"), ("interval", "<f4")])
STEP_TIMES_KEPT = 64


class Counters:
    """This rank's counters (see the module docstring)."""

    def __init__(self, rank: int, size: int, start: float = 0.0) -> None:
        self.rank = rank
        self.size = size
        self.ops: dict[str, list[float]] = {}  # op -> [collectives, bytes, seconds]
        self.wait_seconds = 0.0
        self.steps = 0
        self.step_times: collections.deque[float] = collections.deque(maxlen=STEP_TIMES_KEPT)
        self._last_step_end = start
        self._last_round_t = start  # when the previous completing round learned it could run
        self._window: collections.deque[tuple[int, float, float]] = collections.deque(
            maxlen=MAX_WINDOW_ROUNDS)
        # The coordinator's verdict, as of the last exchange (the same on every rank).
        self.exchanges = 0
        self.stragglers: list[int] = []
        self.scores: list[float] = [0.0] * size
        self.flag_events = 0

    def record_batch(self, op: str, tensors: int, nbytes: int, seconds: float) -> None:
        row = self.ops.get(op)
        if row is None:
            row = self.ops[op] = [0, 0, 0.0]
        row[0] += tensors
        row[1] += nbytes
        row[2] += seconds

    def record_round(self, round_no: int, t_ready: float, first_submit: float,
                     last_submit: float) -> None:
        """A round at ``t_ready`` completed this rank's operations submitted in
        [``first_submit``, ``last_submit``]."""
        prev = self._last_round_t
        start = first_submit if first_submit > prev else prev
        if t_ready > start:
            self.wait_seconds += t_ready - start
        interval = t_ready - prev
        self._last_round_t = t_ready
        self._window.append((round_no, max(t_ready - last_submit, 0.0), interval))

    def step_done(self, t: float) -> None:
        self.step_times.append(t - self._last_step_end)
        self._last_step_end = t
        self.steps += 1

    def take_window(self) -> bytes:
        """The per-round records since the last call, packed (and forgotten here)."""
        recs = np.array(list(self._window), _RECORD)
        self._window.clear()
        return recs.tobytes()

    def apply_verdict(self, data: bytes) -> None:
        stragglers, scores, events = decode_verdict(data, self.size)
        self.stragglers, self.scores, self.flag_events = stragglers, scores, events
        self.exchanges += 1

    def snapshot(self) -> dict[str, Any]:
        ops = {op: list(v) for op, v in list(self.ops.items())}
        return {
            "rank": self.rank,
            "size": self.size,
            "collectives": {op: int(v[0]) for op, v in ops.items()},
            "collective_bytes": {op: int(v[1]) for op, v in ops.items()},
            "collective_seconds": {op: float(v[2]) for op, v in ops.items()},
            "wait_seconds": self.wait_seconds,
            "steps": self.steps,
            "step_times": list(self.step_times),
            "straggler": self.rank in self.stragglers,
            "straggler_score": self.scores[self.rank] if self.rank < len(self.scores) else 0.0,
            "stragglers": list(self.stragglers),
            "straggler_scores": list(self.scores),
            "straggler_flag_events": self.flag_events,
            "exchanges": self.exchanges,
        }


def encode_verdict(stragglers: Sequence[int], scores: np.ndarray, events: int) -> bytes:
    return (struct.pack("<ii", len(stragglers), events) + np.asarray(stragglers, "<i4").tobytes()
            + np.asarray(scores, "<f4").tobytes())


def decode_verdict(data: bytes, size: int) -> tuple[list[int], list[float], int]:
    n, events = struct.unpack_from("<ii", data)
    stragglers = np.frombuffer(data, "<i4", n, 8).tolist()
    scores = np.frombuffer(data, "<f4", size, 8 + 4 * n).astype(float).tolist()
    return stragglers, scores, events


class StragglerDetector:
    """The coordinator's straggler rule over every rank's round records (module docstring)."""

    def __init__(self, size: int, *, flag_window: int = 5, flag_hits: int = 4,
                 release_window: int = 10, release_hits: int = 2, min_relative: float = 0.25,
                 min_seconds: float = 0.01, min_gap: float = 0.5, score_alpha: float = 0.2) -> None:
        if not 0 < flag_hits <= flag_window <= release_window or release_hits >= flag_hits:
            raise ValueError("straggler rule: need 0 < flag_hits <= flag_window <= release_window "
                             "and release_hits < flag_hits")
        self.size = size
        self.flag_window, self.flag_hits = flag_window, flag_hits
        self.release_window, self.release_hits = release_window, release_hits
        self.min_relative, self.min_seconds, self.alpha = min_relative, min_seconds, score_alpha
        self.min_gap = min_gap
        self._hits: collections.deque[int] = collections.deque(maxlen=release_window)  # hit rank or -1
        self._flagged: set[int] = set()
        self.scores = np.zeros(size)
        self.flag_events = 0  # times any rank went from unflagged to flagged
        self.rounds = 0

    def feed(self, windows: Sequence[bytes | None]) -> None:
        """Take one exchange's records (``windows[rank]``, ``Counters.take_window``)."""
        parts = [np.frombuffer(w, _RECORD) for w in windows if w]
        if not parts:
            return
        ranks = np.concatenate([np.full(len(np.frombuffer(w, _RECORD)), r)
                                for r, w in enumerate(windows) if w])
        recs = np.concatenate(parts)
        ids, row = np.unique(recs["round"], return_inverse=True)
        late = np.full((len(ids), self.size), np.nan)
        interval = np.full((len(ids), self.size), np.nan)
        late[row, ranks] = recs["late"]
        interval[row, ranks] = recs["interval"]
        self.judge(late, interval)

    def judge(self, late: np.ndarray, interval: np.ndarray) -> None:
        """Apply the rule to rounds in order: ``late[i, r]`` / ``interval[i, r]`` (NaN: rank ``r``
        completed nothing in round ``i``)."""
        n = np.sum(~np.isnan(late), axis=1)
        keep = n >= 2
        late, interval, n = late[keep], interval[keep], n[keep]
        if not len(late):
            return
        order = np.sort(late, axis=1)  # NaN last
        last = np.nanargmin(late, axis=1)
        idx = np.arange(len(late))
        k = n - 1  # the other reporters, at order[:, 1:n]
        others = (order[idx, 1 + (k - 1) // 2] + order[idx, 1 + k // 2]) / 2
        lateness = others - order[:, 0]
        ivs = np.sort(np.where(np.isnan(late), np.nan, interval), axis=1)
        period = (ivs[idx, (n - 1) // 2] + ivs[idx, n // 2]) / 2
        relative = lateness / np.maximum(period, 1e-9)
        # separated: the next-latest rank was not nearly as late (a round in which two ranks were
        # both late, by a shared cause such as a descheduled core, says nothing about either)
        gap = order[idx, 1] - order[:, 0]
        hit = ((relative >= self.min_relative) & (lateness >= self.min_seconds) & (period > 0)
               & (gap >= self.min_gap * lateness))
        rounds = len(late)
        # Scores: every round decays them by (1 - alpha) and adds alpha * relative lateness to its
        # last rank; summed in one pass with each round's weight (1 - alpha) ** (rounds after it).
        weights = self.alpha * np.minimum(relative, 1.0) * (1 - self.alpha) ** np.arange(rounds - 1, -1, -1)
        self.scores *= (1 - self.alpha) ** rounds
        np.add.at(self.scores, last, np.nan_to_num(weights))
        for r, h in zip(last.tolist(), hit.tolist()):
            self._round(r if h else -1)

    def _round(self, hit_rank: int) -> None:
        self.rounds += 1
        hits = self._hits
        hits.append(hit_rank)
        if hit_rank >= 0 and hit_rank not in self._flagged:
            recent = list(hits)[-self.flag_window:]
            if recent.count(hit_rank) >= self.flag_hits:
                self._flagged.add(hit_rank)
                self.flag_events += 1
        if self._flagged and len(hits) >= self.release_window:
            for r in [r for r in self._flagged if hits.count(r) <= self.release_hits]:
                self._flagged.discard(r)

    @property
    def stragglers(self) -> list[int]:
        return sorted(self._flagged)

    def verdict(self) -> bytes:
        return encode_verdict(self.stragglers, self.scores, self.flag_events)
