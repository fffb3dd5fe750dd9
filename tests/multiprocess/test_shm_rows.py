"""Rows through shared memory (``horovod/common/backends/shm_rows.py``) between real processes.

Every process checks every byte of every rank's row, over many rounds of changing lengths with
random delays between them (a rank two rounds ahead must never overwrite a row a peer has not
read yet), at 2 and 3 processes; a peer that dies is reported at once (its lock is gone), naming
it, and a peer alive but stuck after the timeout, naming it; a mapping made for another job (a
different token) or another world size is refused.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time

import numpy as np
import pytest

from horovod.common.backends import shm_rows
from horovod.common.exceptions import HorovodInternalError

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(not shm_rows.usable(), reason="shared rows need Linux on x86-64 with /dev/shm")]

ROUNDS = 300
_KEEP: list = []


def _row(rank: int, rnd: int, n: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.int64) * 7 + rank * 31 + rnd * 13) % 251).astype(np.uint8)


def _rounds(path: str, token: str, rank: int, size: int, cap: int, q: mp.Queue, opened) -> None:
    try:
        rows = shm_rows.ShmRows(path, token, rank, size, cap, 30.0)
        opened.wait()  # (the backend's vote: nobody waits for a rank that has not opened yet)
        rng = random.Random(rank)
        bad = []
        for rnd in range(ROUNDS):
            n = 1 + (rnd * 37) % cap  # every rank the same length, changing every round
            if rng.random() < 0.2:
                time.sleep(rng.random() * 1e-3)
            got = rows.exchange(_row(rank, rnd, n))
            for j in range(size):
                if got.shape != (size, n) or not np.array_equal(got[j], _row(j, rnd, n)):
                    bad.append(f"rank {rank} round {rnd}: rank {j}'s row differs")
        rows.close()
        q.put((rank, bad))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        q.put((rank, [repr(exc)]))


def _start(target, size: int, cap: int, *extra) -> tuple[list[mp.Process], mp.Queue, str]:
    made = shm_rows.create(size, cap)
    assert made is not None
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    opened = ctx.Barrier(size)
    _KEEP[:] = [opened]  # (alive until the children have it)
    procs = [ctx.Process(target=target, args=(made[0], made[1], r, size, cap, q, opened, *extra))
             for r in range(size)]
    for p in procs:
        p.start()
    return procs, q, made[0]


def _results(procs: list[mp.Process], q: mp.Queue, n: int, timeout: float = 120) -> dict[int, list[str]]:
    out = {}
    for _ in range(n):
        rank, bad = q.get(timeout=timeout)
        out[rank] = bad
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return out


@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_reads_every_row_of_every_round(size):
    procs, q, path = _start(_rounds, size, 4096)
    try:
        got = _results(procs, q, size)
    finally:
        shm_rows.discard(path)
    assert sorted(got) == list(range(size))
    for bad in got.values():
        assert not bad, bad[:5]


def _dies(path: str, token: str, rank: int, size: int, cap: int, q: mp.Queue, opened, how: str) -> None:
    try:
        rows = shm_rows.ShmRows(path, token, rank, size, cap, 20.0 if how == "dies" else 1.0)
        opened.wait()
        rows.exchange(_row(rank, 0, 8))
        if rank == size - 1:
            if how == "dies":
                os._exit(0)  # without a word: its lock ends with it
            time.sleep(5)  # stuck (alive, holding its lock) past the others' timeout
            q.put((rank, ["stuck"]))
            return
        t0 = time.monotonic()
        try:
            rows.exchange(_row(rank, 1, 8))
        except HorovodInternalError as exc:
            q.put((rank, [str(exc), time.monotonic() - t0]))
            return
        q.put((rank, ["no error"]))
    except BaseException as exc:  # noqa: BLE001
        q.put((rank, [repr(exc)]))


@pytest.mark.parametrize("size", [2, 3])
def test_a_peer_that_dies_is_named_at_once(size):
    procs, q, path = _start(_dies, size, 64, "dies")
    try:
        got = _results(procs, q, size - 1)
    finally:
        shm_rows.discard(path)
    for rank in range(size - 1):
        message = got[rank][0]
        # the lock path (not the 20 s timeout's): the dead rank by number, the round
        assert f"ranks [{size - 1}] left" in message and "round 2" in message, got[rank]


def test_a_stuck_peer_fails_the_others_after_the_timeout():
    procs, q, path = _start(_dies, 2, 64, "stuck")
    try:
        got = _results(procs, q, 2)
    finally:
        shm_rows.discard(path)
    assert "ranks [1] sent no rows of round 2 within 1 s" in got[0][0], got
    assert got[1] == ["stuck"]


def test_another_jobs_mapping_is_refused():
    made = shm_rows.create(2, 64)
    assert made is not None
    try:
        with pytest.raises(ValueError, match="another job"):
            shm_rows.ShmRows(made[0], "0" * 16, 0, 2, 64, 1.0)
        with pytest.raises(ValueError, match="not a rows mapping"):
            shm_rows.ShmRows(made[0], made[1], 0, 3, 64, 1.0)
        rows = shm_rows.ShmRows(made[0], made[1], 0, 2, 64, 1.0)
        rows.close()
    finally:
        shm_rows.discard(made[0])
    assert not os.path.exists(made[0])
