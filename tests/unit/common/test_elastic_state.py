"""The framework-neutral elastic worker side: State/ObjectState and the run loop (one process,
injected broadcast and reset)."""

from __future__ import annotations

from typing import Any

import pytest

from horovod.common.elastic import ObjectState, run_fn
from horovod.common.elastic import worker as elastic_worker
from horovod.common.elastic.worker import HostUpdateResult, RoundInfo
from horovod.common.exceptions import (
    CollectiveMismatchError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
)
from horovod.common.protocol import RankIdentity


def make_state(**kw: Any) -> ObjectState:
    return ObjectState(bcast_object=lambda obj, *a, **k: obj, get_rank=lambda: 0, **kw)


def test_commit_restore_and_in_place_changes() -> None:
    s = make_state(epoch=0, history=[])
    s.epoch = 3
    s.history.append("a")
    s.restore()
    assert s.epoch == 0 and s.history == []
    s.epoch, s.history = 4, ["b"]
    s.commit()
    s.history.append("c")  # an in-place change after the commit is undone too
    s.restore()
    assert s.epoch == 4 and s.history == ["b"]
    s.history.append("d")
    s.restore()
    assert s.history == ["b"]


def test_check_host_updates_raises_once_per_new_notice() -> None:
    s = make_state(x=1)
    s.check_host_updates()
    s.on_hosts_updated(1, HostUpdateResult.removed)
    with pytest.raises(HostsUpdatedInterrupt) as info:
        s.commit()
    assert info.value.skip_sync is True
    s.check_host_updates()  # already seen
    s.on_hosts_updated(2, HostUpdateResult.removed)
    s.on_hosts_updated(3, HostUpdateResult.added)
    with pytest.raises(HostsUpdatedInterrupt) as info:
        s.check_host_updates()
    assert info.value.skip_sync is False


def test_rank0_decides_for_everyone() -> None:
    # A rank that saw no notice still raises when rank 0's broadcast says hosts changed.
    s = ObjectState(bcast_object=lambda obj, *a, **k: (0, 7, int(HostUpdateResult.added)),
                    get_rank=lambda: 1, x=1)
    with pytest.raises(HostsUpdatedInterrupt):
        s.check_host_updates()
    assert s._last_updated_timestamp == 7


class Recorder:
    def __init__(self, failures: list[BaseException], skip: bool = False) -> None:
        self.failures = failures
        self.calls: list[str] = []
        self.skip = skip

    def reset(self) -> None:
        self.calls.append("reset")
        elastic_worker._current = RoundInfo(len(self.calls), RankIdentity("h", 0, 0, 0, 1, 1, 1), self.skip, 0)


def test_run_loop_restores_on_error_and_keeps_state_on_host_change() -> None:
    s = make_state(step=0)
    calls: list[str] = []
    s.sync = lambda: calls.append("sync")  # type: ignore[method-assign]
    failures: list[BaseException] = [HorovodInternalError("peer died"),
                                      HostsUpdatedInterrupt(skip_sync=False)]
    rec = Recorder(failures)
    seen: list[int] = []

    def train(state: ObjectState) -> str:
        seen.append(state.step)
        state.step += 1
        if rec.failures:
            raise rec.failures.pop(0)
        return "done"

    assert run_fn(train, rec.reset)(s) == "done"
    # First attempt from 0, error -> restored to 0; second from 0, interrupt keeps step=1.
    assert seen == [0, 0, 1]
    assert rec.calls == ["reset", "reset"] and calls == ["sync", "sync", "sync"]


def test_run_loop_skips_sync_only_when_the_driver_says_so() -> None:
    # Upstream #3494: a removal-only interrupt skips the sync only if the round formed has no
    # newcomer (the driver's skip_sync); otherwise the survivors would skip a sync the new
    # workers wait in.
    for driver_says, want_syncs in ((True, 1), (False, 2)):
        s = make_state(step=0)
        syncs: list[str] = []
        s.sync = lambda syncs=syncs: syncs.append("sync")  # type: ignore[method-assign]
        rec = Recorder([HostsUpdatedInterrupt(skip_sync=True)], skip=driver_says)

        def train(state: ObjectState, rec: Recorder = rec) -> None:
            if rec.failures:
                raise rec.failures.pop(0)

        run_fn(train, rec.reset)(s)
        assert len(syncs) == want_syncs, (driver_says, syncs)
    elastic_worker._current = None


def test_mismatch_is_not_retried() -> None:
    s = make_state(step=0)
    rec = Recorder([])

    def train(state: ObjectState) -> None:
        raise CollectiveMismatchError("shapes differ")

    with pytest.raises(CollectiveMismatchError):
        run_fn(train, rec.reset)(s)
    assert rec.calls == []
