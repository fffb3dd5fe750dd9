"""The user's PyTorch recipe end to end: the MNIST example under mpirun, and the recipe's promises
(identical parameters after training, checkpoints from rank 0 only, broadcasts fix different seeds)."""

from __future__ import annotations

import os
import re

import pytest

from tests._shared_launch import JOINT_TIMEOUT, in_a_directory, joint_launch, run_as_main

pytestmark = pytest.mark.multiprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples", "pytorch")


def _example(name: str, *args: str) -> str:
    """examples/pytorch/``name`` as ``__main__`` in this rank with ``args``: what it printed (the
    threads it sets for torch put back afterwards, for the launch's next bodies)."""
    import torch

    threads = torch.get_num_threads()
    try:
        return run_as_main(os.path.join(EXAMPLES, name), *args)
    finally:
        torch.set_num_threads(threads)


def _mnist_example(directory: str) -> dict:
    """The MNIST example with its checkpoint in ``directory`` (and a data directory there that
    holds no MNIST); then, once every rank is done, what ``directory`` holds and the checkpoint."""
    import torch

    import horovod.torch as hvd

    ckpt = os.path.join(directory, "ckpt.pt")
    out = _example("pytorch_mnist.py", "--epochs", "4", "--data-dir", os.path.join(directory, "no-mnist-here"),
                   "--checkpoint", ckpt)
    hvd.allgather_object(None, name="mnist_example.done")
    state = torch.load(ckpt, weights_only=False) if os.path.exists(ckpt) else {}
    return {"out": out, "listing": os.listdir(directory), "epoch": state.get("epoch"),
            "keys": sorted(state.get("model", {}))}


def _synthetic_benchmark() -> str:
    return _example("pytorch_synthetic_benchmark.py", "--model", "resnet_tiny", "--batch-size", "4",
                    "--image-size", "16", "--num-iters", "2", "--num-batches-per-iter", "2",
                    "--num-warmup-batches", "1")


# Late parts of the torch launch at np=2 that other modules share (tests/_shared_launch.py): the
# examples as __main__ in its ranks.
_NP2 = joint_launch("torch", 2, {"mnist": in_a_directory(_mnist_example), "synthetic": _synthetic_benchmark},
                    timeout=420, late=True)


@JOINT_TIMEOUT
def test_pytorch_mnist_example_trains_on_two_ranks():
    results = _NP2.results("mnist")
    out = "".join(r["out"] for r in results)
    losses = [float(x) for x in re.findall(r"Epoch \d+: average training loss ([0-9.]+)", out)]
    assert len(losses) == 4, f"expected one loss line per epoch (rank 0 only):\n{out[-3000:]}"
    assert losses[-1] < losses[0], f"loss did not go down: {losses}"
    acc = re.search(r"Final test accuracy: ([0-9.]+)%", out)
    assert acc and float(acc.group(1)) > 90.0, f"accuracy too low:\n{out[-3000:]}"
    assert out.count("Final test accuracy") == 1, "only rank 0 should report"
    for r in results:
        assert r["listing"] == ["ckpt.pt"], r["listing"]
        assert r["epoch"] == 4 and "conv1.weight" in r["keys"], (r["epoch"], r["keys"][:5])


@JOINT_TIMEOUT
def test_synthetic_benchmark_example_runs():
    out = "".join(_NP2.results("synthetic"))
    assert re.search(r"Total img/sec on 2 CPU\(s\): [0-9.]+", out), out[-2000:]


def _seed_recipe(tmp):
    """The seed recipe as written, on a small model and scikit-learn's digits."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import torch.optim as optim
    import torch.utils.data
    from sklearn.datasets import load_digits

    import horovod.torch as hvd

    # Initialize Horovod
    hvd.init()
    torch.manual_seed(100 + hvd.rank())  # every rank starts from different random weights

    digits = load_digits()
    train_dataset = torch.utils.data.TensorDataset(torch.tensor(digits.data / 16.0, dtype=torch.float32),
                                                   torch.tensor(digits.target))
    # Partition dataset among workers using DistributedSampler
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=64, sampler=train_sampler)

    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10), nn.LogSoftmax(dim=1))
    before = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    optimizer = optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
    # Add Horovod Distributed Optimizer
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    # Broadcast parameters from rank 0 to all other processes.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    after_broadcast = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()

    for epoch in range(3):
        train_sampler.set_epoch(epoch)
        losses = []
        for data, target in train_loader:
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        # Save checkpoints only on worker 0
        if hvd.rank() == 0:
            torch.save({"rank": hvd.rank(), "model": model.state_dict()}, os.path.join(tmp, f"ckpt-{epoch}.pt"))
    final = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return before, after_broadcast, final, sum(losses) / len(losses)


def _seed_recipe_and_checkpoints(directory):
    """``_seed_recipe`` with its checkpoints in ``directory`` (``in_a_directory``'s, shared by the
    ranks), then what it holds: (the recipe's result, the file names, each file's saved rank)."""
    import torch

    import horovod.torch as hvd

    result = _seed_recipe(directory)
    hvd.barrier()  # rank 0's last checkpoint is written
    files = sorted(os.listdir(directory))
    return result, files, [torch.load(os.path.join(directory, f), weights_only=False)["rank"] for f in files]


# np=3 (an odd world size, uneven shards of the 1797 rows) is the one size this recipe needs (the
# seed's recipe at np=2 is test_device_plane.py's, tests/gpu/bin/torch_recipe.py): a part of the
# torch launch at np=3 that other modules share (tests/_shared_launch.py).
_NP3 = joint_launch("torch", 3, {"seed_recipe": in_a_directory(_seed_recipe_and_checkpoints)}, timeout=240)


@JOINT_TIMEOUT
def test_seed_recipe_parameters_identical_and_rank0_checkpoints():
    import torch

    out = _NP3.results("seed_recipe")
    results = [r for r, _, _ in out]
    before = [r[0] for r in results]
    assert not torch.equal(before[0], before[1]), "ranks should start from different weights"
    for k, (_before, after, final, loss) in enumerate(results):
        assert torch.equal(after, before[0]), f"rank {k}: weights after broadcast differ from rank 0's"
        assert torch.equal(final, results[0][2]), f"rank {k}: parameters differ after training"
        assert loss < 1.0, f"rank {k}: mean loss of the last epoch {loss}"
    for k, (_, files, saved) in enumerate(out):
        assert files == ["ckpt-0.pt", "ckpt-1.pt", "ckpt-2.pt"], (k, files)
        assert saved == [0, 0, 0], (k, saved)
