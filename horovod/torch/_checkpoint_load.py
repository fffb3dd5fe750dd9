"""The reading half of ``hvd.checkpoint.load``: the newest committed version's index, the checks of
the checkpoint against the model and optimizer given (keys, shapes, optimizer class and
hyper-parameters, parameter names), and DCP reads of whole entries or of a rank's rows."""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any

import torch

from horovod.torch import _checkpoint_dir as layout
from horovod.torch._checkpoint_parts import (
    _algorithm,
    _hyperparameters,
    _optimizer_params,
    _param_names,
    optimizer_list,
    row_layout,
    world,
)
from horovod.torch.reducer import RowShard, ShardedStateful

__all__ = ["read_metadata", "load_version"]

def read_metadata(path: str) -> tuple[str, Any]:
    """The newest committed version's directory at ``path`` and its DCP index."""
    from torch.distributed.checkpoint import FileSystemReader

    for attempt in range(3):
        where = layout.resolve(path)
        if where == f"{path}.old":
            warnings.warn(f"hvd.checkpoint.load: no checkpoint at {path!r}; reading {where!r}, the "
                          "previous checkpoint that a save of the first format left there when it "
                          "crashed between its two renames", stacklevel=3)
        try:
            return where, FileSystemReader(where).read_metadata()
        except FileNotFoundError:
            if attempt < 2 and layout.resolve(path) != where:
                continue  # a newer version was committed and this one removed meanwhile
            raise ValueError(f"hvd.checkpoint.load: {path!r} is not a complete checkpoint (no "
                             "index '.metadata': the save did not commit)") from None
    raise AssertionError("unreachable")


class _RowRequests:
    """The entries a rank reads as rows of a whole tensor (a fully sharded parameter's, or its
    optimizer state's): the region of each, the ones with no row here (nothing to read), and
    0-d tensors read whole and held as one row."""

    def __init__(self) -> None:
        self.regions: dict[str, RowShard] = {}
        self.ready: dict[str, torch.Tensor] = {}
        self.zero_d: set[str] = set()

    def add(self, request: dict[str, Any], key: str, rs: RowShard, dtype: torch.dtype) -> None:
        if rs.hi <= rs.lo:
            self.ready[key] = torch.empty(rs.local_shape, dtype=dtype)
        elif not rs.shape:
            request[key] = torch.empty((), dtype=dtype)
            self.zero_d.add(key)
        else:
            request[key] = torch.empty(rs.local_shape, dtype=dtype)
            self.regions[key] = rs

    def finish(self, got: dict[str, Any]) -> dict[str, Any]:
        for key in self.zero_d:
            got[key] = got[key].reshape(1)
        got.update(self.ready)
        return got


def _read(path: str, request: dict[str, Any], regions: dict[str, RowShard] | None = None) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    objects: dict[str, Any] = {}
    rows = regions or {}

    class _Planner(DefaultLoadPlanner):
        # dcp.load reads objects into a copy of the request that it drops: keep them aside
        def load_bytes(self, read_item: Any, value: Any) -> None:
            objects[read_item.dest_index.fqn] = torch.load(value, weights_only=False)

        # the entries of ``regions`` are read as their rows of the whole tensor (chunks of it
        # that other world sizes wrote, or the whole tensor an unsharded model saved)
        def create_local_plan(self) -> Any:
            if not rows:
                return super().create_local_plan()
            assert self.metadata is not None
            rest = {k: v for k, v in self.state_dict.items() if k not in rows}
            plan = create_default_local_load_plan(rest, self.metadata, not self.allow_partial_load)
            items = list(plan.items)
            for fqn, rs in rows.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size((rs.lo,) + (0,) * (len(rs.shape) - 1)),
                                             sizes=torch.Size(rs.local_shape))
                md = self.metadata.state_dict_metadata[fqn]
                assert isinstance(md, TensorStorageMetadata)
                items += create_read_items_for_chunk_list(fqn, md, [chunk])
            return dataclasses.replace(plan, items=items)

        def lookup_tensor(self, index: Any) -> Any:
            if index.fqn in rows:
                return self.state_dict[index.fqn]
            return super().lookup_tensor(index)

    if request:
        with warnings.catch_warnings():  # "torch.distributed is disabled ... single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(request, storage_reader=FileSystemReader(path), no_dist=True,
                     planner=_Planner(flatten_state_dict=False))
        request.update(objects)
    return request


def load_version(path: str, where: str, meta: Any, model: torch.nn.Module | None,
                  optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = meta.state_dict_metadata
    head = _read(where, {k: None for k in md if k in ("horovod", "extra") or _GROUPS_KEY.fullmatch(k)})
    problems: list[str] = []
    request: dict[str, Any] = {}
    model_sd: dict[str, Any] = {}
    layout = row_layout(model, world()[1], "load")
    rows = _RowRequests()
    if model is not None:
        model_sd = model.state_dict()
        want = {f"model.{k}" for k in model_sd}
        have = {k for k in md if k.startswith("model.")}
        if want - have:
            problems.append(f"missing model keys {sorted(k[6:] for k in want - have)}")
        if have - want:
            problems.append(f"unexpected model keys {sorted(k[6:] for k in have - want)}")
        for k, v in model_sd.items():
            m = md.get(f"model.{k}")
            rs = layout.get(k)
            if isinstance(v, torch.Tensor) and isinstance(m, TensorStorageMetadata):
                shape = rs.shape if rs is not None else tuple(v.shape)  # a shard: the whole one's
                if tuple(m.size) != shape:
                    problems.append(f"model key {k!r}: shape {tuple(m.size)} in the checkpoint, "
                                    f"{shape} in the model")
                elif rs is not None:
                    rows.add(request, f"model.{k}", rs, m.properties.dtype)
                else:
                    request[f"model.{k}"] = torch.empty(v.shape, dtype=m.properties.dtype)
            elif m is not None:
                request[f"model.{k}"] = None
    header = head.get("horovod") or {}
    given = optimizer_list(optimizer)
    optim_sds: list[tuple[torch.optim.Optimizer, Any]] = []
    count = _optimizer_count_mismatch(optimizer, header, md)
    if count:
        problems.append(count)
    else:
        for (prefix, opt), h in zip(given, header.get("optimizers") or [header]):
            optim_sds.append((opt, _optimizer_request(opt, model, md, head.get(f"{prefix}.param_groups"),
                                                      problems, request, h, layout, rows, prefix)))
    if problems:
        raise ValueError(f"hvd.checkpoint.load({path!r}): the checkpoint does not match the "
                         f"{'model and optimizer' if optimizer is not None else 'model'} given: "
                         + "; ".join(problems) + ". Nothing was loaded.")
    got = rows.finish(_read(where, request, rows.regions))
    if model is not None:
        model.load_state_dict({k: got[f"model.{k}"] for k in model_sd})
    for opt, optim_sd in optim_sds:
        for i, keys in optim_sd.pop("_keys").items():
            optim_sd["state"][i] = {sk: got[fk] for sk, fk in keys.items()}
        opt.load_state_dict(optim_sd)
    return dict(head.get("extra") or {})


_GROUPS_KEY = re.compile(r"optim(\.\d+)?\.param_groups")


def _optimizer_count_mismatch(optimizer: Any, header: dict[str, Any], md: Any) -> str | None:
    """Why the optimizers given cannot take the checkpoint's: one given where it holds a list's
    (``save(optimizer=[...])``), a list where it holds one optimizer's, lists of other lengths."""
    saved: list[Any] | None = header.get("optimizers")
    if optimizer is None:
        return None
    many = isinstance(optimizer, (list, tuple))
    if saved is None:
        if not many:
            return None
        if "optim.param_groups" not in md:
            return "the checkpoint has no optimizer state (it was saved without an optimizer)"
        return (f"the checkpoint holds one optimizer's state (saved with optimizer=<an optimizer>), a "
                f"list of {len(optimizer)} was given; pass the optimizer itself")
    if not many:
        return (f"the checkpoint holds the state of {len(saved)} optimizers (saved with optimizer=[...]), "
                f"one {type(optimizer).__name__} was given; pass the list of {len(saved)} optimizers, "
                "in the order they were saved")
    if len(saved) != len(optimizer):
        return (f"the checkpoint holds the state of {len(saved)} optimizers "
                f"({[h.get('optimizer') for h in saved]}), {len(optimizer)} were given")
    return None


_WRAPPERS = {"ZeroRedundancyOptimizer"}  # names the first format recorded instead of the class


def _optimizer_mismatch(optimizer: torch.optim.Optimizer, saved_groups: list[dict[str, Any]],
                        header: dict[str, Any]) -> str | None:
    """Why the checkpoint's optimizer state cannot go into ``optimizer`` (another class; for a
    checkpoint of the first format, which recorded no class, other hyper-parameter names)."""
    cls = _algorithm(optimizer)
    have = _hyperparameters(optimizer.param_groups)
    saved = header.get("hyperparameters") or _hyperparameters(saved_groups)
    saved_cls = header.get("optimizer")
    only_saved = sorted(set(saved) - set(have))
    only_have = sorted(set(have) - set(saved))
    diff = (f"hyper-parameters only in the checkpoint: {only_saved or 'none'}; only in the "
            f"optimizer given: {only_have or 'none'}")
    fix = ("Load the model alone (optimizer=None) and start the optimizer afresh, or build the "
           "optimizer the checkpoint was saved with")
    if isinstance(saved_cls, str) and saved_cls not in _WRAPPERS:
        if saved_cls != cls.__name__:
            where = header.get("optimizer_module")
            return (f"the checkpoint holds the state of a {f'{where}.' if where else ''}{saved_cls} "
                    f"optimizer, the optimizer given is a {cls.__module__}.{cls.__name__} ({diff}). "
                    + fix)
        return None
    if only_saved or only_have:
        return (f"the checkpoint's optimizer has other hyper-parameters than the "
                f"{cls.__module__}.{cls.__name__} given ({diff}). " + fix)
    return None


def _optimizer_request(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None, md: Any,
                       saved_groups: Any, problems: list[str], request: dict[str, Any],
                       header: dict[str, Any], layout: dict[str, RowShard] | None = None,
                       rows: _RowRequests | None = None, key: str = "optim") -> Any:
    """Check the saved optimizer (its keys under ``key``) against ``optimizer``; add what to read
    to ``request`` and return the full state dict to fill (state keys under ``_keys``)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    if saved_groups is None:
        problems.append("the checkpoint has no optimizer state (it was saved without an optimizer)")
        return None
    mismatch = _optimizer_mismatch(optimizer, saved_groups, header)
    if mismatch:
        problems.append(mismatch)
        return None
    params = _optimizer_params(optimizer)
    names = _param_names(model, params)
    current = [len(g["params"]) for g in optimizer.param_groups]
    if [len(g["params"]) for g in saved_groups] != current:
        problems.append(f"optimizer groups of sizes {[len(g['params']) for g in saved_groups]} in "
                        f"the checkpoint, {current} in the optimizer")
        return None
    saved_names = [n for g in saved_groups for n in g["params"]]
    if saved_names != names:
        diff = [(a, b) for a, b in zip(saved_names, names) if a != b]
        problems.append(f"optimizer parameters differ (checkpoint, optimizer): {diff[:5]}")
        return None
    owned = set(range(len(params)))
    if isinstance(optimizer, ShardedStateful):
        owned = set(optimizer.owned_indices())  # each rank reads its shard only
    keys: dict[int, dict[str, str]] = {}
    for i, name in enumerate(names):
        prefix = f"{key}.state.{name}."
        entries = {k[len(prefix):]: k for k in md if k.startswith(prefix) and "." not in k[len(prefix):]}
        if not entries or i not in owned:
            continue
        keys[i] = entries
        rs = (layout or {}).get(name)
        for sk, fk in entries.items():
            m = md[fk]
            # a sharded parameter's per-element state (its shape; of a 0-d parameter's 0-d
            # state tensors, ``step`` is the one that is not per element): this rank's rows
            if (rs is not None and rows is not None and isinstance(m, TensorStorageMetadata)
                    and tuple(m.size) == rs.shape and (rs.shape or sk != "step")):
                rows.add(request, fk, rs, m.properties.dtype)
            elif isinstance(m, TensorStorageMetadata):
                request[fk] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
            elif isinstance(m, BytesStorageMetadata):
                request[fk] = None
    groups, start = [], 0
    for g in saved_groups:
        k = len(g["params"])
        groups.append({**{a: b for a, b in g.items() if a != "params"},
                       "params": list(range(start, start + k))})
        start += k
    return {"state": {}, "param_groups": groups, "_keys": keys}
