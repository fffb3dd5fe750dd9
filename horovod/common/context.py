"""The one runtime object made by ``init()`` and cleared by ``shutdown()``."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from horovod.common.backends.registry import create_backend, detect_launch
from horovod.common.config import EngineConfig
from horovod.common.current import _lock, get_context, peek_context, set_context  # noqa: F401 - re-exported
from horovod.common.engine.device import check_gpu_settings
from horovod.common.engine.executor import Entry
from horovod.common.engine.handles import GroupHandle, Handle, HandleCounter
from horovod.common.engine.loop import Engine
from horovod.common.job_state import JobState
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.common.protocol import RankIdentity
from horovod.common.topology import homogeneous, topology_from_hostnames
from horovod.common.types import Request, RequestType

__all__ = ["Context", "Prepared", "get_context", "set_context", "peek_context"]

log = logging.getLogger("horovod")



def _ranks_of_comm(backend: Any, comm: Any) -> list[int]:
    if backend.name != "mpi":
        raise NotImplementedError("Process sets given as MPI communicators need the MPI backend "
                                  "(hvd.init(comm=<mpi4py communicator>)).")
    from mpi4py import MPI

    group = comm.Get_group()
    return sorted(MPI.Group.Translate_ranks(group, list(range(group.Get_size())),
                                            backend.comm.Get_group()))


def _nccl_version() -> int:
    from horovod.common.probes import nccl_built

    return nccl_built()


def _set_key(ranks: list[int]) -> tuple[int, ...]:
    return tuple(ranks)


def _node_names(pairs: list[tuple[str, int | None]]) -> list[str]:
    """Every rank's host name; ``name#node<k>`` where a launcher's node ranks (torchrun's
    ``GROUP_RANK``, Slurm's ``SLURM_NODEID``) split ranks that share a host name (containers, or
    two agents on one machine), so that local and cross ranks follow the launcher's nodes."""
    if len(set(pairs)) == len({h for h, _ in pairs}):
        return [h for h, _ in pairs]
    return [h if n is None else f"{h}#node{n}" for h, n in pairs]


class Prepared:
    """A checked request of one context (``Context.prepare``): the one way onto the engine.

    ``submit`` queues the operation on buffers of the request's signature and returns its handle:
    once, for a call that was just checked (``collectives.py``), or again every step, for a
    binding that resubmits a checked request as it is (the torch repeat path, a gradient hook).
    The caller guarantees what the checks established: the buffers have the request's dtype and
    shapes and are C-contiguous (a device plane's buffers, its own), and the context is live.
    ``submit_all`` queues many single-tensor prepared requests at once under one handle.
    """

    __slots__ = ("ctx", "request")

    def __init__(self, ctx: Context, request: Request) -> None:
        self.ctx = ctx
        self.request = request

    def submit(self, inputs: list[Any], outputs: list[Any] | None = None, splits: Any = None,
               wake: bool = True, defer: bool = False, post: Callable[[Any], Any] | None = None) -> Handle:
        """Queue the operation on ``inputs`` (results into ``outputs``: pass ``inputs`` itself for
        in place, None for new outputs) and return its handle; with ``post``, the handle is also
        registered for ``synchronize`` (``ctx.handles[handle.id] = (handle, post)``).

        ``wake=False``: the caller waits at once and drives the round itself; ``defer=True``: the
        engine may hold it until a caller waits (``TensorQueue.submit``).
        """
        ctx = self.ctx
        request = self.request
        hid = ctx.counter.next()
        handle = Handle(hid, request.name)
        handle.request = request
        engine = ctx.engine
        if engine is None:
            engine = ctx._engine()  # raises, saying why
        engine.submit(Entry(request, inputs, outputs, handle, splits), wake, defer)
        if post is not None:
            ctx.handles[hid] = (handle, post)
        return handle

    @staticmethod
    def submit_all(prepared: Sequence[Prepared], arrays: Sequence[Any], post: Callable[[Any], Any],
                   wake: bool = True, defer: bool = False) -> int:
        """``submit`` in place for many single-tensor requests of one context at once, with one
        handle for all (a backward pass's gradients): one engine submission and one
        ``GroupHandle``, registered with ``post``, whose ``synchronize`` returns ``post(None)``
        once every request completed (raising the first error if any failed). On the wire nothing
        changes: each request is negotiated and cached under its own name, as if submitted alone.
        The names must differ."""
        ctx = prepared[0].ctx
        hid = ctx.counter.next()
        handle = GroupHandle(hid, f"{prepared[0].request.name} and {len(prepared) - 1} more", len(prepared))
        entries = []
        for p, a in zip(prepared, arrays):
            buf = [a]
            entries.append(Entry(p.request, buf, buf, handle))
        ctx._engine().submit_many(entries, wake, defer)
        ctx.handles[hid] = (handle, post)
        return int(hid)


class Context:
    """Everything ``init()`` creates: config, transport, topology, process sets, engine, handles.

    Made in two steps, as upstream: the transport and topology first (``hvd.size()`` works from
    then on), then ``start(process_sets)`` registers the process sets and starts the engine. A bad
    process-set list raises ``ValueError`` from ``start`` and leaves the context connected but not
    started, so that ``hvd.init()`` can be called again with a valid list.
    """

    def __init__(self, comm: Any = None, process_sets: Any = None,
                 environ: Mapping[str, str] | None = None, *, start: bool = True) -> None:
        environ = os.environ if environ is None else environ
        self.config = EngineConfig.from_env(environ)
        check_gpu_settings(self.config, _nccl_version)  # HOROVOD_GPU_OPERATIONS=NCCL without CUDA
        self.launch = detect_launch(self.config, environ, comm)  # logged by init() at info level
        self.backend_name = self.launch.transport
        self.backend = create_backend(self.backend_name, self.config, environ, comm)
        # The ports task 0 of a joined job bound (an srun step's may be a later candidate).
        self.launch = self.launch.met(getattr(self.backend, "met", None))
        host = environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
        hostnames = _node_names(self.backend.allgather_object((host, self.launch.node_rank)))
        self.hostnames: list[str] = list(hostnames)
        self.topology: RankIdentity = topology_from_hostnames(hostnames, self.backend.rank)
        self.is_homogeneous = homogeneous(hostnames)
        self.counter = HandleCounter()
        self.handles: dict[int, tuple[Handle, Any]] = {}
        # A binding's repeat signatures of named calls, by call key (the torch binding's
        # ``_repeat``): they hold this context and go with it.
        self.repeats: dict[tuple[Any, ...], Any] = {}
        self.groups = {0: self.backend.world_group()}
        global_process_set.ranks = list(range(self.topology.size))
        global_process_set.process_set_id = 0
        global_process_set.mpi_comm = comm if comm is not None and not isinstance(
            comm, (list, tuple)) else None
        self.process_sets: dict[int, ProcessSet] = {0: global_process_set}
        self.engine: Engine | None = None
        self.environ = environ
        self.reporter: Any = None  # horovod.common.reporter.Reporter, when a monitor listens
        self.state = JobState()  # the bindings' state between calls (``job_state``)
        if start:
            self.start(process_sets)

    @property
    def started(self) -> bool:
        return self.engine is not None

    def _local_sets(self, process_sets: Any) -> list[ProcessSet]:
        """This rank's process sets with their ranks resolved, checked without communicating.

        Raises:
            ValueError: a set repeats the global set or another set of the list, or has bad ranks.
        """
        sets: list[ProcessSet] = []
        seen = {_set_key(global_process_set.ranks or [])}
        for ps in process_sets or []:
            if not isinstance(ps, ProcessSet):
                raise ValueError(f"process_sets must hold ProcessSet objects, got {ps!r}")
            ranks = ps.ranks if ps.mpi_comm is None else _ranks_of_comm(self.backend, ps.mpi_comm)
            assert ranks is not None
            bad = [r for r in ranks if not 0 <= r < self.topology.size]
            if bad or not ranks or len(set(ranks)) != len(ranks):
                raise ValueError(f"Invalid process set ranks {ranks}: ranks must be unique and in "
                                 f"[0, {self.topology.size}).")
            if _set_key(ranks) in seen:
                raise ValueError(f"{ps} (ranks {ranks}) is a duplicate of an already registered "
                                 "process set (or of the global set); pass each set once.")
            seen.add(_set_key(ranks))
            ps.ranks = list(ranks)
            sets.append(ps)
        return sets

    def start(self, process_sets: Any = None) -> None:
        """Register the process sets (the union over ranks) and start the engine.

        Every rank's list is checked locally first (a rank with a bad list raises ``ValueError``
        and takes no part). Then the lists are gathered and registered in one order on every
        rank: the first set of each rank in rank order, then the second of each, and so on,
        leaving out repeats, so that ranks giving different communicators (each its own half of
        a split) agree on the ids.
        """
        if isinstance(process_sets, str):
            if process_sets.lower() != "dynamic":
                raise ValueError(f"process_sets={process_sets!r}: pass a list of ProcessSet or 'dynamic'.")
            import dataclasses

            self.config = dataclasses.replace(self.config, dynamic_process_sets=True)
            process_sets = None
        mine = self._local_sets(process_sets)
        # Each rank's process sets, and its pid (for stall reports about a rank that stopped).
        gathered = self.backend.allgather_object([os.getpid(), [ps.ranks for ps in mine]])
        self.pids: list[int] = [int(g[0]) for g in gathered]
        lists = [g[1] for g in gathered]
        order: list[list[int]] = []
        keys = {_set_key(global_process_set.ranks or [])}
        for i in range(max((len(x) for x in lists), default=0)):
            for ranks_list in lists:
                if i < len(ranks_list) and _set_key(ranks_list[i]) not in keys:
                    keys.add(_set_key(ranks_list[i]))
                    order.append(list(ranks_list[i]))
        by_key = {_set_key(ps.ranks or []): ps for ps in mine}
        for ranks in order:
            new_id = len(self.process_sets)
            self.groups[new_id] = self.backend.new_group(ranks)
            ps = by_key.get(_set_key(ranks)) or ProcessSet(ranks)
            ps.process_set_id = new_id
            self.process_sets[new_id] = ps
        self.engine = Engine(self.backend, self.config, self.groups, hostnames=self.hostnames, pids=self.pids)
        self.engine.start()
        from horovod.common import reporter

        self.reporter = reporter.from_env(self.environ, self.engine.metrics_snapshot,
                                          self.topology.rank, self.topology.local_rank,
                                          self.hostnames[self.topology.rank],
                                          flight=self.engine.flight_record)

    def resolve_process_sets(self, process_sets: Any) -> None:
        """Give already registered ids to ``process_sets`` (``hvd.init()`` when already running)."""
        if not isinstance(process_sets, (list, tuple)):
            return
        table = {_set_key(ps.ranks or []): i for i, ps in self.process_sets.items()}
        for ps in process_sets:
            if not isinstance(ps, ProcessSet):
                continue
            ranks = ps.ranks if ps.mpi_comm is None else _ranks_of_comm(self.backend, ps.mpi_comm)
            if ranks is not None and _set_key(ranks) in table:
                ps.ranks = list(ranks)
                ps.process_set_id = table[_set_key(ranks)]

    def _engine(self) -> Engine:
        if self.engine is None:
            raise ValueError("Horovod is connected but its engine is not running: hvd.init() "
                             "raised on this rank (bad process_sets). Call hvd.init() again with "
                             "a valid list of process sets.")
        return self.engine

    # ------------------------------------------------------------------ submission
    def prepare(self, request: Request) -> Prepared:
        """``request``, checked by the caller, ready to submit on this context's engine (once, or
        every step: ``Prepared.submit``)."""
        return Prepared(self, request)

    def control(self, kind: RequestType, name: str, payload: Any = None, process_set_id: int = 0) -> Any:
        """Run a control operation (barrier, join, process-set change) and wait for its result."""
        req = Request(name=name, kind=kind, dtype="uint8", process_set_id=process_set_id,
                      payload=payload, rank=self.topology.rank)
        return self.prepare(req).submit([], wake=False).wait()

    # ------------------------------------------------------------------ process sets
    def add_process_set(self, process_set: ProcessSet | Iterable[int]) -> ProcessSet:
        if not self.config.dynamic_process_sets:
            raise ValueError("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow adding process sets after "
                             "Horovod initialization.")
        ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
        if ps.mpi_comm is not None:
            raise NotImplementedError("Adding process sets from MPI communicators after init is not "
                                      "supported; pass a list of ranks.")
        assert ps.ranks is not None
        bad = [r for r in ps.ranks if not 0 <= r < self.topology.size]
        if bad or not ps.ranks or len(set(ps.ranks)) != len(ps.ranks):
            raise ValueError(f"Invalid process set ranks {ps.ranks}: ranks must be unique and in "
                             f"[0, {self.topology.size}).")
        if any(p.ranks == ps.ranks for p in self.process_sets.values()):
            raise ValueError(f"Attempted to add a duplicate process set: {ps}")
        new_id = self.control(RequestType.ADD_PROCESS_SET,
                              f"process_set.add.{','.join(map(str, ps.ranks))}", tuple(ps.ranks))
        ps.process_set_id = int(new_id)
        self.process_sets[ps.process_set_id] = ps
        return ps

    def remove_process_set(self, process_set: ProcessSet) -> bool:
        if not self.config.dynamic_process_sets:
            raise ValueError("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow removing process sets after "
                             "Horovod initialization.")
        ps_id = process_set.process_set_id
        if ps_id is None or ps_id == 0 or ps_id not in self.process_sets:
            return False
        self.control(RequestType.REMOVE_PROCESS_SET, f"process_set.remove.{ps_id}", ps_id)
        del self.process_sets[ps_id]
        process_set._invalidate()
        return True

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        if self.reporter is not None:
            self.reporter.stop(final=self.engine is not None and not self.engine.stopped)
            self.reporter = None
        if self.engine is not None:
            self.engine.shutdown()
            if self.engine.stopped:
                self.backend.close()
        else:
            self.backend.close()
        for ps_id, ps in list(self.process_sets.items()):
            if ps_id != 0:
                ps._invalidate()
        self.handles.clear()
        self.repeats.clear()
