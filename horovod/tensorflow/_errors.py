"""The TensorFlow error types of Horovod's ops: upstream Horovod's, in eager mode, ``tf.function`` and TF1.

Upstream's ops (C++ kernels) fail with a TF status chosen by the engine:

============================================  =================================
ranks disagree (shape, dtype, root, op, ...)  ``tf.errors.FailedPreconditionError``
bad argument (splits, set membership, ...)    ``tf.errors.InvalidArgumentError``
engine failed or shut down                    ``tf.errors.UnknownError``
============================================  =================================

Eager ops raise these directly. In graphs an op is a ``tf.numpy_function``, and TF derives the
status of a Python exception from its type only: ValueError/TypeError give INVALID_ARGUMENT,
most others UNKNOWN; there is no way to ask for FAILED_PRECONDITION. So a mismatch inside a graph
raises :class:`HorovodFailedPrecondition` (a ValueError; TF writes its class name into the status
message), and :func:`install` makes ``tf.errors.InvalidArgumentError(...)`` build a
``FailedPreconditionError`` (same arguments, same message) when the message carries that name.
Every way TF turns a status into a Python exception (``session.run``, ``tf.function`` calls,
``tf.data`` iterators) constructs the class it looks up for the status code, so this one hook
covers them all.

The mapping is limited to Horovod's ops: only a message that one of them wrote (the
``HorovodFailedPrecondition:`` mark) is changed, every other InvalidArgumentError of TensorFlow is
built as before; and it is installed when the first Horovod op is put into a graph
(``_bridge``), not when ``horovod.tensorflow`` is imported, so a program that imports Horovod but
runs its ops eagerly (or not at all) keeps TensorFlow's class untouched.
"""

from __future__ import annotations

import re
from typing import Any

import tensorflow as tf

from horovod.common.exceptions import CollectiveMismatchError, HorovodInternalError, NotInitializedError

__all__ = ["HorovodEngineFailed", "HorovodFailedPrecondition", "eager_error", "graph_error", "install",
           "is_peer_loss"]

_MARK = re.compile(r"\bHorovodFailedPrecondition: ")
_ENGINE_MARK = re.compile(r"\bHorovodEngineFailed: ")


class HorovodFailedPrecondition(ValueError):
    """Ranks disagree about a collective inside a graph op; surfaces as ``FailedPreconditionError``."""


class HorovodEngineFailed(RuntimeError):
    """The engine failed or shut down under a graph op (a peer left); surfaces as ``UnknownError``
    whose message carries this class name, which :func:`is_peer_loss` looks for."""


def eager_error(op_type: str, key: Any, exc: BaseException) -> BaseException:
    """The exception to raise for ``exc`` from an eager op (``exc`` itself when it is not translated)."""
    where = f"{op_type} ({key!r})" if key is not None else op_type
    msg = f"{where}: {exc}"
    if isinstance(exc, CollectiveMismatchError):
        return tf.errors.FailedPreconditionError(None, None, msg)
    if isinstance(exc, HorovodInternalError):
        return tf.errors.UnknownError(None, None, msg)
    if isinstance(exc, NotInitializedError):
        return exc
    if isinstance(exc, ValueError):
        return tf.errors.InvalidArgumentError(None, None, msg)
    return exc


def graph_error(op_type: str, key: Any, exc: BaseException) -> BaseException:
    """The exception to raise for ``exc`` inside a ``numpy_function`` (TF maps its type to a status)."""
    msg = f"{op_type} ({key!r}): {exc}"
    if isinstance(exc, CollectiveMismatchError):
        return HorovodFailedPrecondition(msg)  # FailedPreconditionError, through install()
    if isinstance(exc, NotInitializedError | ValueError):
        return ValueError(msg)  # InvalidArgumentError
    if isinstance(exc, HorovodInternalError):
        return HorovodEngineFailed(msg)  # UnknownError
    return exc


def is_peer_loss(exc: BaseException) -> bool:
    """Whether a TF error of one of Horovod's ops says that the engine failed under it (a peer
    left, the transport broke) rather than that the program is wrong (ranks disagree, a bad
    argument): only the former may be retried by an elastic reset.

    Eager ops raise the TF error *from* Horovod's exception; in graphs only the status message
    survives, marked by :class:`HorovodEngineFailed`.
    """
    seen: set[int] = set()
    below: BaseException | None = exc
    while below is not None and id(below) not in seen:
        seen.add(id(below))
        if isinstance(below, CollectiveMismatchError):
            return False
        if isinstance(below, HorovodInternalError):
            return True
        below = below.__cause__ or below.__context__
    return isinstance(exc, tf.errors.UnknownError) and bool(_ENGINE_MARK.search(str(exc)))


_BASE_NEW = BaseException.__new__


def _invalid_argument_new(cls: type, *args: Any, **kwargs: Any) -> Any:
    if cls is tf.errors.InvalidArgumentError:
        if len(args) == 1 and not kwargs and isinstance(args[0], tf.errors.FailedPreconditionError):
            # Python normalizing an exception raised as InvalidArgumentError whose value we
            # already turned into a FailedPreconditionError: keep that value.
            return args[0]
        message = args[2] if len(args) > 2 else kwargs.get("message")
        if isinstance(message, str) and _MARK.search(message):
            return tf.errors.FailedPreconditionError(*args, **kwargs)
    return _BASE_NEW(cls, *args, **kwargs)


def install() -> None:
    """Make TF report a graph-mode mismatch as ``FailedPreconditionError`` (idempotent)."""
    cls = tf.errors.InvalidArgumentError
    current = cls.__dict__.get("__new__")
    if isinstance(current, staticmethod) and current.__func__ is _invalid_argument_new:
        return
    cls.__new__ = staticmethod(_invalid_argument_new)  # type: ignore[assignment]
