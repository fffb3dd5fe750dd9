"""PowerSGD: low-rank gradient compression with error feedback (Vogels, Karimireddy and Jaggi,
"PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization", NeurIPS 2019).

Each gradient with enough elements is viewed as a matrix M (n x m: its first dimension by the
rest) and replaced by a rank-r approximation computed with one step of power iteration shared by
all ranks::

    P = M Q          (n x r)   averaged over ranks (one fused allreduce of every P)
    P = orth(P)                Gram-Schmidt (r <= 2) or QR
    Q = M^T P        (m x r)   averaged over ranks (one fused allreduce of every Q)
    M ~ P Q^T

so a matrix costs (n + m) r numbers on the wire instead of n m. Vectors, and matrices whose
compression rate n m / ((n + m) r) is below ``min_compression_rate``, travel uncompressed in one
fused allreduce. With error feedback, what the approximation missed of this rank's M
(M - P Q_local^T) is added to the next step's gradient; with warm start, the averaged Q of a step
starts the next step's power iteration. Q starts from a normal draw seeded by ``seed`` and the
iteration, identical on every rank. Before ``start_iter`` steps every gradient is averaged exactly.

Steps whose gradients hold inf/NaN on any rank (an AMP overflow) produce non-finite averages on
every rank (the scaler then skips the step on all of them) and leave the error memory and Q
untouched.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch

from horovod.common import basics
from horovod.torch.compression import StatefulCompressor

__all__ = ["PowerSGD"]

_CONFIG = ("rank", "start_iter", "min_compression_rate", "error_feedback", "warm_start", "seed")


def _orthogonalize_(m: torch.Tensor) -> None:
    """Orthonormalize the columns of ``m`` (n x r) in place; an all-zero column stays zero."""
    r = m.shape[1]
    if r > 2:
        q, _ = torch.linalg.qr(m)
        m.copy_(q)
        return
    for i in range(r):
        col = m[:, i]
        norm = torch.linalg.vector_norm(col)
        if norm > 0:
            col /= norm
        if i + 1 < r:
            rest = m[:, i + 1:]
            rest -= torch.outer(col, col @ rest)


class PowerSGD(StatefulCompressor):
    """PowerSGD compression for ``hvd.DistributedOptimizer(..., compression=hvd.PowerSGD(...))``.

    Args:
        rank: rank r of the approximation (>= 1): each compressed n x m gradient costs
            (n + m) r numbers on the wire.
        start_iter: steps averaged exactly before compression starts (a warm-up).
        min_compression_rate: compress a matrix only if n m / ((n + m) r) is at least this.
        error_feedback: add what the approximation missed to the next step's gradient.
        warm_start: start each step's power iteration from the previous step's Q.
        seed: seed of Q's initial draw (the same on every rank).

    Raises:
        ValueError: ``rank`` < 1, ``start_iter`` < 0 or ``min_compression_rate`` < 0.
    """

    def __init__(self, rank: int = 1, start_iter: int = 10, min_compression_rate: float = 2,
                 error_feedback: bool = True, warm_start: bool = True, seed: int = 0) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
            raise ValueError(f"PowerSGD: rank must be a positive integer (the rank of the gradient "
                             f"approximation, e.g. 1, 2 or 4), got {rank!r}")
        if start_iter < 0:
            raise ValueError(f"PowerSGD: start_iter must be >= 0, got {start_iter!r}")
        if min_compression_rate < 0:
            raise ValueError(f"PowerSGD: min_compression_rate must be >= 0, got {min_compression_rate!r}")
        self.rank = rank
        self.start_iter = int(start_iter)
        self.min_compression_rate = float(min_compression_rate)
        self.error_feedback = bool(error_feedback)
        self.warm_start = bool(warm_start)
        self.seed = int(seed)
        self.iter = 0
        self._qs: dict[str, torch.Tensor] = {}
        self._errors: dict[str, torch.Tensor] = {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={getattr(self, k)!r}" for k in _CONFIG)
        return f"PowerSGD({args})"

    # ------------------------------------------------------------------ the plan
    def _shape(self, grad: torch.Tensor) -> tuple[int, int, int] | None:
        """(n, m, r) of the matrix ``grad`` is compressed as, or None to send it uncompressed."""
        if grad.dim() < 2 or not grad.dtype.is_floating_point:
            return None
        n = grad.shape[0]
        m = grad.numel() // n if n else 0
        r = min(n, m, self.rank)
        if r == 0 or n * m < self.min_compression_rate * (n + m) * r:
            return None
        return n, m, r

    def compressed_numel(self, shapes: list[tuple[int, ...]]) -> tuple[int, int]:
        """(elements before, elements on the wire) of one compressed step on gradients of
        ``shapes`` (the uncompressed ones count whole)."""
        before = after = 0
        for shape in shapes:
            numel = math.prod(shape)
            before += numel
            plan = self._shape(torch.empty(shape, device="meta"))
            after += numel if plan is None else (plan[0] + plan[1]) * plan[2]
        return before, after

    # ------------------------------------------------------------------ one step
    def reduce_(self, grads: list[torch.Tensor], names: list[str], comm: Any) -> None:
        """Average ``grads`` in place over ``comm``'s ranks, compressed from ``start_iter`` on."""
        prefix = f"powersgd.{names[0]}" if names else "powersgd"
        # Every step, before anything whose names or shapes depend on the state: one small
        # allreduce says whether all ranks agree (elastic syncs and restores may change it).
        if not comm.agree(self._fingerprint(grads, names), f"{prefix}.agree"):
            self._raise_disagreement(grads, names, comm, prefix)
        if self.iter < self.start_iter:
            comm.allreduce_(list(grads), f"{prefix}.all")
            self.iter += 1
            return
        plain, mats = [], []
        for g, name in zip(grads, names):
            plan = self._shape(g)
            if plan is None:
                plain.append(g)
            else:
                mats.append((g, name, plan))
        h_plain = comm.allreduce_async_(plain, f"{prefix}.uncompressed")
        if mats:
            self._compress_(mats, comm, prefix)
        comm.wait(h_plain)
        self.iter += 1

    def _compress_(self, mats: list[tuple[torch.Tensor, str, tuple[int, int, int]]], comm: Any,
                   prefix: str) -> None:
        devices = {g.device for g, _, _ in mats}
        if len(devices) > 1:
            raise ValueError(f"PowerSGD: gradients on several devices {sorted(map(str, devices))}; "
                             "it compresses the gradients of one device")
        dev = mats[0][0].device
        p_flat = torch.empty(sum(n * r for _, _, (n, _, r) in mats), device=dev)
        q_flat = torch.empty(sum(m * r for _, _, (_, m, r) in mats), device=dev)
        ms, ps, qs = [], [], []
        gen = None
        p_at = q_at = 0
        for g, name, (n, m, r) in mats:
            mat = g.detach().reshape(n, m).to(torch.float32, copy=True)
            if self.error_feedback and name in self._errors:
                mat += self._errors[name].to(dev)  # a restored state may live elsewhere
            p = p_flat[p_at:p_at + n * r].view(n, r)
            q = q_flat[q_at:q_at + m * r].view(m, r)
            p_at, q_at = p_at + n * r, q_at + m * r
            prev = self._qs.get(name) if self.warm_start else None
            if prev is not None and prev.shape == q.shape:
                q.copy_(prev)
            else:
                if gen is None:  # the same draws on every rank: seeded by seed and iteration
                    gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.iter)
                q.copy_(torch.randn(m, r, generator=gen))
            torch.matmul(mat, q, out=p)
            ms.append(mat)
            ps.append(p)
            qs.append(q)
        comm.allreduce_([p_flat], f"{prefix}.P")
        finite = bool(torch.isfinite(p_flat).all())  # the same verdict on every rank
        for p in ps:
            _orthogonalize_(p)
        for mat, p, q in zip(ms, ps, qs):
            torch.matmul(mat.t(), p, out=q)
        if self.error_feedback and finite:
            # what this rank's approximation P P^T M = P Q_local^T missed
            for (_, name, _), mat, p, q in zip(mats, ms, ps, qs):
                self._errors[name] = mat.sub_(p @ q.t())
        comm.allreduce_([q_flat], f"{prefix}.Q")
        for (g, name, _), p, q in zip(mats, ps, qs):
            g.copy_((p @ q.t()).view_as(g))
            if not finite:
                continue  # an overflow: keep the last good Q
            if self.warm_start and bool(q.abs().sum(0).gt(0).all()):
                self._qs[name] = q.clone()
            else:  # a zero column (an all-zero gradient) would stay zero: draw afresh next step
                self._qs.pop(name, None)

    # ------------------------------------------------------------------ agreement, state
    def _signature(self, grads: list[torch.Tensor], names: list[str]) -> dict[str, Any]:
        sig: dict[str, Any] = {k: getattr(self, k) for k in _CONFIG}
        sig["iter"] = self.iter
        sig["gradients"] = [(n, tuple(g.shape)) for g, n in zip(grads, names)]
        sig["Q shapes"] = sorted((n, tuple(q.shape)) for n, q in self._qs.items())
        return sig

    def _fingerprint(self, grads: list[torch.Tensor], names: list[str]) -> list[int]:
        sig = self._signature(grads, names)
        ints = [int(sig[k] * 1_000_000) if isinstance(sig[k], float) else int(sig[k])
                for k in (*_CONFIG, "iter")]
        ints.append(zlib.crc32(repr((sig["gradients"], sig["Q shapes"])).encode()))
        return ints

    def _raise_disagreement(self, grads: list[torch.Tensor], names: list[str], comm: Any,
                            prefix: str) -> None:
        """Allgather every rank's configuration, iteration and shapes and raise, naming what
        differs (every rank sees the same list, so every rank raises the same error)."""
        every = comm.allgather_object(self._signature(grads, names), f"{prefix}.disagree")
        diffs = []
        for key in every[0]:
            values = [sig.get(key) for sig in every]
            if any(v != values[0] for v in values):
                if key in ("gradients", "Q shapes"):
                    shown = "; ".join(f"rank {r}: {_diff(values[0], v)}" for r, v in enumerate(values)
                                      if v != values[0])
                    diffs.append(f"{key} differ from rank 0's ({shown})")
                else:
                    diffs.append(f"{key}: " + ", ".join(f"rank {r}={v!r}" for r, v in enumerate(values)))
        raise ValueError(
            "PowerSGD: the compressor's state differs across ranks: " + "; ".join(diffs)
            + ". Construct PowerSGD with the same arguments on every rank, and restore the same "
            "checkpoint (optimizer.load_state_dict) on every rank or on none.")

    def state_dict(self) -> dict[str, Any]:
        """Configuration, iteration, the warm-start Qs and this rank's error memory (by
        parameter name), and the global rank that saved them."""
        return {"config": {k: getattr(self, k) for k in _CONFIG}, "iter": self.iter,
                "q": {k: v.clone() for k, v in self._qs.items()},
                "error": {k: v.clone() for k, v in self._errors.items()},
                "saved_by_rank": basics.rank() if basics.is_initialized() else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s state. The error memory is this rank's own: it is kept only
        when the state was saved by the same global rank (an elastic sync hands rank 0's state to
        every rank; the others then start with no error memory).

        Raises:
            ValueError: the state was saved by a PowerSGD with another configuration.
        """
        config = state.get("config", {})
        differ = {k: (config.get(k), getattr(self, k)) for k in _CONFIG if config.get(k) != getattr(self, k)}
        if differ:
            raise ValueError("PowerSGD.load_state_dict: the state was saved with "
                             + ", ".join(f"{k}={a!r}" for k, (a, _) in differ.items())
                             + " but this compressor has "
                             + ", ".join(f"{k}={b!r}" for k, (_, b) in differ.items())
                             + ": construct it with the saved arguments")
        self.iter = int(state["iter"])
        self._qs = {k: v.detach().clone().float() for k, v in state.get("q", {}).items()}
        me = basics.rank() if basics.is_initialized() else None
        own = state.get("saved_by_rank") == me
        self._errors = {k: v.detach().clone().float() for k, v in state.get("error", {}).items()} if own else {}


def _diff(a: list[Any], b: list[Any]) -> str:
    sa, sb = set(a), set(b)
    only_b, only_a = sorted(sb - sa)[:3], sorted(sa - sb)[:3]
    return f"has {only_b} where rank 0 has {only_a}" if only_a or only_b else f"order differs: {b[:3]}..."
