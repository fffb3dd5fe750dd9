"""Elastic ``RayExecutor`` (``min_workers``/``max_workers``) on a real local Ray cluster: a killed
actor is survived and a node added to the cluster is taken in, with no committed step lost."""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest

from horovod.common import exceptions as errors
from horovod.ray import RayExecutor
from tests._averaging import averaged_params
from tests._logs import records_of

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]


def _elastic_train(kill_host_suffix, min_steps, max_steps):
    import os
    import signal

    import torch

    import horovod.torch as hvd
    from horovod.ray import ray_logger

    hvd.init()
    ray_logger.log({"started": os.getpid(), "host": os.environ["HOROVOD_ELASTIC_HOST"]})
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, opt, step=0, sizes=[], step_sizes=[])

    @hvd.elastic.run
    def train(state):
        state.sizes = state.sizes + [hvd.size()]  # the sizes of the rounds this state lived in
        while state.step < max_steps:
            if state.step >= min_steps and state.sizes[-1] == 3 and 2 in state.sizes:
                break
            if (len(state.sizes) == 1 and state.step == 3
                    and os.environ["HOROVOD_ELASTIC_HOST"].endswith(kill_host_suffix)):
                os.kill(os.getpid(), signal.SIGKILL)  # this actor dies mid-training
            # each rank on its own batch: the weights show whether the step averaged every rank
            state.step_sizes = state.step_sizes + [hvd.size()]
            x, y = _batch(state.step, hvd.rank())
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            state.step += 1
            time.sleep(0.1)
            state.commit()

    train(state)
    ray_logger.log({"finished": os.getpid()})
    return {"rank": hvd.rank(), "size": hvd.size(), "step": state.step, "sizes": state.sizes,
            "step_sizes": state.step_sizes,
            "host": os.environ["HOROVOD_ELASTIC_HOST"],
            "params": [p.detach().numpy().copy() for p in model.parameters()]}


def _batch(step, rank):
    import torch

    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 4, generator=gen) + rank, torch.randn(8, 1, generator=gen)


def _expected_params(step_sizes):
    """``_train`` in one process (``tests/_averaging.py``)."""
    return averaged_params(step_sizes, _batch, lr=0.05)


def test_killed_actor_survived_and_new_node_taken_in(free_cluster):
    second = free_cluster.second_id[:8]
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=20), min_workers=2, max_workers=3,
                     elastic_timeout=60)
    ex.start()
    added: list = []
    outcome: dict = {}
    logged: list = []

    def run():
        try:
            outcome["out"] = ex.run(_elastic_train, args=[second, 10, 1500], callbacks=[logged.append])
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            outcome["error"] = exc

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    try:
        # Once the driver has blacklisted the dead actor's node, a new node joins the cluster
        # (Ray adds nodes from the main thread only).
        deadline = time.monotonic() + 90
        while runner.is_alive() and time.monotonic() < deadline and not added:
            driver = ex.adapter.driver if ex.adapter is not None else None
            if driver is not None and any("blacklisting" in e for e in list(driver.events)):
                added.append(free_cluster.add_node(num_cpus=1))
            time.sleep(0.2)
        runner.join(timeout=150)
        assert not runner.is_alive(), "the elastic run did not end"
        if "error" in outcome:
            raise outcome["error"]
        out = outcome["out"]
        events = list(ex.adapter.events)
    finally:
        ex.shutdown()
        for node in added:
            free_cluster.remove_node(node)
    assert added, "the dead actor's node was never blacklisted"
    assert [o["rank"] for o in out] == [0, 1, 2], out
    assert all(o["size"] == 3 for o in out), out
    # Round 0 had 3 workers, the survivors went on with 2, the new node's worker made 3 again.
    assert out[0]["sizes"][:3] == [3, 2, 3], out[0]["sizes"]
    hosts = {o["host"] for o in out}
    assert not any(h.endswith(second) for h in hosts), hosts  # the dead actor's node is out
    assert any(h.endswith(added[0].node_id[:8]) for h in hosts), (hosts, added[0].node_id)
    steps = out[0]["step"]
    assert all(o["step"] == steps for o in out)
    for o in out[1:]:
        for a, b in zip(out[0]["params"], o["params"]):
            np.testing.assert_array_equal(a, b)  # identical on every rank
    step_sizes = out[0]["step_sizes"]
    assert len(step_sizes) == steps and {2, 3} <= set(step_sizes), step_sizes
    assert all(o["step_sizes"] == step_sizes for o in out), [o["step_sizes"] for o in out]
    for got, want in zip(out[0]["params"], _expected_params(step_sizes)):
        # no committed step lost, applied twice or left unaveraged across the two resets
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # Every worker's ray_logger values reach the callbacks (as upstream's elastic executor): the
    # three first workers, the one on the new node; the three that finished.
    started = [e for e in logged if "started" in e]
    assert len(started) == 4 and len({e["started"] for e in started}) == 4, logged
    assert any(e["host"].endswith(added[0].node_id[:8]) for e in started), started
    assert sorted(e["finished"] for e in logged if "finished" in e) == sorted(
        e["started"] for e in started if not e["host"].endswith(second)), logged
    text = "\n".join(events)
    assert "killed by signal 9" in text and "round 1: training resumes with 2 workers" in text, text
    assert "round 2: training resumes with 3 workers" in text, text


def _raise_everywhere():
    import horovod.torch as hvd

    hvd.init()
    raise ValueError(f"bad input on rank {hvd.rank()}")


def test_every_worker_raising_fails_the_run_with_their_errors(free_cluster):
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=20), min_workers=2, max_workers=2,
                     elastic_timeout=5)
    ex.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(errors.WorkerFailedError) as info:
            ex.run(_raise_everywhere)
        elapsed = time.monotonic() - t0
    finally:
        ex.shutdown()
    err, text = info.value, str(info.value)
    lines = text.splitlines()
    assert lines[0].startswith("RayExecutor.run(_raise_everywhere) [elastic]: the elastic job failed: "), text
    # the root-cause worker in the words of every launcher (job_outcome.format_failure), the other
    # one after it, the executor's note, the root cause's traceback
    # (a worker's slot on its node: [0] or [1], where Ray placed both workers on one node)
    root = re.fullmatch(r"  root cause: worker (\S+)\[(\d)\] \(rank (\d)\) raised ValueError: bad input on rank \3",
                        lines[2])
    assert root is not None, text
    # (the other worker raised too, unless the driver stopped it first: its node was the culprit's)
    also = [line for line in lines if line.startswith("  also ")]
    assert all(re.fullmatch(r"  also worker \S+\[\d\] \(rank \d\): ValueError: bad input on rank \d", a)
               for a in also), text
    assert "min_workers=2" in lines[3 + len(also)], text
    assert lines[4 + len(also)] == f"Traceback of worker {root[1]}[{root[2]}] (rank {root[3]}):", text
    assert isinstance(err.exception, ValueError) and err.rank == int(root[3]) and err.host == root[1]
    assert err.outcome.elastic is not None and err.ranks[0] == int(root[3])
    assert elapsed < 60, elapsed


def test_too_few_slots_fails_after_the_elastic_timeout(free_cluster):
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=20), min_workers=5, elastic_timeout=3)
    ex.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(errors.WorkerFailedError) as info:
            ex.run(_raise_everywhere)
        elapsed = time.monotonic() - t0
    finally:
        ex.shutdown()
    text = str(info.value)
    assert "too few hosts: only 3 slot(s) available" in text, text
    assert "min_workers=5" in text and "offers 3 slot(s)" in text, text
    assert elapsed >= 3, elapsed  # it waited the elastic timeout (the message says which limit ended it)


def _rank_and_size():
    import ray

    import horovod.torch as hvd

    hvd.init()
    return hvd.rank(), hvd.size(), ray.get_runtime_context().get_node_id()


class _OnlyTheSecondNode:
    """A user's discovery (override_discovery=False): the second node by its id, 1 slot."""

    def __init__(self, node_id):
        self.node_id = node_id

    def find_available_hosts_and_slots(self):
        return {self.node_id: 1}


def test_upstream_elastic_ray_executor_api_with_own_discovery(free_cluster):
    from horovod.ray import ElasticRayExecutor

    settings = ElasticRayExecutor.create_settings(min_num_proc=1, max_num_proc=2, elastic_timeout=30)
    settings.discovery = _OnlyTheSecondNode(free_cluster.second_id)
    with pytest.warns(DeprecationWarning, match="RayExecutor\\(settings, min_workers"):
        ex = ElasticRayExecutor(settings, cpus_per_slot=1, env_vars={"X": "1"},
                                override_discovery=False)
    ex.start()
    try:
        assert ex.run(_rank_and_size) == [(0, 1, free_cluster.second_id)]
    finally:
        ex.executor.shutdown()


class _NamedHosts:
    """A user's discovery naming hosts as upstream's tests do: names the cluster holds as
    ``node:<name>`` resources, not Ray node ids or IPs."""

    def __init__(self, hosts):
        self.hosts = hosts

    def find_available_hosts_and_slots(self):
        return dict(self.hosts)


def test_discovery_by_host_names_places_workers_on_the_nodes_holding_node_resources(free_cluster):
    named = free_cluster.add_node(num_cpus=1, resources={"node:hvd-host-a": 1})
    try:
        settings = RayExecutor.create_settings(timeout_s=20)
        settings.discovery = _NamedHosts({"hvd-host-a": 1})
        ex = RayExecutor(settings, min_workers=1, max_workers=1, cpus_per_worker=1, elastic_timeout=30,
                         override_discovery=False)
        ex.start()
        try:
            assert ex.run(_rank_and_size) == [(0, 1, named.node_id)]
        finally:
            ex.shutdown()
    finally:
        free_cluster.remove_node(named)


def test_discovery_of_an_unknown_host_name_says_what_names_are_accepted(free_cluster):
    settings = RayExecutor.create_settings(timeout_s=20)
    settings.discovery = _NamedHosts({"no-such-host": 1})
    ex = RayExecutor(settings, min_workers=1, max_workers=1, elastic_timeout=10, override_discovery=False)
    with records_of("horovod.runner.elastic") as records:
        ex.start()
        try:
            with pytest.raises(errors.LaunchError, match="node:no-such-host"):
                ex.run(_rank_and_size)
        finally:
            ex.shutdown()
    # The worker that could not be placed never started: the job's end does not wait for it
    # (it used to, for the 10 s workers get to end before they are killed).
    lines = [r.getMessage() for r in records]
    assert not [line for line in lines if "still running" in line], lines
