"""The piece size follows the machine: large CPU reductions run in whichever of two piece sizes is
faster now, measured while the job trains (``HOROVOD_ADAPTIVE_PIECES``).

Why: the best piece size is a property of the machine, and on some machines of its current state.
On a 2-core AMD EPYC virtual machine, raw mpi4py reductions of ResNet-50's 97.5 MiB gradient set
flip between two states within one process, for stretches of seconds
(benchmarks/results/piece_modes.md): in one, 2 MiB pieces take 13-19 ms and 16 MiB pieces 25-34;
in the other, 2 MiB pieces take 34-72 ms and 16 MiB pieces 20-33 (one flat call: 47-67 in both).
A fixed piece size is up to 2-3x off the best schedule in one of the two states.

The policy (``PiecePolicy``, pure; rank 0's copy decides):

- a **sample** is one allreduce batch on the host transport of at least ``MIN_SAMPLE_BYTES``, its
  seconds per byte on this rank; every rank counts the same samples (the batches and their bytes
  are the agreed responses'), so every rank reaches each check point in the same round. A step's
  batches differ (a bucket of flat gradients, a fusion buffer of small tensors packed), so a
  sample is judged against the same batch at the chosen size: a memoized step's batches are the
  same objects every step;
- the chosen size runs; after ``period`` samples, or as soon as the chosen size's last ``TRIAL``
  samples are, by their median, ``DEGRADED`` times slower than the same batches were when the
  size was last decided (the machine changed), a **trial** runs the two sizes in turn until each
  has ``TRIAL`` samples of batches that ran at both (what is compared ran at the same time: the
  machine's state can change at any moment, and a reference from before it would mislead), or,
  with nothing to compare, until the other size has had ``4 * TRIAL`` and the chosen size a turn
  after it; a size's first run ever is not counted (a new lane, buffers touched first);
- a **turn** lasts until a check point at which it has run every batch the trial has seen, or a
  batch twice (a whole step), or ``4 * TRIAL`` samples or check points. A turn of one check point
  would lock onto a step's phase: with four large batches a step and a check point every two
  samples, one size would run the step's first two batches and the other its last two, every
  step, and nothing would ever run at both;
- the other size wins when the median over the trial's batches of its median time over the
  chosen size's is below ``WIN``; the period then starts again at ``FIRST_PERIOD``, else it
  doubles, up to ``MAX_PERIOD`` (on a machine that never changes, the slower size runs
  ``TRIAL`` samples in ``MAX_PERIOD``).

The follower (``PieceFollower``, an engine observer) feeds rank 0's policy and, at the end of every
round in which the samples passed a check point (every ``CHECK`` samples), broadcasts rank 0's
choice; every rank sets ``Tunables.chunk_bytes`` to it at that same round boundary (the tunables'
rule: the executor's plan must be the same on every rank).

On only where nobody else decides the piece size: the transport has no preference of its own (the
MPI plane; Gloo's pieces are its own), ``HOROVOD_CHUNK_BYTES`` is unset and ``HOROVOD_AUTOTUNE`` is
off. The sizes: ``tunables.FOLLOWED_CHUNK_BYTES``.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from horovod.common.engine.device import is_plane
from horovod.common.engine.memo import StepMemo
from horovod.common.engine.observers import Observer
from horovod.common.engine.tunables import Tunables, followed_pieces
from horovod.common.types import ReduceOp, RequestType, Response

__all__ = ["PiecePolicy", "PieceFollower", "MIN_SAMPLE_BYTES"]

MIN_SAMPLE_BYTES = 8 * 1024 * 1024  # a batch smaller than this is hardly cut either way
TRIAL = 3
FIRST_PERIOD = 8
MAX_PERIOD = 768
DEGRADED = 1.5
WIN = 0.9
CHECK = 2
HISTORY = 256  # changes kept for ``PiecePolicy.changes`` and ``PieceFollower.applied``


class PiecePolicy:
    """Which piece size runs next, from the samples seen (see the module docstring). Pure.

    ``sample`` takes one batch's time at the size running; ``choose``, at each check point, says
    which size runs until the next one. Samples are compared batch by batch (``key``: the batch's
    identity; a memoized step's batches are the same objects every step), and a trial alternates
    the two sizes, so that what is compared ran at the same time, in the same state of the
    machine."""

    def __init__(self, sizes: Sequence[int], trial: int = TRIAL, first_period: int = FIRST_PERIOD,
                 max_period: int = MAX_PERIOD, degraded: float = DEGRADED, win: float = WIN) -> None:
        if len(sizes) != 2 or sizes[0] == sizes[1]:
            raise ValueError(f"two different piece sizes to follow, got {list(sizes)}")
        self.sizes = (int(sizes[0]), int(sizes[1]))
        self.trial, self.first_period, self.max_period = trial, first_period, max_period
        self.degraded, self.win = degraded, win
        self.chosen = self.running = self.sizes[0]
        self.period = first_period
        # Outside trials, per batch: its latest times at the chosen size, and their median when
        # the size was last decided; the drift is each new time over that median.
        self._hist: dict[Any, deque[float]] = {}
        self._base: dict[Any, float] = {}
        self._drift: deque[float] = deque(maxlen=trial)
        # A running trial: size -> batch -> its times during the trial (None: no trial); the
        # running turn's batches, and whether one came twice.
        self._trial: dict[int, dict[Any, list[float]]] | None = None
        self._turn: list[Any] = []
        self._turn_repeats = False
        self._turn_checks = 0  # check points in the running turn
        self._since = 0  # samples of the chosen size since the last decision
        self._fresh = set(self.sizes)  # sizes not run yet: their first sample is not counted
        self.trials = 0
        # (samples seen, the size chosen): the latest changes
        self.changes: deque[tuple[int, int]] = deque(maxlen=HISTORY)

    @property
    def other(self) -> int:
        return self.sizes[1] if self.chosen == self.sizes[0] else self.sizes[0]

    def sample(self, size: int, key: Any, seconds_per_byte: float) -> None:
        """One sample of batch ``key`` run at ``size``."""
        if size != self.running:
            return  # (run before the size changed at this round's end: not this size's)
        if size in self._fresh:  # a size's first run: a new lane, buffers touched first
            self._fresh.discard(size)
            return
        if self._trial is not None:
            self._trial[size].setdefault(key, []).append(seconds_per_byte)
            self._turn_repeats = self._turn_repeats or key in self._turn
            self._turn.append(key)
            return
        self._since += 1
        hist = self._hist.get(key)
        if hist is None:
            if len(self._hist) >= 256:
                self._hist.clear()
                self._base.clear()
            hist = self._hist[key] = deque(maxlen=self.trial)
        hist.append(seconds_per_byte)
        if len(hist) == self.trial:
            base = self._base.setdefault(key, statistics.median(hist))
            self._drift.append(seconds_per_byte / base)

    def _counts(self, common: bool) -> tuple[int, int]:
        """The trial's samples of the other size and of the chosen one; ``common``: only those of
        batches that ran at both (a step of many large batches runs each at one size per turn)."""
        assert self._trial is not None
        other, chosen = self._trial[self.other], self._trial[self.chosen]
        keys = other.keys() & chosen.keys() if common else None
        return (sum(len(t) for k, t in other.items() if keys is None or k in keys),
                sum(len(t) for k, t in chosen.items() if keys is None or k in keys))

    def verdict(self) -> float | None:
        """A running trial's result: the median over batches of the other size's median time over
        the chosen size's (in the trial); None while either size has fewer than ``trial`` samples
        of batches that ran at both."""
        if self._trial is None or min(self._counts(common=True)) < self.trial:
            return None
        other, chosen = self._trial[self.other], self._trial[self.chosen]
        ratios = [statistics.median(t) / statistics.median(chosen[k]) for k, t in other.items() if k in chosen]
        return statistics.median(ratios)

    def _turn_done(self) -> bool:
        """Whether the running turn has run a whole step: every batch the trial has seen, or one
        batch twice, or ``4 * trial`` samples; or ``4 * trial`` check points passed (samples
        counted but not timed: the turn must not hold the size for ever) (see the module
        docstring)."""
        assert self._trial is not None
        self._turn_checks += 1
        if self._turn_checks >= 4 * self.trial:
            return True
        if not self._turn:
            return False
        seen = self._trial[self.sizes[0]].keys() | self._trial[self.sizes[1]].keys()
        return self._turn_repeats or len(self._turn) >= 4 * self.trial or seen <= set(self._turn)

    def choose(self, seen: int = 0) -> int:
        """The size to run from now on (``seen``: samples so far, for ``changes``)."""
        if self._trial is not None:
            result = self.verdict()
            if result is None:
                if not self._turn_done():
                    return self.running
                if self.running == self.other or self._counts(common=False)[0] < 4 * self.trial:
                    # the trial goes on, the two sizes in turn
                    self.running = self.chosen if self.running == self.other else self.other
                    self._turn, self._turn_repeats, self._turn_checks = [], False, 0
                    return self.running
            if result is not None and result < self.win:
                self.chosen = self.other
                self.period = self.first_period
                self.changes.append((seen, self.chosen))
            else:
                self.period = min(2 * self.period, self.max_period)
            self._trial = None
            self._hist.clear()  # learned again at the size chosen, from now on
            self._base.clear()
            self._drift.clear()
            self._since = 0
            self.running = self.chosen
            return self.running
        worse = len(self._drift) == self.trial and statistics.median(self._drift) > self.degraded
        if self._since >= self.period or worse:
            self.trials += 1
            self._trial = {size: {} for size in self.sizes}
            self._turn, self._turn_repeats, self._turn_checks = [], False, 0
            self.running = self.other
        return self.running


class PieceFollower(Observer):
    """Feeds this rank's samples to the policy and applies rank 0's choice on every rank."""

    def __init__(self, policy: PiecePolicy, tunables: Tunables, rank: int,
                 bcast_from_root: Callable[[Any], Any], memo: StepMemo | None = None,
                 min_bytes: int = MIN_SAMPLE_BYTES, check: int = CHECK) -> None:
        self.policy = policy
        self.tunables = tunables
        self.rank = rank
        self._bcast = bcast_from_root
        self.min_bytes = min_bytes
        self._check = check
        self.samples = 0
        self._checked = 0
        self._bytes = (memo if memo is not None else StepMemo()).agreed_bytes  # the step memo's table
        self._timed: tuple[Sequence[Response], int] | None = None  # the running batch, a sample
        # (samples, size): the latest changes (a long job's trials would grow a list for ever)
        self.applied: deque[tuple[int, int]] = deque([(0, policy.running)], maxlen=HISTORY)
        tunables.chunk_bytes = policy.running

    @classmethod
    def from_config(cls, config: Any, tunables: Tunables, backend: Any,
                    memo: StepMemo | None = None) -> PieceFollower | None:
        """The follower of this engine, or None where the piece size is decided otherwise."""
        if not getattr(config, "adaptive_pieces", False) or getattr(config, "autotune", False) or backend.size < 2:
            return None
        sizes = followed_pieces(int(getattr(config, "chunk_bytes", -1)), backend)
        if not sizes:
            return None
        return cls(PiecePolicy(sizes), tunables, backend.rank, backend.bcast_from_root, memo)

    def _batch_bytes(self, batch: Sequence[Response]) -> int:
        known = self._bytes.get(id(batch))
        if known is not None and known[0] is batch:
            return known[1]
        n = sum(r.request.nbytes for r in batch)
        if type(batch) is tuple:  # a memoized plan's: the same object next step
            StepMemo.full(self._bytes, StepMemo.AGREED_BYTES)
            self._bytes[id(batch)] = (batch, n)
        return n

    def batch_started(self, kind: RequestType, batch: Sequence[Response]) -> None:
        # Counted here, where every rank of the world sees every batch of the global set (a
        # batch's own completion may be this rank's alone: ``batch_run`` times it).
        self._timed = None
        if kind != RequestType.ALLREDUCE:
            return
        req = batch[0].request
        if req.process_set_id != 0 or req.reduce_op == ReduceOp.ADASUM or is_plane(req.device):
            return
        n = self._batch_bytes(batch)
        if n >= self.min_bytes:
            self.samples += 1
            # timed when it is a memoized step's (the same object every step: ``PiecePolicy``
            # compares a batch with itself); counted either way (every rank alike)
            self._timed = (batch, n) if type(batch) is tuple else None

    def batch_run(self, kind: RequestType, batch: Sequence[Response], entries: Sequence[Any],
                  t0: float, t1: float) -> None:
        timed = self._timed
        if timed is not None and timed[0] is batch and self.rank == 0:
            self.policy.sample(self.tunables.chunk_bytes, id(batch), (t1 - t0) / timed[1])
        self._timed = None

    def batches_done(self, responses: Sequence[Response], completed: bool, rounds: Any) -> None:
        if self.samples - self._checked < self._check:
            return
        self._checked = self.samples
        size = int(self._bcast(self.policy.choose(self.samples) if self.rank == 0 else None))
        if size != self.tunables.chunk_bytes:
            self.tunables.chunk_bytes = size
            self.applied.append((self.samples, size))
