"""The piece size follows the machine (``engine/pieces.py``) in a real MPI job, np=2 and np=3.

Every rank reduces a large tensor (above the follower's sample size) and a grouped set of tensors
of several sizes step after step, with rank-dependent values, while the follower runs its trials
of the other piece size. Every element of every result is checked exactly on every rank, at every
step (trials included); every rank applied the same piece sizes at the same steps; the trial ran
(both sizes were used); and turned off (``HOROVOD_ADAPTIVE_PIECES=0``), the piece size never
changes.
"""

from __future__ import annotations

import pytest

from horovod.testing import run_ranks

pytestmark = [pytest.mark.multiprocess]


def _steps(steps: int):
    import numpy as np

    import horovod.numpy as hvd
    from horovod.common.context import get_context
    from horovod.common.engine.pieces import MIN_SAMPLE_BYTES

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    eng = get_context().engine
    big = MIN_SAMPLE_BYTES // 4 + 12_345  # float32 elements: a sample, not a whole number of pieces
    shapes = [(3 * 1024 * 1024 + 7,), (513, 1031), (4097,), (17,)]  # one group: a sample too
    bad: list[str] = []
    used: list[int] = []
    sync = np.zeros(1, np.float32)
    for step in range(steps):
        # The size this step runs with, read once the last step's round has ended (its handles
        # complete before the round's end, where the follower may change the size; this small
        # allreduce completes in a later round, which changes nothing: it is no sample).
        hvd.allreduce(sync, name="sync")
        used.append(eng.tunables.chunk_bytes)
        x = (np.arange(big, dtype=np.float32) % 1000) + r + step
        got = hvd.allreduce(x, name="big", op=hvd.Sum)
        want = n * ((np.arange(big, dtype=np.float32) % 1000) + step) + n * (n - 1) / 2
        if not np.array_equal(got, want):
            at = int(np.flatnonzero(got != want)[0])
            bad.append(f"rank {r} step {step} big: element {at} is {got[at]}, expected {want[at]}")
        group = [np.full(s, float(r + k + step), np.float32) for k, s in enumerate(shapes)]
        outs = hvd.grouped_allreduce(group, name="group", op=hvd.Average)
        for k, (s, out) in enumerate(zip(shapes, outs)):
            want_k = np.full(s, (n - 1) / 2 + k + step, np.float32)
            if not np.array_equal(out, want_k):
                bad.append(f"rank {r} step {step} group[{k}]: {out.reshape(-1)[:3]} != {want_k.reshape(-1)[:3]}")
    follower = eng.pieces
    hvd.shutdown()  # (the last round, and the follower's choice at its end, done on every rank)
    applied = list(follower.applied) if follower is not None else None
    return bad, used, applied


@pytest.mark.parametrize("np_", [2, 3])
def test_every_rank_follows_the_same_sizes_with_exact_results(np_):
    results = run_ranks(_steps, np=np_, timeout=300, args=(40,))
    for bad, _, _ in results:
        assert bad == []
    used = [u for _, u, _ in results]
    applied = [a for _, _, a in results]
    assert all(u == used[0] for u in used), f"ranks used different piece sizes: {used}"
    assert all(a == applied[0] for a in applied), f"ranks applied different sizes: {applied}"
    # the first trial comes after FIRST_PERIOD (24) counted samples, two per step: both sizes ran
    assert set(used[0]) == {2 * 1024 * 1024, 16 * 1024 * 1024}, used[0]
    assert len(applied[0]) >= 2


def test_turned_off_the_piece_size_never_changes():
    results = run_ranks(_steps, np=2, timeout=300, args=(30,), env={"HOROVOD_ADAPTIVE_PIECES": "0"})
    for bad, used, applied in results:
        assert bad == []
        assert applied is None and set(used) == {2 * 1024 * 1024}
