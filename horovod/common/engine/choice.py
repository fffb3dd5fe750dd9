"""A rank's own choice between two ways of running the same batch, made by timing it. PURE.

Some choices the executor makes change nothing another rank sees: whether a call is reduced in the
tensors' memory or copied through the fusion buffer (``placement``) leaves the transport calls as
planned. Which way is faster depends on the machine's state, not on the code: on this project's
two-core VM, reducing a gradient set where it lies on 4 KiB pages took twice the time of copying
it through the huge-page buffer in one state of the machine, and copying was 2-16% slower in
another, where the same raw schedules took 3.5x longer (most likely memory bandwidth shared with
the host's other guests; see docs/performance.md, "The MPI data plane"). A ``TimedChoice``
settles it per repeated batch:

* a batch planned afresh (a list: not a memoized step) runs with the default;
* a memoized batch (a tuple, the same object every step of a cached workload) runs ``TRIES``
  times each way, alternating, then the way with the lower median time, until ``RECHECK`` runs
  later it tries both again (the machine's state changes over minutes).

Every rank runs the same batches in the same order, so the ranks try the two ways in step (a
rank's choice also changes how fast its peers read its memory). The choices never need to agree:
the transport calls are the same either way.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["TimedChoice"]


class _Trial:
    __slots__ = ("batch", "times", "chosen", "runs")

    def __init__(self, batch: Sequence[Any]) -> None:
        self.batch = batch
        self.times: dict[bool, list[float]] = {True: [], False: []}
        self.chosen: bool | None = None  # None: trying both
        self.runs = 0  # runs since the choice


class TimedChoice:
    """Pick one of two ways (True/False) per memoized batch by its measured time (see the module
    docstring)."""

    TRIES = 4
    RECHECK = 200

    def __init__(self, default: bool, trials: dict[int, Any] | None = None, size: int = 64) -> None:
        self.default = default
        # id(batch) -> its trial: a table of the engine's step memo (``memo.StepMemo.choices``),
        # emptied with it; ``size`` batches at most (emptied when full)
        self._trials: dict[int, _Trial] = {} if trials is None else trials
        self._size = size

    def pick(self, batch: Sequence[Any]) -> bool:
        """The way to run ``batch`` now."""
        if type(batch) is not tuple:
            return self.default
        trial = self._trials.get(id(batch))
        if trial is None or trial.batch is not batch:
            if len(self._trials) >= self._size:
                self._trials.clear()
            trial = self._trials[id(batch)] = _Trial(batch)
        if trial.chosen is not None:
            trial.runs += 1
            if trial.runs <= self.RECHECK:
                return trial.chosen
            trial.chosen, trial.runs = None, 0
            trial.times = {True: [], False: []}
        first, second = self.default, not self.default
        return first if len(trial.times[first]) <= len(trial.times[second]) else second

    def record(self, batch: Sequence[Any], way: bool, seconds: float) -> None:
        """``batch`` ran ``way`` in ``seconds``."""
        trial = self._trials.get(id(batch)) if type(batch) is tuple else None
        if trial is None or trial.batch is not batch or trial.chosen is not None:
            return
        trial.times[way].append(seconds)
        yes, no = trial.times[True], trial.times[False]
        if len(yes) >= self.TRIES and len(no) >= self.TRIES:
            trial.chosen = statistics.median(yes) < statistics.median(no)

    def chosen(self, batch: Sequence[Any]) -> bool | None:
        """What ``batch`` runs with now (None: still trying both, or not a remembered batch)."""
        trial = self._trials.get(id(batch))
        return trial.chosen if trial is not None and trial.batch is batch else None
