"""The seed PyTorch recipe, as written (GPU pinned by local rank, model.cuda()), on synthetic data.

The one change: the GPU is ``local_rank % device_count``, which is the seed's ``local_rank`` whenever
each local rank has a GPU of its own; it lets the GPU tier run two ranks on a one-GPU machine
(host-staged, since NCCL refuses two ranks on one GPU), where ``set_device(1)`` would not exist.

Prints one line per rank: ``rank <r> device <d> loss <first> -> <last> params_hash <h>``.
Runs on the CPU too (no CUDA): then it trains on CPU tensors.
"""

import torch
import torch.nn.functional as F  # noqa: N812
import torch.optim as optim

import horovod.torch as hvd

# Initialize Horovod
hvd.init()

# Pin GPU to be used to process local rank (one GPU per process)
if torch.cuda.is_available():
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())

# Define dataset...
g = torch.Generator().manual_seed(0)
data_x = torch.randn(512, 20, generator=g)
data_y = (data_x[:, :10].sum(1) > 0).long()
train_dataset = torch.utils.data.TensorDataset(data_x, data_y)

# Partition dataset among workers using DistributedSampler
train_sampler = torch.utils.data.distributed.DistributedSampler(
    train_dataset, num_replicas=hvd.size(), rank=hvd.rank())

train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=32, sampler=train_sampler)

# Build model...
torch.manual_seed(hvd.rank())
model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2),
                            torch.nn.LogSoftmax(dim=1))
if torch.cuda.is_available():
    model.cuda()

optimizer = optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)

# Add Horovod Distributed Optimizer
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

# Broadcast parameters from rank 0 to all other processes.
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

losses = []
for epoch in range(5):
    train_sampler.set_epoch(epoch)
    for data, target in train_loader:
        if torch.cuda.is_available():
            data, target = data.cuda(), target.cuda()
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())

flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
same = hvd.allreduce(flat, op=hvd.Max, name="check.max") - hvd.allreduce(flat, op=hvd.Min, name="check.min")
print(f"rank {hvd.rank()} device {flat.device} loss {losses[0]:.4f} -> {losses[-1]:.4f} "
      f"spread {same.abs().max().item():.3g}", flush=True)
hvd.shutdown()
