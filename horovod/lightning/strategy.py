"""The Horovod strategy for one Lightning 2 package (``lightning.pytorch`` or ``pytorch_lightning``).

Each Lightning distribution has its own ``Strategy`` base classes and strategy registry, so the
strategy class is built once per package by :func:`strategy_class` (same code, that package's base
classes). What the strategy does, in Lightning's hook order:

- ``__init__``: ``hvd.init()``; ranks, sizes and the node come from Horovod (``HorovodEnvironment``),
  processes are started by the launcher (horovodrun, mpirun, ``horovod.run``, Spark, Ray), never by
  Lightning.
- ``setup`` (fit): the optimizers from ``configure_optimizers`` are wrapped in
  ``hvd.DistributedOptimizer`` (named parameters, ``accumulate_grad_batches`` as
  ``backward_passes_per_step``), LR schedulers are re-pointed at the wrapped optimizers, and the
  parameters (and any optimizer state) are broadcast from rank 0. Validate/test/predict broadcast
  the parameters only.
- automatic optimization: gradients are averaged in ``post_backward`` (``synchronize()``) and the
  optimizer steps inside ``skip_synchronize()``, so Lightning's gradient clipping and AMP unscaling
  see averaged gradients; micro-batches of an accumulation window skip the synchronization.
  Manual optimization: the same after every ``manual_backward``, for every wrapped optimizer
  (DDP's behaviour; a GAN's generator loss fills the discriminator's gradients too).
- the strategy holds the optimizers through public members only: their ``GradientReducer``
  (``opt.reducer``, ``horovod/torch/reducer.py``: pending reductions, hooks, pass counts),
  ``synchronize()``/``skip_synchronize()``; ``flat_gradients`` restores the gradient views in
  ``pre_backward``; with ``zero_stage``, ``gradient_clip_val`` (by norm) is applied by the
  optimizers' reducers (``GradientReducer.clip_grad_norm_``: the norm of the whole gradient,
  across the shards) from a callback's ``on_before_optimizer_step`` (after AMP's unscaling, before
  Lightning's own clipping, which then finds nothing to clip), as Lightning's DeepSpeed strategy
  leaves clipping to its engine.
- ``zero_stage=3``: ``model_to_device`` broadcasts rank 0's weights and shards the module
  (``hvd.fully_shard``: the modules that ``fully_shard_modules`` picks, then the LightningModule)
  before ``configure_optimizers`` runs, so its optimizers step the shards; the module's reducer
  (``horovod.torch.fully_shard.reducer_for``) takes the place of a wrapped optimizer's;
  checkpoints are always sharded (``hvd.checkpoint``), restored after setup.
- ``reduce`` / ``all_gather`` / ``broadcast`` / ``barrier`` / ``reduce_boolean_decision`` are
  Horovod collectives (``self.log(..., sync_dist=True)``, early stopping, checkpoint names).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import socket
from typing import Any

import torch

import horovod.torch as hvd
from horovod.lightning import _sharded_checkpoint as sharded
from horovod.torch.fully_shard import is_shard, reducer_for
from horovod.torch.reducer import GradientReducer, reducer_of

PACKAGES = ("lightning.pytorch", "pytorch_lightning")
_FABRIC = {"lightning.pytorch": "lightning.fabric", "pytorch_lightning": "lightning_fabric"}
_built: dict[str, type[Any]] = {}


def strategy_class(package: str) -> type[Any]:
    """``HorovodStrategy`` for ``package`` (``"lightning.pytorch"`` or ``"pytorch_lightning"``)."""
    if package not in PACKAGES:
        raise ValueError(f"unknown Lightning package {package!r}; expected one of {', '.join(PACKAGES)}")
    cls = _built.get(package)
    if cls is None:
        cls = _built[package] = _build(package)
    return cls


def _hvd_op(reduce_op: Any) -> Any:
    """Horovod's op for Lightning's ``reduce_op`` (a string, or torch.distributed's ReduceOp)."""
    if reduce_op is None:
        return hvd.Average
    if isinstance(reduce_op, str):
        key = reduce_op.lower()
    else:
        from torch.distributed import ReduceOp

        names = {ReduceOp.SUM: "sum", ReduceOp.MAX: "max", ReduceOp.MIN: "min", ReduceOp.PRODUCT: "product",
                 ReduceOp.AVG: "avg"}
        key = next((name for op, name in names.items() if reduce_op == op), repr(reduce_op))
    ops = {"mean": hvd.Average, "avg": hvd.Average, "sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min,
           "product": hvd.Product, "prod": hvd.Product}
    if key not in ops:
        raise ValueError(f"HorovodStrategy.reduce: unsupported reduce_op {reduce_op!r}; "
                         "use 'mean', 'sum', 'max', 'min' or 'product'")
    return ops[key]


def _track_step_for_schedulers(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer.step`` the way torch's LR schedulers do, so that a scheduler re-pointed at
    the wrapped optimizer does not warn that ``step()`` was overridden or not called."""
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return

    @functools.wraps(step)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    tracked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = tracked  # type: ignore[method-assign]


def _flat_gradients(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One flat gradient buffer for the optimizer's parameters: ``[(parameter, its view)]`` (as DDP's
    ``gradient_as_bucket_view``), or ``[]`` where the parameters differ in dtype/device or are sparse."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if not params or len({(p.dtype, p.device) for p in params}) != 1 or any(p.is_sparse for p in params):
        return []
    flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    views, offset = [], 0
    for p in params:
        views.append((p, flat[offset:offset + p.numel()].view_as(p)))
        offset += p.numel()
    _restore_views(views)
    return views


def _restore_views(views: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Give a parameter whose gradient was set to None (``zero_grad(set_to_none=True)`` from
    anywhere) its view back, zeroed."""
    for p, view in views:
        if p.grad is None:
            view.zero_()
            p.grad = view


def _zero_optimizer(opt: torch.optim.Optimizer, named: list[tuple[str, torch.Tensor]], stage: int,
                    passes: int, compression: Any, op: Any, predivide: float) -> Any:
    """``opt``'s parameter groups and options in a ``hvd.ZeroRedundancyOptimizer``."""
    import inspect

    groups = [dict(group) for group in opt.param_groups]
    accepted = inspect.signature(type(opt).__init__).parameters
    options = {k: v for k, v in opt.defaults.items() if k in accepted}
    return hvd.ZeroRedundancyOptimizer(groups, type(opt), stage=stage, named_parameters=named,
                                       backward_passes_per_step=passes, compression=compression,
                                       op=op, gradient_predivide_factor=predivide, **options)


def _pending(optimizer: Any) -> bool:
    """Whether ``optimizer``'s gradient reducer has reductions in flight (False for an optimizer
    without one)."""
    reducer = reducer_of(optimizer)
    return reducer is not None and reducer.pending()


def _unwrap(optimizer: Any, lightning_optimizer_cls: type[Any]) -> Any:
    return optimizer.optimizer if isinstance(optimizer, lightning_optimizer_cls) else optimizer


def _build(package: str) -> type[Any]:
    pl = importlib.import_module(package)
    # Lightning's classes, from the package the caller named (lightning.pytorch or pytorch_lightning).
    fabric_envs: Any = importlib.import_module(_FABRIC[package] + ".plugins.environments")
    strategies: Any = importlib.import_module(package + ".strategies")
    states = importlib.import_module(package + ".trainer.states")
    core_optimizer = importlib.import_module(package + ".core.optimizer")
    pl_rank_zero = importlib.import_module(package + ".utilities.rank_zero")
    pl_callbacks: Any = importlib.import_module(package + ".callbacks")
    from lightning_utilities.core import rank_zero as utils_rank_zero

    LightningOptimizer = core_optimizer.LightningOptimizer  # noqa: N806
    TrainerFn = states.TrainerFn  # noqa: N806

    class HorovodEnvironment(fabric_envs.ClusterEnvironment):
        """Ranks and sizes from Horovod; the launcher (not Lightning) starts the processes."""

        @property
        def creates_processes_externally(self) -> bool:
            return True

        @property
        def main_address(self) -> str:
            return os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()

        @property
        def main_port(self) -> int:
            return 0  # Horovod's own rendezvous; Lightning opens no process group

        @staticmethod
        def detect() -> bool:
            return False  # chosen by HorovodStrategy only, never auto-detected for another strategy

        def world_size(self) -> int:
            return hvd.size()

        def set_world_size(self, size: int) -> None:
            pass  # fixed by the launcher

        def global_rank(self) -> int:
            return hvd.rank()

        def set_global_rank(self, rank: int) -> None:
            pass  # fixed by the launcher

        def local_rank(self) -> int:
            return hvd.local_rank()

        def node_rank(self) -> int:
            return hvd.cross_rank()

    class ClipAcrossRanks(pl_callbacks.Callback):
        """``Trainer(gradient_clip_val=..., gradient_clip_algorithm="norm")`` by the norm of the
        whole gradient: each optimizer's ``GradientReducer.clip_grad_norm_`` (across the shards
        of ZeRO stage 2 and 3). Added by ``HorovodStrategy(zero_stage=...)`` while it fits."""

        def __init__(self, strategy: Any) -> None:
            self.strategy = strategy

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            val = trainer.gradient_clip_val
            algorithm = trainer.gradient_clip_algorithm
            if not val or not pl_module.automatic_optimization or (
                    algorithm is not None and str(getattr(algorithm, "value", algorithm)) != "norm"):
                return
            reducer = self.strategy.reducer(optimizer)
            if reducer is not None:
                reducer.clip_grad_norm_(float(val))

    class HorovodStrategy(strategies.ParallelStrategy):
        """Lightning on Horovod: one process per device, started by a Horovod launcher.

        ``Trainer(strategy="horovod")`` or ``Trainer(strategy=HorovodStrategy(...))``.

        Args:
            accelerator, parallel_devices, checkpoint_io, precision_plugin: as for any Lightning
                strategy (usually left to the Trainer's ``accelerator=``/``precision=``).
            compression: ``hvd.Compression.none`` (default), ``hvd.Compression.fp16``/``bf16``, or
                ``hvd.PowerSGD(...)`` (docs/compression.md).
            op: gradient reduction, ``hvd.Average`` (default), ``hvd.Sum`` or ``hvd.Adasum``.
            gradient_predivide_factor: as for ``hvd.DistributedOptimizer``.
            sparse_as_dense: as for ``hvd.DistributedOptimizer``.
            zero_stage: 1 or 2 wraps the optimizers in ``hvd.ZeroRedundancyOptimizer`` (optimizer
                state, and with 2 the gradients, sharded across ranks) instead of
                ``hvd.DistributedOptimizer``; ``Trainer(strategy="horovod_zero")`` is stage 1.
                With one optimizer, Lightning's checkpoints are then sharded: a directory at the
                checkpoint's path where each rank writes its part (``hvd.checkpoint``), which
                ``ckpt_path=`` resumes from at any world size; with several optimizers they are
                one file holding the consolidated (plain) optimizer states. 3 shards the
                parameters as well (``hvd.fully_shard``, ZeRO stage 3): the optimizers from
                ``configure_optimizers`` are plain torch optimizers over this rank's shards, and
                checkpoints are sharded directories (every optimizer's rows, each optimizer's
                state under its index when there are several).
            fully_shard_modules: with ``zero_stage=3``, the submodules to shard as units of
                their own (gathered for their forward and backward only), each before the
                LightningModule itself: a module class, a tuple of classes, or a function
                ``module -> bool``; ``None``: the LightningModule as one unit. A LightningModule
                that ``configure_model`` already sharded is left as it is.
        """

        strategy_name = "horovod"

        def __init__(self, accelerator: Any = None, parallel_devices: list[torch.device] | None = None,
                     checkpoint_io: Any = None, precision_plugin: Any = None,
                     compression: Any = hvd.Compression.none, op: Any = hvd.Average,
                     gradient_predivide_factor: float = 1.0, sparse_as_dense: bool = False,
                     flat_gradients: bool = False, zero_stage: int = 0,
                     fully_shard_modules: Any = None) -> None:
            if zero_stage not in (0, 1, 2, 3):
                raise ValueError(f"HorovodStrategy: zero_stage={zero_stage!r}; use 0 (no sharding), "
                                 "1 (optimizer state), 2 (optimizer state and gradients) or 3 "
                                 "(parameters too: hvd.fully_shard)")
            if fully_shard_modules is not None and zero_stage != 3:
                raise ValueError("HorovodStrategy: fully_shard_modules applies to zero_stage=3")
            if zero_stage == 3 and not isinstance(compression, type(hvd.Compression.none)) and (
                    isinstance(compression, hvd.compression.StatefulCompressor)):
                raise ValueError("HorovodStrategy(zero_stage=3): a stateful compression (PowerSGD) "
                                 "averages whole gradients; fully sharded gradients are "
                                 "reduce-scattered. Use hvd.Compression.fp16/bf16")
            if zero_stage and flat_gradients:
                raise ValueError("HorovodStrategy: flat_gradients applies to DistributedOptimizer, "
                                 "not to zero_stage; use one of them")
            self._zero_stage = zero_stage
            self._fully_shard_modules = fully_shard_modules
            self._clip_callback: Any = None
            hvd.init()
            super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                             cluster_environment=HorovodEnvironment(), checkpoint_io=checkpoint_io,
                             precision_plugin=precision_plugin)
            self._compression = compression
            self._op = op
            self._gradient_predivide_factor = gradient_predivide_factor
            self._sparse_as_dense = sparse_as_dense
            self._flat_gradients = flat_gradients
            self._views: list[tuple[torch.Tensor, torch.Tensor]] = []
            self._skip_sync: contextlib.ExitStack | None = None
            self._blocked = False
            self._set_rank_zero()

        # ---------------------------------------------------------------- ranks and devices
        # global_rank, local_rank, node_rank and world_size: ParallelStrategy's, read from the
        # HorovodEnvironment given as cluster_environment.
        @property
        def is_distributed(self) -> bool:
            return True  # Lightning inserts the DistributedSampler for strategies that say so

        @property
        def root_device(self) -> torch.device:
            devices = self.parallel_devices or [torch.device("cpu")]
            if devices[0].type == "cuda":
                # One process per GPU, pinned by local rank as in every Horovod recipe; a process
                # that sees a single GPU (Spark/Ray assign one per task) uses that one.
                count = torch.cuda.device_count()
                return torch.device("cuda", 0 if count == 1 else self.local_rank)
            return devices[0]

        @property
        def distributed_sampler_kwargs(self) -> dict[str, Any]:
            return {"num_replicas": self.world_size, "rank": self.global_rank}

        def _set_rank_zero(self) -> None:
            pl_rank_zero.rank_zero_only.rank = self.global_rank
            # lightning_utilities types rank_zero_only as a function; Lightning sets this attribute too.
            utils_rank_zero.rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

        def set_world_ranks(self) -> None:
            self._set_rank_zero()

        def model_to_device(self) -> None:
            assert self.model is not None
            self.model.to(self.root_device)
            if self._zero_stage == 3:
                self._fully_shard(self.model)

        def _fully_shard(self, module: torch.nn.Module) -> None:
            """ZeRO stage 3: every rank starts from rank 0's weights, then keeps its rows."""
            if isinstance(module, hvd.FullyShardedModule):
                return  # configure_model did it, or an earlier fit
            hvd.broadcast_parameters(module.state_dict(), root_rank=0)
            pick = self._fully_shard_modules
            if pick is None:
                inner: list[torch.nn.Module] = []
            else:
                match = pick if callable(pick) and not isinstance(pick, type) else (
                    lambda m: isinstance(m, pick))
                inner = [m for m in module.modules() if m is not module and match(m)]
            for m in reversed(inner):  # the deepest first
                hvd.fully_shard(m, compression=self._compression)
            hvd.fully_shard(module, compression=self._compression)

        def reducer(self, optimizer: Any) -> GradientReducer | None:
            """The ``GradientReducer`` that averages ``optimizer``'s gradients: a wrapped
            optimizer's own, or with ``zero_stage=3`` the fully sharded module's."""
            opt = _unwrap(optimizer, LightningOptimizer)
            found = reducer_of(opt)
            if found is None and self._zero_stage == 3 and isinstance(self.model, hvd.FullyShardedModule):
                return reducer_for(self.model)
            return found

        @property
        def restore_checkpoint_after_setup(self) -> bool:
            return self._zero_stage == 3  # the module's shards exist after setup only

        def lightning_module_state_dict(self) -> dict[str, Any]:
            if self._zero_stage == 3:
                return {}  # written by each rank from the module (save_checkpoint)
            return super().lightning_module_state_dict()

        # ---------------------------------------------------------------- setup / teardown
        def setup(self, trainer: Any) -> None:
            super().setup(trainer)  # accelerator, precision, model to device, optimizers
            assert self.lightning_module is not None
            if self._zero_stage != 3:  # stage 3: broadcast before sharding (model_to_device)
                hvd.broadcast_parameters(self.lightning_module.state_dict(), root_rank=0)
            if trainer.state.fn != TrainerFn.FITTING:
                return
            automatic = self.lightning_module.automatic_optimization
            passes = trainer.accumulate_grad_batches if automatic else 1
            self.optimizers: list[Any] = self._wrap_optimizers(self.optimizers, passes)
            if self._zero_stage and self._clip_callback is None:
                self._clip_callback = ClipAcrossRanks(self)
                trainer.callbacks.append(self._clip_callback)
            for opt in self.optimizers:
                self._broadcast_optimizer_state(_unwrap(opt, LightningOptimizer))
            # Gradients are synchronized in post_backward (every wrapped optimizer, after every
            # backward, automatic or manual optimization); step() must not do it again.
            self._skip_sync = contextlib.ExitStack()
            for opt in self.optimizers:
                skip = self.reducer(opt) if self._zero_stage == 3 else _unwrap(opt, LightningOptimizer)
                assert skip is not None
                self._skip_sync.enter_context(skip.skip_synchronize())

        def _wrap_optimizers(self, optimizers: list[Any], passes: int) -> list[Any]:
            assert self.lightning_module is not None
            named = list(self.lightning_module.named_parameters())
            wrapped_for: dict[int, Any] = {}
            out: list[Any] = []
            for opt in optimizers:
                opt = _unwrap(opt, LightningOptimizer)
                if reducer_of(opt) is not None:
                    out.append(opt)  # the user wrapped it already
                    continue
                mine = {id(p) for group in opt.param_groups for p in group["params"]}
                if self._zero_stage == 3:
                    not_shards = [n for n, p in named if id(p) in mine and not is_shard(p)]
                    if not_shards:
                        raise ValueError(f"HorovodStrategy(zero_stage=3): the optimizer steps "
                                         f"parameters that are not fully sharded: {not_shards[:5]}; "
                                         "configure_optimizers must use self.parameters() (the "
                                         "shards, after the strategy sharded the module)")
                    reducer_for(self.model).set_backward_passes_per_step(passes)
                    out.append(opt)  # a plain optimizer over the shards
                    continue
                if self._zero_stage:
                    wrapped = _zero_optimizer(opt, [(n, p) for n, p in named if id(p) in mine],
                                              self._zero_stage, passes, self._compression, self._op,
                                              self._gradient_predivide_factor)
                    wrapped_for[id(opt)] = wrapped
                    out.append(wrapped)
                    continue
                # A stateful compression (PowerSGD) reduces every gradient of a step at once: no groups.
                stateful = isinstance(self._compression, hvd.compression.StatefulCompressor)
                views = _flat_gradients(opt) if self._flat_gradients and not stateful else []
                self._views += views
                wrapped = hvd.DistributedOptimizer(
                    opt, named_parameters=[(n, p) for n, p in named if id(p) in mine],
                    compression=self._compression, backward_passes_per_step=passes, op=self._op,
                    gradient_predivide_factor=self._gradient_predivide_factor,
                    sparse_as_dense=self._sparse_as_dense,
                    groups=[[p for p, _ in views]] if views else None)
                wrapped.state.update(opt.state)  # normally empty: nothing has stepped yet
                wrapped_for[id(opt)] = wrapped
                out.append(wrapped)
            for config in self.lr_scheduler_configs:
                scheduler = config.scheduler
                target = wrapped_for.get(id(getattr(scheduler, "optimizer", None)))
                if target is not None:
                    scheduler.optimizer = target
                    _track_step_for_schedulers(target)
            return out

        def _broadcast_optimizer_state(self, opt: torch.optim.Optimizer) -> None:
            if isinstance(opt, hvd.ZeroRedundancyOptimizer) or self._zero_stage == 3:
                return  # sharded: each rank holds (only) its own part
            # A fresh optimizer has no state: broadcasting it would take a step on zero gradients
            # to create some (which moves weights under decoupled weight decay). Then only the
            # hyper-parameters travel.
            if hvd.broadcast_object(len(opt.state) > 0, root_rank=0, name="HorovodStrategy.has_state"):
                hvd.broadcast_optimizer_state(opt, root_rank=0)
                return
            options = [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
            options = hvd.broadcast_object(options, root_rank=0, name="HorovodStrategy.param_groups")
            for group, values in zip(opt.param_groups, options):
                group.update(values)

        def teardown(self) -> None:
            self._views = []
            if self._clip_callback is not None and self.lightning_module is not None:
                callbacks = self.lightning_module.trainer.callbacks
                if self._clip_callback in callbacks:
                    callbacks.remove(self._clip_callback)
                self._clip_callback = None
            if self._skip_sync is not None:
                self._skip_sync.close()
                self._skip_sync = None
            for opt in self.optimizers:
                opt = _unwrap(opt, LightningOptimizer)
                # A later fit() builds new optimizers: this one's gradient hooks must go.
                remove_hooks = getattr(reducer_of(opt) or opt, "remove_hooks", None)  # or Adasum's
                if remove_hooks is not None:
                    remove_hooks()
            super().teardown()

        # ---------------------------------------------------------------- gradients
        @contextlib.contextmanager
        def block_backward_sync(self) -> Any:
            """Lightning's accumulation micro-batches: no synchronization (the optimizer's own
            ``backward_passes_per_step`` counter holds the allreduces back)."""
            self._blocked = True
            reducer = reducer_for(self.model) if self._zero_stage == 3 and isinstance(
                self.model, hvd.FullyShardedModule) else None
            if reducer is not None:  # stage 3: the micro-batch accumulates unsharded gradients
                reducer.accumulating(False)
            try:
                yield None
            finally:
                self._blocked = False
                if reducer is not None:
                    reducer.accumulating(True)

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            # GradientAccumulationScheduler changes accumulate_grad_batches at an epoch's start (a
            # window boundary): the optimizers' pass counters follow.
            if self._skip_sync is None or self.lightning_module is None:
                return
            _restore_views(self._views)
            passes = self.lightning_module.trainer.accumulate_grad_batches
            if self._zero_stage == 3:
                return  # block_backward_sync holds the micro-batches' reductions back
            for opt in self.optimizers:
                opt = _unwrap(opt, LightningOptimizer)
                if opt.backward_passes_per_step != passes:
                    opt.set_backward_passes_per_step(passes)

        def pre_backward(self, closure_loss: torch.Tensor) -> None:
            """``flat_gradients``: gradients that ``zero_grad()`` set to None become views of the
            flat buffer again (zeroed) before the backward pass accumulates into them."""
            _restore_views(self._views)

        def post_backward(self, closure_loss: torch.Tensor) -> None:
            """Average the gradients of every wrapped optimizer, as DDP does in each backward.

            Under manual optimization a backward may fill the gradients of several optimizers
            (a GAN's generator loss reaches the discriminator's parameters) while only one of them
            steps: each one's allreduces must end here, or its next ``zero_grad()`` finds them in
            flight. Averaging is linear, so gradients accumulated over several backward passes
            before a step come out as under DDP. An optimizer none of whose parameters require a
            gradient now (``toggle_optimizer`` switched them off, on every rank) received none.
            """
            if self._blocked or self._skip_sync is None:
                return  # a micro-batch of an accumulation window, or not fitting
            self._synchronize_all()

        def _synchronize_all(self) -> None:
            for opt in self.optimizers:
                opt = _unwrap(opt, LightningOptimizer)
                if any(p.requires_grad for group in opt.param_groups for p in group["params"]):
                    if self._zero_stage == 3:
                        reducer = self.reducer(opt)
                        assert reducer is not None
                        reducer.synchronize()
                    else:
                        opt.synchronize()

        def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
            if (self._skip_sync is not None and self.lightning_module is not None
                    and not self.lightning_module.automatic_optimization
                    and any(_pending(_unwrap(o, LightningOptimizer)) for o in self.optimizers)):
                # loss.backward() instead of self.manual_backward(): no post_backward ran.
                self._synchronize_all()
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        # ---------------------------------------------------------------- collectives
        def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
            """Allreduce ``tensor`` over all ranks (``'mean'`` by default, or ``'sum'``/``'max'``/...)."""
            if group is not None:
                raise ValueError("HorovodStrategy.reduce: process groups are not supported; leave `group` unset")
            if not isinstance(tensor, torch.Tensor):
                return tensor
            op = _hvd_op(reduce_op)
            if op == hvd.Average and not tensor.is_floating_point():
                tensor = tensor.float()
            return hvd.allreduce(tensor, op=op)

        def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
            """Every rank's ``tensor`` stacked along a new first dimension of size ``world_size``."""
            if group is not None and group is not getattr(torch.distributed.group, "WORLD", None):
                raise ValueError("HorovodStrategy.all_gather: process groups are not supported; "
                                 "leave `group` unset")
            if not sync_grads:
                tensor = tensor.detach()
            return hvd.allgather(tensor.unsqueeze(0))

        def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002
            votes = hvd.allreduce(torch.tensor([int(bool(decision))]), op=hvd.Sum,
                                  name="HorovodStrategy.reduce_boolean_decision")
            return int(votes.item()) == self.world_size if all else int(votes.item()) > 0

        def broadcast(self, obj: Any, src: int = 0) -> Any:
            return hvd.broadcast_object(obj, root_rank=src)

        def barrier(self, *args: Any, **kwargs: Any) -> None:
            if hvd.size() > 1:
                hvd.barrier()

        def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
            """A ``ZeroRedundancyOptimizer``'s state: a marker when the checkpoint is sharded
            (``save_checkpoint`` writes each rank's shard), else the whole state consolidated on
            rank 0 (every rank calls this while Lightning builds a checkpoint; rank 0 writes it)."""
            opt = _unwrap(optimizer, LightningOptimizer)
            if any(opt is o for o in self._sharded_optimizers()):
                return {sharded.MARK: True}  # each rank's part, written by save_checkpoint
            if isinstance(opt, hvd.ZeroRedundancyOptimizer):
                opt.consolidate_state_dict(to=0)
                return opt.state_dict() if opt.rank == 0 else {}
            return super().optimizer_state(optimizer)

        # ---------------------------------------------------------------- checkpoints
        def _sharded_optimizers(self) -> list[Any]:
            """The optimizers whose checkpoints are sharded: with ``zero_stage=3`` every one (plain
            optimizers over the shards); with stage 1 or 2 the only one, a ZeRO one."""
            opts = [_unwrap(o, LightningOptimizer) for o in self.optimizers]
            if self._zero_stage == 3 or (len(opts) == 1 and isinstance(opts[0], hvd.ZeroRedundancyOptimizer)):
                return opts
            return []

        def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                            storage_options: Any = None) -> None:
            """With ``zero_stage=3`` (any number of optimizers), or stage 1/2 and one optimizer: a
            sharded checkpoint directory at ``filepath``, each rank writing its part
            (collective); otherwise Lightning's file."""
            opts = self._sharded_optimizers()
            if self.lightning_module is None or not (opts or self._zero_stage == 3):
                return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            if storage_options is not None:
                raise TypeError("HorovodStrategy(zero_stage=...).save_checkpoint(..., storage_options=...) "
                                "is not supported: each rank writes its shard with hvd.checkpoint, "
                                "not through the CheckpointIO plugin")
            path = hvd.broadcast_object(os.fspath(filepath), 0, name="HorovodStrategy.ckpt_path")
            # no optimizer: weights only (validate/test); one: as hvd.checkpoint.save(optimizer=opt)
            sharded.save(checkpoint, path, self.lightning_module,
                         None if not opts else opts[0] if len(opts) == 1 else opts, self.global_rank)

        def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
            """A sharded checkpoint directory (``hvd.checkpoint``, any world size): the module's
            weights are loaded here, the optimizer's shard in ``load_optimizer_state_dict``; a
            file: Lightning's loading."""
            path = hvd.broadcast_object(os.fspath(checkpoint_path), 0, name="HorovodStrategy.load_path")
            if sharded.is_sharded(path) and self.lightning_module is not None:
                return sharded.load(path, self.lightning_module)
            return super().load_checkpoint(checkpoint_path, *args, **kwargs)

        def load_optimizer_state_dict(self, checkpoint: Any) -> None:
            opts = [_unwrap(o, LightningOptimizer) for o in self.optimizers]
            if self.lightning_module is None or not sharded.load_optimizer(
                    checkpoint, self.lightning_module, opts):
                super().load_optimizer_state_dict(checkpoint)

        @classmethod
        def register_strategies(cls, strategy_registry: Any) -> None:
            strategy_registry.register(cls.strategy_name, cls, description="Horovod (horovod.lightning)",
                                       override=True)
            strategy_registry.register("horovod_zero", cls, override=True, zero_stage=1,
                                       description="Horovod with ZeRO stage 1 (sharded optimizer state)")

    HorovodStrategy.__module__ = HorovodEnvironment.__module__ = "horovod.lightning"
    HorovodStrategy.__qualname__ = "HorovodStrategy"
    HorovodEnvironment.__qualname__ = "HorovodEnvironment"
    HorovodStrategy.lightning_package = package  # type: ignore[attr-defined]
    HorovodStrategy.Environment = HorovodEnvironment  # type: ignore[attr-defined]
    del pl
    return HorovodStrategy
