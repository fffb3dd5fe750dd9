"""Rendezvous handlers: how the ranks of a job meet, whoever started them.

Each handler turns what its launcher gives (``horovod.common.launcher_detection.Launch``, the environment)
into what the transport needs, as torch elastic's handlers do (``next_rendezvous()`` returns a
store, this rank and the world size; the process groups are built on that store):

* :class:`HorovodHandler`: ``horovodrun --gloo``, ``horovod.run``, Spark, Ray. Rank 0 opens an
  authenticated store (``horovod.common.backends.authstore``: every connection and request
  HMAC-checked with a key derived from the job secret, listening on the job's interface only) on
  a free port and publishes its address through the launcher's rendezvous service
  (``horovod.common.rendezvous``, requests and answers signed with ``HOROVOD_SECRET_KEY``); the
  other ranks read it there, so a worker never connects to an address it did not get from its
  own launcher. An elastic round meets the same way under its round's scope
  (``horovod.common.elastic.rounds``).
* :class:`TorchGroupHandler`: an initialised default ``torch.distributed`` group (Ray Train,
  Lightning, Accelerate): that group's store.
* :class:`TorchrunHandler`: torchrun / ``RANK`` + ``WORLD_SIZE`` + ``MASTER_*``: the agent's store,
  or one rank 0 opens (Horovod's authenticated store when the ranks share ``HOROVOD_SECRET_KEY``,
  else torch's ``TCPStore``).
* :class:`SlurmHandler`: an ``srun`` step: task 0 opens an authenticated store on the step's first
  node, keyed with the step's secret (``horovod.common.slurm_secret``).
* :class:`MPIHandler`: ``mpirun`` with ``HOROVOD_CONTROLLER=gloo``: rank 0 opens an authenticated
  store and sends its address and key to the others over MPI.

The stores of launchers Horovod did not start carry Horovod's keys under a ``horovod/...`` prefix
(docs/launcher.md). The handlers only answer where and how the ranks meet: the transports are
built on what they return by ``horovod.common.backends.factories`` (which also starts MPI for an
MPI launcher's ranks).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from horovod.common import launcher_detection as _launcher
from horovod.common import protocol, slurm_ports, slurm_secret
from horovod.common.backends import authstore
from horovod.common.config import EngineConfig
from horovod.common.exceptions import BackendUnavailableError, HorovodInternalError
from horovod.common.rendezvous import RendezvousClient, RendezvousError, route_address

__all__ = ["StoreRendezvous", "RendezvousHandler", "HorovodHandler", "TorchGroupHandler",
           "TorchrunHandler", "SlurmHandler", "MPIHandler", "LauncherService", "handler_for", "horovod_store",
           "local_address", "single_store", "elastic_round"]

log = logging.getLogger("horovod")

# One rendezvous scope per store created in this process: every rank creates its stores in the
# same order (init, shutdown, init ...), so the n-th init of every rank meets the others'.
_INIT_SEQUENCE = itertools.count()
# Likewise for the stores of jobs Horovod did not start (every rank counts its inits alike).
_JOIN_SEQUENCE = itertools.count()


@dataclass
class StoreRendezvous:
    """What a handler hands the Gloo transport: the store, this rank, the world size.

    ``address``/``interface``: where this rank's Gloo device listens (``""`` and None: Gloo's
    default device). ``job_secret``: the secret every rank holds (the device plane keys its stores
    with it). ``owned``: the Python stores this rendezvous opened (they live only while their
    Python objects do), closed by :meth:`close`; ``key_service``: task 0's srun secret service,
    ended once every rank has joined (:meth:`joined`). ``launch``: where a job Horovod did not
    start met (the handler's launch: the store's address and the ports task 0 bound), None when
    Horovod's launcher met it (``Launch.met``).
    """

    store: Any
    rank: int
    size: int
    address: str = ""
    interface: str | None = None
    job_secret: str | None = None
    owned: list[Any] = field(default_factory=list)
    key_service: slurm_secret.KeyService | None = None
    launch: _launcher.Launch | None = None

    def joined(self) -> None:
        """Every rank has joined the world (or failed to): what only served the meeting ends."""
        if self.key_service is not None:
            self.key_service.close()
            self.key_service = None

    def close(self) -> None:
        self.joined()
        for store in self.owned:
            if isinstance(store, authstore.torch_store_type()):
                store.close()
        self.owned.clear()
        self.store = None


class RendezvousHandler(Protocol):
    def next_rendezvous(self) -> StoreRendezvous:
        """Meet the job's other ranks; return the store they share.

        Raises:
            HorovodInternalError, LauncherError, BackendUnavailableError: they cannot be met.
        """


def _timeout(config: EngineConfig) -> float:
    return float(config.gloo_timeout_seconds or 30.0)


def local_address(environ: Mapping[str, str], toward: str) -> str:
    """The address the other ranks reach this one at: ``HOROVOD_GLOO_IFACE``'s, else the one of
    the interface that routes to ``toward`` (the launcher, the master)."""
    iface = environ.get("HOROVOD_GLOO_IFACE")
    if iface:
        import psutil

        for entry in psutil.net_if_addrs().get(iface, []):
            if entry.family == socket.AF_INET:
                return str(entry.address)
        raise BackendUnavailableError(f"HOROVOD_GLOO_IFACE={iface!r}: no such interface with an IPv4 "
                                      "address on this host.", backend="gloo")
    return route_address(toward)


def single_store(environ: Mapping[str, str], rank: int = 0) -> StoreRendezvous:
    """A job of one rank: an in-process store."""
    import torch.distributed as dist

    return StoreRendezvous(dist.HashStore(), rank, 1, "127.0.0.1", environ.get("HOROVOD_GLOO_IFACE"),
                           environ.get(protocol.SECRET_ENV) or None)


def _connecting(rank: int) -> contextlib.AbstractContextManager[None]:
    from horovod.common.backends.gloo import GlooErrors

    return GlooErrors("connecting to the job's store", rank)


# ----------------------------------------------------------------------- horovod's launchers
class LauncherService:
    """The two calls a rank needs from its launcher's rendezvous service: put and wait-for a key
    (its errors as ``HorovodInternalError`` naming the rank and the fix)."""

    def __init__(self, addr: str, port: int, secret: str, rank: int) -> None:
        self.client = RendezvousClient(addr, port, secret)
        self.addr, self.port, self.rank = addr, port, rank

    def put(self, scope: str, key: str, value: bytes) -> None:
        try:
            self.client.put(scope, key, value)
        except RendezvousError as exc:
            raise HorovodInternalError(f"Gloo rendezvous: rank {self.rank}: {exc}",
                                       rank=self.rank) from exc

    def wait(self, scope: str, key: str, timeout: float) -> bytes:
        try:
            value = self.client.wait(scope, key, timeout)
        except RendezvousError as exc:
            if getattr(exc, "key", None) == key:
                raise HorovodInternalError(
                    f"Gloo rendezvous: rank {self.rank} waited {timeout:g} s for rank 0 to publish "
                    f"its store address ({scope}/{key}). Did rank 0 start? Raise "
                    "HOROVOD_GLOO_TIMEOUT_SECONDS if start-up is slow.", rank=self.rank) from exc
            if getattr(exc, "refused", False):
                raise HorovodInternalError(
                    f"Gloo rendezvous: the launcher at {self.addr}:{self.port} refused rank "
                    f"{self.rank} (wrong HOROVOD_SECRET_KEY: this process belongs to another job).",
                    rank=self.rank) from exc
            raise HorovodInternalError(
                f"Gloo rendezvous: rank {self.rank} cannot use the launcher's service at "
                f"{self.addr}:{self.port}: {exc}. Check that this host can reach that address "
                "(horovodrun --network-interfaces selects it).", rank=self.rank) from exc
        if value == protocol.ABANDONED_STORE:
            raise HorovodInternalError(
                f"Gloo rendezvous: round {scope} was abandoned by the elastic driver (a member "
                "left before it formed).", rank=self.rank)
        return value


def horovod_store(config: EngineConfig, environ: Mapping[str, str], scope: str, rank: int, size: int,
                  on_store: Callable[[Any], None] | None = None) -> StoreRendezvous:
    """Meet under ``scope`` of a Horovod launcher's rendezvous service (see the module docstring).

    ``on_store`` gets the store as soon as it exists (an elastic round closes it when the driver
    abandons the round, which ends this rank's waits on it).

    Raises:
        BackendUnavailableError: the launcher's variables are missing.
        HorovodInternalError: the service or the store cannot be reached.
    """
    try:
        addr = environ[protocol.RENDEZVOUS_ADDR_ENV]
        port = int(environ[protocol.RENDEZVOUS_PORT_ENV])
        secret = environ[protocol.SECRET_ENV]
    except (KeyError, ValueError) as exc:
        raise BackendUnavailableError(
            f"Gloo needs {protocol.RENDEZVOUS_ADDR_ENV}, {protocol.RENDEZVOUS_PORT_ENV} and "
            f"{protocol.SECRET_ENV} ({exc} is missing or invalid): start the job with "
            "horovodrun --gloo or horovod.run(..., use_gloo=True).", backend="gloo") from exc
    service = LauncherService(addr, port, secret, rank)
    my_addr = local_address(environ, addr)
    wait = _timeout(config)
    key = authstore.derive_key(secret)
    with _connecting(rank):
        if rank == 0:
            store = authstore.open_store(my_addr, key, wait)
            service.put(scope, protocol.STORE_KEY, f"{my_addr}:{store.server.port}".encode())
        else:
            host, _, p = service.wait(scope, protocol.STORE_KEY, wait).decode().rpartition(":")
            store = authstore.connect_store(host, int(p), key, wait)
    if on_store is not None:
        on_store(store)
    return StoreRendezvous(store, rank, size, my_addr, environ.get("HOROVOD_GLOO_IFACE"), secret,
                           owned=[store])


class HorovodHandler:
    """A static job of a Horovod launcher: ``HOROVOD_RANK``/``HOROVOD_SIZE``, the launcher's service."""

    def __init__(self, config: EngineConfig, environ: Mapping[str, str]) -> None:
        self.config, self.environ = config, environ

    def next_rendezvous(self) -> StoreRendezvous:
        try:
            rank = int(self.environ.get("HOROVOD_RANK", "0"))
            size = int(self.environ.get("HOROVOD_SIZE", "1"))
        except ValueError as exc:
            raise BackendUnavailableError(f"HOROVOD_RANK/HOROVOD_SIZE are not integers: {exc}",
                                          backend="gloo") from exc
        scope = protocol.gloo_scope(next(_INIT_SEQUENCE))
        if size == 1:
            return single_store(self.environ, rank)
        return horovod_store(self.config, self.environ, scope, rank, size)


# ----------------------------------------------------------------------- other launchers
class _JoinedHandler:
    """The store of a job Horovod did not start (see docs/launcher.md); subclasses open it."""

    # What decides where the store is (named when it cannot be reached).
    where = "MASTER_ADDR/MASTER_PORT (or the first node of SLURM_STEP_NODELIST)"

    def __init__(self, config: EngineConfig, environ: Mapping[str, str], launch: _launcher.Launch) -> None:
        self.config, self.environ, self.launch = config, environ, launch
        self.rank, self.size = launch.rank or 0, launch.size or 1
        self.wait = _timeout(config)

    def _open(self, rdv: StoreRendezvous, seq: int) -> Any:
        raise NotImplementedError

    def next_rendezvous(self) -> StoreRendezvous:
        import torch.distributed as dist

        launch = self.launch
        seq = next(_JOIN_SEQUENCE)
        rdv = StoreRendezvous(None, self.rank, self.size, interface=self.environ.get("HOROVOD_GLOO_IFACE"),
                              job_secret=self.environ.get(protocol.SECRET_ENV) or None)
        try:
            store = self._open(rdv, seq)
        except _launcher.LauncherError:
            raise
        except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError subclasses, OSError...
            rdv.joined()
            launch = self.launch  # with the address rank 0 sent, where the launcher gives none
            seen = ", ".join(f"{k}={v}" for k, v in launch.seen.items())
            raise _launcher.LauncherError(
                f"Rank {self.rank} of a job started by {launch.launcher} cannot reach the job's "
                f"store at {launch.master_addr}:{launch.master_port} within {self.wait:g} s ({exc}). "
                f"Variables seen: {seen or 'none'}. Check {self.where}, that HOROVOD_SECRET_KEY is "
                "exported to every rank or to none, and that rank 0 runs; raise "
                "HOROVOD_GLOO_TIMEOUT_SECONDS if start-up is slow.", rank=self.rank,
                launcher=launch.launcher) from exc
        rdv.launch = self.launch  # the ports task 0 bound (``_authenticated``)
        # A Python store lives only while its Python object does: keep it beside the prefix store.
        rdv.owned.append(store)
        rdv.store = dist.PrefixStore(f"horovod/{launch.scope}/{seq}", store)
        return rdv

    def _authenticated(self, rdv: StoreRendezvous, host: str, ports: Sequence[int] = ()) -> Any:
        """Horovod's store keyed with ``rdv.job_secret``: rank 0 serves it on ``host``, on the first
        free one of ``ports`` (default: the launch's master port), and the other ranks find it
        among them (``horovod.common.slurm_ports``); ``self.launch`` then names the port."""
        launch = self.launch
        ports = list(ports) or ([launch.master_port] if launch.master_port else [])
        assert rdv.job_secret and launch.master_addr and ports
        key = authstore.derive_key(rdv.job_secret)
        if self.rank == 0:
            try:
                store = slurm_ports.bind_first(
                    ports, lambda port: authstore.open_store(host, key, self.wait, port=port))
            except OSError as exc:
                rdv.joined()
                raise _launcher.LauncherError(
                    f"{launch.launcher} job {launch.scope}: rank 0 cannot open the job's store on {host}: "
                    f"every candidate port is taken ({', '.join(map(str, ports))}; {exc}). Set "
                    "MASTER_PORT to a free port.", rank=0, launcher=launch.launcher) from exc
            port = int(store.server.port)
            if port != ports[0]:
                log.info("%s job %s: store port %d is taken; the store is on candidate port %d",
                         launch.launcher, launch.scope, ports[0], port)
        else:
            store, port = authstore.connect_any(launch.master_addr, ports, key, self.wait)
        self.launch = replace(launch, master_port=port)
        return store


class TorchGroupHandler(_JoinedHandler):
    """An initialised default ``torch.distributed`` group: Horovod's groups on its store."""

    def _open(self, rdv: StoreRendezvous, seq: int) -> Any:
        import torch.distributed as dist

        addr = self.launch.master_addr or self.environ.get("MASTER_ADDR")
        rdv.address = local_address(self.environ, addr) if addr else ""
        return dist.distributed_c10d._get_default_store()


class TorchrunHandler(_JoinedHandler):
    """torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``), or one rank 0 opens as torch's
    ``env://`` does: Horovod's authenticated store when the ranks share ``HOROVOD_SECRET_KEY``,
    else torch's ``TCPStore`` (every interface, anybody: docs/security.md)."""

    def _open(self, rdv: StoreRendezvous, seq: int) -> Any:
        import torch.distributed as dist

        launch = self.launch
        assert launch.master_addr and launch.master_port
        rdv.address = local_address(self.environ, launch.master_addr)
        if not launch.master_is_store and rdv.job_secret:
            return self._authenticated(rdv, socket.gethostbyname(launch.master_addr))
        master = self.rank == 0 and not launch.master_is_store
        if master:
            log.warning("rank 0 opens torch's TCPStore on port %d of every interface, which "
                        "anybody who reaches it can read and write; export the same "
                        "HOROVOD_SECRET_KEY=$(python -m horovod.runner.secret) to every rank "
                        "to use Horovod's authenticated store (docs/security.md)", launch.master_port)
        return dist.TCPStore(launch.master_addr, launch.master_port, self.size, master,
                             timeout=datetime.timedelta(seconds=self.wait), wait_for_workers=False)


class SlurmHandler(_JoinedHandler):
    """An srun step: task 0 opens an authenticated store on the step's first node, on the first
    free one of the step's candidate ports; the other tasks find it among them
    (``horovod.common.slurm_ports``)."""

    where = ("MASTER_ADDR/MASTER_PORT (or the first node of SLURM_STEP_NODELIST and the candidate "
             "ports of docs/launcher.md#slurm)")

    def _open(self, rdv: StoreRendezvous, seq: int) -> Any:
        launch = self.launch
        assert launch.master_addr and launch.master_port
        rdv.address = local_address(self.environ, launch.master_addr)
        host = socket.gethostbyname(launch.master_addr) if self.rank == 0 else launch.master_addr
        # The step's secret: HOROVOD_SECRET_KEY, else one only this user can get (MUNGE or a
        # private key file), else a LauncherError (horovod.common.slurm_secret).
        rdv.job_secret, rdv.key_service = slurm_secret.step_secret(
            self.environ, launch, self.rank, host, self.wait, seq)
        if rdv.key_service is not None and rdv.key_service.port is not None:
            self.launch = replace(launch, key_port=rdv.key_service.port)
        return self._authenticated(rdv, host, slurm_ports.step_ports(self.environ))


class MPIHandler(_JoinedHandler):
    """An MPI launcher's job on Gloo (``HOROVOD_CONTROLLER=gloo`` under ``mpirun``, as upstream):
    rank 0 opens Horovod's authenticated store, keyed with ``HOROVOD_SECRET_KEY`` or else a fresh
    random key, and sends its address and key to the other ranks over ``MPI_COMM_WORLD`` (the
    job's own channel); rank and size are the communicator's."""

    where = "that every host reaches rank 0's address (HOROVOD_GLOO_IFACE chooses it)"

    def __init__(self, config: EngineConfig, environ: Mapping[str, str], launch: _launcher.Launch,
                 comm: Any) -> None:
        super().__init__(config, environ, launch)
        self.comm = comm

    @staticmethod
    def store_host(environ: Mapping[str, str], hosts: list[str]) -> str:
        """Where rank 0 (on ``hosts[0]``) serves the store: ``HOROVOD_GLOO_IFACE``'s address, else
        the one that routes to another rank's host (``127.0.0.1`` when all share one host)."""
        others = [h for h in hosts if h != hosts[0]]
        if not others:
            return local_address(environ, "127.0.0.1")
        try:
            toward = socket.gethostbyname(others[0])
        except OSError:  # a host name only the MPI runtime resolves: this host's own address
            toward = socket.gethostbyname(socket.gethostname())
        return local_address(environ, toward)

    def _rank0_store(self, rdv: StoreRendezvous, hosts: list[str]) -> tuple[Any, tuple[str, int, bytes]]:
        addr = self.store_host(self.environ, hosts)
        key = authstore.derive_key(rdv.job_secret) if rdv.job_secret else authstore.random_key()
        store = authstore.open_store(addr, key, self.wait)
        return store, (addr, int(store.server.port), key)

    def _open(self, rdv: StoreRendezvous, seq: int) -> Any:
        hosts = self.comm.allgather(socket.gethostname())
        store: Any = None
        if self.rank == 0:
            try:
                store, meeting = self._rank0_store(rdv, hosts)
            except BaseException as exc:
                self.comm.bcast(f"{type(exc).__name__}: {exc}", root=0)  # the others fail too
                raise
            self.comm.bcast(meeting, root=0)
        else:
            meeting = self.comm.bcast(None, root=0)
            if isinstance(meeting, str):
                raise _launcher.LauncherError(
                    f"Rank {self.rank} of a job started by mpirun cannot join Gloo: rank 0 could not "
                    f"open the job's store ({meeting}). Check HOROVOD_GLOO_IFACE, or unset "
                    "HOROVOD_CONTROLLER/HOROVOD_CPU_OPERATIONS to use MPI.", rank=self.rank,
                    launcher="mpi")
        addr, port, key = meeting
        self.launch = replace(self.launch, master_addr=addr, master_port=port)
        rdv.address = addr if self.rank == 0 else local_address(self.environ, addr)
        if store is None:
            store = authstore.connect_store(addr, port, key, self.wait)
        return store


_JOINED: dict[str, type[_JoinedHandler]] = {
    "torch-group": TorchGroupHandler, "torchrun": TorchrunHandler, "slurm": SlurmHandler}


def handler_for(config: EngineConfig, environ: Mapping[str, str],
                launch: _launcher.Launch) -> RendezvousHandler:
    """The handler of the launcher that started this process (elastic rounds: elastic.rounds)."""
    joined = _JOINED.get(launch.launcher)
    if joined is not None and (launch.size or 1) > 1:
        return joined(config, environ, launch)
    return HorovodHandler(config, environ)


def _launch(environ: Mapping[str, str]) -> _launcher.Launch:
    return _launcher.detect(environ, _launcher.torch_default_group())


def elastic_round(environ: Mapping[str, str]) -> bool:
    """Whether this worker meets its job in the elastic driver's rounds
    (``horovod.common.elastic.rounds``) rather than through :func:`handler_for`."""
    from horovod.common.elastic.worker import is_elastic

    if not is_elastic(environ):
        return False
    launch = _launch(environ)
    return not (launch.launcher in _JOINED and (launch.size or 1) > 1)
