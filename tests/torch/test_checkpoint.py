"""hvd.checkpoint on real ranks: saved at np=4 by every rank (ZeroRedundancyOptimizer and
DistributedOptimizer, blocking and not), loaded at np=2, at np=3 and in one plain process with the
same consolidated state, training continued from it equal to training that never stopped (one
launch per world size); really sharded files; a failed save leaves nothing loadable; a directory
holding a user's files is refused; a checkpoint of another model, an optimizer the checkpoint
lacks, another optimizer class, fail on every rank (tests/torch/test_checkpoint_safety.py: crashes,
leftovers, exit without wait())."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tests._shared_launch import SharedLaunch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

_DIR = tempfile.mkdtemp(prefix="hvd-checkpoint-test-")
BATCH = 12  # the global batch: equal slices at 1, 2, 3 and 4 ranks


def _model():
    import torch

    torch.manual_seed(0)
    # four equal layers: four ranks can share the bytes evenly
    return torch.nn.Sequential(torch.nn.Linear(7, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))


def _batch(k, r, n):
    import torch

    g = torch.Generator().manual_seed(1000 + k)
    x, y = torch.randn(BATCH, 7, generator=g), torch.randint(0, 3, (BATCH,), generator=g)
    per = BATCH // n
    return x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]


def _train(model, opt, steps, r, n):
    import torch.nn.functional as F

    for k in steps:
        x, y = _batch(k, r, n)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def _close(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) <= 1e-5


def _save_at_4():
    """Train 10 steps, save (sharded and unsharded), train 10 more as the reference; a save that
    fails on one rank must commit nothing."""
    import copy

    import torch

    import horovod.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    model = _model()
    plain = copy.deepcopy(model)
    opt = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=1,
                                      named_parameters=model.named_parameters(), lr=1e-2)
    _train(model, opt, range(10), r, n)
    state10 = opt.full_state_dict(None)
    hvd.checkpoint.save(os.path.join(_DIR, "zero"), model=model, optimizer=opt, extra={"step": 10})
    popt = hvd.DistributedOptimizer(torch.optim.AdamW(plain.parameters(), lr=1e-2),
                                    named_parameters=plain.named_parameters())
    _train(plain, popt, range(10), r, n)
    handle = hvd.checkpoint.save(os.path.join(_DIR, "plain"), model=plain, optimizer=popt,
                                 extra={"step": 10}, blocking=False)
    _train(plain, popt, range(10, 12), r, n)  # training goes on while the files are written
    handle.wait()
    plain12 = [p.detach().clone() for p in plain.parameters()]
    _train(model, opt, range(10, 20), r, n)
    if r == 0:
        torch.save({"state10": state10, "final": [p.detach() for p in model.parameters()],
                    "plain12": plain12},
                   os.path.join(_DIR, "ref.pt"))
    # a failed write on the last rank: RuntimeError everywhere, nothing committed
    from torch.distributed.checkpoint import FileSystemWriter

    original = FileSystemWriter.write_data
    if r == n - 1:
        def broken(self, plan, planner):
            original(self, plan, planner).wait()  # its files are there...
            raise OSError("disk full (injected)")  # ...then the write fails
        FileSystemWriter.write_data = broken
    failed = None
    try:
        hvd.checkpoint.save(os.path.join(_DIR, "broken"), model=model, optimizer=opt)
    except RuntimeError as exc:
        failed = str(exc)
    finally:
        FileSystemWriter.write_data = original
    # a directory holding a user's files: refused on every rank, nothing touched
    user = os.path.join(_DIR, "user")
    if r == 0:
        os.makedirs(os.path.join(user, "sub"))
        with open(os.path.join(user, "notes.txt"), "w") as f:
            f.write("mine")
    hvd.barrier()
    refused = None
    try:
        hvd.checkpoint.save(user, model=model, optimizer=opt)
    except FileExistsError as exc:
        refused = str(exc)
    hvd.barrier()
    return failed, refused, sorted(os.listdir(user))


def _load_and_continue():
    """Load the np=4 checkpoints at np=2 (into stage 2) or np=3 (into stage 1): the same
    consolidated state, and the continued training equals the uninterrupted one; the sharded
    checkpoint into DistributedOptimizer and the unsharded one into the other stage; errors on
    every rank for bad input."""
    import torch

    import horovod.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad = []
    ref = torch.load(os.path.join(_DIR, "ref.pt"))
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # not the saved values: the load must set them
    stage = 2 if n == 2 else 1
    opt = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=0.5)
    extra = hvd.checkpoint.load(os.path.join(_DIR, "zero"), model=model, optimizer=opt)
    if extra != {"step": 10}:
        bad.append(f"rank {r}: extra {extra}")
    bad += _compare_state(opt.full_state_dict(None), ref["state10"], f"rank {r}: np={n} stage {stage}")
    _train(model, opt, range(10, 20), r, n)
    for i, (p, q) in enumerate(zip(model.parameters(), ref["final"])):
        if not _close(p.detach(), q):
            bad.append(f"rank {r}: continued at np={n}: parameter {i} differs from the "
                       "uninterrupted run")
    # the sharded checkpoint into an unsharded optimizer, and the unsharded one into ZeRO
    m2 = _model()
    dopt = hvd.DistributedOptimizer(torch.optim.AdamW(m2.parameters(), lr=1e-2),
                                    named_parameters=m2.named_parameters())
    hvd.checkpoint.load(os.path.join(_DIR, "zero"), model=m2, optimizer=dopt)
    bad += _compare_state(dopt.state_dict(), ref["state10"], f"rank {r}: into DistributedOptimizer")
    m3 = _model()
    zopt = hvd.ZeroRedundancyOptimizer(m3.parameters(), torch.optim.AdamW, stage=3 - stage, lr=1e-2)
    hvd.checkpoint.load(os.path.join(_DIR, "plain"), model=m3, optimizer=zopt)
    if len(zopt.optim.state) != len(zopt._local_index):
        bad.append(f"rank {r}: the unsharded checkpoint gave {len(zopt.optim.state)} states")
    _train(m3, zopt, range(10, 12), r, n)
    for i, (p, q) in enumerate(zip(m3.parameters(), ref["plain12"])):
        if not _close(p.detach(), q):
            bad.append(f"rank {r}: the unsharded checkpoint continued at np={n} (stage {3 - stage}): "
                       f"parameter {i} differs from the uninterrupted run")
    # bad input: another model; an optimizer the checkpoint does not have; half-written saves
    errors = {}
    other = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.Tanh(), torch.nn.Linear(33, 3))
    before = [p.detach().clone() for p in other.parameters()]
    try:
        hvd.checkpoint.load(os.path.join(_DIR, "zero"), model=other)
    except ValueError as exc:
        errors["other_model"] = str(exc)
    if any(not torch.equal(p, q) for p, q in zip(other.parameters(), before)):
        bad.append(f"rank {r}: a failed load changed the model")
    only = os.path.join(_DIR, f"model_only_np{n}")
    hvd.checkpoint.save(only, model=model)
    try:
        hvd.checkpoint.load(only, model=model, optimizer=opt)
    except ValueError as exc:
        errors["no_optimizer"] = str(exc)
    try:  # the AdamW checkpoint into SGD with momentum: refused before anything loads
        hvd.checkpoint.load(os.path.join(_DIR, "zero"), model=m2,
                            optimizer=hvd.DistributedOptimizer(torch.optim.SGD(m2.parameters(), lr=0.1,
                                                                               momentum=0.9)))
    except ValueError as exc:
        errors["sgd"] = str(exc)
    for name in ("broken", "uncommitted"):
        try:
            hvd.checkpoint.load(os.path.join(_DIR, name), model=model, optimizer=opt)
        except (ValueError, FileNotFoundError) as exc:
            errors[name] = str(exc)
    return bad, errors


def _compare_state(got, want, label):
    import torch

    bad = []
    if sorted(got["state"]) != sorted(want["state"]):
        return [f"{label}: state ids {sorted(got['state'])} != {sorted(want['state'])}"]
    for pid, st in want["state"].items():
        for key, v in st.items():
            if not torch.equal(got["state"][pid][key], v):
                bad.append(f"{label}: state {pid}.{key} differs")
    if [g["lr"] for g in got["param_groups"]] != [g["lr"] for g in want["param_groups"]]:
        bad.append(f"{label}: lr differs")
    return bad


_SAVE = SharedLaunch(4, {"save": _save_at_4}, timeout=300)
_LOAD = {n: SharedLaunch(n, {"load": _load_and_continue}, timeout=240) for n in (2, 3)}


@pytest.fixture(scope="module")
def saved():
    import horovod.torch as hvd

    results = _SAVE.results("save")
    # a checkpoint whose commit never happened: data files but no index
    shutil.copytree(os.path.join(_DIR, "zero"), os.path.join(_DIR, "uncommitted"))
    os.remove(os.path.join(hvd.checkpoint.latest(os.path.join(_DIR, "uncommitted")), ".metadata"))
    yield results
    shutil.rmtree(_DIR, ignore_errors=True)


def test_checkpoint_files_are_sharded(saved):
    import horovod.torch as hvd

    for name in ("zero", "plain"):
        root = hvd.checkpoint.latest(os.path.join(_DIR, name))
        sizes = {f: os.path.getsize(os.path.join(root, f)) for f in os.listdir(root)}
        assert len([f for f in sizes if f.endswith(".distcp")]) == 4, sizes
        assert max(sizes.values()) <= 0.6 * sum(sizes.values()), sizes


def test_failed_save_commits_nothing(saved):
    for r, (msg, _, _) in enumerate(saved):
        assert msg is not None and "disk full (injected)" in msg and "rank 3" in msg, (r, msg)
    assert not os.path.exists(os.path.join(_DIR, "broken"))
    assert not os.path.exists(os.path.join(_DIR, "broken.partial"))


def test_a_foreign_directory_is_refused_on_every_rank(saved):
    for r, (_, refused, listing) in enumerate(saved):
        assert refused is not None and "refusing to write" in refused and "notes.txt, sub/" in refused, (r, refused)
        assert listing == ["notes.txt", "sub"], (r, listing)


@pytest.mark.parametrize("n", [2, 3])
def test_load_at_another_size_and_continue(saved, n):
    results = _LOAD[n].results("load")
    assert len(results) == n
    for bad, errors in results:
        assert not bad, "\n".join(bad)
        assert "unexpected model keys ['4.bias', '4.weight'" in errors["other_model"], errors
        assert "shape (32, 7) in the checkpoint, (33, 7) in the model" in errors["other_model"]
        assert "no optimizer state" in errors["no_optimizer"], errors
        assert "torch.optim.adamw.AdamW" in errors["sgd"] and "torch.optim.sgd.SGD" in errors["sgd"], errors
        assert "'momentum'" in errors["sgd"] and "'betas'" in errors["sgd"], errors
        assert "no checkpoint" in errors["broken"], errors
        assert "not a complete checkpoint" in errors["uncommitted"], errors


def test_load_in_one_plain_process(saved):
    """No launcher, no hvd.init(): the np=4 sharded checkpoint into a plain AdamW."""
    import torch

    import horovod.torch as hvd

    ref = torch.load(os.path.join(_DIR, "ref.pt"))
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    assert hvd.checkpoint.load(os.path.join(_DIR, "zero"), model=model, optimizer=opt) == {"step": 10}
    assert not _compare_state(opt.state_dict(), ref["state10"], "one process")
    _train(model, opt, range(10, 20), 0, 1)
    for p, q in zip(model.parameters(), ref["final"]):
        assert _close(p.detach(), q)
