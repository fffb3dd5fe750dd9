"""An srun step's store and key service never depend on a port staying free between its choice
and its bind (``horovod.common.slurm_ports``): the candidates lie below the ephemeral range, task 0
binds and holds the first free one, and the other tasks find it among the candidates.

The taken port is taken for real before task 0 starts (a socket holding it), so the fallback is
what the test sees, every time.
"""

from __future__ import annotations

import dataclasses
import errno
import socket
import threading
from typing import Any

import pytest

from horovod.common import slurm_ports, slurm_secret
from horovod.common.launcher_detection import LauncherError, detect
from tests._ports import held_step_ports

STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "1"}


def _holder() -> socket.socket:
    """A socket holding a free port of 127.0.0.1 (listening, as another service would)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


def test_candidates_are_the_same_everywhere_and_below_the_ephemeral_range() -> None:
    store, key = slurm_ports.step_ports(STEP), slurm_ports.step_ports(STEP, "key")
    assert store == slurm_ports.step_ports(dict(STEP)) and len(set(store)) == slurm_ports.CANDIDATES
    assert all(20000 <= p < 32768 and p % 2 == 0 for p in store)  # Linux's default: 32768-60999
    assert key == [p + 1 for p in store]
    assert detect({**STEP, "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2",
                   "SLURM_STEP_NODELIST": "n1"}).master_port == store[0]
    assert slurm_ports.step_ports({**STEP, "MASTER_PORT": "29500"}) == [29500]  # the user's: no others
    assert slurm_ports.step_ports({**STEP, "MASTER_PORT": "29500"}, "key") == [29501]
    assert slurm_ports.step_ports({**STEP, "SLURM_STEP_ID": "2"})[0] != store[0]


def test_ephemeral_range_is_read_from_proc(tmp_path: Any) -> None:
    f = tmp_path / "range"
    f.write_text("32768\t60999\n")
    assert slurm_ports.ephemeral_range(str(f)) == (32768, 60999)
    assert slurm_ports.ephemeral_range(str(tmp_path / "missing")) is None


def test_task_0_skips_a_taken_candidate_and_binds_the_next() -> None:
    taken = _holder()
    free = _holder()
    free_port = free.getsockname()[1]
    free.close()
    tried: list[int] = []

    def bind(port: int) -> socket.socket:
        tried.append(port)
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            sock.close()
            raise
        return sock

    try:
        got = slurm_ports.bind_first([taken.getsockname()[1], free_port], bind, ephemeral=(1, 1))
        assert tried == [taken.getsockname()[1], free_port] and got.getsockname()[1] == free_port
        got.close()
        # All taken: the last EADDRINUSE, for the caller's message.
        with pytest.raises(OSError) as info:
            slurm_ports.bind_first([taken.getsockname()[1]], bind, ephemeral=(1, 1))
        assert info.value.errno == errno.EADDRINUSE
    finally:
        taken.close()


def test_task_0_prefers_candidates_outside_this_nodes_ephemeral_range() -> None:
    order: list[int] = []

    def bind(port: int) -> int:
        order.append(port)
        return port

    assert slurm_ports.bind_first([33000, 21000, 34000], bind, ephemeral=(32768, 60999)) == 21000
    assert order == [21000]


def test_srun_store_falls_back_to_the_next_candidate_and_every_task_finds_it() -> None:
    # Two tasks of an srun step (threads), the store's first candidate held by another process.
    from horovod.common import rendezvous_handlers
    from horovod.common.config import EngineConfig

    step, ports, held = held_step_ports(taken=1, free=1)
    env = {**step, "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "localhost",
           "MASTER_ADDR": "127.0.0.1", "HOROVOD_SECRET_KEY": "ab" * 32}
    config = dataclasses.replace(EngineConfig(), gloo_timeout_seconds=60)
    got: dict[int, Any] = {}
    errors: list[BaseException] = []

    def task(rank: int) -> None:
        environ = {**env, "SLURM_PROCID": str(rank)}
        try:
            handler = rendezvous_handlers.SlurmHandler(config, environ, detect(environ))
            rdv = handler.next_rendezvous()
            store = rdv.owned[0]  # the raw store (each thread here counts its own init prefix)
            store.set(f"from {rank}", str(rank))
            assert rdv.launch is handler.launch  # what the context's launch takes the port from
            got[rank] = (handler.launch.master_port, store.get(f"from {1 - rank}"), rdv)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=task, args=(r,), daemon=True) for r in (1, 0)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert {r: (p, v) for r, (p, v, _) in got.items()} == {0: (ports[1], b"1"), 1: (ports[1], b"0")}
    finally:
        for *_, rdv in got.values():
            rdv.close()
        for sock in held:
            sock.close()


def test_srun_store_names_the_taken_candidates_when_none_is_free() -> None:
    from horovod.common import rendezvous_handlers
    from horovod.common.config import EngineConfig

    step, ports, held = held_step_ports(taken=slurm_ports.CANDIDATES)
    env = {**step, "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "localhost", "SLURM_PROCID": "0",
           "MASTER_ADDR": "127.0.0.1", "HOROVOD_SECRET_KEY": "ab" * 32}
    listed = ", ".join(map(str, slurm_ports.step_ports(step)))
    try:
        with pytest.raises(LauncherError, match=f"every candidate port is taken \\({listed};.*MASTER_PORT"):
            rendezvous_handlers.SlurmHandler(EngineConfig(), env, detect(env)).next_rendezvous()
    finally:
        for sock in held:
            sock.close()


def test_munge_key_service_skips_a_taken_candidate() -> None:
    taken = _holder()
    free = _holder()
    ports = [taken.getsockname()[1], free.getsockname()[1]]
    free.close()
    try:
        _, service = slurm_secret._serve_munge("127.0.0.1", ports, "42.1.0")
        try:
            assert service._sock.getsockname()[1] == ports[1]  # type: ignore[attr-defined]
            assert service.port == ports[1]  # what task 0's launch names (``Launch.key_port``)
        finally:
            service.close()
        with pytest.raises(LauncherError, match="cannot open its key service.*MASTER_PORT"):
            slurm_secret._serve_munge("127.0.0.1", ports[:1], "42.1.0")
    finally:
        taken.close()
