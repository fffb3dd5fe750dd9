"""The launcher<->worker protocol (horovod.common.protocol) and the choice of rendezvous handler."""

from __future__ import annotations

import json

import pytest

from horovod.common import launcher_detection, protocol
from horovod.common.config import EngineConfig
from horovod.common.exceptions import HorovodInternalError
from horovod.common.rendezvous_handlers import (
    HorovodHandler,
    SlurmHandler,
    TorchrunHandler,
    elastic_round,
    handler_for,
)

SLOT = protocol.RankIdentity(hostname="h2", rank=3, local_rank=1, cross_rank=1, size=4, local_size=2,
                             cross_size=2)


def _wire(answer: protocol.ReadyAnswer) -> dict:
    return json.loads(json.dumps(answer.to_wire()))


@pytest.mark.parametrize("answer", [protocol.Wait(), protocol.Removed("h[0] left"),
                                    protocol.Stop("the job is over"),
                                    protocol.RoundInfo(7, SLOT, skip_sync=True, notice=2)])
def test_every_ready_answer_survives_json(answer: protocol.ReadyAnswer) -> None:
    assert protocol.ready_answer(_wire(answer)) == answer


def test_a_round_answer_carries_the_slot_inline_as_older_workers_read_it() -> None:
    wire = _wire(protocol.RoundInfo(7, SLOT, skip_sync=False, notice=0))
    assert wire == {"status": "round", "round": 7, "hostname": "h2", "rank": 3, "local_rank": 1,
                    "cross_rank": 1, "size": 4, "local_size": 2, "cross_size": 2,
                    "skip_sync": False, "notice": 0}


def test_unknown_or_malformed_answers_name_the_answer() -> None:
    with pytest.raises(HorovodInternalError, match="unknown status 'later'"):
        protocol.ready_answer({"status": "later"})
    with pytest.raises(HorovodInternalError, match="malformed"):
        protocol.ready_answer({"status": "round", "round": 1})


def test_requests_and_notices_round_trip() -> None:
    ready = protocol.ReadyRequest("h", 1, after=4, reason="error", pid=99)
    assert protocol.ReadyRequest.from_wire(json.loads(json.dumps(ready.to_wire()))) == ready
    assert protocol.ReadyRequest.from_wire({"host": "h", "slot": "2"}) == protocol.ReadyRequest("h", 2)
    assert protocol.NoticeRequest.from_wire(protocol.NoticeRequest(5).to_wire()).after == 5
    assert protocol.Notice.from_wire(protocol.Notice(3, 2).to_wire()) == protocol.Notice(3, 2)
    assert protocol.Notice.from_wire({}) == protocol.Notice(0, 0)


def test_identity_variables_and_elastic_variables() -> None:
    assert SLOT.env()["HOROVOD_CROSS_SIZE"] == "2" and SLOT.env()["HOROVOD_HOSTNAME"] == "h2"
    assert protocol.elastic_env("h2", 1) == {"HOROVOD_ELASTIC": "1", "HOROVOD_ELASTIC_HOST": "h2",
                                             "HOROVOD_ELASTIC_SLOT": "1"}
    assert protocol.round_scope(3) != protocol.gloo_scope(3)


def test_each_launcher_gets_its_handler_and_elastic_jobs_their_rounds() -> None:
    config = EngineConfig.from_env({})
    horovod = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1", "HOROVOD_GLOO_RENDEZVOUS_PORT": "1",
               "HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    slurm = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "n[1-2]"}
    for env, kind in ((horovod, HorovodHandler), (torchrun, TorchrunHandler), (slurm, SlurmHandler)):
        assert type(handler_for(config, env, launcher_detection.detect(env))) is kind, env
    assert elastic_round({**horovod, "HOROVOD_ELASTIC": "1"})
    assert not elastic_round(horovod) and not elastic_round({**horovod, "HOROVOD_ELASTIC": "0"})
    # A torchrun job of several ranks meets on torchrun's store even with HOROVOD_ELASTIC set.
    assert not elastic_round({**torchrun, "HOROVOD_ELASTIC": "1"})


# ------------------------------------------------------------------------------ outcomes
OUTCOMES = [protocol.Returned({"loss": 0.5}), protocol.Raised(ValueError("bad batch"), "tb text"),
            protocol.Exited(3), protocol.Died(RuntimeError("actor died"))]


@pytest.mark.parametrize("outcome", OUTCOMES, ids=lambda o: type(o).__name__)
def test_outcomes_survive_pickle_and_cloudpickle(outcome: protocol.WorkerOutcome) -> None:
    """They cross Ray's object store and the rendezvous store pickled."""
    import pickle

    import cloudpickle

    for back in (pickle.loads(pickle.dumps(outcome)), pickle.loads(cloudpickle.dumps(outcome))):
        assert type(back) is type(outcome)
        for name in ("value", "traceback", "code"):
            assert getattr(back, name, None) == getattr(outcome, name, None)
        error = getattr(outcome, "error", None)
        if error is not None:
            assert type(back.error) is type(error) and back.error.args == error.args  # type: ignore[union-attr]


def test_task_outcome_takes_what_workers_report_and_names_anything_else() -> None:
    for outcome in OUTCOMES[:3]:
        assert protocol.task_outcome(outcome) is outcome
    # Died is the launcher's own record, never a worker's report; tuples are no outcome
    for bad in (OUTCOMES[3], ("ok", 1), {"kind": "ok"}):
        with pytest.raises(HorovodInternalError, match="rank 3 reported .* not an outcome"):
            protocol.task_outcome(bad, "rank 3")


def _add(a: int, b: int = 0, *, c: int = 0) -> int:
    return a + b + c


def test_a_function_call_survives_cloudpickle_and_runs_with_its_arguments() -> None:
    import cloudpickle

    call = protocol.FunctionCall.of(_add, [1, 2], {"c": 4})
    assert call.args == (1, 2) and call.kwargs == {"c": 4}
    back = protocol.function_call(cloudpickle.loads(cloudpickle.dumps(call)), "rank 0")
    assert back == call and back() == 7 and back.on_executable(object()) == 7
    with pytest.raises(TypeError):  # no arguments given: none passed
        protocol.FunctionCall.of(_add)()
    bound = cloudpickle.loads(cloudpickle.dumps(call.on_executable))  # what a Ray actor gets
    assert bound(None) == 7
    # the untyped tuple an older launcher sent is refused, naming the reader
    with pytest.raises(HorovodInternalError, match=r"rank 0 read tuple .* not a FunctionCall"):
        protocol.function_call((_add, (1,), {}), "rank 0")


def test_outcome_names_are_unique_across_the_package() -> None:
    import horovod.runner.elastic.session as session

    assert not hasattr(protocol, "Outcome") and not hasattr(session, "Outcome")
    assert set(protocol.TaskOutcome.__args__) < set(protocol.WorkerOutcome.__args__)  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------ Spark messages
SPARK_MESSAGES = [protocol.SparkTaskStarted(("10.0.0.1:41234", "[::1]:2"), attempt=1, pid=77),
                  protocol.SparkRankAssignment(2, "10.0.0.1", 1, {"HOROVOD_RANK": "2", "X": "é"}),
                  protocol.SparkAgentRegistration("10.0.0.1/exec-3", pid=12, attempt=2),
                  protocol.SparkWorkerExit(1, None, protocol.FailureRecord(1, "cause", "ValueError: x", 5.0)),
                  protocol.SparkWorkerExit(None, 9),
                  protocol.SparkOutputBatch((("stdout", "[0]<stdout>:a\n"), ("stderr", "é\r"), ("stdout", ""))),
                  protocol.SparkOutputBatch(())]


@pytest.mark.parametrize("message", SPARK_MESSAGES, ids=lambda m: type(m).__name__)
def test_spark_messages_survive_their_json_encoding(message: object) -> None:
    raw = message.encode()  # type: ignore[attr-defined]
    assert isinstance(raw, bytes) and isinstance(json.loads(raw), dict)
    assert type(message).decode(raw) == message  # type: ignore[attr-defined]


@pytest.mark.parametrize("command", [protocol.StartWorker(4, {"HOROVOD_ELASTIC": "1"}),
                                     protocol.StopWorker(2.5), protocol.KillWorker(),
                                     protocol.ExitAgent()], ids=lambda c: type(c).__name__)
def test_agent_commands_survive_their_json_encoding(command: protocol.AgentCommand) -> None:
    assert protocol.agent_command(command.encode()) == command


def test_a_rank_exit_row_survives_pickle() -> None:
    """A barrier task's row goes back to the driver pickled by Spark."""
    import pickle

    row = protocol.SparkRankExit(1, "h", 0, None, 9, 12.5, None, ("Killed",))
    assert pickle.loads(pickle.dumps(row)) == row


@pytest.mark.parametrize("raw, match", [
    (b'{"op": "reboot"}', "agent command '{\"op\": \"reboot\"}' is malformed .*unknown op 'reboot'"),
    (b'{"op": "start", "seq": 1}', "agent command .*KeyError"),
    (b'{"op": "start", "seq": 1, "env": ["A=1"]}', "env is a list"),
    (b"[1, 2]", "a JSON list, not an object"),
    (b"not json", "agent command .* malformed"),
])
def test_malformed_agent_commands_are_named(raw: bytes, match: str) -> None:
    with pytest.raises(HorovodInternalError, match=match):
        protocol.agent_command(raw)


def test_malformed_spark_messages_name_the_message() -> None:
    with pytest.raises(HorovodInternalError, match="Spark agent's worker exit .* malformed"):
        protocol.SparkWorkerExit.decode(b'{"code": 1}')
    with pytest.raises(HorovodInternalError, match="record is a str"):
        protocol.SparkWorkerExit.decode(b'{"code": 1, "signal": null, "record": "boom"}')
    with pytest.raises(HorovodInternalError, match="rank assignment .* malformed"):
        protocol.SparkRankAssignment.decode(b'{"rank": "two", "host": "h", "local_rank": 0, "env": {}}')


@pytest.mark.parametrize("raw, match", [
    (b'[["stdout", "a"]]', "output batch .* malformed .*a JSON list, not an object"),  # the bare pairs
    (b'{"text": "a"}', "output batch .* malformed .*KeyError"),
    (b'{"lines": "a"}', "lines is a str, not a list"),
    (b'{"lines": [["stdout", "a"], ["stdin", "b"]]}', r"lines\[1\] is \['stdin', 'b'\], not a \[stream, text\]"),
    (b'{"lines": [["stdout", 3]]}', r"lines\[0\] is \['stdout', 3\]"),
    (b'{"lines": [["stderr", "a", "b"]]}', r"lines\[0\] is \['stderr', 'a', 'b'\]"),
    (b'{"lines": ["stdout"]}', r"lines\[0\] is 'stdout'"),
])
def test_malformed_output_batches_name_the_batch_and_the_line(raw: bytes, match: str) -> None:
    with pytest.raises(HorovodInternalError, match=match):
        protocol.SparkOutputBatch.decode(raw)


def test_an_output_batch_is_one_json_pair_a_line() -> None:
    """The wire stays cheap (a batch holds up to 256 KiB of lines) and stable across versions."""
    batch = protocol.SparkOutputBatch((("stdout", "[1]<stdout>:a\n"), ("stderr", "[1]<stderr>:b\n")))
    assert batch.encode() == b'{"lines": [["stdout", "[1]<stdout>:a\\n"], ["stderr", "[1]<stderr>:b\\n"]]}'


def test_a_remote_shims_environment_line_round_trips_and_refuses_anything_else() -> None:
    env = {"HOROVOD_RANK": "1", "HOROVOD_SECRET_KEY": "s\n\"x\"", "PATH": "/bin"}
    line = protocol.env_line(env)
    assert line.endswith(b"\n") and line.count(b"\n") == 1  # one stdin line, whatever the values
    assert protocol.parse_env_line(line) == env
    for bad in (b'{"environ": {}}\n', b"[1, 2]\n", b'{"env": {"A": 1}}\n', b"signal 15\n"):
        with pytest.raises(ValueError, match="not an environment line"):
            protocol.parse_env_line(bad)


def test_store_scopes_and_keys_are_spelled_only_in_the_protocol() -> None:
    """A call on the rendezvous store (``get``/``put``/``wait``/``pop``/``delete`` on a client,
    server or store) names its scope with a protocol constant or function, never a literal, and
    no key under a protocol scope is built with an f-string."""
    import ast
    from pathlib import Path

    package = Path(protocol.__file__).resolve().parents[2]
    bad = []
    for path in sorted(package.rglob("*.py")):
        if "protocol" in path.relative_to(package).parts[:2]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("get", "put", "wait", "pop", "delete") and len(node.args) >= 2):
                continue
            scope, key = node.args[0], node.args[1]
            receiver = ast.unparse(node.func.value).lower()
            on_store = any(word in receiver for word in ("client", "server", "store", "rendezvous"))
            literal_scope = on_store and (isinstance(scope, ast.JoinedStr) or (
                isinstance(scope, ast.Constant) and isinstance(scope.value, str)))
            built_key = (isinstance(scope, ast.Name) and scope.id.endswith("_SCOPE")
                         and isinstance(key, ast.JoinedStr))
            if literal_scope or built_key:
                bad.append(f"{path.relative_to(package.parent)}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "store scopes or keys spelled outside horovod/common/protocol/:\n" + "\n".join(bad)


def test_monitor_report_round_trip_and_checks() -> None:
    import numpy as np

    rep = protocol.MonitorReport(2, "node1", 0, 3, 12.5, False, 7, (0.01, 0.02), 0.5,
                                 {"allreduce": 4}, {"allreduce": 64}, {"allreduce": 0.1}, 1, True, 0.75)
    assert protocol.MonitorReport.from_wire(json.loads(json.dumps(rep.to_wire()))) == rep
    # a newer rank's extra fields are ignored; absent ones take their defaults
    assert protocol.MonitorReport.from_wire({"rank": 1, "future": [1]}) == protocol.MonitorReport(1)
    # hvd.metrics() may hold NumPy scalars: read as Python numbers
    snap = {"steps": np.int64(3), "wait_seconds": np.float32(0.25), "straggler": False,
            "in_flight": 2, "stragglers": [1]}
    got = protocol.MonitorReport.from_snapshot(snap, rank=1, local_rank=1, host="h", time=1.0, final=True)
    assert (got.steps, got.wait_seconds, got.final, got.host) == (3, 0.25, True, "h")
    assert type(got.steps) is int and type(got.wait_seconds) is float
    for bad, named in (({"rank": "0"}, "'rank'"), ({"rank": 0, "steps": 1.5}, "'steps'"),
                       ({"rank": 0, "straggler": 1}, "'straggler'"),
                       ({"rank": 0, "collectives": {"allreduce": "x"}}, "'collectives'"),
                       ({"rank": 0, "step_times": "fast"}, "'step_times'")):
        with pytest.raises(ValueError, match=named):
            protocol.MonitorReport.from_wire(bad)
    with pytest.raises(ValueError, match="without a rank"):
        protocol.MonitorReport.from_wire({"steps": 1})
    with pytest.raises(ValueError, match="JSON object"):
        protocol.MonitorReport.from_wire([1])


def test_monitor_report_where_the_rank_is() -> None:
    """Issue 45: pid, where, stack and flight are optional and checked; an older rank's report,
    without them, is accepted and leaves them unset."""
    flight = {"done": [[3, 0, "allreduce", "grad.w", "float32", [[4, 2]], 1.5, 0.002]],
              "in_flight": [[4, 0, "allreduce", "grad.w", "float32", [[4, 2]], "negotiated", 0.5]]}
    rep = protocol.MonitorReport(1, pid=42, where="load (train.py:3)", stack='  File "t.py", line 3',
                                 flight=flight)
    assert protocol.MonitorReport.from_wire(json.loads(json.dumps(rep.to_wire()))) == rep
    old = protocol.MonitorReport.from_wire({"rank": 1, "steps": 3})
    assert (old.pid, old.where, old.stack, old.flight) == (0, "", None, None)
    assert "stack" not in old.to_wire() and "flight" not in old.to_wire()
    assert protocol.MonitorReport.from_wire({"rank": 0, "flight": {}}).flight == {"done": [], "in_flight": []}
    row = flight["done"][0]
    for bad, named in (({"pid": "42"}, "'pid'"), ({"stack": ["a"]}, "'stack'"),
                       ({"where": 3}, "'where'"), ({"flight": []}, "'flight'.*not an object"),
                       ({"flight": {"later": []}}, "unknown part"),
                       ({"flight": {"done": "x"}}, "'done'.*not a list"),
                       ({"flight": {"done": [row[:7]]}}, "'done' row 0.*8 values"),
                       ({"flight": {"done": [[*row[:5], [["4"]], *row[6:]]]}}, "'done' row 0.*integer"),
                       ({"flight": {"done": [[*row[:6], "old", row[7]]]}}, "'done' row 0.*number"),
                       ({"flight": {"in_flight": [row]}}, "'in_flight' row 0.*not a string"),
                       ({"flight": {"done": [row] * 65}}, "65 rows, at most 64")):
        with pytest.raises(ValueError, match=named):
            protocol.MonitorReport.from_wire({"rank": 0, **bad})
