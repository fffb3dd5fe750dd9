"""PyTorch Lightning 2 on Horovod: ``Trainer(strategy="horovod")``.

Importing this module registers the strategy name ``"horovod"`` in the strategy registry of each
installed Lightning 2 package: the unified ``lightning`` (``lightning.pytorch``) and the standalone
``pytorch_lightning``. A package already imported is registered at once; one imported later is
registered as soon as its import finishes (this module does not import Lightning itself).
Lightning 1's ``Trainer(accelerator="horovod")`` is registered too, as an error that names
``strategy="horovod"`` (a Lightning 2 accelerator cannot choose the strategy).

``HorovodStrategy(...)`` builds the strategy for the Lightning package your script uses: the one
that is imported (``lightning.pytorch`` when both are), or ``package=`` names it. ``isinstance(s,
HorovodStrategy)`` holds for both. To subclass, use ``strategy_class(package)``.

Run the script with ``horovodrun -np N python train.py`` (or mpirun, ``horovod.run``, Spark, Ray);
see docs/lightning.md.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from typing import Any

from horovod.lightning.accelerator import register_accelerator_name
from horovod.lightning.strategy import PACKAGES, strategy_class

__all__ = ["HorovodStrategy", "strategy_class", "registered_packages"]

_registered: list[str] = []
_lock = threading.Lock()


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package.split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def _register(package: str) -> None:
    with _lock:
        if package in _registered:
            return
        _registered.append(package)
    cls = strategy_class(package)
    registry = sys.modules[package + ".strategies"].StrategyRegistry
    cls.register_strategies(registry)
    register_accelerator_name(package)


def registered_packages() -> list[str]:
    """The Lightning packages in whose registry ``"horovod"`` is registered so far."""
    return list(_registered)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Registers ``"horovod"`` in a Lightning package's registry when that package's import ends."""

    def __init__(self, pending: set[str]) -> None:
        self.pending = pending

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            self.pending.discard(fullname)
            if not self.pending and self in sys.meta_path:
                sys.meta_path.remove(self)
            _register(fullname)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _install() -> None:
    pending = set()
    for package in PACKAGES:
        if package in sys.modules:
            _register(package)
        elif _installed(package):
            pending.add(package)
    if pending:
        sys.meta_path.insert(0, _RegisterAfterImport(pending))


def _package_in_use(package: str | None) -> str:
    if package is not None:
        aliases = {"lightning": "lightning.pytorch", "pl": "pytorch_lightning"}
        return aliases.get(package, package)
    loaded = [p for p in PACKAGES if p in sys.modules]
    if loaded:
        return loaded[0]  # lightning.pytorch first when both are imported
    installed = [p for p in PACKAGES if _installed(p)]
    if not installed:
        raise ImportError("HorovodStrategy needs Lightning 2: pip install 'horovod-py[lightning]'")
    return installed[0]


class _ForEachPackage(type):
    def __call__(cls, *args: Any, package: str | None = None, **kwargs: Any) -> Any:
        return strategy_class(_package_in_use(package))(*args, **kwargs)

    def __instancecheck__(cls, obj: Any) -> bool:
        return any(isinstance(obj, strategy_class(p)) for p in PACKAGES if p in sys.modules)

    def __subclasscheck__(cls, sub: Any) -> bool:
        return any(issubclass(sub, strategy_class(p)) for p in PACKAGES if p in sys.modules)


class HorovodStrategy(metaclass=_ForEachPackage):
    """Lightning's strategy on Horovod: ``Trainer(strategy=HorovodStrategy())``.

    Keyword arguments (all optional): ``compression`` (``hvd.Compression.fp16``), ``op``
    (``hvd.Average``, ``hvd.Sum``, ``hvd.Adasum``), ``gradient_predivide_factor``,
    ``sparse_as_dense``, and Lightning's ``accelerator``, ``parallel_devices``, ``checkpoint_io``,
    ``precision_plugin``; ``package="pytorch_lightning"`` picks the standalone package when both
    are imported.
    """

    strategy_name = "horovod"


_install()
