"""Upstream Horovod's ``horovod.common.util`` helpers, for the scripts and tests that import them.

Upstream kept build probes and small utilities here (``gpu_available``, ``env``, ``split_list``,
...). This project has no compiled extensions, so the probes answer from what is importable: an
"extension" is a framework binding (``torch``, ``tensorflow``) whose framework is installed. Every
helper keeps upstream's name, arguments and return values. Asking for one of upstream's internals
that is not here raises an ``ImportError`` that names it, instead of a bare ``AttributeError``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sysconfig
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

__all__ = ["EXTENSIONS", "get_ext_suffix", "get_extension_full_path", "check_extension",
           "extension_available", "gpu_available", "mpi_built", "gloo_built", "nccl_built",
           "ddl_built", "ccl_built", "env", "get_average_backwards_compatibility_fun",
           "num_rank_is_power_2", "split_list", "check_installed_version", "is_iterable",
           "is_version_greater_equal_than"]

EXTENSIONS = ["tensorflow", "torch", "mxnet"]

# binding -> the framework it needs; mxnet has no binding here
_FRAMEWORK = {"torch": "torch", "tensorflow": "tensorflow", "keras": "tensorflow"}

T = TypeVar("T")


def get_ext_suffix() -> str:
    """The file suffix of compiled extension modules of this Python (e.g. ``.cpython-311-x86_64-linux-gnu.so``)."""
    return sysconfig.get_config_var("EXT_SUFFIX") or sysconfig.get_config_var("SO") or ".so"


def get_extension_full_path(pkg_path: str, *args: str) -> str:
    """Where upstream's compiled library ``args[-1]`` would lie, beside ``pkg_path`` (kept for
    scripts that print it; no such file exists in this project)."""
    if not args:
        raise ValueError("get_extension_full_path needs at least the library name")
    return os.path.join(os.path.dirname(pkg_path), *args[:-1], args[-1] + get_ext_suffix())


def _binding(name: str) -> str:
    """'horovod.torch', 'torch', 'torch.mpi_lib' -> 'torch'."""
    parts = [p for p in name.split(".") if p and p != "horovod"]
    return parts[0] if parts else name


def extension_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether the binding ``ext_base_name`` ('torch', 'tensorflow') can be used here."""
    framework = _FRAMEWORK.get(_binding(ext_base_name))
    ok = framework is not None and importlib.util.find_spec(framework) is not None
    if verbose:
        print(f"Extension {ext_base_name} {'was' if ok else 'was NOT'} built.")
    return ok


def check_extension(ext_name: str, ext_env_var: str, pkg_path: str, *args: str) -> None:
    """Raise ``ImportError`` if the binding ``ext_name`` cannot be used (its framework is missing).

    Upstream checked for its compiled library; here the binding is Python and needs only the
    framework, so the message says which package to install.
    """
    binding = _binding(ext_name)
    framework = _FRAMEWORK.get(binding)
    if framework is None:
        raise ImportError(f"Extension {ext_name} is not available in horovod-py: it has bindings for "
                          f"PyTorch, TensorFlow and Keras only ({ext_env_var} does not apply).")
    if importlib.util.find_spec(framework) is None:
        raise ImportError(f"Extension {ext_name} cannot be used: the Python package {framework!r} is not "
                          f"installed (pip install 'horovod-py[{binding}]').")


def _cache(fn: Callable[..., T]) -> Callable[..., T]:
    return functools.lru_cache(maxsize=None)(fn)


@_cache
def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether the framework of binding ``ext_base_name`` sees a GPU."""
    binding = _binding(ext_base_name)
    ok = False
    if extension_available(binding):
        if _FRAMEWORK[binding] == "torch":
            import torch

            ok = bool(torch.cuda.is_available())
        else:
            import tensorflow as tf

            ok = bool(tf.config.list_physical_devices("GPU"))
    if verbose:
        print(f"Extension {ext_base_name} {'was' if ok else 'was NOT'} running with GPU.")
    return ok


def _basics() -> Any:
    from horovod.common import basics

    return basics


@_cache
def mpi_built(verbose: bool = False) -> bool:
    """Whether the MPI transport can be used (mpi4py is installed)."""
    return bool(_basics().mpi_built())


@_cache
def gloo_built(verbose: bool = False) -> bool:
    """Whether the Gloo transport can be used (PyTorch is installed)."""
    return bool(_basics().gloo_built())


@_cache
def nccl_built(verbose: bool = False) -> int:
    """The NCCL version code of the installed PyTorch when it can use a GPU, else 0."""
    return int(_basics().nccl_built())


@_cache
def ddl_built(verbose: bool = False) -> bool:
    """Always False: IBM DDL is not supported."""
    return False


@_cache
def ccl_built(verbose: bool = False) -> bool:
    """Always False: oneCCL is not supported."""
    return False


@contextmanager
def env(**kwargs: str | None) -> Iterator[None]:
    """Set environment variables for the ``with`` block (``None`` values are ignored), then restore them."""
    values = {k: v for k, v in kwargs.items() if v is not None}
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


def op_from_average(op: Any, average: bool | None, average_op: Any, sum_op: Any, stacklevel: int) -> Any:
    """Upstream's rule for the deprecated ``average=`` argument, the one place it lives: ``op`` as given
    (None: neither was given); ``average`` alone maps to ``average_op``/``sum_op`` with a
    DeprecationWarning pointing ``stacklevel`` frames above this function.

    Raises:
        ValueError: both ``op`` and ``average`` were given.
    """
    if average is None:
        return op
    if op is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                  DeprecationWarning, stacklevel=stacklevel + 1)
    return average_op if average else sum_op


def get_average_backwards_compatibility_fun(reduce_ops: Any) -> Callable[[Any, bool | None], Any]:
    """A function ``(op, average) -> op`` for the old ``average=`` argument (upstream's rules).

    ``op`` wins; ``average`` alone maps to Average/Sum with a DeprecationWarning; giving both is an
    error; neither means Average.
    """
    def impl(op: Any, average: bool | None) -> Any:
        op = op_from_average(op, average, reduce_ops.Average, reduce_ops.Sum, stacklevel=3)
        return reduce_ops.Average if op is None else op
    return impl


def num_rank_is_power_2(num_rank: int) -> bool:
    """Whether ``num_rank`` is a power of two (Adasum's requirement)."""
    return num_rank > 0 and num_rank & (num_rank - 1) == 0


def split_list(items: Sequence[T], n: int) -> list[Sequence[T]]:
    """``items`` in ``n`` contiguous chunks whose sizes differ by at most one (larger ones first)."""
    size, extra = divmod(len(items), n)
    bounds = [i * size + min(i, extra) for i in range(n + 1)]
    return [items[bounds[i]:bounds[i + 1]] for i in range(n)]


def check_installed_version(name: str, version: str, exception: BaseException | None = None) -> None:
    """Upstream compared a framework's version with the one Horovod was compiled against.

    Nothing is compiled here, so no version can mismatch: this never warns or raises.
    """
    return None


def is_iterable(x: Any) -> bool:
    """Whether ``iter(x)`` works."""
    try:
        iter(x)
    except TypeError:
        return False
    return True


@_cache
def is_version_greater_equal_than(ver: str, target: str) -> bool:
    """``ver >= target`` for version strings; ``target`` must be ``major.minor.patch``."""
    if not isinstance(ver, str) or not isinstance(target, str):
        raise ValueError(f"is_version_greater_equal_than takes two strings, got {type(ver).__name__} "
                         f"{ver!r} and {type(target).__name__} {target!r}")
    if len(target.split(".")) != 3:
        raise ValueError(f"the target version must be major.minor.patch, got {target!r}")
    from packaging import version

    return version.parse(ver) >= version.parse(target)


# upstream's other names in horovod.common.util: internals of its compiled build
_UPSTREAM_INTERNALS = {"_check_extension_lambda", "get_version_mismatch_message",
                       "HorovodVersionMismatchError"}


def __getattr__(name: str) -> Any:
    if name in _UPSTREAM_INTERNALS:
        raise ImportError(f"horovod.common.util.{name} is an internal of upstream Horovod's compiled build "
                          "and does not exist in horovod-py (it has no compiled extensions).")
    raise AttributeError(f"module 'horovod.common.util' has no attribute {name!r}; the helpers kept from "
                         f"upstream are: {', '.join(__all__)}")
