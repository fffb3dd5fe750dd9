"""The launcher's monitor service (horovod/runner/monitor) and a rank's reporter, in one process."""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import time
from collections.abc import Iterator

import pytest

from horovod.common.exceptions import LaunchError
from horovod.common.protocol import REPORT_PATH, MonitorReport
from horovod.common.rendezvous import RendezvousClient, RendezvousError, make_secret
from horovod.common.reporter import Reporter
from horovod.runner import monitor
from horovod.runner.job_outcome import JobOutcome
from horovod.runner.monitor import JobState, MonitorService, exposition, page, record_result
from horovod.runner.monitor.service import MAX_CONNECTIONS

REQUIRED = ["horovod_world_size", "horovod_rank_info", "horovod_collectives_total",
            "horovod_collective_bytes_total", "horovod_collective_seconds_total",
            "horovod_wait_seconds_total", "horovod_straggler", "horovod_stalled_tensors",
            "horovod_elastic_rounds_total", "horovod_elastic_workers"]


def report(rank: int, **over: object) -> dict:
    base = {"rank": rank, "host": f"node{rank // 2}", "local_rank": rank % 2, "size": 2, "steps": 10,
            "step_times": [0.01] * 10, "collectives": {"allreduce": 20},
            "collective_bytes": {"allreduce": 640}, "collective_seconds": {"allreduce": 0.5},
            "wait_seconds": 1.25, "stalled_tensors": 0, "straggler": rank == 1,
            "straggler_score": 0.8 if rank == 1 else 0.0}
    base.update(over)
    return base


@pytest.fixture
def service() -> Iterator[MonitorService]:
    svc = MonitorService(make_secret(), 0, state=JobState(2, {0: ("node0", 0), 1: ("node0", 1)}))
    yield svc
    svc.stop()


def get(svc: MonitorService, path: str, host: str = "127.0.0.1") -> tuple[int, str]:
    conn = http.client.HTTPConnection(host, svc.port, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def post(svc: MonitorService, body: dict, secret: str | None = None) -> int:
    client = RendezvousClient("127.0.0.1", svc.port, secret or svc.secret, timeout=10)
    status, _ = client.request("POST", REPORT_PATH, json.dumps(body).encode())
    return status


def test_signed_reports_become_metrics(service: MonitorService) -> None:
    assert post(service, report(0)) == 200
    assert post(service, report(1)) == 200
    status, text = get(service, "/metrics")
    assert status == 200
    for name in REQUIRED:
        assert f"# HELP {name} " in text and f"# TYPE {name} " in text, name
    assert "horovod_world_size 2" in text
    assert 'horovod_rank_info{rank="1",host="node0",local_rank="1"} 1' in text
    assert 'horovod_collective_bytes_total{rank="0",op="allreduce"} 640' in text
    assert 'horovod_collectives_total{rank="1",op="allreduce"} 20' in text
    assert 'horovod_wait_seconds_total{rank="0"} 1.25' in text
    assert 'horovod_straggler{rank="1"} 1' in text and 'horovod_straggler{rank="0"} 0' in text
    assert "horovod_elastic_rounds_total 0" in text
    # Every sample line parses as Prometheus text: name{labels} value.
    for line in text.splitlines():
        if not line.startswith("#"):
            assert re.fullmatch(r'[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? -?[0-9.e+-]+', line), line
    status, body = get(service, "/api/job")
    job = json.loads(body)
    assert status == 200 and job["world_size"] == 2 and job["stragglers"] == [1]
    assert [r["state"] for r in job["ranks"]] == ["running", "straggler"]


def test_unsigned_wrong_and_replayed_reports_are_refused(service: MonitorService) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", service.port, timeout=10)
    conn.request("POST", REPORT_PATH, body=json.dumps(report(0)).encode())
    assert conn.getresponse().status == 403
    conn.close()
    with pytest.raises(RendezvousError, match="refused"):
        post(service, report(0), secret=make_secret())
    # The same signed request twice: the second is a replay.
    body = json.dumps(report(0)).encode()
    ts, nonce = f"{time.time():.6f}", "ab" * 16
    from horovod.common.rendezvous import AUTH_HEADER, sign_request

    header = f"{ts}:{nonce}:{sign_request(service.secret, 'POST', REPORT_PATH, ts, nonce, body)}"
    statuses = []
    for _ in range(2):
        conn = http.client.HTTPConnection("127.0.0.1", service.port, timeout=10)
        conn.request("POST", REPORT_PATH, body=body, headers={AUTH_HEADER: header})
        statuses.append(conn.getresponse().status)
        conn.close()
    assert statuses == [200, 403]
    assert service.state.reports == 1


def test_port_in_use_is_a_clear_error() -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        with pytest.raises(LaunchError, match=rf"127\.0\.0\.1:{port}.*in use.*--monitor-port"):
            MonitorService(make_secret(), port)
    finally:
        holder.close()


def test_slow_and_silent_clients_do_not_hold_up_reports(service: MonitorService) -> None:
    # Clients that connect and never finish a request, and one that asks and never reads.
    idle = []
    for _ in range(MAX_CONNECTIONS // 2):
        s = socket.create_connection(("127.0.0.1", service.port))
        s.sendall(b"GET /metrics HTTP/1.1\r\n")
        idle.append(s)
    reader = socket.create_connection(("127.0.0.1", service.port))
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    reader.sendall(b"GET / HTTP/1.0\r\n\r\n")
    try:
        t0 = time.monotonic()
        for i in range(5):
            assert post(service, report(0, steps=10 + i)) == 200
        assert time.monotonic() - t0 < 5.0  # each report answered at once, not after a timeout
        assert get(service, "/api/job")[0] == 200
    finally:
        for s in idle:
            s.close()
        reader.close()


def test_connections_beyond_the_bound_are_dropped(service: MonitorService) -> None:
    idle = [socket.create_connection(("127.0.0.1", service.port)) for _ in range(MAX_CONNECTIONS + 8)]
    try:
        extra = socket.create_connection(("127.0.0.1", service.port))
        extra.settimeout(10)
        extra.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        assert extra.recv(100) == b""  # closed without an answer, at once (not held in a queue)
        extra.close()
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 20  # the slots come back as the idle clients go
    while time.monotonic() < deadline:
        try:
            if get(service, "/metrics")[0] == 200:
                break
        except OSError:
            pass
        time.sleep(0.1)
    else:
        pytest.fail("the monitor did not serve again after the idle clients left")


def test_other_address_needs_the_read_token() -> None:
    svc = MonitorService(make_secret(), 0, address="0.0.0.0")
    try:
        assert svc.read_token and svc.url.endswith(f"?token={svc.read_token}")
        assert get(svc, "/metrics")[0] == 403
        assert get(svc, f"/metrics?token={svc.read_token}")[0] == 200
        conn = http.client.HTTPConnection("127.0.0.1", svc.port, timeout=10)
        conn.request("GET", "/api/job", headers={"Authorization": f"Bearer {svc.read_token}"})
        assert conn.getresponse().status == 200
        conn.close()
        assert post(svc, report(0)) == 200  # reports are signed with the job secret instead
    finally:
        svc.stop()


def test_page_is_self_contained(service: MonitorService) -> None:
    status, html = get(service, "/")
    assert status == 200 and html == page.HTML
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)  # no CDN, no external asset
    assert "api/job" in html and "<svg" in html


def test_failure_and_elastic_state(service: MonitorService) -> None:
    from horovod.runner.failures import RankExit
    from horovod.runner.job_outcome import JobOutcome

    culprit = RankExit(1, "node0", 3, None, time.time(), error="RuntimeError: boom", error_kind="cause")
    stopped = RankExit(0, "node0", 1, None, time.time(), stopped_by="rank 1 failed")
    record_result(service, JobOutcome([stopped, culprit], 1))
    service.state.elastic = lambda: {"rounds": 3, "workers": {"running": 2, "exited": 1}}
    job = json.loads(get(service, "/api/job")[1])
    assert job["failure"]["rank"] == 1 and job["failure"]["host"] == "node0"
    assert job["failure"]["status"] == "exit code 3" and "boom" in job["failure"]["error"]
    assert [r["state"] for r in job["ranks"]] == ["stopped", "failed"]
    text = exposition.render(job)
    assert "horovod_elastic_rounds_total 3" in text
    assert 'horovod_elastic_workers{state="exited"} 1' in text


def test_an_elastic_jobs_outcome_names_its_root_cause_worker(service: MonitorService) -> None:
    """The typed outcome of an elastic job: the root-cause worker (its own error before a
    worker that only lost a peer) with the driver's reason, and the exit status."""
    from horovod.common.protocol import FailureRecord
    from horovod.runner.elastic.driver import ElasticResult, WorkerFailure
    from horovod.runner.job_outcome import JobOutcome

    lost = WorkerFailure(("node0", 0), 0, "exit code 1", 1, None, 5.0,
                         FailureRecord(1, "consequence", "HorovodInternalError: peer left", 5.0))
    own = WorkerFailure(("node1", 0), 1, "exit code 2", 2, None, 6.0,
                        FailureRecord(2, "cause", "ValueError: bad batch", 4.0))
    result = ElasticResult("reset limit 0 exceeded", 2, 1, failures=[lost, own])
    outcome = JobOutcome(returncode=1, error=result.error, elastic=result)
    record_result(service, outcome)
    job = json.loads(get(service, "/api/job")[1])
    assert (job["failure"]["rank"], job["failure"]["host"], job["failure"]["status"]) == (
        1, "node1", "exit code 2"), job["failure"]
    assert job["failure"]["error"] == "reset limit 0 exceeded"
    assert job["finished"]["returncode"] == 1
    assert "root cause: worker node1[0] (rank 1) exit code 2: ValueError: bad batch" in outcome.report()


def test_reporter_pushes_snapshots(service: MonitorService) -> None:
    n = [0]

    def snapshot() -> dict:
        n[0] += 1
        return {k: v for k, v in report(1, steps=n[0]).items() if k not in ("rank", "host", "local_rank")}

    client = RendezvousClient("127.0.0.1", service.port, service.secret)
    rep = Reporter(client, snapshot, rank=1, host="node0", local_rank=1, interval=0.1)
    rep.start()
    deadline = time.monotonic() + 20
    while service.state.reports < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    rep.stop(final=True)
    assert rep.sent >= 3
    row = json.loads(get(service, "/api/job")[1])["ranks"][1]
    assert row["state"] == "finished" and row["steps"] == n[0]


def test_reporter_survives_an_unreachable_monitor() -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    holder.close()  # nothing listens there
    rep = Reporter(RendezvousClient("127.0.0.1", port, make_secret()), dict, rank=0, interval=0.1)
    assert rep.push() is False
    rep.start()
    rep.stop(final=False)


def test_command_line_options() -> None:
    from horovod.common.exceptions import ConfigError
    from horovod.runner.cli import parse_args, settings_from_args

    s = settings_from_args(parse_args(["-np", "2", "--monitor-port", "0", "--monitor-address", "0.0.0.0",
                                       "--monitor-linger", "5", "python", "train.py"]))
    assert (s.monitor_port, s.monitor_address, s.monitor_linger) == (0, "0.0.0.0", 5.0)
    s = settings_from_args(parse_args(["-np", "2", "python", "train.py"]))
    assert s.monitor_port is None
    with pytest.raises(ConfigError, match="--monitor-port 70000"):
        settings_from_args(parse_args(["-np", "2", "--monitor-port", "70000", "python", "train.py"]))


def test_reports_over_a_jobs_rendezvous_service() -> None:
    """Spark and Ray jobs: the ranks post to the job's rendezvous service (which they reach
    already), signed with the job secret; it hands the reports to the monitor in process."""
    from horovod.common import protocol
    from horovod.runner.launch.cluster_job import FunctionJob
    from horovod.runner.monitor.cluster import attach, close
    from horovod.runner.monitor.service import MAX_REPORT_BYTES

    svc = MonitorService(make_secret(), 0, state=JobState(2))
    with FunctionJob("127.0.0.1", bind_addr="127.0.0.1") as job:
        forged = RendezvousClient("127.0.0.1", job.port, job.secret)
        assert forged.request("POST", REPORT_PATH, json.dumps(report(0)).encode())[0] == 404  # no monitor yet
        env = attach(svc, job)
        assert env == {protocol.MONITOR_ADDR_ENV: "127.0.0.1", protocol.MONITOR_PORT_ENV: str(job.port)}
        client = RendezvousClient(env[protocol.MONITOR_ADDR_ENV], int(env[protocol.MONITOR_PORT_ENV]), job.secret)
        for rank in (0, 1):
            assert client.request("POST", REPORT_PATH, json.dumps(report(rank)).encode())[0] == 200
        with pytest.raises(RendezvousError, match="refused"):  # not this job's secret
            RendezvousClient("127.0.0.1", job.port, make_secret()).request(
                "POST", REPORT_PATH, json.dumps(report(0, steps=99)).encode())
        assert client.request("POST", REPORT_PATH, b"{not json")[0] == 400
        status, answer = client.request("POST", REPORT_PATH, json.dumps(report(0, steps="many")).encode())
        assert status == 400 and b"'steps'" in answer  # a malformed field is named, the report refused
        assert client.request("POST", REPORT_PATH, b" " * (MAX_REPORT_BYTES + 1))[0] == 413
        text = get(svc, "/metrics")[1]
        assert text.count("horovod_rank_info{") == 2
        assert 'horovod_collective_bytes_total{rank="1",op="allreduce"} 640' in text
        assert 'horovod_steps_total{rank="0"} 10' in text  # the forged report was not taken
    close(svc)
    assert svc.state.finished is not None
    assert svc.state.finished == {"returncode": 0, "text": "", "time": svc.state.finished["time"]}
    with pytest.raises(OSError):
        get(svc, "/metrics")


def test_cluster_job_failure_names_the_culprit() -> None:
    """A Spark or Ray job's failure reaches the monitor as its typed outcome (``JobFailedError``
    carries it): the root cause's rank, its host from its reports, what it raised; the other
    failed ranks stopped. Any other error is shown with no rank to blame."""
    from horovod.common.exceptions import HorovodInternalError
    from horovod.common.protocol import Raised, Returned
    from horovod.runner.job_outcome import JobOutcome
    from horovod.runner.monitor.cluster import close

    def monitored() -> MonitorService:
        svc = MonitorService(make_secret(), 0, state=JobState(3))
        for rank in range(3):
            svc.state.ingest(MonitorReport.from_wire(report(rank, size=3)))
        return svc

    svc = monitored()
    outcome = JobOutcome(returncode=1, outcomes={
        0: Returned(0), 2: Raised(HorovodInternalError("a peer left"), "tb2"),
        1: Raised(ValueError("bad batch"), "tb1")}, seen={1: 2.0, 2: 1.0})
    close(svc, outcome.failure("RayExecutor.run(f)"))
    job = svc.state.job()
    assert job["failure"]["rank"] == 1 and job["failure"]["host"] == "node0", job["failure"]
    assert job["failure"]["status"] == "raised ValueError"
    assert job["failure"]["error"].startswith("RayExecutor.run(f): rank 1 on host ? raised ValueError: bad batch")
    assert job["finished"]["returncode"] == 1
    assert [r["state"] for r in job["ranks"]] == ["running", "failed", "stopped"]

    svc = monitored()
    close(svc, LaunchError("RayExecutor: no node has 2 free CPUs"))
    job = svc.state.job()
    assert job["failure"]["rank"] is None and job["failure"]["status"] == "LaunchError"
    assert "no node has 2 free CPUs" in job["failure"]["error"] and job["finished"]["returncode"] == 1
    assert not {"failed", "stopped"} & {r["state"] for r in job["ranks"]}  # no rank blamed


def test_an_elastic_cluster_jobs_failure_names_its_root_cause_worker() -> None:
    from horovod.common.exceptions import HorovodInternalError
    from horovod.common.protocol import Raised
    from horovod.runner.elastic.driver import ElasticResult, WorkerFailure
    from horovod.runner.failures import exception_record
    from horovod.runner.job_outcome import JobOutcome
    from horovod.runner.monitor.cluster import job_failed

    svc = MonitorService(make_secret(), 0, state=JobState(2))
    own, peer = ValueError("bad batch"), HorovodInternalError("a peer left")
    result = ElasticResult("reset limit 0 exceeded", 2, 1, failures=[
        WorkerFailure(("10.0.0.1-ab", 0), 0, "exit code 1", 1, None, 5.0, exception_record(peer, 5.0)),
        WorkerFailure(("10.0.0.2-cd", 0), 1, "exit code 1", 1, None, 6.0, exception_record(own, 6.0))])
    outcome = JobOutcome(returncode=1, error=result.error, elastic=result, workers={
        ("10.0.0.1-ab", 0): Raised(peer, "tb"), ("10.0.0.2-cd", 0): Raised(own, "tb")})
    err = outcome.failure("RayExecutor.run(f) [elastic]")
    job_failed(svc, err.outcome, str(err))
    job = svc.state.job()
    assert (job["failure"]["rank"], job["failure"]["host"], job["failure"]["status"]) == (
        1, "10.0.0.2-cd", "raised ValueError"), job["failure"]
    assert "root cause: worker 10.0.0.2-cd[0] (rank 1) raised ValueError" in job["failure"]["error"]
    assert [r["state"] for r in job["ranks"]] == ["stopped", "failed"]


FLIGHT = {"done": [[7, 0, "allreduce", "grad.w", "float32", [[1024]], 0.3, 0.0025]],
          "in_flight": [[8, 0, "allreduce", "grad.w", "float32", [[1024]], "negotiated", 2.0]]}


def test_job_state_keeps_each_ranks_latest_stack_and_its_age() -> None:
    now = [1000.0]
    state = JobState(3, {0: ("node0", 0), 1: ("node0", 1), 2: ("node1", 0)}, clock=lambda: now[0])
    state.ingest(MonitorReport(0, "node0", pid=11, where="load (t.py:3)", stack="  stack of 0",
                               flight=FLIGHT))
    now[0] += 2.0
    state.ingest(MonitorReport(1, "node0", pid=12, where="step (t.py:9)", stack="  stack of 1 (old)"))
    now[0] += 1.0
    state.ingest(MonitorReport(1, "node0", pid=12, where="step (t.py:9)", stack="  stack of 1"))
    state.ingest(MonitorReport(2, "node1", steps=4))  # an older rank: counters only
    now[0] += 0.5
    got = {r["rank"]: r for r in state.stacks()["ranks"]}
    assert sorted(got) == [0, 1, 2]
    assert got[0]["age_seconds"] == pytest.approx(3.5) and got[1]["age_seconds"] == pytest.approx(0.5)
    assert (got[0]["host"], got[0]["pid"], got[0]["where"], got[0]["stack"]) == (
        "node0", 11, "load (t.py:3)", "  stack of 0")
    assert got[0]["flight"] == FLIGHT
    assert got[0]["flight_text"][0].startswith("  done       allreduce 'grad.w' (seq 7) float32 (1024,)")
    assert got[0]["flight_text"][1].startswith("  negotiated allreduce 'grad.w' (seq 8)")
    assert got[1]["stack"] == "  stack of 1" and got[1]["flight"] is None and got[1]["flight_text"] == []
    assert (got[2]["stack"], got[2]["pid"], got[2]["age_seconds"]) == (None, None, None)
    # A later report without a stack (an older rank's format) keeps the last one, and its age grows.
    state.ingest(MonitorReport(0, "node0", steps=9))
    now[0] += 20.0
    row = state.stacks()["ranks"][0]
    assert row["stack"] == "  stack of 0" and row["age_seconds"] == pytest.approx(23.5)
    assert row["state"] == "silent"


def test_api_stacks_shows_where_the_reporting_thread_found_the_main_thread(
        service: MonitorService) -> None:
    client = RendezvousClient("127.0.0.1", service.port, service.secret)
    rep = Reporter(client, dict, rank=1, host="node0", local_rank=1, flight=lambda d, f: FLIGHT)
    assert rep.push()  # from this (the main) thread, as the reporter's thread would
    status, body = get(service, "/api/stacks")
    assert status == 200
    ranks = json.loads(body)["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["stack"] is None
    mine = ranks[1]
    assert "test_api_stacks_shows_where_the_reporting_thread_found_the_main_thread" in mine["stack"]
    assert mine["where"].startswith("test_api_stacks_shows_where") and mine["pid"] == os.getpid()
    assert mine["flight"] == FLIGHT and 0 <= mine["age_seconds"] < 60
    assert "api/stacks" in page.HTML and 'id="stacks-fetch"' in page.HTML


def test_whereabouts_is_bounded() -> None:
    from horovod.common import reporter

    def deep(n: int) -> dict:
        return deep(n - 1) if n else reporter.whereabouts(lambda d, f: {
            "done": [FLIGHT["done"][0]] * 50,
            "in_flight": [[*FLIGHT["in_flight"][0][:5], [[2]] * 100, "submitted", 1.0]] * 50})

    got = deep(200)
    assert got["stack"].startswith(f"  ... (outer frames cut: the innermost {reporter.STACK_FRAMES} shown)")
    assert reporter.STACK_FRAMES - 5 <= got["stack"].count("in deep") < reporter.STACK_FRAMES
    assert len(got["flight"]["done"]) == reporter.FLIGHT_DONE
    assert len(got["flight"]["in_flight"]) == reporter.FLIGHT_IN_FLIGHT
    assert all(len(r[5]) == reporter.FLIGHT_SHAPES for r in got["flight"]["in_flight"])
    MonitorReport.from_wire({"rank": 0, **got})  # what it builds passes the protocol's checks


_PAGE_HARNESS = """
function E(tag){this.tag=tag;this.children=[];this.attrs={};this.textContent="";this.className="";this.style={};}
E.prototype.appendChild=function(c){this.children.push(c);return c;};
E.prototype.setAttribute=function(k,v){this.attrs[k]=v;};
E.prototype.querySelector=function(){return new E("tbody");};
function text(e){return (e.textContent||"")+e.children.map(text).join("|");}
var els={};
var document={getElementById:function(id){return els[id]||(els[id]=new E(id));},
  createElement:function(t){return new E(t);},createElementNS:function(n,t){return new E(t);}};
var window={location:{search:"?token=abc"}};
var opened=[];
function XMLHttpRequest(){}
XMLHttpRequest.prototype.open=function(m,u){this.url=u;opened.push(u);};
XMLHttpRequest.prototype.send=function(){
  if(this.url.indexOf("api/stacks")===0){this.status=200;this.responseText=DATA;this.onload();}};
function setTimeout(){}
"""


def test_page_shows_api_stacks_when_asked() -> None:
    """The page's script (run in Node with a minimal DOM): its Stacks button fetches api/stacks
    with the read token and shows each rank's header, stack and flight record; an old one in red."""
    import shutil
    import subprocess

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    script = re.search(r"<script>(.*)</script>", page.HTML, re.S).group(1)  # type: ignore[union-attr]
    state = JobState(2, {0: ("node0", 0), 1: ("node0", 1)}, clock=lambda: 100.0)
    state.ingest(MonitorReport(0, "node0", pid=7, where="load (t.py:3)", stack='  File "t.py", line 3, in load',
                               flight=FLIGHT))
    state._clock = lambda: 112.5  # type: ignore[method-assign]
    data = json.dumps(state.stacks())
    check = """
document.getElementById("stacks-fetch").onclick();
var d=els["stacks"];
console.log(JSON.stringify({opened:opened, link:els["stacks-link"].href, ranks:d.children.length,
  first:text(d.children[0]), stale:d.children[0].children[1].className, second:text(d.children[1])}));
"""
    res = subprocess.run([node, "-e", _PAGE_HARNESS + f"var DATA={json.dumps(data)};\n" + script + check],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert "api/stacks?token=abc" in got["opened"] and got["link"] == "api/stacks?token=abc"
    assert got["ranks"] == 2 and got["stale"] == "stale"
    first = got["first"]
    assert "rank 0 on node0 (pid 7) \u2014 silent, in load (t.py:3), " in first and "12.5 s ago" in first
    assert 'File "t.py", line 3, in load' in first
    assert "done       allreduce 'grad.w' (seq 7)" in first and "negotiated allreduce 'grad.w' (seq 8)" in first
    assert "rank 1 on node0 \u2014 starting: no stack reported yet" in got["second"]


@pytest.mark.parametrize("interrupted", [None, "SIGINT"])
def test_a_job_interrupted_while_ending_does_not_linger(interrupted: str | None) -> None:
    # Ctrl-C reaching horovodrun while its job is still ending is taken by the supervisor (passed
    # on to the ranks); the monitor must not then stay up for the whole --monitor-linger.
    svc = MonitorService(make_secret(), 0, state=JobState(2, {0: ("node0", 0), 1: ("node0", 1)}))
    try:
        monitor.finish(svc, JobOutcome([], 1, interrupted=interrupted), linger=120)
        lingering = [s for s, _ in monitor._LINGERING]
        assert (svc in lingering) == (interrupted is None)
    finally:
        while monitor._LINGERING:  # an interrupted job's service was stopped by finish itself
            monitor._LINGERING.pop()[0].stop()


def test_stop_ends_even_when_the_serving_thread_is_stuck_in_a_request() -> None:
    # horovodrun stops its monitor after a Ctrl-C (the linger's end): a serving thread that never
    # comes back from a request must not keep it up (socketserver's shutdown() waits without limit).
    import socket
    import threading
    import time

    svc = MonitorService(make_secret(), 0, state=JobState(2))
    release = threading.Event()
    entered = threading.Event()
    real = svc._server.process_request

    def stuck(request, client_address):  # type: ignore[no-untyped-def]
        entered.set()
        release.wait(60)
        real(request, client_address)

    svc._server.process_request = stuck  # type: ignore[method-assign]
    client = socket.create_connection(("127.0.0.1", svc.port), timeout=10)
    try:
        assert entered.wait(10)
        t0 = time.monotonic()
        svc.stop(wait=1.0)
        assert time.monotonic() - t0 < 5.0
        with pytest.raises(OSError):  # the port is closed
            socket.create_connection(("127.0.0.1", svc.port), timeout=2).close()
    finally:
        release.set()
        client.close()
