"""The secret of an ``srun`` step whose batch script exported no ``HOROVOD_SECRET_KEY``.

Every task of the step must key the job's store (``horovod.common.backends.authstore``) alike, and
nobody else may compute that key: the job id alone will not do, since ``squeue`` shows it to every
user. :func:`step_secret` returns the secret and, on task 0, a service to close once the ranks have
joined. In order, the first that applies:

1. ``HOROVOD_SECRET_KEY`` (the batch script exported one): used as is.
2. **MUNGE** (how Slurm itself authenticates; ``munge``/``unmunge`` work here): task 0 draws a
   random secret and serves it, on ``key port`` of the step's first node, as a MUNGE credential
   made for this user only (``munge -u <uid>``: munged decodes it for that uid and root, nobody
   else) whose payload names the job step. Every other task fetches a fresh credential, decodes it
   with ``unmunge`` and accepts it only if it was *made* by its own uid and names its own step.
   A stranger who connects gets a credential it cannot decode; one who serves a credential of its
   own is refused (wrong uid); a credential is decoded once (MUNGE refuses replays). The key port
   is ``MASTER_PORT + 1`` when ``MASTER_PORT`` is set, else the first free one of the step's
   candidates (``horovod.common.slurm_ports``: odd ports of 20000-32767, beside the store's even
   ones), which the other tasks try in turn. Trusts: munged and its key (as Slurm does), root.
3. **A key file** (no MUNGE, or ``HOROVOD_SLURM_KEY=file``): task 0 writes the secret to
   ``<dir>/slurm-<job id>.<step id>.<n>.key`` (``n`` counts the ``hvd.init()`` calls; mode 0600,
   in a directory of mode 0700 owned by the user; written whole, then renamed into place), the
   others read it; task 0 removes it once the ranks have joined, and the others take no file
   older than their step. ``<dir>`` is ``HOROVOD_SLURM_KEY_DIR``, else ``~/.horovod/keys``. A step on
   one node always can; a step on several nodes only with ``HOROVOD_SLURM_KEY_DIR`` naming a
   directory every node shares (the user says so: Horovod cannot tell a shared home from a local
   one). Trusts: the file system's permissions, root.
4. Otherwise ``LauncherError``: export ``HOROVOD_SECRET_KEY``, or make MUNGE or a shared key
   directory available.

``HOROVOD_SLURM_KEY=munge|file`` forces one mechanism (``auto``, the default, is the order above).
Standard library only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from horovod.common import slurm_ports
from horovod.common.launcher_detection import Launch, LauncherError

__all__ = ["KeyService", "step_secret", "key_ports", "munge_available"]

log = logging.getLogger("horovod")

_PAYLOAD = "horovod-slurm-step-secret"
_MAX_CRED = 4096
_TTL = 120  # seconds a served credential stays decodable


class KeyService:
    """What task 0 keeps running until the ranks have joined; ``close()`` ends it (idempotent).
    ``port``: the port it listens on (None: a key file)."""

    port: int | None = None

    def close(self) -> None:  # pragma: no cover - overridden
        pass


def key_ports(environ: Mapping[str, str]) -> list[int]:
    """The candidate ports of task 0's MUNGE key service (see the module docstring)."""
    return slurm_ports.step_ports(environ, "key")


def munge_available() -> str | None:
    """None when ``munge | unmunge`` works here, else why not."""
    if shutil.which("munge") is None or shutil.which("unmunge") is None:
        return "the munge and unmunge commands are not on PATH"
    try:
        cred = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
        if cred.returncode != 0:
            return f"munge -n failed: {cred.stderr.decode(errors='replace').strip()}"
        res = subprocess.run(["unmunge"], input=cred.stdout, capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"munge does not answer: {exc}"
    if res.returncode != 0:
        return f"unmunge failed: {res.stderr.decode(errors='replace').strip()}"
    return None


def _nodes(environ: Mapping[str, str]) -> int:
    raw = environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_NNODES") or "1"
    try:
        return int(raw)
    except ValueError:
        return 2  # unknown: assume the step spans several nodes


def step_secret(environ: Mapping[str, str], launch: Launch, rank: int, bind_host: str,
                timeout: float, seq: int = 0) -> tuple[str, KeyService | None]:
    """The step's secret, and on task 0 the service to close once every rank has joined.

    ``bind_host`` is the address task 0 listens on (the first node's); ``timeout`` bounds the wait
    of the other tasks for task 0's secret; ``seq`` counts the ``hvd.init()`` calls of this process
    (every task counts alike), so that a later init never takes an earlier one's secret.

    Raises:
        LauncherError: no mechanism applies (multi-node step without MUNGE or a shared key
            directory), or task 0's secret could not be obtained in ``timeout`` seconds.
    """
    given = environ.get("HOROVOD_SECRET_KEY")
    if given:
        return given, None
    step = f"{environ.get('SLURM_JOB_ID', '0')}.{environ.get('SLURM_STEP_ID', '0')}"
    scope = f"{step}.{seq}"
    choice = (environ.get("HOROVOD_SLURM_KEY") or "auto").strip().lower()
    if choice not in ("auto", "munge", "file"):
        raise LauncherError(f"HOROVOD_SLURM_KEY={choice!r}: use auto, munge or file.", launcher="slurm")
    no_munge = munge_available() if choice in ("auto", "munge") else "HOROVOD_SLURM_KEY=file"
    if no_munge is None:
        assert launch.master_addr
        ports = key_ports(environ)
        if rank == 0:
            return _serve_munge(bind_host, ports, scope)
        return _fetch_munge(launch.master_addr, ports, scope, rank, timeout), None
    if choice == "munge":
        raise LauncherError(f"HOROVOD_SLURM_KEY=munge but MUNGE cannot be used here: {no_munge}.",
                            launcher="slurm", rank=rank)
    key_dir = environ.get("HOROVOD_SLURM_KEY_DIR")
    if not key_dir and _nodes(environ) > 1:
        raise LauncherError(
            f"srun step {step} spans several nodes, HOROVOD_SECRET_KEY is not exported and MUNGE "
            f"cannot be used ({no_munge}), so rank {rank} has no secret the other tasks share and "
            "strangers cannot compute. Export HOROVOD_SECRET_KEY=$(python -m horovod.runner.secret) "
            "in the batch script before srun, or set HOROVOD_SLURM_KEY_DIR to a directory every node "
            "shares (such as a directory in a shared home), or make munge/unmunge available.",
            launcher="slurm", rank=rank)
    path = Path(key_dir or Path.home() / ".horovod" / "keys") / f"slurm-{scope}.key"
    if rank == 0:
        try:
            return _write_key_file(path)
        except OSError as exc:
            raise LauncherError(
                f"srun: task 0 cannot write the step's key file {path} ({exc}): set HOROVOD_SLURM_KEY_DIR "
                "to a directory of yours, or export HOROVOD_SECRET_KEY.", launcher="slurm", rank=0) from exc
    return _read_key_file(path, rank, timeout), None


# ------------------------------------------------------------------------------- MUNGE
def _mint(scope: str, secret: str) -> bytes:
    payload = f"{_PAYLOAD} {scope} {secret}"
    res = subprocess.run(["munge", "-s", payload, "-u", str(os.getuid()), "-t", str(_TTL)],
                         capture_output=True, timeout=10)
    if res.returncode != 0:
        raise OSError(f"munge failed: {res.stderr.decode(errors='replace').strip()}")
    return res.stdout.strip()


class _MungeService(KeyService):
    def __init__(self, sock: socket.socket, scope: str, secret: str) -> None:
        self._sock, self._scope, self._secret = sock, scope, secret
        self.port = int(sock.getsockname()[1])  # the candidate bound (``slurm_ports.bind_first``)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="horovod-slurm-key", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._closed.is_set():
                    return
                time.sleep(0.05)  # EMFILE and the like: keep serving
                continue
            with conn:
                # Anybody may ask; the credential is only decodable by this uid. Nothing is read
                # from the peer, and a peer that does not read cannot block a 200-byte write.
                try:
                    conn.settimeout(2.0)
                    conn.sendall(_mint(self._scope, self._secret) + b"\n")
                except (OSError, subprocess.TimeoutExpired) as exc:
                    log.debug("srun key service: %s", exc)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout=5)


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    return sock


def _serve_munge(host: str, ports: list[int], scope: str) -> tuple[str, KeyService]:
    secret = secrets.token_hex(32)
    try:
        sock = slurm_ports.bind_first(ports, lambda port: _listen(host, port))
    except OSError as exc:
        raise LauncherError(
            f"srun step {scope}: task 0 cannot open its key service on {host} (ports "
            f"{', '.join(map(str, ports))}: {exc}). Other processes hold them: set MASTER_PORT (the "
            "service uses MASTER_PORT + 1) to free ports, or export HOROVOD_SECRET_KEY.",
            launcher="slurm", rank=0) from exc
    return secret, _MungeService(sock, scope, secret)


def _decode(cred: bytes, scope: str) -> str:
    """The secret in ``cred`` if it was made by this uid for ``scope``; raises ValueError otherwise."""
    res = subprocess.run(["unmunge", "--numeric", "--keys=UID"],
                         input=cred, capture_output=True, timeout=10)
    if res.returncode != 0:
        raise ValueError(f"unmunge refused it: {res.stderr.decode(errors='replace').strip()}")
    lines = res.stdout.decode(errors="replace").splitlines()
    uid = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("UID:")), "")
    if uid != str(os.getuid()):
        raise ValueError(f"it was made by uid {uid or '?'}, not by this job's user (uid {os.getuid()})")
    for ln in lines:
        parts = ln.split()
        if len(parts) == 3 and parts[0] == _PAYLOAD:
            if parts[1] != scope:
                raise ValueError(f"it is for step {parts[1]}, not {scope}")
            return parts[2]
    raise ValueError("its payload is not a Horovod step secret")


def _fetch_munge(host: str, ports: list[int], scope: str, rank: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    last: dict[int, str] = {}
    while True:
        # Task 0 serves on the first free candidate: ask each in turn (nothing there, a stranger
        # or a stale service moves on to the next) until the deadline.
        for port in ports:
            try:
                return _ask_munge(host, port, scope, timeout)
            except (OSError, subprocess.TimeoutExpired) as exc:
                last[port] = str(exc)
            except ValueError as exc:
                last[port] = f"the credential served there was refused: {exc}"
        if time.monotonic() > deadline:
            raise LauncherError(
                f"srun step {scope}: rank {rank} could not get the step's secret from task 0's MUNGE key "
                f"service at {host} (ports {', '.join(map(str, ports))}) within {timeout:g} s ("
                + "; ".join(f"{p}: {e}" for p, e in last.items()) + "). Check that task 0 runs; raise "
                "HOROVOD_GLOO_TIMEOUT_SECONDS if start-up is slow, or export HOROVOD_SECRET_KEY.",
                launcher="slurm", rank=rank)
        time.sleep(0.2)


def _ask_munge(host: str, port: int, scope: str, timeout: float) -> str:
    with socket.create_connection((host, port), timeout=min(5.0, max(timeout, 0.1))) as conn:
        data = b""
        while not data.endswith(b"\n") and len(data) < _MAX_CRED:
            chunk = conn.recv(_MAX_CRED)
            if not chunk:
                break
            data += chunk
    return _decode(data.strip(), scope)


# ------------------------------------------------------------------------------- key file
class _KeyFile(KeyService):
    def __init__(self, path: Path) -> None:
        self._path: Path | None = path

    def close(self) -> None:
        if self._path is not None:
            self._path.unlink(missing_ok=True)
            self._path = None


def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise LauncherError(
            f"srun key directory {path} must be owned by uid {os.getuid()} with mode 0700 (it is owned by "
            f"uid {st.st_uid}, mode {oct(st.st_mode & 0o777)}): chmod 700 {path}, or choose another with "
            "HOROVOD_SLURM_KEY_DIR.", launcher="slurm")


def _write_key_file(path: Path) -> tuple[str, KeyService]:
    _private_dir(path.parent)
    secret = secrets.token_hex(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    os.replace(tmp, path)  # readers see the whole secret or nothing; a stale file is replaced
    return secret, _KeyFile(path)


def _step_start() -> float:
    """When this step began on this node: the start of the nearest ``slurmstepd`` ancestor (of
    this process where there is none)."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        boot = next(float(ln.split()[1]) for ln in Path("/proc/stat").read_text().splitlines()
                    if ln.startswith("btime "))
        pid, mine = os.getpid(), None
        for _ in range(32):
            stat = Path(f"/proc/{pid}/stat").read_text()
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat.rsplit(")", 1)[1].split()
            start = boot + int(fields[19]) / ticks
            mine = start if mine is None else mine
            if name.startswith("slurmstepd"):
                return start
            pid = int(fields[1])
            if pid <= 1:
                break
        return mine if mine is not None else time.time()
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def _read_key_file(path: Path, rank: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    # A file left by an earlier step with the same ids (job ids restart when a controller's state
    # is wiped) predates this step: wait for task 0's. A minute of slack for clocks of a shared
    # file system's server.
    not_before = _step_start() - 60
    while True:
        try:
            st = path.stat()
            if st.st_mtime >= not_before:
                text = path.read_text().strip()
                if len(text) == 64:
                    return text
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise LauncherError(
                f"srun: rank {rank} waited {timeout:g} s for task 0's key file {path}. Is the directory "
                "shared by every node of the step (HOROVOD_SLURM_KEY_DIR)? Does task 0 run? Export "
                "HOROVOD_SECRET_KEY=$(python -m horovod.runner.secret) before srun to do without it.",
                launcher="slurm", rank=rank)
        time.sleep(0.1)
