"""The torch integrations hold each other by public members only: no ``__class__`` assignment and
no access to another object's private attribute in ``horovod/torch/`` (the checkpoint module
included) and ``horovod/lightning/``.

What counts (checked on the syntax tree of every module there):

- ``x.__class__ = ...`` (any target, also in a tuple, an augmented or annotated assignment) and
  ``setattr(x, "__class__", ...)``: swapping an object's class is never allowed.
- ``obj._name`` (read, write or delete, also as ``getattr(obj, "_name")``/``hasattr``/``setattr``/
  ``delattr``; a name with one or more leading underscores that is not a
  dunder such as ``__dict__``) where ``obj`` is not:
  - ``self`` or ``cls`` (the class's own attributes, inherited ones included);
  - ``super()`` (the base class's implementation, called from the subclass);
  - a class or function defined at the top level of the same module (``_Slot.x``,
    ``Helper._build``): module-private names are private to the module, not to a class.
  ``self.other._x`` counts: ``self.other`` is another object.
- Not counted: ``from horovod.x._mod import _helper`` (a private module's functions are the
  package's internal API: the module name says so, and import cycles are tested separately), and
  namedtuple's public methods ``_replace``/``_asdict``/``_fields``/``_make``.

Framework internals that have no public equivalent are listed in ``ALLOWED`` with the reason,
each by module and attribute, so that a new reach into another object's privates fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCOPE = ("horovod/torch", "horovod/lightning")
NAMEDTUPLE = {"_replace", "_asdict", "_fields", "_make"}

# (module path, attribute) -> why it is read although private
ALLOWED = {
    ("horovod/torch/_autograd.py", "_execution_engine"):
        "torch's autograd engine: queue_callback (end of a backward pass) has no public API; "
        "torch's DistributedDataParallel uses the same call (the dense reducer's, ZeRO stage 2's)",
    ("horovod/torch/_shard_hooks.py", "_execution_engine"):
        "as in _autograd.py: the end-of-backward callback of fully_shard's root",
    ("horovod/torch/_shard_hooks.py", "_C"): "torch's C extension, for the next entry",
    ("horovod/torch/_shard_hooks.py", "_autograd"): "torch's autograd bindings, for the next entry",
    ("horovod/torch/_shard_hooks.py", "_top_saved_tensors_default_hooks"):
        "the innermost saved-tensor hooks in force (no public reader; torch's AOT autograd reads "
        "them too): fully_shard pushes its own only where no one else's are in force, and without "
        "the function every resharding module keeps its parameters' storage (read with getattr)",
    ("horovod/torch/_shard_params.py", "_parameters"):
        "nn.Module's parameter table: a wrapped module's entry switched between the shard and the "
        "gathered parameter around its forward, as torch's FSDP does (register_parameter refuses "
        "to replace an existing name)",
    ("horovod/torch/_shard_group.py", "_parameters"):
        "nn.Module's parameter table, read: the parameters each module registers itself (tied "
        "ones under each name), which fully_shard takes over (named_parameters drops duplicates)",
    ("horovod/lightning/strategy.py", "_opt_called"):
        "torch's LR scheduler step tracking (set by torch's own step wrapper; no public API) for a "
        "scheduler re-pointed at the wrapped optimizer",
    ("horovod/lightning/strategy.py", "_wrapped_by_lr_sched"):
        "the mark torch's LR schedulers put on a tracked optimizer.step (on our own wrapper)",
    ("horovod/torch/_device_plane.py", "_Options"):
        "torch.distributed's Gloo options class (no public constructor for its timeout/devices)",
    ("horovod/torch/_device_plane.py", "_timeout"): "torch.distributed's Gloo/NCCL options' timeout",
    ("horovod/torch/_device_plane.py", "_devices"): "torch.distributed's Gloo options' devices",
    ("horovod/torch/_device_plane.py", "_reduce_scatter_base"):
        "torch.distributed ProcessGroup's flat reduce-scatter (the public one takes lists)",
    ("horovod/torch/_device_tensor.py", "_C"): "torch's C extension module (stream/event handles)",
    ("horovod/torch/_device_tensor.py", "_cuda_getCurrentStream"):
        "torch._C's current CUDA stream handle without a Stream object (the hot path)",
    ("horovod/torch/_torch_buffers.py", "_C"): "torch's C extension module (fused kernels)",
    ("horovod/torch/_torch_buffers.py", "_nn"): "torch._C._nn: torch's fused kernels",
    ("horovod/torch/_torch_buffers.py", "_foreach_copy_"): "torch's fused multi-tensor copy",
    ("horovod/torch/_torch_buffers.py", "_foreach_div_"): "torch's fused multi-tensor division",
    ("horovod/torch/_torch_buffers.py", "_foreach_mul_"): "torch's fused multi-tensor product",
}

# module path -> why it assigns ``__class__`` (an API whose documented contract is the swap)
CLASS_SWAPS = {
    "horovod/torch/fully_shard.py":
        "hvd.fully_shard follows torch's fully_shard (FSDP2): the module it returns is the same "
        "object, now an instance of a subclass of FullyShardedModule and of its own class, so that "
        "isinstance(model, hvd.FullyShardedModule) and its methods (unshard, reshard, no_sync, "
        "full_state_dict) hold; it is the user's module, not another integration's object",
}


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__") and len(name) > 4


def violations(source: str, path: str) -> list[str]:
    """Every ``__class__`` assignment and private access of ``source`` (see the module docstring)
    that ``ALLOWED`` does not list, as ``path:line: text``."""
    tree = ast.parse(source)
    local = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))}
    out = []

    def flag(node: ast.AST, why: str) -> None:
        out.append(f"{path}:{getattr(node, 'lineno', 0)}: {why}: {ast.unparse(node)}")

    def targets(node: ast.AST) -> list[ast.expr]:
        if isinstance(node, ast.Assign):
            found = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            found = [node.target]
        else:
            return []
        flat: list[ast.expr] = []
        while found:
            t = found.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                found.extend(t.elts)
            else:
                flat.append(t)
        return flat

    for node in ast.walk(tree):
        for t in targets(node):
            if isinstance(t, ast.Attribute) and t.attr == "__class__" and path not in CLASS_SWAPS:
                flag(node, "__class__ assignment")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            name, owner = node.args[1].value, node.args[0]
            if name == "__class__" and node.func.id == "setattr":
                if path not in CLASS_SWAPS:
                    flag(node, "__class__ assignment")
            elif (name.startswith("_") and not _dunder(name) and (path, name) not in ALLOWED
                  and not (isinstance(owner, ast.Name) and owner.id in ("self", "cls"))):
                flag(node, "private attribute of another object")
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or _dunder(node.attr):
            continue
        if node.attr in NAMEDTUPLE:
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and (owner.id in ("self", "cls") or owner.id in local):
            continue
        if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
            continue
        if (path, node.attr) in ALLOWED:
            continue
        flag(node, "private attribute of another object")
    return out


def _modules() -> list[Path]:
    return sorted(p for d in SCOPE for p in (REPO / d).rglob("*.py"))


def test_no_class_swaps_and_no_private_reads_across_objects() -> None:
    found = []
    for p in _modules():
        rel = p.relative_to(REPO).as_posix()
        found += violations(p.read_text(), rel)
    assert not found, ("the torch integrations must hold each other by public members (a "
                       "GradientReducer, ShardedStateful: horovod/torch/reducer.py); found:\n"
                       + "\n".join(found))


def test_every_allowed_entry_is_still_needed() -> None:
    """An entry whose access is gone must go too (the list only shrinks)."""
    used = set()
    for p in _modules():
        rel = p.relative_to(REPO).as_posix()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Attribute) and (rel, node.attr) in ALLOWED:
                used.add((rel, node.attr))
            if isinstance(node, ast.Constant) and (rel, node.value) in ALLOWED:
                used.add((rel, node.value))
    assert set(ALLOWED) - used == set()
    swapping = {p.relative_to(REPO).as_posix() for p in _modules() if "__class__ =" in p.read_text()}
    assert set(CLASS_SWAPS) - swapping == set()


@pytest.mark.parametrize("code, expected", [
    ("def f(opt):\n    opt.__class__ = int\n", "__class__ assignment"),
    ("def f(opt):\n    a, opt.__class__ = 1, int\n", "__class__ assignment"),
    ("def f(opt):\n    setattr(opt, '__class__', int)\n", "__class__ assignment"),
    ("def f(opt):\n    return opt._handles\n", "private attribute of another object"),
    ("def f(opt):\n    opt._hook_handles = []\n", "private attribute of another object"),
    ("def f(opt):\n    return getattr(opt, '_bundles', None)\n", "private attribute of another object"),
    ("class A:\n    def f(self):\n        return self.reducer._busy\n", "private attribute of another object"),
    ("import horovod.torch as hvd\nx = hvd.optimizer._DistributedOptimizer\n",
     "private attribute of another object"),
    ("from torch.autograd import Variable\nVariable._execution_engine.queue_callback(print)\n",
     "private attribute of another object"),  # allowed only in the modules ALLOWED names
])
def test_the_rule_catches(code: str, expected: str) -> None:
    found = violations(code, "horovod/torch/example.py")
    assert len(found) == 1 and expected in found[0], found


@pytest.mark.parametrize("code", [
    "class A:\n    def f(self):\n        return self._x\n",
    "class A(B):\n    def f(self):\n        return super()._g()\n",
    "class _Slot:\n    _n = 1\n\ndef f():\n    return _Slot._n\n",
    "import collections\nP = collections.namedtuple('P', 'a')\n\ndef f(p):\n    return p._replace(a=1)\n",
    "def f(o):\n    return o.__dict__, o.__class__\n",
])
def test_the_rule_allows(code: str) -> None:
    assert violations(code, "horovod/torch/example.py") == []
