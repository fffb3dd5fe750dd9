"""Pytree helpers: ``broadcast_parameters``, ``allreduce_tree``; object collectives."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from horovod.common import collectives as _C
from horovod.common.objects import allgather_object, broadcast_object
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.common.types import ReduceOp
from horovod.jax.compression import Compression
from horovod.jax.mpi_ops import _allreduce_list, _run, _same

__all__ = ["broadcast_parameters", "allreduce_tree", "broadcast_object", "allgather_object"]


def _by_dtype(leaves: list[Any]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault(jnp.dtype(leaf.dtype).name, []).append(i)
    return groups


def broadcast_parameters(params: Any, root_rank: int = 0, name: str | None = None,
                         process_set: ProcessSet = global_process_set) -> Any:
    """Return the pytree ``params`` with every array leaf replaced by ``root_rank``'s value.

    Every rank must pass a pytree of the same structure, shapes and dtypes (e.g. the same model
    initialised with its own random key). One grouped broadcast per dtype; eager or under ``jax.jit``.
    """
    leaves, treedef = jax.tree_util.tree_flatten(params)
    arrays = [jnp.asarray(x) for x in leaves]
    out: list[Any] = list(arrays)
    base = name or "broadcast_parameters"
    for dtype, idx in sorted(_by_dtype(arrays).items()):
        group = [arrays[i] for i in idx]

        def host(xs: list[np.ndarray], key: str = f"{base}.{dtype}") -> list[np.ndarray]:
            work = [np.array(x, order="C") for x in xs]  # writeable copies, broadcast in place
            return _C.broadcast_async(work, root_rank, name=key, process_set=process_set, inplace=True,
                                      grouped=True, wake=False).wait()

        def into(xs: list[np.ndarray], outs: list[np.ndarray], key: str = f"{base}.{dtype}") -> None:
            for o, x in zip(outs, xs):  # XLA's result buffers, broadcast in place
                np.copyto(o, x)
            _C.broadcast_async(outs, root_rank, name=key, process_set=process_set, inplace=True,
                               grouped=True, wake=False).wait()

        for i, r in zip(idx, _run(host, group, _same(group), into)):
            out[i] = r
    return jax.tree_util.tree_unflatten(treedef, out)


def allreduce_tree(tree: Any, op: int = ReduceOp.AVERAGE, name: str | None = None,
                   compression: Any = Compression.none, prescale_factor: float = 1.0,
                   postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Any:
    """Allreduce every array leaf of a pytree: one grouped (fused) operation per dtype.

    Eager or under ``jax.jit``; differentiable. Used by ``DistributedOptimizer`` on gradients.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves:
        return tree
    pairs = [compression.compress(jnp.asarray(x)) for x in leaves]
    sent = [p[0] for p in pairs]
    out: list[Any] = list(sent)
    base = name or "allreduce_tree"
    for dtype, idx in sorted(_by_dtype(sent).items()):
        reduced = _allreduce_list([sent[i] for i in idx], f"{base}.{dtype}", ReduceOp(int(op)),
                                  float(prescale_factor), float(postscale_factor), process_set, True)
        for i, r in zip(idx, reduced):
            out[i] = r
    return jax.tree_util.tree_unflatten(treedef, [compression.decompress(o, p[1]) for o, p in zip(out, pairs)])
