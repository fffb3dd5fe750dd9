"""A rank that finishes while another still submits a collective (issue 45).

Every rank trains two steps of a ZeroRedundancyOptimizer; then rank 0 alone calls
``consolidate_state_dict()`` (a collective every rank must call), while the others end normally
(exit 0). Prints "FINISHED <rank> <time>" as each of the others ends its program.
"""

from __future__ import annotations

import time

import torch

import horovod.torch as hvd

hvd.init()
model = torch.nn.Linear(4, 2)
opt = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1,
                                  named_parameters=model.named_parameters())
for _ in range(2):
    opt.zero_grad()
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
if hvd.rank() == 0:
    opt.consolidate_state_dict()  # the others never join it
    print("DONE 0", flush=True)
else:
    print(f"FINISHED {hvd.rank()} {time.time():.3f}", flush=True)
