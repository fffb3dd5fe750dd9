"""The piece size follows the machine (``engine/pieces.py``): the policy, when the follower is on,
and what it counts as a sample and applies.

* ``PiecePolicy`` (pure): the default size runs; a trial of the other size comes after ``period``
  samples or as soon as the chosen size got ``DEGRADED`` times slower; the other size wins only
  when ``WIN`` times faster; a lost trial doubles the period (up to its cap), a won one resets it;
  the first sample after a change of size is not counted; samples of the size not running are.
* ``followed_pieces`` / ``PieceFollower.from_config``: on only where nobody else decides the piece
  size (MPI, ``HOROVOD_CHUNK_BYTES`` unset, no autotune, more than one rank, not turned off).
* ``PieceFollower``: counts every large allreduce batch of the global set (not another set's, not
  a small one, not Adasum, not another kind), times them on rank 0 only, and at each check point
  applies the broadcast size to the tunables on every rank.
"""

from __future__ import annotations

import pytest

from horovod.common.backends.gloo import GlooBackend
from horovod.common.backends.mpi import MPIBackend
from horovod.common.config import EngineConfig
from horovod.common.engine import pieces
from horovod.common.engine.pieces import MIN_SAMPLE_BYTES, PieceFollower, PiecePolicy
from horovod.common.engine.tunables import (
    DEFAULT_CHUNK_BYTES,
    FOLLOWED_CHUNK_BYTES,
    Tunables,
    followed_pieces,
    piece_sizes,
)
from horovod.common.types import ReduceOp, Request, RequestType, Response

pytestmark = pytest.mark.unit

MiB = 1 << 20
A, B = 2 * MiB, 16 * MiB


def _feed(policy: PiecePolicy, times: dict[int, float], n: int, batches: tuple[float, ...] = (1.0,)) -> list[int]:
    """``n`` samples, a check point after each: batch ``i % len(batches)`` in turn, its time at a
    size ``times[size] * batches[i]``; the size running after each."""
    out = []
    for i in range(n):
        k = i % len(batches)
        policy.sample(policy.running, k, times[policy.running] * batches[k])
        out.append(policy.choose())
    return out


def _warm(p: PiecePolicy) -> None:
    """Both sizes' first runs (never counted) out of the way, as in a job's first trial."""
    p._fresh.clear()


def test_the_default_runs_until_the_period_then_a_trial_in_turns_that_loses_doubles_the_period() -> None:
    p = PiecePolicy((A, B), trial=3, first_period=6, max_period=24)
    _warm(p)
    assert p.running == p.chosen == A
    ran = _feed(p, {A: 1.0, B: 2.0}, 6)
    assert ran == [A] * 5 + [B] and p.trials == 1
    # the trial: B and A in turn until each has 3 samples, then A again, the period doubled
    ran = _feed(p, {A: 1.0, B: 2.0}, 6)
    assert ran == [A, B, A, B, A, A]
    assert p.chosen == A and p.period == 12 and list(p.changes) == [] and p.verdict() is None
    assert _feed(p, {A: 1.0, B: 2.0}, 12)[-1] == B
    _feed(p, {A: 1.0, B: 2.0}, 6)
    assert p.period == 24
    assert _feed(p, {A: 1.0, B: 2.0}, 24)[-1] == B
    _feed(p, {A: 1.0, B: 2.0}, 6)
    assert p.period == 24 and p.chosen == A and p.trials == 3


def test_a_faster_other_size_wins_and_the_period_starts_again() -> None:
    p = PiecePolicy((A, B), trial=3, first_period=6, max_period=24)
    _warm(p)
    _feed(p, {A: 1.0, B: 2.0}, 12)  # one lost trial: period 12
    assert p.period == 12
    _feed(p, {A: 1.0, B: 0.5}, 12 + 6)  # the next trial: B twice as fast
    assert p.chosen == p.running == B and p.period == 6
    assert [size for _, size in p.changes] == [B]
    # now A is the other size: its trial comes after 6 samples, and A wins back when faster
    _feed(p, {A: 0.3, B: 0.5}, 6 + 6)
    assert p.chosen == A and [size for _, size in p.changes] == [B, A]


def test_a_margin_below_win_keeps_the_chosen_size() -> None:
    p = PiecePolicy((A, B), trial=3, first_period=6, max_period=24, win=0.9)
    _warm(p)
    _feed(p, {A: 1.0, B: 0.95}, 12)  # 5 % faster: not enough
    assert p.chosen == A and p.trials == 1 and list(p.changes) == []


def test_a_degraded_chosen_size_gets_a_trial_before_its_period() -> None:
    p = PiecePolicy((A, B), trial=3, first_period=100, degraded=1.5)
    _warm(p)
    _feed(p, {A: 1.0, B: 2.0}, 4)  # the base: 1.0
    assert p.running == A and p.trials == 0
    ran = _feed(p, {A: 2.0, B: 0.8}, 2)  # the machine changed: A twice as slow
    assert ran[-1] == B and p.trials == 1
    _feed(p, {A: 2.0, B: 0.8}, 6)
    assert p.chosen == B
    # after the trial the base is learned again at the chosen size: no new trial at once
    _feed(p, {A: 2.0, B: 0.8}, 10)
    assert p.trials == 1


def test_the_trial_compares_what_ran_at_the_same_time() -> None:
    # A took 2.0 until the trial; then the machine got faster for both sizes (A 1.0, B 1.6):
    # against A's times from before, B would look 0.8x; in turns it is 1.6x and loses
    p = PiecePolicy((A, B), trial=3, first_period=6)
    _warm(p)
    _feed(p, {A: 2.0, B: 3.2}, 6)
    assert p.running == B
    _feed(p, {A: 1.0, B: 1.6}, 6)
    assert p.chosen == A and list(p.changes) == []


def test_a_sizes_first_run_is_not_counted_nor_a_sample_of_the_size_not_running() -> None:
    p = PiecePolicy((A, B), trial=3, first_period=2)
    p.sample(B, 0, 9.0)  # B is not running: ignored
    p.sample(A, 0, 100.0)  # A's first run: not counted (else it would be in A's base)
    p.sample(A, 0, 1.0)
    p.sample(A, 0, 1.0)
    assert p.choose() == B and p._since == 2
    p.sample(B, 0, 100.0)  # B's first run: not counted
    p.sample(B, 0, 0.5)
    assert p.choose() == A
    for size in (A, B, A, B, A):  # in turn until each has 3
        assert p.running == size
        p.sample(size, 0, 1.0 if size == A else 0.5)
        p.choose()
    assert p.chosen == B and p.verdict() is None  # (decided: no trial running)


def _trial(chosen: list[str], other: list[str], factor: float) -> PiecePolicy:
    """A trial of B against A: A runs the batches ``chosen`` and B the batches ``other``, each in
    its order whenever its turn comes, B ``factor`` times A's time for every batch (a cheap batch
    costs 1, a dear one 4), a check point after each sample; the policy after the trial."""
    cost = {"cheap": 1.0, "dear": 4.0}
    p = PiecePolicy((A, B), trial=3, first_period=1)
    _warm(p)
    p.sample(A, "cheap", 1.0)
    assert p.choose() == B
    turns = {A: iter(chosen), B: iter(other)}
    while p.trials == 1 and p._trial is not None:
        size = p.running
        key = next(turns[size])  # (runs out, and fails, if the trial needs more than it was given)
        p.sample(size, key, cost[key] * (factor if size == B else 1.0))
        p.choose()
    return p


def test_each_batch_is_compared_with_itself() -> None:
    # B 0.8x for every batch wins, though its trial sampled dear batches more often than A's
    # (the plain medians: 3.2 against 1)
    assert _trial(["dear", "cheap", "cheap"], ["dear", "dear", "cheap"], 0.8).chosen == B
    # B 1.2x for every batch loses, though its trial sampled cheap ones more often (1.2 against 4)
    assert _trial(["cheap", "dear", "dear"], ["cheap", "cheap", "dear"], 1.2).chosen == A


def test_a_trial_whose_batches_never_ran_at_both_sizes_ends_lost() -> None:
    p = PiecePolicy((A, B), trial=3, first_period=1)
    _warm(p)
    p.sample(A, "x", 1.0)
    assert p.choose() == B
    ran = []
    for i in range(100):  # every batch new: nothing to compare
        if p._trial is None:
            break
        ran.append(p.running)
        p.sample(p.running, f"b{i}", 0.1 if p.running == B else 1.0)
        p.choose()
    # it ends lost once B has had 4 x 3 samples and A a turn after them: a turn ends at 4 x 3
    # samples where no batch comes twice
    assert p._trial is None and ran.count(B) >= 12 and ran[-1] == A and len(ran) <= 3 * 12 + 1
    assert p.chosen == A and p.running == A and p.period == 2 and list(p.changes) == []


def test_a_turn_runs_a_whole_step_and_does_not_lock_onto_its_phase() -> None:
    # Four large batches a step, a check point every two samples, B 0.5x for every batch. A turn
    # of one check point would give B the step's last two batches and A its first two, every
    # step: nothing would run at both and B would never win.
    p = PiecePolicy((A, B), trial=3, first_period=4)
    _warm(p)
    step = ["grouped", "flat", "async", "numpy"]
    seen = 0
    while p.trials < 1 or p._trial is not None:
        key = step[seen % 4]
        p.sample(p.running, key, 1.0 if p.running == A else 0.5)
        seen += 1
        if seen % 2 == 0:
            p.choose(seen)
        assert seen < 4 * 10, "the trial did not end"
    assert p.chosen == B and [size for _, size in p.changes] == [B]


def test_a_step_of_many_large_batches_is_compared_over_the_steps_it_takes() -> None:
    # Seven different large batches a step (a per-tensor fusion, grouped calls, flat buckets), a
    # check point every two samples: in one step's turns each batch runs at one size only, and the
    # trial goes on until the same batches have run at both. B, 0.5x for every batch, wins its
    # first trial.
    p = PiecePolicy((A, B), trial=3, first_period=4)
    steps = [f"batch{k}" for k in range(7)]
    seen = 0
    while p.trials < 2 and seen < 7 * 20:  # up to the start of a second trial
        key = steps[seen % 7]
        p.sample(p.running, key, (1.0 if p.running == A else 0.5) * (1 + seen % 7))
        seen += 1
        if seen % 2 == 0:
            p.choose(seen)
    assert [size for _, size in p.changes][:1] == [B], (p.trials, list(p.changes))


def test_a_turn_without_timed_samples_ends_after_its_check_points() -> None:
    # Samples counted on every rank but not timed (a step's batches that are not the memo's own
    # objects) reach check points with nothing for the policy: the turn must not hold a size.
    p = PiecePolicy((A, B), trial=3, first_period=1)
    _warm(p)
    p.sample(A, "x", 1.0)
    assert p.choose() == B
    ran = [p.choose() for _ in range(4 * 3)]
    assert ran[:-1] == [B] * (4 * 3 - 1) and ran[-1] == A


def test_two_different_sizes_are_required() -> None:
    with pytest.raises(ValueError, match="two different piece sizes"):
        PiecePolicy((A, A))


# ---------------------------------------------------------------- when the follower is on

class _Backend:
    def __init__(self, size: int = 2, rank: int = 0, gloo: bool = False) -> None:
        self.size, self.rank = size, rank
        if gloo:
            self.piece_sizes = GlooBackend.piece_sizes
        self.sent: list[object] = []

    def bcast_from_root(self, obj: object) -> object:
        self.sent.append(obj)
        return obj


def _config(**env: str) -> EngineConfig:
    return EngineConfig.from_env(env)


def test_followed_sizes_only_where_the_transport_has_no_preference_and_the_user_set_none() -> None:
    assert FOLLOWED_CHUNK_BYTES == (DEFAULT_CHUNK_BYTES, 16 * MiB)
    assert followed_pieces(-1, MPIBackend) == FOLLOWED_CHUNK_BYTES
    assert followed_pieces(-1, None) == FOLLOWED_CHUNK_BYTES
    assert followed_pieces(-1, GlooBackend) == ()
    assert followed_pieces(4 * MiB, MPIBackend) == ()
    assert followed_pieces(0, MPIBackend) == ()


@pytest.mark.parametrize("env,backend,on", [
    ({}, _Backend(), True),
    ({"HOROVOD_ADAPTIVE_PIECES": "0"}, _Backend(), False),
    ({"HOROVOD_CHUNK_BYTES": str(4 * MiB)}, _Backend(), False),
    ({"HOROVOD_AUTOTUNE": "1"}, _Backend(), False),
    ({}, _Backend(gloo=True), False),
    ({}, _Backend(size=1), False),
])
def test_the_follower_is_on_only_where_nobody_else_decides(env, backend, on) -> None:
    config = _config(**env)
    tunables = Tunables.from_config(config, backend=backend)
    follower = PieceFollower.from_config(config, tunables, backend)
    assert (follower is not None) is on
    # on, it starts at the default piece size; off, the size is the one policy's (piece_sizes)
    assert tunables.chunk_bytes == piece_sizes(config.chunk_bytes, backend)[0]
    assert not on or tunables.chunk_bytes == DEFAULT_CHUNK_BYTES


# ---------------------------------------------------------------- samples and check points

def _batch(nbytes: int, op: ReduceOp = ReduceOp.SUM, ps: int = 0, name: str = "g") -> tuple[Response, ...]:
    req = Request(name, RequestType.ALLREDUCE, "float32", ((nbytes // 4,),), reduce_op=op, process_set_id=ps)
    return (Response(req),)


def _run(f: PieceFollower, batch, seconds: float, kind: RequestType = RequestType.ALLREDUCE) -> None:
    f.batch_started(kind, batch)
    f.batch_run(kind, batch, [None], 10.0, 10.0 + seconds)


def test_only_large_allreduces_of_the_global_set_are_samples() -> None:
    be = _Backend()
    tun = Tunables()
    f = PieceFollower(PiecePolicy((A, B)), tun, 0, be.bcast_from_root)
    _run(f, _batch(MIN_SAMPLE_BYTES), 0.01)
    _run(f, _batch(MIN_SAMPLE_BYTES - 4), 0.01)  # small
    _run(f, _batch(4 * MIN_SAMPLE_BYTES, ps=1), 0.01)  # another process set
    _run(f, _batch(4 * MIN_SAMPLE_BYTES, op=ReduceOp.ADASUM), 0.01)
    _run(f, _batch(4 * MIN_SAMPLE_BYTES), 0.01, RequestType.BROADCAST)
    assert f.samples == 1
    assert f.policy._hist == {}  # (the first run of a size is not counted)
    _run(f, _batch(2 * MIN_SAMPLE_BYTES), 0.04)
    want = pytest.approx(0.04 / (2 * MIN_SAMPLE_BYTES))
    assert f.samples == 2 and [list(h) for h in f.policy._hist.values()] == [[want]]
    # a batch planned afresh (a list: not the same object next step) is counted, not timed
    f.batch_started(RequestType.ALLREDUCE, list(_batch(MIN_SAMPLE_BYTES)))
    f.batch_run(RequestType.ALLREDUCE, [], [None], 10.0, 11.0)
    assert f.samples == 3 and len(f.policy._hist) == 1


def test_the_broadcast_size_is_applied_at_each_check_point_on_every_rank() -> None:
    root = _Backend(rank=0)
    tr, to = Tunables(), Tunables()
    decided = iter([B, B, A])
    fr = PieceFollower(PiecePolicy((A, B), first_period=2), tr, 0, root.bcast_from_root, check=2)
    fo = PieceFollower(PiecePolicy((A, B)), to, 1, lambda obj: next(decided), check=2)  # rank 0's choices
    assert tr.chunk_bytes == to.chunk_bytes == A
    big = _batch(MIN_SAMPLE_BYTES)
    sizes = []
    for _ in range(6):
        for f in (fr, fo):
            _run(f, big, 0.01)
            f.batches_done([], True, None)
        sizes.append(to.chunk_bytes)
    # rank 1 applies what it received, only at check points (every 2 samples)
    assert sizes == [A, B, B, B, B, A]
    assert list(fo.applied) == [(0, A), (2, B), (6, A)]
    assert len(root.sent) == 3 and all(s in (A, B) for s in root.sent)
    # rank 0 times, rank 1 does not
    assert fo.policy._hist == {} and fo.policy.trials == 0
    assert fr.policy._hist and fr.policy.trials >= 1


def test_module_constants_make_trials_rare_on_a_steady_machine() -> None:
    # the cost bound the docs state: at most TRIAL samples of the slower size per MAX_PERIOD
    assert pieces.TRIAL / pieces.MAX_PERIOD < 0.005
    assert pieces.WIN < 1 < pieces.DEGRADED
