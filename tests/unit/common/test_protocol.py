"""The launcher<->worker protocol (horovod.common.protocol) and the choice of rendezvous handler."""

from __future__ import annotations

import json

import pytest

from horovod.common import launcher, protocol
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
        assert type(handler_for(config, env, launcher.detect(env))) is kind, env
    assert elastic_round({**horovod, "HOROVOD_ELASTIC": "1"})
    assert not elastic_round(horovod) and not elastic_round({**horovod, "HOROVOD_ELASTIC": "0"})
    # A torchrun job of several ranks meets on torchrun's store even with HOROVOD_ELASTIC set.
    assert not elastic_round({**torchrun, "HOROVOD_ELASTIC": "1"})
