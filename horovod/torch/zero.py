"""``ZeroRedundancyOptimizer``: data parallelism with the optimizer state (stage 1) and the
gradients (stage 2) sharded across the ranks of a process set.

Every rank keeps the whole model; each parameter is *owned* by one rank, which alone holds its
optimizer state and updates it. The owners are chosen once, deterministically, balancing bytes
(largest parameter first onto the least loaded rank), so every rank computes the same partition
without communicating and no rank holds more than ``total / N + the largest parameter``.

One step:

- stage 1: gradients are averaged during backward exactly as ``DistributedOptimizer`` averages
  them (the same hooks, bundling and fusion: an internal ``DistributedOptimizer`` does it);
- stage 2: gradient hooks hand each gradient to its bucket as backward produces it; each bucket
  is reduce-scattered (an alltoall by owner plus a local sum, or an in-place allreduce after which
  the other ranks' parameters' gradients are released: ``reduce_schedule``, see
  ``_zero_grads.ShardedGradients``), so each rank keeps only its own parameters' averaged
  gradients (``p.grad = None`` for the others);
- each rank runs the wrapped optimizer (``.optim``, built on its shard only) and the updated
  parameters are shared with one allgather per dtype (the same ``[N, L]`` layout).

The layout and partition live in ``_Layout``; the state-dict translation between the local
optimizer and the plain optimizer's format in ``consolidate_state_dict``/``load_state_dict``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from horovod.common.objects import allgather_object, broadcast_object
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.common.types import Adasum, Average, Max, Sum
from horovod.torch._dense_reducer import DenseReducer, parameter_names, validate_whole_step
from horovod.torch._zero_grads import SCHEDULES, ShardedGradients
from horovod.torch.compression import Compression, StatefulCompressor
from horovod.torch.mpi_ops import allgather_async, allreduce_, synchronize
from horovod.torch.reducer import GradientReducer

__all__ = ["ZeroRedundancyOptimizer", "partition_by_bytes"]

STAGES = (1, 2)
# The most bytes one collective of the reduce-scatter or of the parameter allgather moves
# (its [N, columns] buffer): bounds the transient memory of a step.
BUCKET_BYTES = 64 << 20


def partition_by_bytes(sizes: list[int], n: int) -> list[int]:
    """The owner (0..n-1) of each item of ``sizes`` (bytes): largest first onto the least loaded
    rank, ties to the lower index and the lower rank. The heaviest rank carries at most
    ``sum(sizes) / n + max(sizes)``."""
    owner = [0] * len(sizes)
    loads = [0] * n
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(n), key=lambda r: (loads[r], r))
        owner[i] = r
        loads[r] += sizes[i]
    return owner


def _pieces(row: list[tuple[int, int, int]], c0: int, c1: int) -> Iterator[tuple[int, int, int, int, bool]]:
    """The parts of ``row``'s parameters (index, offset, numel) in columns ``[c0, c1)``: (index,
    start in the parameter, start in the chunk, length, whether the parameter ends here)."""
    for i, off, n in row:
        a, b = max(off, c0), min(off + n, c1)
        if a < b:
            yield i, a - off, a - c0, b - a, off + n <= c1
        elif off >= c1:
            break


class _Layout:
    """Which rank owns which parameter, and the ``[N, L]`` row layout of each dtype's buffer."""

    def __init__(self, params: list[torch.Tensor], n: int) -> None:
        self.n = n
        self.owner = partition_by_bytes([p.numel() * p.element_size() for p in params], n)
        # dtype -> (per rank: [(param index, offset, numel)], row length L)
        self.buckets: dict[torch.dtype, tuple[list[list[tuple[int, int, int]]], int]] = {}
        for dtype in sorted({p.dtype for p in params}, key=str):
            rows: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
            fill = [0] * n
            for i, p in enumerate(params):
                if p.dtype == dtype:
                    r = self.owner[i]
                    rows[r].append((i, fill[r], p.numel()))
                    fill[r] += p.numel()
            self.buckets[dtype] = (rows, max(max(fill), 1))

    def loads(self, params: list[torch.Tensor]) -> list[int]:
        out = [0] * self.n
        for i, p in enumerate(params):
            out[self.owner[i]] += p.numel() * p.element_size()
        return out


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer_class`` so that each rank of ``process_set`` keeps and updates only its
    shard of the optimizer state (``stage=1``) and, with ``stage=2``, of the averaged gradients.

    A drop-in for ``hvd.DistributedOptimizer``: build it on every rank from the same parameters,
    broadcast the initial parameters as usual, then ``loss.backward(); opt.step()``.

    Args:
        params: parameters or parameter groups (dicts with their own options), as for any
            ``torch.optim`` optimizer; the same on every rank.
        optimizer_class: a ``torch.optim.Optimizer`` class (SGD, Adam, AdamW, Adagrad, ...).
        stage: 1 (shard the optimizer state) or 2 (also shard the averaged gradients).
        process_set: the ranks that share the work; a rank outside it trains alone.
        backward_passes_per_step: backward passes accumulated locally before gradients are
            averaged (as ``DistributedOptimizer``).
        compression: ``Compression.none``/``fp16``/``bf16`` for the gradient reduction; with
            ``stage=1`` also a stateful compression such as ``hvd.PowerSGD``.
        op: ``Average`` or ``Sum`` (Adasum is not a sharded reduction).
        gradient_predivide_factor: divide by this before the sum, multiply after (Average only).
        named_parameters: optional ``model.named_parameters()``: names for the reductions and the
            error messages.
        optimizer_kwargs: the options of ``optimizer_class`` (``lr=...``).

    Attributes:
        optim: this rank's local ``optimizer_class`` over the parameters it owns.

    Raises:
        ValueError: an unknown stage (3 is not implemented: every rank keeps all parameters), an
            unsupported op, parameters on different devices on a rank, or ranks that disagree on
            the parameters; raised on every rank of the set.
    """

    def __init__(self, params: Any, optimizer_class: type[torch.optim.Optimizer], stage: int = 1,
                 process_set: ProcessSet = global_process_set, backward_passes_per_step: int = 1,
                 compression: Any = Compression.none, op: int = Average,
                 gradient_predivide_factor: float = 1.0, named_parameters: Any = None,
                 **optimizer_kwargs: Any) -> None:
        self._initialized = False
        super().__init__(params, optimizer_kwargs)
        self._all = [p for g in self.param_groups for p in g["params"]]
        self.stage, self.process_set, self.op = stage, process_set, op
        self.gradient_predivide_factor, self._compression = gradient_predivide_factor, compression
        self.backward_passes_per_step = backward_passes_per_step
        self._optimizer_class, self._optimizer_kwargs = optimizer_class, optimizer_kwargs
        self._names = self._param_names(named_parameters)
        self._check(self._local_problems())
        self._synchronized = False
        self._bucket_bytes = BUCKET_BYTES
        self._schedule = "auto"
        self._consolidated: dict[str, Any] | None = None
        # The GradientReducer (horovod/torch/reducer.py): stage 1 averages as DistributedOptimizer
        # does (a DenseReducer), stage 2 reduce-scatters (ShardedGradients, also kept typed as
        # ``_sharded`` for its partition and schedule).
        self._sharded: ShardedGradients | None = None
        self.reducer: GradientReducer
        if stage == 1:
            validate_whole_step(compression, op, None, gradient_predivide_factor)
            groups = [{"params": list(g["params"])} for g in self.param_groups]
            named = [(self._names[i], p) for i, p in enumerate(self._all)]
            self.reducer = DenseReducer(groups, parameter_names(groups, named), compression,
                                        backward_passes_per_step, op, gradient_predivide_factor,
                                        None, False, process_set)
        self._partition()
        self._initialized = True

    # ------------------------------------------------------------------ construction
    def _param_names(self, named_parameters: Any) -> list[str]:
        by_id = {}
        if named_parameters is not None:
            by_id = {id(p): str(n) for n, p in named_parameters}
        return [by_id.get(id(p), f"zero.param.{i}") for i, p in enumerate(self._all)]

    def _local_problems(self) -> str | None:
        if self.stage not in STAGES:
            extra = (" (stage 3, sharding the parameters themselves, is not implemented: every "
                     "rank keeps the whole model)") if self.stage == 3 else ""
            return (f"stage={self.stage!r} is not a ZeRO stage this optimizer offers{extra}; "
                    "use stage=1 (optimizer state sharded) or stage=2 (gradients too)")
        if self.op == Adasum or self.op not in (Average, Sum):
            return (f"op={self.op!r}: the sharded reduction sums or averages; use op=hvd.Average "
                    "or op=hvd.Sum (or DistributedOptimizer for Adasum)")
        if self.gradient_predivide_factor != 1.0 and self.op != Average:
            return "gradient_predivide_factor not supported with op != Average"
        if self.backward_passes_per_step <= 0:
            return "backward_passes_per_step must be > 0"
        if self.stage == 2 and isinstance(self._compression, StatefulCompressor):
            return (f"compression={self._compression!r} reduces the whole gradient set itself; stage 2 "
                    "reduce-scatters the gradients: use stage=1 with it, or a stateless compression")
        if not isinstance(self._optimizer_class, type) or not issubclass(
                self._optimizer_class, torch.optim.Optimizer):
            return f"optimizer_class must be a torch.optim.Optimizer class, got {self._optimizer_class!r}"
        flat = [n for n, p in zip(self._names, self._all) if not p.is_contiguous()]
        if flat:
            return (f"parameters {flat[:5]} are not contiguous: a shard's parameters are read and "
                    "written as flat views; make them contiguous (p.data = p.data.contiguous())")
        devices: dict[str, str] = {}
        for name, p in zip(self._names, self._all):
            devices.setdefault(str(p.device), name)
        if len(devices) > 1:
            listed = ", ".join(f"{n!r} on {d}" for d, n in devices.items())
            return (f"parameters on different devices ({listed}): a rank's shard is packed into "
                    "one buffer per dtype on one device; move the model to one device per rank")
        return None

    def _check(self, problem: str | None) -> None:
        """Raise on every rank of the set if any rank found a problem or the ranks disagree on
        the parameters (shapes, dtypes, groups)."""
        signature = [[(tuple(p.shape), str(p.dtype)) for p in g["params"]] for g in self.param_groups]
        # An elastic worker joining a running job builds its optimizer alone: check locally.
        elastic = os.environ.get("HOROVOD_ELASTIC") == "1"
        if self.process_set.included() and (self.process_set.size() or 1) > 1 and not elastic:
            seen = allgather_object((problem, signature), name="zero.check",
                                    process_set=self.process_set)
        else:
            seen = [(problem, signature)]
        by_msg: dict[str, list[int]] = {}
        for r, (msg, _) in enumerate(seen):
            if msg:
                by_msg.setdefault(msg, []).append(r)
        if by_msg:
            raise ValueError("ZeroRedundancyOptimizer: " + "; ".join(
                f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {msg}"
                for msg, rs in by_msg.items()))
        differ = [r for r, (_, sig) in enumerate(seen) if sig != seen[0][1]]
        if differ:
            raise ValueError(
                f"ZeroRedundancyOptimizer: ranks {differ} have other parameters than rank 0 "
                f"(shapes and dtypes per group: rank 0 {seen[0][1]}, rank {differ[0]} "
                f"{seen[differ[0]][1]}); build the optimizer from the same model on every rank")

    def _world(self) -> tuple[int, int]:
        if not self.process_set.included():
            return 0, 1
        return self.process_set.rank() or 0, self.process_set.size() or 1

    def _partition(self) -> None:
        """(Re)build the partition and the local optimizer for the current world size; the local
        state is dropped (``load_state_dict`` after a re-partition restores it)."""
        self.rank, self.world = self._world()
        self.layout = _Layout(self._all, self.world)
        index = {id(p): i for i, p in enumerate(self._all)}
        groups, self._local_index = [], []
        for g in self.param_groups:
            mine = [p for p in g["params"] if self.layout.owner[index[id(p)]] == self.rank]
            self._local_index += [index[id(p)] for p in mine]
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": mine})
        self.optim = self._optimizer_class(groups, **self._optimizer_kwargs)
        for g, local in zip(self.param_groups, self.optim.param_groups):
            for k, v in local.items():  # the class's own defaults (betas...) visible here too
                if k != "params":
                    g[k] = v
        self.state = self.optim.state  # type: ignore[assignment]
        self._consolidated = None
        self._synchronized = False
        if self.stage == 2:
            if self._sharded is None:
                self.reducer = self._sharded = self._sharded_gradients()
            else:
                self._configure_sharded()
        self._drop_pending()

    @property
    def bucket_bytes(self) -> int:
        """The most bytes one collective of the gradient reduction (stage 2) or of the parameter
        allgather moves; set it between steps."""
        return self._bucket_bytes

    @bucket_bytes.setter
    def bucket_bytes(self, value: int) -> None:
        self._bucket_bytes = int(value)
        if self._sharded is not None:  # new buckets
            self._sharded.check_idle()
            self._configure_sharded()

    @property
    def reduce_schedule(self) -> str:
        """How stage 2 reduce-scatters a bucket: ``"alltoall"`` (by owner, then a local sum),
        ``"allreduce"`` (of the whole bucket, each rank keeping its part) or ``"auto"`` (the
        default: time both over the first steps and keep the faster one; ``chosen_schedule``
        then says which). Set it on every rank alike, between steps."""
        return self._schedule

    @reduce_schedule.setter
    def reduce_schedule(self, value: str) -> None:
        if value not in SCHEDULES:
            raise ValueError(f"reduce_schedule={value!r}; use one of {SCHEDULES}")
        self._schedule = value
        self.bucket_bytes = self._bucket_bytes  # new buckets with it

    @property
    def chosen_schedule(self) -> str | None:
        """Stage 2: the schedule the next reduction uses (None for stage 1)."""
        return None if self._sharded is None else self._sharded.current

    def _sharded_gradients(self) -> ShardedGradients:
        return ShardedGradients(self._all, self._names, self.layout.owner, self.rank, self.world,
                                self._bucket_bytes, self.process_set, self.op,
                                self._scale_factors(), self._compression,
                                self.backward_passes_per_step, self._schedule)

    def _configure_sharded(self) -> None:
        assert self._sharded is not None
        self._sharded.configure(self.layout.owner, self.rank, self.world, self._bucket_bytes,
                                self._schedule)

    def _drop_pending(self) -> None:
        """Forget the reductions of a step that will not finish (a failed step, a reload)."""
        self.reducer.reset()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only while constructing: the partition covers the parameters given at construction."""
        if getattr(self, "_initialized", False):
            raise NotImplementedError("ZeroRedundancyOptimizer.add_param_group after construction: "
                                      "the partition is fixed; build a new optimizer with every group")
        super().add_param_group(param_group)

    # ------------------------------------------------------------------ gradients
    def synchronize(self) -> None:
        """Average the gradients: stage 1 waits for the allreduces started during backward;
        stage 2 reduce-scatters them so that this rank keeps only its parameters' gradients.

        Stage 2 then agrees, with one 1-element allreduce, on whether any gradient is not finite,
        and if so makes one of this rank's gradients infinite as well, so that ``GradScaler``
        skips the step on every rank alike; a rank that owns no parameter keeps a zero gradient
        on the smallest parameter for that. A second call before ``step()`` does nothing.
        """
        if self._synchronized:
            return
        if self.stage == 1 or self.world > 1:
            self.reducer.synchronize()
        self._synchronized = True

    def _scale_factors(self) -> tuple[float, float]:
        if self.op == Average:
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _chunks(self) -> list[tuple[torch.dtype, list[list[tuple[int, int, int]]], int, int]]:
        """The column ranges ``[c0, c1)`` of each dtype's ``[N, L]`` layout that one collective
        moves: at most ``bucket_bytes`` for the whole ``[N, c1 - c0]`` buffer, so the transient
        buffers stay small whatever the model's size."""
        out = []
        for dtype, (rows, length) in self.layout.buckets.items():
            width = max(1, self.bucket_bytes // (self.world * torch.empty(0, dtype=dtype).element_size()))
            out += [(dtype, rows, c0, min(c0 + width, length)) for c0 in range(0, length, width)]
        return out

    def _pipelined(self, submit: Any, finish: Any) -> None:
        """``submit`` each chunk's collective, finishing the previous one meanwhile (two in flight)."""
        pending = None
        for k, chunk in enumerate(self._chunks()):
            handle = submit(k, chunk)
            if pending is not None:
                finish(*pending)
            pending = (chunk, handle)
        if pending is not None:
            finish(*pending)

    def skip_synchronize(self) -> AbstractContextManager[None]:
        """Make ``step()`` skip synchronization (after an explicit ``synchronize()``)."""
        return self.reducer.skip_synchronize()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the averaged gradients by their global norm, computed across the shards (each
        rank the norm of its own parameters' gradients, combined by one allreduce), like
        ``torch.nn.utils.clip_grad_norm_`` over the whole model. Synchronizes first if
        ``synchronize()`` has not run since the last step. Returns the total norm (the same on
        every rank)."""
        if not self._synchronized:
            self.synchronize()
        norm_type = float(norm_type)
        grads = [self._all[i].grad for i in self._local_index if self._all[i].grad is not None]
        if norm_type == math.inf:
            local = max((g.detach().abs().max().float() for g in grads), default=torch.tensor(0.0))
            total = torch.tensor([float(local)])
            allreduce_(total, name="zero.clip.norm", op=Max, process_set=self.process_set)
            total = total[0]
        else:
            local = sum((torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float64)
                         ** norm_type for g in grads), torch.tensor(0.0, dtype=torch.float64))
            total = torch.tensor([float(local)], dtype=torch.float64)
            allreduce_(total, name="zero.clip.norm", op=Sum, process_set=self.process_set)
            total = (total[0] ** (1.0 / norm_type)).float()
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients from "
                               "`parameters` is non-finite, so it cannot be clipped.")
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        for p in self._all:
            if p.grad is not None:
                p.grad.detach().mul_(coef.to(p.grad.device, p.grad.dtype))
        return total

    # ------------------------------------------------------------------ step
    def _sync_groups(self, src: list[dict[str, Any]], dst: list[dict[str, Any]]) -> None:
        for s, d in zip(src, dst):
            for k, v in s.items():
                if k != "params":
                    d[k] = v

    def step(self, closure: Any = None) -> Any:
        """Average the gradients (unless already synchronized or inside ``skip_synchronize()``),
        update this rank's parameters with ``.optim``, then share the updated parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.reducer.synchronize_on_step and not self._synchronized:
            self.synchronize()
        self._synchronized = False
        self._sync_groups(self.param_groups, self.optim.param_groups)  # schedulers change ours
        self.optim.step()
        self._sync_groups(self.optim.param_groups, self.param_groups)
        self._share_parameters()
        self._consolidated = None
        return loss

    @torch.no_grad()
    def _share_parameters(self) -> None:
        if self.world == 1:
            return
        params, rank, device = self._all, self.rank, self._all[0].device

        def submit(k: int, chunk: Any) -> Any:
            dtype, rows, c0, c1 = chunk
            send = torch.empty(1, c1 - c0, dtype=dtype, device=device)
            for i, ps, cs, n, _ in _pieces(rows[rank], c0, c1):
                send[0, cs:cs + n].copy_(params[i].view(-1)[ps:ps + n])
            return allgather_async(send, name=f"zero.params.{dtype}.{k}", process_set=self.process_set)

        def finish(chunk: Any, handle: Any) -> None:
            _, rows, c0, c1 = chunk
            gathered = synchronize(handle)
            for r, row in enumerate(rows):
                if r != rank:
                    for i, ps, cs, n, _ in _pieces(row, c0, c1):
                        params[i].view(-1)[ps:ps + n].copy_(gathered[r, cs:cs + n])

        self._pipelined(submit, finish)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset every parameter's gradient (forbidden while the reduction is in flight)."""
        self.reducer.check_idle()
        super().zero_grad(set_to_none)
        self._synchronized = False

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated locally before the reduction."""
        if passes <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        self.backward_passes_per_step = passes
        self.reducer.set_backward_passes_per_step(passes)

    # ------------------------------------------------------------------ state
    def _local_to_full(self, local: dict[str, Any]) -> dict[int, Any]:
        return {self._local_index[k]: v for k, v in local["state"].items()}

    # ShardedStateful (horovod/torch/reducer.py): what hvd.checkpoint reads and writes per rank
    @property
    def num_shards(self) -> int:
        """How many ranks the optimizer state is split across."""
        return self.world

    def owned_indices(self) -> list[int]:
        """The indices (in ``param_groups`` order) of the parameters this rank owns."""
        return list(self._local_index)

    def local_state_dict(self) -> dict[int, Any]:
        """This rank's shard of the state: ``{parameter index: its state}``."""
        return self._local_to_full(self.optim.state_dict())

    def full_state_dict(self, to: int | None = None) -> dict[str, Any] | None:
        """The whole optimizer state in ``optimizer_class``'s format, gathered on rank ``to`` of the
        set (None there elsewhere), or on every rank with ``to=None``. Collective."""
        state: dict[int, Any] = {}
        local = self._local_to_full(self.optim.state_dict())
        if self.world == 1:
            state = local
        elif to is None:
            for part in allgather_object(local, name="zero.consolidate", process_set=self.process_set):
                state.update(part)
        else:
            for r in range(self.world):
                root = self.process_set.ranks[r] if self.process_set.ranks else r
                part = broadcast_object(local if r == self.rank else None, root_rank=root,
                                        name=f"zero.consolidate.{r}", process_set=self.process_set)
                if self.rank == to:
                    state.update(part)
            if self.rank != to:
                return None
        groups, start = [], 0
        for g in self.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        return {"state": {k: state[k] for k in sorted(state)}, "param_groups": groups}

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole state on rank ``to`` of the set (collective: call it on every rank);
        ``state_dict()`` on that rank then returns it."""
        self._consolidated = self.full_state_dict(to)

    def state_dict(self) -> dict[str, Any]:
        """The consolidated state, in the plain optimizer's format (``optimizer_class`` alone can
        load it). Call ``consolidate_state_dict(to=this rank)`` on every rank first."""
        if self._consolidated is None:
            if self.world == 1:
                return self.full_state_dict(0) or {}
            raise RuntimeError(
                f"ZeroRedundancyOptimizer.state_dict() on rank {self.rank}: the state is sharded "
                "and was not consolidated on this rank since the last step; call "
                "consolidate_state_dict(to=<rank>) on every rank first (or use "
                "hvd.checkpoint.save, which writes each rank's shard)")
        return self._consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state (the plain optimizer's format, e.g. from ``state_dict()`` or from a
        plain ``optimizer_class``) on every rank; each rank keeps its shard."""
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or "state" not in state_dict:
            raise ValueError("ZeroRedundancyOptimizer.load_state_dict expects a full optimizer "
                             "state dict with 'state' and 'param_groups'")
        sizes = [len(s["params"]) for s in groups]
        if sizes != [len(g["params"]) for g in self.param_groups] and self.world > 1 and sizes == [
                len(g["params"]) for g in self.optim.param_groups]:
            raise ValueError(
                f"ZeroRedundancyOptimizer.load_state_dict on rank {self.rank}: the state dict has "
                f"groups of sizes {sizes}, this rank's shard's sizes: it looks like one rank's "
                "sharded state (opt.optim.state_dict()), which does not say which parameters it "
                "holds. Load the full state: opt.full_state_dict() or consolidate_state_dict() then "
                "state_dict() when saving, or hvd.checkpoint.save/load")
        if len(groups) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"]) for s, g in zip(groups, self.param_groups)):
            raise ValueError(
                "loaded state dict has groups of sizes "
                f"{[len(s['params']) for s in groups]}, this optimizer has "
                f"{[len(g['params']) for g in self.param_groups]}")
        # the ids of the saved groups, in order, are the positions of the parameters
        ids = [i for s in groups for i in s["params"]]
        position = {pid: k for k, pid in enumerate(ids)}
        full = state_dict["state"]
        unknown = [pid for pid in full if pid not in position]
        if unknown:
            raise ValueError(f"loaded state dict has state for parameter ids {unknown[:5]} that "
                             "none of its groups lists")
        for s, g in zip(groups, self.param_groups):
            for k, v in s.items():
                if k != "params":
                    g[k] = v
        local_state = {}
        for k, i in enumerate(self._local_index):
            saved = full.get(ids[i])
            if saved is not None:
                local_state[k] = saved
        local_groups, start = [], 0
        for g, lg in zip(self.param_groups, self.optim.param_groups):
            n = len(lg["params"])
            local_groups.append({**{k: v for k, v in g.items() if k != "params"},
                                 "params": list(range(start, start + n))})
            start += n
        self._drop_pending()
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
        self.state = self.optim.state  # type: ignore[assignment]
        self._synchronized = False
        self._consolidated = None

    def repartition(self) -> None:
        """Re-partition over the process set's current size (after an elastic reset). The local
        state is dropped: load the full state (``load_state_dict``) afterwards."""
        self._partition()

    def __repr__(self) -> str:
        return (f"ZeroRedundancyOptimizer(stage={self.stage}, rank={self.rank}/{self.world}, "
                f"optim={self.optim!r})")
