"""hvd.fully_shard on real ranks, checkpoints: full state dicts (model and AdamW) saved at np=4 and
loaded at np=2 and in a plain process; hvd.checkpoint (each rank its rows) saved at np=4, resumed
at np=2 and read by an unsharded model in a plain process; each equal to the uninterrupted run."""

from __future__ import annotations

import cloudpickle
import pytest

from tests._shared_launch import JOINT_TIMEOUT, SharedLaunch
from tests.torch import fully_shard_nets
from tests.torch.fully_shard_nets import batches_for, make_batches, net, rel, wrap

pytestmark = [pytest.mark.multiprocess, JOINT_TIMEOUT]
cloudpickle.register_pickle_by_value(fully_shard_nets)  # the ranks cannot import the tests


def _checkpoint_save_cases(path):
    """np=4: 4 steps, full state dicts (model and AdamW) saved by rank 0, 4 more steps."""
    import torch
    import torch.nn.functional as F

    import horovod.torch as hvd
    from horovod.torch.fully_shard import full_optim_state_dict

    hvd.init()
    m = wrap(net())
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    batches = make_batches(8, 8, seed=11)
    for k, (x, y) in enumerate(batches):
        if k == 4:
            model_sd = m.full_state_dict(to=0)
            optim_sd = full_optim_state_dict(m, o, to=0)
            if hvd.rank() == 0:
                torch.save({"model": model_sd, "optim": optim_sd}, path)
        o.zero_grad()
        F.cross_entropy(m(x), y).backward()
        o.step()
    return m.full_state_dict(to=0)


def _checkpoint_load_cases(path):
    """np=2: the checkpoint loaded, the last 4 steps run on the same global data."""
    import torch
    import torch.nn.functional as F

    import horovod.torch as hvd
    from horovod.torch.fully_shard import load_full_optim_state_dict

    hvd.init()
    m = wrap(net())
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ck = torch.load(path, weights_only=False)
    m.load_full_state_dict(ck["model"])
    load_full_optim_state_dict(m, o, ck["optim"])
    # the np=4 run's ranks 2r and 2r+1 data, averaged: the same global batch
    parts = [batches_for(rank, 8) for rank in (2 * hvd.rank(), 2 * hvd.rank() + 1)]
    for k in range(4, 8):
        x = torch.cat([p[k][0] for p in parts])
        y = torch.cat([p[k][1] for p in parts])
        o.zero_grad()
        # the mean over 16 rows == the mean of the two 8-row means
        F.cross_entropy(m(x), y).backward()
        o.step()
    return m.full_state_dict(to=0)


def _hvd_checkpoint_save_cases(path):
    """np=4: 8 steps of AdamW, hvd.checkpoint.save of the fully sharded model and its optimizer
    after step 4 (each rank writes its rows), the uninterrupted result."""
    import torch
    import torch.nn.functional as F

    import horovod.torch as hvd

    hvd.init()
    m = wrap(net())
    o = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    for k, (x, y) in enumerate(make_batches(8, 8, seed=11)):
        if k == 4:
            hvd.checkpoint.save(path, m, o, extra={"step": k})
        o.zero_grad()
        F.cross_entropy(m(x), y).backward()
        o.step()
    return m.full_state_dict(to=0)


def _resume(m, o, path, parts, plain=False):
    """Spoil the weights, load the checkpoint (the extra says where), run the last steps on
    the global batches that ``parts`` (each rank of the saving run's data) make up."""
    import torch
    import torch.nn.functional as F

    import horovod.torch as hvd

    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)  # a load that left anything out shows
    start = hvd.checkpoint.load(path, m, o)["step"]
    for k in range(start, 8):
        x = torch.cat([p[k][0] for p in parts])
        y = torch.cat([p[k][1] for p in parts])
        o.zero_grad()
        F.cross_entropy(m(x), y).backward()
        o.step()
    return start


def _hvd_checkpoint_load_cases(path):
    """np=2: the np=4 checkpoint loaded into a model fully sharded over 2 ranks."""
    import torch

    import horovod.torch as hvd

    hvd.init()
    m = wrap(net())
    o = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    # the np=4 run's ranks 2r and 2r+1 data: the mean over 16 rows == the mean of two 8-row means
    parts = [batches_for(rank, 8) for rank in (2 * hvd.rank(), 2 * hvd.rank() + 1)]
    start = _resume(m, o, path, parts)
    held = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    return start, held, m.full_state_dict(to=0)


# --------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The two checkpoint tests' runs share their launches: one at np=4 that saves both
    checkpoints (full state dicts, then hvd.checkpoint), one at np=2 that loads both (started by
    the first test that asks for a load, after the saves); each test reads its own bodies."""
    d = tmp_path_factory.mktemp("fully_shard_checkpoints")
    full, sharded = str(d / "ck.pt"), str(d / "ck")
    save = SharedLaunch(4, {"full": lambda: _checkpoint_save_cases(full),
                            "hvd": lambda: _hvd_checkpoint_save_cases(sharded)}, timeout=780)
    load = SharedLaunch(2, {"full": lambda: _checkpoint_load_cases(full),
                            "hvd": lambda: _hvd_checkpoint_load_cases(sharded)}, timeout=480)
    return {"full": full, "hvd": sharded, "save": save, "load": load}


def test_fully_shard_checkpoint_np4_to_np2_and_plain(checkpoints):
    import torch
    import torch.nn.functional as F

    path = checkpoints["full"]
    uninterrupted = checkpoints["save"].results("full")[0]
    resumed = checkpoints["load"].results("full")[0]
    for k, v in uninterrupted.items():
        assert rel(resumed[k], v) <= 1e-4, (k, rel(resumed[k], v))
    # the same checkpoint in a plain process: an unsharded model and AdamW, the global batches
    m = net()
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ck = torch.load(path, weights_only=False)
    m.load_state_dict(ck["model"])
    o.load_state_dict(ck["optim"])
    parts = [batches_for(rank, 8) for rank in range(4)]
    for k in range(4, 8):
        o.zero_grad()
        F.cross_entropy(m(torch.cat([p[k][0] for p in parts])), torch.cat([p[k][1] for p in parts])).backward()
        o.step()
    for k, v in uninterrupted.items():
        assert rel(m.state_dict()[k], v) <= 1e-4, (k, rel(m.state_dict()[k], v))


def test_fully_shard_hvd_checkpoint_np4_to_np2_and_plain(checkpoints):
    """The goal: saved by hvd.checkpoint at np=4 (each rank its rows; two shards are empty),
    resumed at np=2 and read by an unsharded model and AdamW in a plain process (no hvd.init),
    each equal to the uninterrupted run within 1e-4."""
    import torch

    import horovod.torch as hvd

    path = checkpoints["hvd"]
    uninterrupted = checkpoints["save"].results("hvd")[0]
    # the checkpoint holds the unsharded model's keys and whole shapes
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(hvd.checkpoint.latest(path)).read_metadata().state_dict_metadata
    ref = net()
    for k, v in ref.state_dict().items():
        assert tuple(md[f"model.{k}"].size) == tuple(v.shape), (k, md[f"model.{k}"])
    assert tuple(md["optim.state.blocks.0.a.weight.exp_avg"].size) == (18, 9)
    outs = checkpoints["load"].results("hvd")
    start, held, resumed = outs[0]
    assert start == 4
    assert held["blocks.0.a.weight"] == (9, 9) and outs[1][1]["out.weight"] == (1, 9), held  # rows
    for k, v in uninterrupted.items():
        assert rel(resumed[k], v) <= 1e-4, (k, rel(resumed[k], v))
    m = net()
    o = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    assert _resume(m, o, path, [batches_for(rank, 8) for rank in range(4)], plain=True) == 4
    for k, v in uninterrupted.items():
        assert rel(m.state_dict()[k], v) <= 1e-4, (k, rel(m.state_dict()[k], v))
