"""``DenseReducer``: the ``GradientReducer`` of ``hvd.DistributedOptimizer`` (and of
``hvd.ZeroRedundancyOptimizer(stage=1)``): averages every gradient across ranks while backward is
still running, every rank keeping every average.

A hook on every parameter (``register_post_accumulate_grad_hook``) starts an in-place allreduce of
``p.grad`` as soon as autograd has finished accumulating it, so communication of the last layers'
gradients overlaps the backward pass of the first layers. The pass's last autograd callback waits
for all of them (and for parameters whose gradient never came, which are reduced as zeros so every
rank submits the same set of names), so ``backward()`` returns with averaged gradients.

Where the engine holds the hooks' gradients until the step anyway (``tunables.overlap`` off),
the hooks of a backward pass only note their gradients, and one callback at the end of the pass
submits them together under one handle (``_collect``): each is still its own allreduce.

By default (``HOROVOD_FLAT_GRADIENTS=1``, no ``groups``, no compression) the CPU gradients are
instead views of one flat buffer per dtype, cut into buckets (``horovod/torch/_flat_grads.py``):
each bucket is the ``groups`` machinery's grouped allreduce, started by the hook of its last
gradient (overlap on) or at the end of the pass (overlap off), and reduced as one span.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from horovod.common.basics import size
from horovod.common.context import get_context, peek_context
from horovod.common.objects import broadcast_object
from horovod.common.process_sets import ProcessSet
from horovod.common.types import Average
from horovod.torch._autograd import GradHooks, at_end_of_backward
from horovod.torch._clip import clip_by_global_norm
from horovod.torch._flat_grads import adopt, flat_buckets
from horovod.torch._grad_comm import GradientCommunicator
from horovod.torch._repeat import _repeat_signature, _resubmit, _resubmit_many
from horovod.torch.compression import Compression, StatefulCompressor
from horovod.torch.compression import plain_wire as _plain_wire
from horovod.torch.mpi_ops import (
    _allreduce_wire_async_,
    _grouped_allreduce_wire_async_,
    allreduce_async_,
    fused_wire,
    grouped_allreduce_async_,
    sparse_allreduce_async,
    synchronize,
)
from horovod.torch.reducer import PassesPerStep, SkipSynchronize

__all__ = ["DenseReducer", "parameter_names", "validate_whole_step", "COMPRESSION_KEY", "MANY_PASSES",
           "ZERO_GRAD", "NO_SYNC_STEP", "STEP_AFTER_SYNC"]

MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before call to "
               "step(). Increase backward_passes_per_step to accumulate gradients locally.")
ZERO_GRAD = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
             "optimizer.synchronize(). This is prohibited as it can cause a race condition.")
COMPRESSION_KEY = "horovod_compression"
NO_SYNC_STEP = ("optimizer.{what} was called inside optimizer.no_sync(): gradients accumulated there "
                "are averaged by the first backward pass after the context (or by step() after "
                "it). Leave the no_sync() context before calling {what}.")
STEP_AFTER_SYNC = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                   "optimizer.synchronize(). This can cause training slowdown. You may want to "
                   "consider using optimizer.skip_synchronize() context if you use "
                   "optimizer.synchronize() in your code.")


def _all_params(param_groups: list[dict[str, Any]]) -> Iterator[tuple[int, torch.Tensor]]:
    for gi, group in enumerate(param_groups):
        for p in group["params"]:
            yield gi, p


def parameter_names(param_groups: list[dict[str, Any]], named_parameters: Any) -> dict[torch.Tensor, str]:
    """``{parameter: name}`` from ``named_parameters`` (``model.named_parameters()``), or
    ``allreduce.noname.<group>.<index>`` names when it is None.

    Raises:
        ValueError: not (name, parameter) pairs, duplicate names, or parameters left unnamed.
    """
    if named_parameters is not None:
        named = list(named_parameters)
    else:
        named = [(f"allreduce.noname.{gi}.{pi}", p) for gi, group in enumerate(param_groups)
                 for pi, p in enumerate(group["params"])]
    if any(not isinstance(x, tuple) or len(x) != 2 for x in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: "
                         + ", ".join(dups))
    known = {id(p) for _, p in named}
    missing = [id(p) for _, p in _all_params(param_groups) if id(p) not in known]
    if missing:
        raise ValueError("named_parameters was specified, but one or more model parameters were "
                         "not named. Python object ids: " + ", ".join(str(i) for i in missing))
    return {p: n for n, p in named}


def validate_whole_step(compression: Any, op: int, groups: Any, gradient_predivide_factor: float) -> None:
    """Reject the options a stateful compression (PowerSGD, which averages a whole step's
    gradients itself) cannot honour.

    Raises:
        ValueError: an op other than Average, groups, or a gradient_predivide_factor.
    """
    if not isinstance(compression, StatefulCompressor):
        return
    if op != Average:
        raise ValueError(f"compression={compression!r} averages gradients itself: use op=hvd.Average "
                         "(the default), or a stateless compression with other ops")
    if groups is not None:
        raise ValueError(f"compression={compression!r} reduces all gradients of a step together: "
                         "leave groups (and num_groups) unset")
    if gradient_predivide_factor != 1.0:
        raise ValueError(f"compression={compression!r} does not apply gradient_predivide_factor: "
                         "leave it at 1.0")


class _Slot:
    """One parameter's per-step state, held by its hook (no dictionary keyed by tensors, whose
    ``__hash__`` is a Python call, on the hook's path): how many backward passes remain before
    its allreduce starts, and its gradient's repeat signature (``mpi_ops._repeat_signature``)."""

    __slots__ = ("delay", "fast", "wire")

    def __init__(self, delay: int) -> None:
        self.delay = delay
        self.fast: tuple[Any, ...] | None = None
        # The gradient narrowed by a plain cast compression (``_plain_wire``), reused every step.
        self.wire: torch.Tensor | None = None




def _flat_gradients_enabled() -> bool:
    """``HOROVOD_FLAT_GRADIENTS`` (default on): the same value on every rank, as the launcher
    passes the environment to all of them."""
    ctx = peek_context()
    return bool(ctx is not None and getattr(ctx.config, "flat_gradients", True))


def _overlapping() -> bool:
    ctx = peek_context()
    engine = None if ctx is None else ctx.engine
    return engine is None or bool(engine.tunables.overlap)


class DenseReducer(PassesPerStep, SkipSynchronize):
    """A ``GradientReducer`` (``horovod/torch/reducer.py``) that averages every gradient on every
    rank: see the module docstring.

    Args:
        param_groups: the optimizer's ``param_groups`` (the list itself: read live).
        names: ``{parameter: name}`` (``parameter_names``): the allreduce names.
        compression, backward_passes_per_step, op, gradient_predivide_factor, groups,
        sparse_as_dense, process_set: as for ``hvd.DistributedOptimizer``.
    """

    def __init__(self, param_groups: list[dict[str, Any]], names: dict[torch.Tensor, str],
                 compression: Any, backward_passes_per_step: int, op: int,
                 gradient_predivide_factor: float, groups: Any, sparse_as_dense: bool,
                 process_set: ProcessSet) -> None:
        self.param_groups = param_groups
        self._compression = compression
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._parameter_names = names
        self._passes = backward_passes_per_step
        self._slots = {p: _Slot(backward_passes_per_step) for _, p in self._all_params()}
        self._handles: dict[Any, tuple[Any, Any]] = {}
        # Gradients of this backward pass held for one bundled submission at its end (see
        # ``_collect``), and the bundles submitted: (handle, parameters).
        self._collected: list[tuple[torch.Tensor, tuple[Any, ...]]] = []
        self._bundles: list[tuple[int, list[torch.Tensor]]] = []
        self._hooks = GradHooks()
        self._requires_update: set[torch.Tensor] = set()
        self._synchronized = False
        # End of backward (DDP's contract): a pass whose hooks started allreduces waits for all of
        # them before ``backward()`` returns (``_end_of_backward``), so whatever reads ``p.grad``
        # before ``step()`` (``GradScaler.unscale_``, clipping) sees the averages. ``_armed``: the
        # callback is queued for the running pass; ``_auto_synced``: this step's gradients are
        # averaged (``step()`` has nothing left to wait for).
        self._armed = False
        self._auto_synced = False
        self._no_sync = False
        # A StatefulCompressor (PowerSGD) reduces the step's gradients at once, in synchronize().
        self._whole_step = isinstance(compression, StatefulCompressor)
        self._comm = GradientCommunicator(process_set) if self._whole_step else None
        hooked = process_set.included() and (size() > 1 or os.environ.get("HOROVOD_ELASTIC") == "1")
        # Gradients as views of one flat buffer, reduced in buckets (``_flat_grads``): where nothing
        # asks for another grouping or a compression that makes new tensors.
        self._views: dict[torch.Tensor, torch.Tensor] = {}
        self._groups: list[tuple[torch.Tensor, ...]] | None
        self._groups = None
        if hooked and groups is None and not self._whole_step and compression is Compression.none \
                and _flat_gradients_enabled():
            flat_groups, self._views = flat_buckets([p for _, p in self._all_params()])
            if self._views:  # (no CPU floating-point parameter: each gradient its own allreduce)
                self._groups = flat_groups
        if not self._views:
            self._groups = self._make_groups(groups)
        self._p_to_group: dict[torch.Tensor, tuple[torch.Tensor, ...]] = {}
        # id(group) -> how many of its gradients this step has produced. Keyed by id: a group's
        # hash would hash each of its tensors (a Python call each) in every one of its hooks.
        self._group_counts: dict[int, int] = {}
        for g in self._groups or []:
            for p in g:
                self._p_to_group[p] = g
            self._group_counts[id(g)] = 0
        if hooked:
            self.register_hooks()

    def _all_params(self) -> Iterator[tuple[int, torch.Tensor]]:
        return _all_params(self.param_groups)

    # ------------------------------------------------------------------ GradientReducer
    def _passes_changed(self, passes: int) -> None:
        for slot in self._slots.values():
            slot.delay = passes

    def register_hooks(self) -> None:
        """A gradient hook on every parameter that requires a gradient (at construction)."""
        for _, p in self._all_params():
            if p.requires_grad:
                self._requires_update.add(p)
                self._hooks.add(p, self._make_hook(p))

    def remove_hooks(self) -> None:
        self._hooks.remove()

    def pending(self) -> bool:
        """Whether gradients of this step are in flight or held (accumulating passes included)."""
        return bool(self._handles or self._bundles or self._collected)

    def check_idle(self) -> None:
        """Raise if allreduces are in flight; forget gradients averaged at the end of a backward
        pass whose step was skipped (a GradScaler that found inf/NaN) or abandoned.

        Raises:
            AssertionError: called after ``backward()`` but before ``step()``/``synchronize()``.
        """
        if self._handles or self._bundles or self._collected:
            raise AssertionError(ZERO_GRAD)
        self._auto_synced = False

    def reset(self) -> None:
        """Drop pending allreduces and reset the pass counters."""
        self._handles.clear()
        self._collected.clear()
        self._bundles.clear()
        self._synchronized = False
        self._auto_synced = False
        for g in self._group_counts:
            self._group_counts[g] = 0
        for slot in self._slots.values():
            slot.delay = self._passes

    def state_dict(self) -> dict[str, Any]:
        """A stateful compression's state (PowerSGD) under ``"horovod_compression"``, else {}."""
        return {COMPRESSION_KEY: self._compression.state_dict()} if self._whole_step else {}

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the averaged gradients by their norm (every rank holds all of them: the same norm
        everywhere, no communication); finishes reductions in flight first."""
        if self.pending():
            self.synchronize()
        grads = [p.grad for _, p in self._all_params() if p.grad is not None]
        return clip_by_global_norm(grads, grads, max_norm, norm_type, None, "hvd.DistributedOptimizer",
                                   error_if_nonfinite)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if COMPRESSION_KEY in state and self._whole_step:
            self._compression.load_state_dict(state[COMPRESSION_KEY])

    # ------------------------------------------------------------------ the optimizer's step
    def before_step(self) -> None:
        """What ``step()`` does before the update: synchronize unless inside
        ``skip_synchronize()`` or already done at the end of backward (warning after an explicit
        ``synchronize()``, which is then repeated, as upstream).

        Raises:
            RuntimeError: inside ``no_sync()``.
        """
        if self._no_sync:
            raise RuntimeError(NO_SYNC_STEP.format(what="step()"))
        if self._should_synchronize and not self._auto_synced:
            if self._synchronized:
                warnings.warn(STEP_AFTER_SYNC, stacklevel=3)
            self._synchronize()
        self._synchronized = False

    def after_step(self) -> None:
        """The step's update ran (or failed): the next backward pass starts a new step."""
        self._auto_synced = False

    # ------------------------------------------------------------------ construction
    def _make_groups(self, groups: Any) -> list[tuple[torch.Tensor, ...]] | None:
        if groups is None:
            return None
        if isinstance(groups, int):
            if groups <= 0:
                raise ValueError("groups should be a positive integer or a list of lists of parameters.")
            plist = [p for _, p in self._all_params() if p.requires_grad]
            # Every rank must form the same groups: take rank 0's order of names.
            order = [self._parameter_names[p] for p in plist]
            if size() > 1 and self.process_set.included():
                order = broadcast_object(order, 0, name="DistributedOptimizer.groups",
                                         process_set=self.process_set)
            by_name = {self._parameter_names[p]: p for p in plist}
            plist = [by_name[n] for n in order]
            k = min(groups, len(plist)) or 1
            per, extra = divmod(len(plist), k)
            out, start = [], 0
            for i in range(k):
                n = per + (1 if i < extra else 0)
                if n:
                    out.append(tuple(plist[start:start + n]))
                start += n
            return out
        if not isinstance(groups, list):
            raise ValueError("groups should be a positive integer or a list of lists of parameters.")
        seen: set[int] = set()
        out = []
        for g in groups:
            for p in g:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must contain only torch.Tensor parameters, got "
                                     f"{type(p).__name__}")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))
            out.append(tuple(g))
        out += [(p,) for _, p in self._all_params() if id(p) not in seen and p.requires_grad]
        return [g for g in out if g]

    # ------------------------------------------------------------------ gradient reduction
    def _make_hook(self, p: torch.Tensor) -> Any:
        slot = self._slots[p]

        def hook(_param: torch.Tensor) -> None:
            if self._auto_synced:
                # Another pass after one that averaged the step's gradients (several losses
                # per step): what it adds is local again, so it is averaged again (at the end
                # of this pass, or by step() after a no_sync() pass): avg(g1) + avg(g2).
                self._auto_synced = False
            if self._no_sync:
                return  # accumulating locally (``no_sync()``); a later pass or step() reduces it
            delay = slot.delay
            if delay <= 0:
                raise AssertionError(MANY_PASSES)
            slot.delay = delay - 1
            if delay > 1:
                self._handles[p] = (None, None)  # accumulating locally; step() may force it
                return
            if not self._armed:
                self._arm()
            if self._whole_step:
                self._handles[p] = (None, None)  # the compressor reduces the step's set at once
                return
            if self._groups is None:
                signature = slot.fast
                if signature is not None and signature[7].host:  # bundles: host tensors only
                    if self._collected:  # a bundle of this pass is open: join it
                        self._collected.append((p, signature))
                        return
                    if self._collect(p, signature):
                        return
                self._handles[p] = self._allreduce_grad_async(p)
                return
            group = self._p_to_group[p]
            counts = self._group_counts
            counts[id(group)] += 1
            if counts[id(group)] < len(group):
                self._handles[p] = (None, None)
                return
            if self._views and not _overlapping():
                # A flat bucket while the engine holds the hooks' gradients until the step anyway:
                # hold it here too (placeholders), so that the end of the pass starts every bucket
                # in parameter order on every rank (what is sent never depends on this choice).
                self._handles[p] = (None, None)
                return
            for gp in group:
                self._handles.pop(gp, None)
            self._handles[group] = self._grouped_allreduce_async(group)
        return hook

    def _arm(self) -> None:
        """Queue ``_end_of_backward`` for the running backward pass (once per pass)."""
        self._armed = at_end_of_backward(self._end_of_backward)  # outside one: step() synchronizes

    def _end_of_backward(self) -> None:
        """Autograd's last callback of a pass that started allreduces: wait for every gradient
        (reducing those that did not come as zeros, as ``step()`` would), so that ``backward()``
        returns with averaged gradients, as under DDP. Every rank's pass ends here, or in
        ``step()`` for a rank whose pass produced no gradient at all."""
        self._armed = False
        self._synchronize()
        self._auto_synced = True

    def _collect(self, p: torch.Tensor, signature: tuple[Any, ...]) -> bool:
        """Hold ``p``'s gradient (whose checked request only needs resubmitting) for one bundled
        submission at the end of this backward pass; False when it must be submitted now.

        Bundling applies only where the engine would hold the hooks' submissions until ``step()``
        anyway (``tunables.overlap`` off, see ``TensorQueue.submit``): then submitting the pass's
        gradients together, deferred, changes nothing but the cost (one engine submission and
        one handle instead of one per gradient). On the wire each gradient is still its own
        named, cached allreduce. With overlap on, each gradient starts as soon as it is ready.
        """
        collected = self._collected
        if not collected:
            ctx = signature[0]
            engine = ctx.engine
            if engine is None or engine.tunables.overlap or ctx is not peek_context():
                return False
            if not at_end_of_backward(self._submit_collected):  # not inside a backward pass
                return False
        collected.append((p, signature))
        return True

    def _submit_collected(self) -> None:
        """Submit the gradients ``_collect`` held, as one bundle (deferred like the hooks'
        submissions), or one by one when they no longer match their checked requests."""
        collected, self._collected = self._collected, []
        if not collected:
            return
        params = [p for p, _ in collected]
        grads: list[Any] = [p.grad for p in params]  # set: their hooks ran
        handle = _resubmit_many(grads, [sig for _, sig in collected], defer=True)
        if handle is not None:
            self._bundles.append((handle, params))
            return
        for p in params:
            self._handles[p] = self._allreduce_grad_async(p)

    def _scale_factors(self) -> tuple[float, float]:
        if self.op == Average:
            # The engine adds the 1/size of Average to the postscale factor.
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _grad_for(self, p: torch.Tensor) -> torch.Tensor:
        if self._views:
            view = self._views.get(p)
            if view is not None:
                adopt(p, view)  # the gradient moves into (or is zeroed in) its place in the flat buffer
        if p.grad is None:
            # No gradient on this rank (unused in this forward); other ranks may have one, and
            # every rank must submit the same names, so reduce zeros.
            p.grad = torch.zeros_like(p)
        return p.grad

    def _allreduce_grad_async(self, p: torch.Tensor) -> tuple[Any, Any]:
        name = self._parameter_names.get(p)
        tensor = self._grad_for(p)
        slot = self._slots.get(p)  # None for a parameter added after construction (no hook)
        signature = None if slot is None else slot.fast
        if signature is not None:
            # The same gradient as last step (dtype, shape, context, process set): resubmit its
            # request without the checks (a hook runs ~60 times per backward, on its critical path).
            fast = _resubmit(tensor, signature, defer=True)  # step() waits for it
            if fast is not None:
                return fast, (None, tensor)
        if tensor.is_sparse:
            if self.sparse_as_dense:
                tensor = tensor.to_dense()
            else:
                return sparse_allreduce_async(tensor, name=str(name), op=self.op,
                                              process_set=self.process_set), None
        pre, post = self._scale_factors()
        fused = fused_wire(self._compression, (tensor,), self.op) if slot is not None else None
        if fused is not None:
            # A plain cast compression of a host gradient: reduced in place as 16 bits, narrowed in
            # the fusion buffer and widened back into the gradient (``mpi_ops.fused_wire``); its
            # request is resubmitted on later steps as an uncompressed gradient's is.
            handle = _allreduce_wire_async_(tensor, fused, name, self.op, pre, post, self.process_set)
            signature = _repeat_signature(tensor, get_context().handles[handle][0].request)
            if signature is not None and slot is not None:
                slot.fast = signature
            return handle, (None, tensor)
        wire = _plain_wire(self._compression)
        if wire is not None and slot is not None and tensor.dtype.is_floating_point and tensor.dtype != wire:
            compressed = slot.wire
            if (compressed is None or compressed.shape != tensor.shape or compressed.dtype != wire
                    or compressed.device != tensor.device):
                compressed = slot.wire = torch.empty(tensor.shape, dtype=wire, device=tensor.device)
            compressed.copy_(tensor)  # narrowed as ``tensor.to(wire)`` rounds
            ctx = tensor.dtype
        else:
            compressed, ctx = self._compression.compress(tensor)
        handle = allreduce_async_(compressed, name=name, op=self.op, prescale_factor=pre,
                                  postscale_factor=post, process_set=self.process_set)
        if compressed is tensor:
            signature = _repeat_signature(tensor, get_context().handles[handle][0].request)
            if signature is not None and slot is not None:
                slot.fast = signature
        return handle, (ctx, compressed)

    def _grouped_allreduce_async(self, group: tuple[torch.Tensor, ...], wake: bool = True) -> tuple[Any, Any]:
        """Start ``group``'s grouped allreduce; ``wake=False`` where the caller waits for it next
        (it then drives the round itself, without handing it to the engine thread and back)."""
        grads = []
        for p in group:
            g = self._grad_for(p)
            grads.append(g.to_dense() if g.is_sparse else g)  # grouped reduction is dense
        pre, post = self._scale_factors()
        name = self._parameter_names.get(group[0])
        fused = fused_wire(self._compression, grads, self.op)
        if fused is not None:  # narrowed in the fusion buffer, widened back in place (``fused_wire``)
            handle = _grouped_allreduce_wire_async_(grads, fused, name, self.op, pre, post, self.process_set)
            return handle, [(None, g) for g in grads]
        tensors, ctxs = [], []
        for g in grads:
            c, ctx = self._compression.compress(g)
            tensors.append(c)
            ctxs.append((ctx, c))
        handle = grouped_allreduce_async_(tensors, name=name, op=self.op,
                                          prescale_factor=pre, postscale_factor=post,
                                          process_set=self.process_set, _wake=wake)
        return handle, ctxs

    def _write_grad(self, p: torch.Tensor, output: torch.Tensor, ctx: Any) -> None:
        grad = p.grad
        assert grad is not None
        if (ctx is not None and ctx[0] is not None and ctx[0] == grad.dtype and not grad.is_sparse
                and not output.is_sparse and _plain_wire(self._compression) is not None):
            if output is not grad:  # (a gradient already of the wire dtype was reduced in place)
                grad.copy_(output)  # widened as ``decompress`` would, without a new tensor
            return
        result = output if ctx is None else self._compression.decompress(output, ctx[0])
        if grad.is_sparse:
            if not result.is_sparse:  # sparse_as_dense: back to the gradient's layout
                result = result.to_sparse()
            grad.zero_().add_(result)
        elif result is not grad:
            grad.copy_(result)

    def _not_launched(self) -> list[torch.Tensor]:
        """The parameters to update whose allreduce has not started, in parameter order (dropping
        the placeholders of passes still accumulating locally)."""
        handles = self._handles
        if not handles and sum(len(params) for _, params in self._bundles) == len(self._requires_update):
            # The common step: one bundle of every gradient (a parameter joins at most one bundle
            # per step, and only parameters to update have hooks), so nothing is left.
            return []
        launched: set[torch.Tensor] = set()
        for _, params in self._bundles:
            launched.update(params)
        for key, (handle, _) in list(handles.items()):
            if handle is None:
                del handles[key]
            else:
                launched.update(key if isinstance(key, tuple) else (key,))
        if self._requires_update <= launched:
            return []
        return [p for _, p in self._all_params() if p in self._requires_update and p not in launched]

    def synchronize(self) -> None:
        """Wait for every gradient's allreduce and write the averaged gradients into ``p.grad``.

        Parameters whose allreduce has not started (no gradient in this backward, or fewer than
        ``backward_passes_per_step`` passes so far) are reduced now, in parameter order, so that
        every rank submits the same names. After a backward pass that already averaged the
        gradients (``_end_of_backward``) there is nothing left to wait for.

        Raises:
            RuntimeError: inside ``no_sync()``.
        """
        if self._no_sync:
            raise RuntimeError(NO_SYNC_STEP.format(what="synchronize()"))
        if self._auto_synced:
            # The gradients were averaged at the end of backward; a later backward pass before
            # step() is then a new accumulation, as after an explicit synchronize().
            self._auto_synced = False
            self._synchronized = True
            return
        self._synchronize()
        self._synchronized = True

    def _synchronize(self) -> None:
        if not self.process_set.included():
            return
        if self._whole_step:
            self._reduce_whole_step()
            return
        if self._collected:  # a pass whose end-of-backward callback has not run
            self._submit_collected()
        todo = self._not_launched()
        if self._groups is not None:
            started: set[int] = set()  # ids: a group's hash would hash each of its tensors
            for p in todo:
                g = self._p_to_group.get(p, (p,))
                if id(g) not in started:
                    started.add(id(g))
                    self._handles[g] = self._grouped_allreduce_async(g, wake=False)
        else:
            for p in todo:
                self._handles[p] = self._allreduce_grad_async(p)
        for handle, _ in self._bundles:
            synchronize(handle)  # reduced in place: each p.grad holds its average
        self._bundles.clear()
        for key, (handle, ctx) in self._handles.items():
            if isinstance(key, tuple):
                outputs = synchronize(handle)
                for gp, out, gctx in zip(key, outputs, ctx):
                    self._write_grad(gp, out, gctx)
            else:
                out = handle() if callable(handle) else synchronize(handle)
                self._write_grad(key, out, ctx)
        self._handles.clear()
        passes = self._passes
        for slot in self._slots.values():
            slot.delay = passes
        for gid in self._group_counts:
            self._group_counts[gid] = 0

    def _reduce_whole_step(self) -> None:
        """Hand every gradient to update (zeros where none came; sparse ones made dense), in
        parameter order, to the stateful compressor, which averages them in place."""
        params = [p for _, p in self._all_params() if p in self._requires_update]
        grads = []
        for p in params:
            g = self._grad_for(p)
            if g.is_sparse:
                p.grad = g = g.to_dense()
            grads.append(g)
        self._handles.clear()
        if params:
            self._compression.reduce_(grads, [self._parameter_names[p] for p in params], self._comm)
        passes = self._passes
        for slot in self._slots.values():
            slot.delay = passes

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes inside the context start no allreduce;
        the first backward pass after it (or ``step()``) averages everything accumulated, one
        allreduce per gradient. ``step()`` and ``synchronize()`` inside the context raise.

        Every rank must run the same passes inside and outside the context. Compared with
        ``backward_passes_per_step`` (a fixed count chosen up front), the context decides per
        pass, as DDP's ``model.no_sync()``."""
        if self._no_sync:
            raise RuntimeError("optimizer.no_sync() contexts cannot be nested")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False
