"""The elastic driver's decisions, without processes: discovery parsing, blacklist cooldown, and
the round state machine driven step by step with fake workers and a fake clock."""

from __future__ import annotations

import pytest

from horovod.common.exceptions import ConfigError
from horovod.runner.elastic.discovery import (
    FixedHosts,
    HostDiscovery,
    HostDiscoveryScript,
    HostManager,
    cooldown_seconds,
    parse_discovery_output,
)
from horovod.runner.elastic.driver import ElasticDriver


def test_host_discovery_is_the_base_user_discoveries_subclass() -> None:
    """Upstream's ``HostDiscovery``: user code subclasses it (a Ray job's ``settings.discovery``);
    the base names the missing method, the launcher's discoveries are its subclasses."""

    class Two(HostDiscovery):
        def find_available_hosts_and_slots(self) -> dict[str, int]:
            return {"a": 2}

    assert Two().find_available_hosts_and_slots() == {"a": 2}
    with pytest.raises(NotImplementedError, match="HostDiscovery must implement find_available_hosts_and_slots"):
        HostDiscovery().find_available_hosts_and_slots()
    assert isinstance(FixedHosts({"a": 1}), HostDiscovery)
    assert isinstance(HostDiscoveryScript("discover.sh", 1), HostDiscovery)


def test_discovery_output_parsing() -> None:
    assert parse_discovery_output("a:2\n\nb\n# c:9\na:5\n", 3, "s") == {"a": 2, "b": 3}
    with pytest.raises(ConfigError, match="gives no slots"):
        parse_discovery_output("a\n", None, "s")
    with pytest.raises(ConfigError, match="positive integer"):
        parse_discovery_output("a:0\n", None, "s")
    with pytest.raises(ConfigError, match="line 1"):
        parse_discovery_output("a b:2\n", None, "s")


def test_cooldown_grows_and_is_clamped() -> None:
    assert cooldown_seconds(1, None) is None
    # upstream's lo * 2**count + jitter, counting from the first failure, within [lo, hi]
    assert cooldown_seconds(1, (10, 100), rand=lambda: 0.0) == 20
    assert cooldown_seconds(1, (10, 100), rand=lambda: 0.99) == 29.9
    assert cooldown_seconds(2, (10, 100), rand=lambda: 0.5) == 45
    assert cooldown_seconds(3, (10, 100), rand=lambda: 0.0) == 80
    assert cooldown_seconds(1, (10, 15), rand=lambda: 0.0) == 15
    assert cooldown_seconds(8, (10, 100), rand=lambda: 0.0) == 100


def test_blacklisted_host_comes_back_after_its_cooldown() -> None:
    now = [0.0]
    hm = HostManager(FixedHosts({"a": 1, "b": 2}), (10, 100), clock=lambda: now[0],
                     rand=lambda: 0.0)
    hm.update()
    assert hm.blacklist_host("b") == 20
    assert hm.available() == {"a": 1}
    now[0] = 19.5
    assert hm.available() == {"a": 1}
    now[0] = 20.5
    assert hm.available() == {"a": 1, "b": 2}
    permanent = HostManager(FixedHosts({"a": 1}))
    permanent.update()
    assert permanent.blacklist_host("a") is None and permanent.all_blacklisted()


class FakeProc:
    def __init__(self) -> None:
        self.stopped = False

    def stop(self, grace: float = 5.0) -> None:
        self.stopped = True

    def kill(self) -> None:
        self.stopped = True


class Harness:
    def __init__(self, hosts: dict[str, int], np: int, min_np: int, max_np: int | None = None,
                 **kw: object) -> None:
        self.now = 0.0
        self.fixed = FixedHosts(hosts)
        self.started: list[tuple[str, int]] = []
        hm = HostManager(self.fixed, clock=lambda: self.now)
        self.d = ElasticDriver(hm, np, min_np, max_np, self.start, clock=lambda: self.now, **kw)
        self.d.discover_once()

    def start(self, key: tuple[str, int], slot: object) -> FakeProc:
        self.started.append(key)
        return FakeProc()

    def ready(self, *keys: tuple[str, int], reason: str = "error") -> None:
        for k in keys:
            w = self.d.workers[k]
            w.state, w.reason = "ready", reason

    def running(self) -> None:
        for k in self.d.members:
            self.d.workers[k].state = "running"
            self.d.workers[k].after = self.d.round

    def exit(self, key: tuple[str, int], code: int | None, sig: int | None = None,
             record: object = None) -> None:
        self.d.worker_exited(key, code, sig, record)

    def step(self) -> None:
        with self.d.cv:
            self.d._step()

    def ranks(self) -> dict[tuple[str, int], int]:
        return {k: self.d.answers[k].slot.rank for k in self.d.members}


def test_first_round_waits_for_every_started_worker() -> None:
    h = Harness({"a": 2, "b": 1}, np=3, min_np=2)
    h.step()
    assert h.started == [("a", 0), ("a", 1), ("b", 0)] and h.d.round == -1
    h.ready(("a", 0), ("a", 1), reason="start")
    h.step()
    assert h.d.round == -1
    h.ready(("b", 0), reason="start")
    h.step()
    assert h.d.round == 0 and h.ranks() == {("a", 0): 0, ("a", 1): 1, ("b", 0): 2}
    assert h.d.answers[("b", 0)].slot.local_size == 1 and h.d.answers[("a", 1)].slot.local_rank == 1


def first_round(h: Harness) -> None:
    h.step()
    h.ready(*h.started, reason="start")
    h.step()
    h.running()


def test_failure_blacklists_host_and_survivors_form_the_next_round_with_sync() -> None:
    h = Harness({"a": 1, "b": 1, "c": 1}, np=3, min_np=2)
    first_round(h)
    h.exit(("a", 0), None, 9)
    h.step()
    assert h.d.hosts.is_blacklisted("a")
    assert h.d.round == 0  # b and c have not rejoined yet
    h.ready(("b", 0), ("c", 0))
    h.step()
    assert h.d.round == 1 and h.ranks() == {("b", 0): 0, ("c", 0): 1}
    assert h.d.answers[("b", 0)].skip_sync is False
    assert any("failed (killed by signal 9 (SIGKILL)); blacklisting host a" in e for e in h.d.events)


def test_removal_only_round_skips_sync_but_not_when_a_newcomer_joins() -> None:
    # Upstream #3494: skip_sync must be decided for the round as formed, for every member.
    h = Harness({"a": 1, "b": 1, "c": 1}, np=3, min_np=2)
    first_round(h)
    h.fixed.hosts = {"a": 1, "b": 1}
    h.d.discover_once()
    h.step()
    assert h.d.notice_version == 1 and h.d.notice_update == 1  # removed
    h.ready(("a", 0), ("b", 0), ("c", 0), reason="removed")
    h.step()
    assert h.d.round == 1 and h.d.answers[("a", 0)].skip_sync is True
    assert h.d.workers[("c", 0)].removed
    h.running()

    h2 = Harness({"a": 1, "b": 1, "c": 1}, np=3, min_np=3)
    first_round(h2)
    h2.fixed.hosts = {"a": 1, "b": 1}
    h2.d.discover_once()
    h2.step()
    h2.ready(("a", 0), ("b", 0), ("c", 0), reason="removed")
    h2.step()
    assert h2.d.round == 0  # 2 slots < --min-np 3: waiting
    h2.fixed.hosts = {"a": 1, "b": 1, "d": 1}
    h2.d.discover_once()
    h2.step()
    assert ("d", 0) in h2.started
    h2.ready(("d", 0), reason="start")
    h2.now += 1
    h2.step()
    assert h2.d.round == 1 and set(h2.ranks()) == {("a", 0), ("b", 0), ("d", 0)}
    assert all(h2.d.answers[k].skip_sync is False for k in h2.d.members)


def test_new_host_is_started_members_notified_once_and_the_round_waits_for_it() -> None:
    h = Harness({"a": 1}, np=1, min_np=1, max_np=2)
    first_round(h)
    h.fixed.hosts = {"a": 1, "b": 1}
    h.d.discover_once()
    h.step()
    assert ("b", 0) in h.started
    assert h.d.notice_version == 1 and h.d.notice_update == 2  # added
    h.step()
    assert h.d.notice_version == 1  # notified once
    h.ready(("a", 0), reason="added")
    h.now += 5
    h.step()
    assert h.d.round == 0  # the member asked to take b in: wait for b
    h.ready(("b", 0), reason="start")
    h.step()
    assert h.d.round == 1 and h.ranks() == {("a", 0): 0, ("b", 0): 1}


def test_too_few_slots_for_longer_than_the_timeout_fails() -> None:
    h = Harness({"a": 1, "b": 1}, np=2, min_np=2, timeout=30)
    first_round(h)
    h.exit(("b", 0), 1)
    h.step()
    h.ready(("a", 0))
    h.step()
    assert not h.d.done and any("waiting for hosts" in e for e in h.d.events)
    h.now += 31
    h.step()
    assert h.d.done and "too few hosts" in (h.d.error or "")
    # a worker exited non-zero: upstream's sentence follows ours (log scrapers look for it)
    assert "Horovod detected that one or more processes exited with non-zero status" in h.d.error


def test_all_workers_failing_keeps_upstreams_sentence() -> None:
    h = Harness({"a": 1, "b": 1}, np=2, min_np=1)
    first_round(h)
    h.exit(("a", 0), 1)
    h.exit(("b", 0), None, 9)
    h.step()
    assert h.d.done and h.d.error.startswith("all workers of the last round failed or left")
    assert h.d.error.endswith("Horovod detected that one or more processes exited with non-zero status, "
                              "thus causing the job to be terminated.")


def test_failure_without_a_failed_worker_has_no_exit_sentence() -> None:
    h = Harness({"a": 1}, np=1, min_np=1)
    h.step()
    h.d.abort("the cluster went away")
    assert h.d.error == "the cluster went away"


def test_reset_limit() -> None:
    h = Harness({"a": 1, "b": 1, "c": 1}, np=3, min_np=1, reset_limit=1)
    first_round(h)
    h.exit(("c", 0), 1)
    h.step()
    h.ready(("a", 0), ("b", 0))
    h.step()
    assert h.d.round == 1
    h.running()
    h.exit(("b", 0), 1)
    h.step()
    h.ready(("a", 0))
    h.step()
    assert h.d.done and "more than --reset-limit 1" in (h.d.error or "")
    # upstream's wording first (constants.RESET_LIMIT_EXCEEDED_MESSAGE), then ours
    assert h.d.error.startswith("Horovod was shutdown because number of resets during elastic job "
                                "exceeded limit: 1 (stopping: this would be reset number 2")


def test_member_exit_zero_completes_the_job() -> None:
    h = Harness({"a": 1, "b": 1}, np=2, min_np=1)
    first_round(h)
    h.exit(("a", 0), 0)
    h.step()
    assert not h.d.hosts.is_blacklisted("a")
    h.exit(("b", 0), 0)
    h.step()
    assert h.d.done and h.d.error is None


def test_a_round_abandoned_by_the_driver_fails_fast_in_the_gloo_rendezvous() -> None:
    # A member died before the round formed: the others must not wait for its store address
    # until the Gloo timeout.
    from horovod.common.exceptions import HorovodInternalError
    from horovod.common.protocol import ABANDONED_STORE, STORE_KEY, round_scope
    from horovod.common.rendezvous_handlers import LauncherService
    from horovod.runner.rendezvous import RendezvousServer, make_secret

    secret = make_secret()
    with RendezvousServer(secret) as server:
        server.put(round_scope(3), STORE_KEY, ABANDONED_STORE)
        rdv = LauncherService("127.0.0.1", server.port, secret, rank=1)
        with pytest.raises(HorovodInternalError, match="abandoned"):
            rdv.wait("elastic.3", "store", timeout=30)


def test_member_death_abandons_the_current_round() -> None:
    h = Harness({"a": 1, "b": 1}, np=2, min_np=1)
    put: list[tuple[str, str, bytes]] = []
    h.d.put_kv = lambda scope, key, value: put.append((scope, key, value))
    first_round(h)
    h.exit(("b", 0), 1)
    h.step()
    assert [(scope, key) for scope, key, _ in put] == [("elastic.0", "abandoned"),
                                                       ("elastic.0", "store")]
    assert b"b[0]" in put[0][2] and b"exit code 1" in put[0][2]
    h.exit(("a", 0), 1)  # once per round
    h.step()
    assert len(put) == 2


def test_a_member_forming_an_abandoned_round_stops_waiting_within_a_second() -> None:
    # A member blocked in the round's formation (here: a build that would wait for 60 s, as
    # Gloo's process group waits for a dead peer's address) gives up as soon as the driver
    # writes the round's abandon key; what the build makes later is closed.
    import threading
    import time

    from horovod.common.elastic.worker import ABANDONED_KEY, RoundInfo, form_round
    from horovod.common.exceptions import HorovodInternalError
    from horovod.common.protocol import RankIdentity
    from horovod.common.rendezvous import RendezvousClient
    from horovod.runner.rendezvous import RendezvousServer, make_secret

    info = RoundInfo(4, RankIdentity(hostname="h", rank=1, local_rank=0, cross_rank=1, size=3,
                     local_size=1, cross_size=3), skip_sync=False, notice=0)
    secret = make_secret()
    release = threading.Event()
    closed: list[str] = []
    with RendezvousServer(secret) as server:
        client = RendezvousClient("127.0.0.1", server.port, secret)
        assert form_round(lambda: "built", client, info) == "built"

        def slow_build() -> str:
            t0.append(time.monotonic())  # the driver gives the round up while this member waits
            server.put("elastic.4", ABANDONED_KEY, b"b[0] died")
            release.wait(60)
            return "late"

        t0: list[float] = []
        with pytest.raises(HorovodInternalError, match="round 4 was abandoned.*b\\[0\\] died"):
            form_round(slow_build, client, info, close=closed.append)
        assert time.monotonic() - t0[0] < 1.0
        release.set()
        deadline = time.monotonic() + 5
        while not closed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert closed == ["late"]


def test_notify_when_ready_lets_members_train_while_new_workers_start() -> None:
    h = Harness({"a": 1}, np=1, min_np=1, max_np=2, notify_when_ready=True)
    first_round(h)
    h.fixed.hosts = {"a": 1, "b": 1}
    h.d.discover_once()
    h.step()
    assert ("b", 0) in h.started and h.d.notice_version == 0  # b is still starting
    h.ready(("b", 0), reason="start")
    h.step()
    assert h.d.notice_version == 1 and h.d.notice_update == 2
    h.ready(("a", 0), reason="added")
    h.step()
    assert h.d.round == 1 and h.ranks() == {("a", 0): 0, ("b", 0): 1}


def test_abort_ends_the_job_with_the_launchers_reason() -> None:
    h = Harness({"a": 2}, np=2, min_np=1)
    h.d.abort("the Spark job of the elastic agents failed: executor lost")
    result = h.d.run()
    assert result.error == "the Spark job of the elastic agents failed: executor lost"
    h.d.abort("a second reason")  # once over, the first reason stays
    assert h.d.error == "the Spark job of the elastic agents failed: executor lost"


def test_elastic_settings_are_read_in_one_place() -> None:
    from horovod.runner.elastic.settings import DriverSettings

    d = DriverSettings.from_env({})
    assert (d.timeout, d.notify_when_ready, d.rejoin_timeout, d.reset_limit) == (600, False, 90, None)
    env = {"HOROVOD_ELASTIC_TIMEOUT": "50", "HOROVOD_ELASTIC_NOTIFY_WHEN_READY": "1",
           "HOROVOD_ELASTIC_REJOIN_TIMEOUT": "7"}
    s = DriverSettings.from_env(env, reset_limit=3)
    assert (s.timeout, s.notify_when_ready, s.rejoin_timeout, s.reset_limit) == (50, True, 7, 3)
    assert DriverSettings.from_env(env, timeout=9).timeout == 9  # the launcher's argument wins
    with pytest.raises(ConfigError, match="HOROVOD_ELASTIC_REJOIN_TIMEOUT"):
        DriverSettings.from_env({"HOROVOD_ELASTIC_REJOIN_TIMEOUT": "soon"})
    h = Harness({"a": 1}, np=1, min_np=1)
    drv = ElasticDriver.from_settings(s, h.d.hosts, 1, 1, None, h.d.start_worker)
    assert (drv.timeout, drv.stuck_seconds, drv.notify_when_ready, drv.reset_limit) == (50, 7, True, 3)


def test_round_answer_is_one_dataclass_on_both_sides() -> None:
    import json

    from horovod.common.elastic.worker import RoundInfo
    from horovod.common.exceptions import HorovodInternalError

    h = Harness({"a": 2, "b": 1}, np=3, min_np=1)
    first_round(h)
    info = h.d.answers[("b", 0)]
    wire = json.loads(json.dumps(info.to_wire()))
    assert wire["status"] == "round" and RoundInfo.from_wire(wire) == info
    with pytest.raises(HorovodInternalError, match="malformed"):
        RoundInfo.from_wire({k: v for k, v in wire.items() if k != "rank"})


def _two_failures(record_a: object = None, record_c: object = None) -> list:
    """c is killed, then a exits 1 (each with the exit record given)."""
    h = Harness({"a": 1, "b": 1, "c": 1}, np=3, min_np=1)
    first_round(h)
    h.exit(("c", 0), None, 9, record_c)
    h.step()
    h.exit(("a", 0), 1, None, record_a)
    h.step()
    return list(h.d.failures)


def test_failures_are_kept_in_order_and_one_rule_names_the_root_cause() -> None:
    from horovod.runner.elastic.driver import ElasticResult

    res = ElasticResult("x", 1, 0, failures=_two_failures())
    assert [(f.key, f.status) for f in res.failures] == [
        (("c", 0), "killed by signal 9 (SIGKILL)"), (("a", 0), "exit code 1")]
    assert res.root_cause().key == ("c", 0)  # the earliest; killed before an exit code
    assert ElasticResult(None, 1, 0).root_cause() is None


def test_elastic_root_cause_reads_the_exit_records_as_static_jobs_do() -> None:
    import time

    from horovod.common.protocol import FailureRecord
    from horovod.runner.elastic.driver import ElasticResult

    now = time.time()
    cause = FailureRecord(1, "cause", "ValueError: bad batch", now)
    consequence = FailureRecord(1, "consequence", "HorovodInternalError: peer left", now - 5)
    # a's own error comes before c's death, although c ended first
    res = ElasticResult("x", 1, 0, failures=_two_failures(record_a=cause))
    root = res.root_cause()
    assert root is not None and root.key == ("a", 0) and root.record == cause
    assert root.as_exit().error == "ValueError: bad batch" and root.as_exit().rank == 0
    # an error that only says a peer left is not a root cause, even recorded earlier
    res = ElasticResult("x", 1, 0, failures=_two_failures(record_a=consequence))
    assert res.root_cause().key == ("c", 0)
    # the same function decides for static jobs
    from horovod.runner.failures import root_cause

    exits = [f.as_exit() for f in _two_failures(record_a=cause)]
    assert root_cause(exits) is exits[1]


def test_hung_worker_is_a_failure_and_named_when_nothing_else_failed() -> None:
    from horovod.runner.elastic.driver import ElasticResult, WorkerFailure

    hung = WorkerFailure(("b", 0), 1, "hung", time=10.0)
    killed = WorkerFailure(("c", 0), 2, "killed by signal 9 (SIGKILL)", None, 9, 5.0)
    assert hung.as_exit().failed and hung.as_exit().status == "hung"
    assert ElasticResult("x", 1, 1, failures=[hung]).root_cause() is hung
    assert ElasticResult("x", 1, 1, failures=[hung, killed]).root_cause() is killed


def _beat(h: Harness, *keys: tuple[str, int]) -> None:
    from horovod.common.protocol import Beat

    for k in keys:
        h.d._beat(Beat(k[0], k[1], 100 + k[1]))


def _advance(h: Harness, seconds: float, beating: tuple[tuple[str, int], ...]) -> None:
    """Time passes in driver steps of 0.25 s; ``beating`` keep beating."""
    end = h.now + seconds
    while h.now < end:
        h.now += 0.25
        _beat(h, *beating)
        h.step()


def test_silent_worker_alone_on_its_host_is_killed_and_its_host_blacklisted() -> None:
    h = Harness({"a": 2, "b": 1}, np=3, min_np=2, heartbeat_timeout=5.0)
    first_round(h)
    every = (("a", 0), ("a", 1), ("b", 0))
    _advance(h, 2, every)
    _advance(h, 4.9, every[:2])  # b[0] stopped: not yet 5 s of silence
    assert not h.d.workers[("b", 0)].removed
    _advance(h, 0.5, every[:2])
    w = h.d.workers[("b", 0)]
    assert w.removed and w.proc.stopped  # type: ignore[attr-defined]
    assert any("worker b[0] (rank 2, pid 100) sent no heartbeat for 5." in e for e in h.d.events)
    assert h.d.hosts.is_blacklisted("b") and not h.d.hosts.is_blacklisted("a")
    h.exit(("b", 0), None, 9)
    h.ready(("a", 0), ("a", 1))
    h.step()
    assert h.d.round == 1 and h.ranks() == {("a", 0): 0, ("a", 1): 1}
    assert [f.status for f in h.d.failures] == ["hung"]


def test_silent_worker_on_a_shared_host_keeps_the_host() -> None:
    h = Harness({"a": 3}, np=3, min_np=2, max_np=3, heartbeat_timeout=5.0)
    first_round(h)
    every = (("a", 0), ("a", 1), ("a", 2))
    _advance(h, 1, every)
    _advance(h, 6, every[:2])
    assert h.d.workers[("a", 2)].removed and not h.d.hosts.is_blacklisted("a")
    assert any("host a stays in the job" in e for e in h.d.events)


def test_no_verdict_when_every_worker_is_silent_or_the_worker_is_leaving() -> None:
    from horovod.common.protocol import Beat

    h = Harness({"a": 1, "b": 1}, np=2, min_np=1, heartbeat_timeout=5.0)
    first_round(h)
    _advance(h, 1, (("a", 0), ("b", 0)))
    h.d._beat(Beat("a", 0, 7, leaving=True))  # a[0] is exiting: its end is watched instead
    _advance(h, 10, ())  # nobody beats (the driver may be the one starved): nobody is judged
    assert not any(w.removed for w in h.d.workers.values())
    _advance(h, 10, (("b", 0),))
    assert not h.d.workers[("a", 0)].removed


def test_busy_worker_that_beats_is_kept() -> None:
    h = Harness({"a": 1, "b": 1}, np=2, min_np=1, heartbeat_timeout=5.0)
    first_round(h)
    _advance(h, 120, (("a", 0), ("b", 0)))  # its main thread computes; its heartbeat goes on
    assert not any(w.removed for w in h.d.workers.values()) and h.d.round == 0
