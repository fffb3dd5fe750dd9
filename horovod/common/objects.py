"""Object collectives: any picklable Python object, sent as bytes through the tensor collectives."""

from __future__ import annotations

import io
from typing import Any

import cloudpickle
import numpy as np

from horovod.common import collectives as C
from horovod.common.context import get_context
from horovod.common.process_sets import ProcessSet

__all__ = ["broadcast_object", "allgather_object"]


def _dumps(obj: Any) -> np.ndarray:
    buf = io.BytesIO()
    cloudpickle.dump(obj, buf)
    return np.frombuffer(buf.getvalue(), dtype=np.uint8)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet | None = None) -> Any:
    """Return the root rank's ``obj`` on every rank of the set (cloudpickle; any picklable object).

    Every rank of the set must call it; non-root ranks may pass anything (e.g. None).
    """
    name = name or "broadcast_object"
    is_root = get_context().topology.rank == int(root_rank)
    payload = _dumps(obj) if is_root else None
    size = np.array([payload.size if payload is not None else 0], np.int64)
    C.broadcast_async([size], root_rank, name=f"{name}.sz", process_set=process_set,
                      inplace=True, wake=False).wait()
    data = payload.copy() if payload is not None else np.empty(int(size[0]), np.uint8)
    C.broadcast_async([data], root_rank, name=f"{name}.t", process_set=process_set, inplace=True, wake=False).wait()
    if is_root:
        return obj
    return cloudpickle.loads(data.tobytes())


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet | None = None) -> list[Any]:
    """Return the list of every rank's ``obj``, in rank order of the set."""
    name = name or "allgather_object"
    payload = _dumps(obj)
    sizes = C.allgather_async([np.array([payload.size], np.int64)], name=f"{name}.sz",
                              process_set=process_set, wake=False).wait()[0]
    data = C.allgather_async([payload], name=f"{name}.t", process_set=process_set, wake=False).wait()[0]
    out, off = [], 0
    for n in sizes.tolist():
        out.append(cloudpickle.loads(data[off:off + n].tobytes()))
        off += n
    return out
