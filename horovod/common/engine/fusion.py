"""Fusion planning: group this round's responses into batches that share one transport call. PURE.

Every rank plans the same response list with the same settings, so every rank gets the same
batches in the same order. Inside a batch the executor reduces the tensors piece by piece
(``chunk_bytes``), packing tensors of at most ``max_tensor_bytes`` into the fusion buffer and
reducing larger ones in their own memory (see ``executor.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from horovod.common.types import Request, RequestType, Response

__all__ = ["fusion_key", "plan_batches", "FUSABLE_KINDS"]

FUSABLE_KINDS = frozenset({RequestType.ALLREDUCE, RequestType.BROADCAST})


def fusion_key(req: Request) -> tuple[Any, ...]:
    """Responses can share a batch only if everything but the name and shapes is equal."""
    return (req.kind, req.dtype, req.reduce_op, req.prescale, req.postscale, req.root_rank,
            req.process_set_id, req.device)


def _fusable_bytes(req: Request, max_tensor_bytes: int) -> int:
    item = req.nbytes // max(1, sum(_numel(s) for s in req.shapes)) if req.shapes else 0
    return sum(n * item for n in (_numel(s) for s in req.shapes) if n * item <= max_tensor_bytes)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def plan_batches(responses: Sequence[Response], threshold: int, max_tensor_bytes: int,
                 group_fusion: bool = True) -> list[list[Response]]:
    """Split responses into ordered batches.

    Args:
        responses: this round's responses, in the order every rank executes them.
        threshold: fusion buffer size in bytes (``HOROVOD_FUSION_THRESHOLD``); 0 disables fusion.
        max_tensor_bytes: tensors above this size never count towards the threshold.
        group_fusion: when False, a grouped request (several tensors) always gets its own batch.

    Returns:
        Batches in execution order; each is a list of responses with the same ``fusion_key``.
        Error responses and non-fusable kinds are batches of one.
    """
    if len(responses) == 1:
        return [list(responses)]
    batches: list[list[Response]] = []
    open_batch: dict[tuple[Any, ...], tuple[int, int]] = {}  # key -> (batch index, fused bytes)
    for resp in responses:
        req = resp.request
        if (threshold <= 0 or resp.error is not None or req.kind not in FUSABLE_KINDS
                or (not group_fusion and len(req.shapes) > 1)):
            batches.append([resp])
            continue
        key = fusion_key(req)
        size = _fusable_bytes(req, max_tensor_bytes)
        current = open_batch.get(key)
        if current is not None and current[1] + size <= threshold:
            batches[current[0]].append(resp)
            open_batch[key] = (current[0], current[1] + size)
        else:
            batches.append([resp])
            open_batch[key] = (len(batches) - 1, size)
    return batches
