"""Random frames and requests thrown at the store and at the rendezvous service (hypothesis).

Each test is bounded (a fixed number of examples, derandomized, and a ~20 s budget after which
the remaining examples do nothing). Afterwards: the servers still run, no thread is left behind,
and members are served throughout.
"""

from __future__ import annotations

import socket
import threading
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from horovod.common.backends import authstore as A
from horovod.runner.rendezvous import RendezvousClient, RendezvousServer, make_secret

KEY = A.derive_key("ab" * 32)
BUDGET = 20.0
FUZZ = settings(max_examples=400, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


def _send_and_read(port: int, raw: bytes, timeout: float = 15.0) -> bytes:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        try:
            s.sendall(raw)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        out = b""
        while len(out) < 1 << 20:
            try:
                chunk = s.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
        return out
    finally:
        s.close()


def _settle(baseline: int) -> int:
    """The thread count once the servers' per-connection threads have ended (bounded wait)."""
    deadline = time.monotonic() + 30
    while threading.active_count() > baseline and time.monotonic() < deadline:
        time.sleep(0.1)
    return threading.active_count()


# ------------------------------------------------------------------------------ the store
_WAITING = (A.GET, A.WAIT, A.MGET)
frames = st.tuples(st.integers(0, 255), st.lists(st.binary(max_size=40), max_size=6))
handshakes = st.one_of(st.binary(max_size=120),
                       st.binary(max_size=100).map(lambda tail: A._HELLO + tail))


def test_fuzz_the_store() -> None:
    baseline = threading.active_count()
    server = A.StoreServer("127.0.0.1", KEY, handshake_seconds=2.0)
    member = A.StoreClient("127.0.0.1", server.port, KEY, timeout=15)
    stop = time.monotonic() + BUDGET
    served = [0]

    @FUZZ
    @given(handshake=handshakes, frame=frames)
    def one(handshake: bytes, frame: tuple[int, list[bytes]]) -> None:
        if time.monotonic() > stop:
            return
        # A stranger: random bytes where the handshake answer should be.
        s = socket.create_connection(("127.0.0.1", server.port), timeout=15)
        try:
            s.sendall(handshake)
            s.shutdown(socket.SHUT_WR)
            s.recv(100)
        except OSError:
            pass
        finally:
            s.close()
        # A member sending a random (authentic) frame gets an answer, and its connection lives.
        op, fields = frame
        if op in _WAITING:
            fields = [b"0"] + fields  # no wait: a random timeout could be hours
        member._chan.send(A._pack(op, fields))
        status, _ = A._unpack(member._chan.recv())
        assert status in (A._OK, A._TIMEOUT, A._ERROR)
        assert member.call(A.SET, [b"alive", str(served[0]).encode()]) == []
        served[0] += 1

    try:
        one()
        assert server._thread.is_alive() and served[0] > 0
        late = A.connect_store("127.0.0.1", server.port, KEY, timeout=15)
        late.set("late", b"1")
        assert late.get("late") == b"1"
        late.close()
    finally:
        member.close()
        server.close()
    assert _settle(baseline) <= baseline


# ------------------------------------------------------------------------- the rendezvous
_METHODS = st.sampled_from(["GET", "PUT", "POST", "DELETE", "HEAD", "OPTIONS", "FROB", "G ET", ""])
_TEXT = st.text(max_size=30)
_HEADER_NAMES = st.sampled_from(["X-Horovod-Auth", "X-Horovod-Body-Digest", "Content-Length",
                                 "Transfer-Encoding", "Host", "Connection", "Expect"])
requests = st.builds(
    lambda method, path, version, headers, body: (
        f"{method} {path} {version}\r\n".encode("utf-8", "surrogatepass")
        + b"".join(f"{k}: {v}\r\n".encode("utf-8", "surrogatepass") for k, v in headers)
        + b"\r\n" + body),
    _METHODS, _TEXT.map(lambda t: "/" + t), st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2", "x"]),
    st.lists(st.tuples(_HEADER_NAMES, st.one_of(_TEXT, st.integers(-10, 1 << 40).map(str))),
             max_size=5),
    st.binary(max_size=200))


def test_fuzz_the_rendezvous() -> None:
    baseline = threading.active_count()
    secret = make_secret()
    server = RendezvousServer(secret, header_seconds=2.0)
    member = RendezvousClient("127.0.0.1", server.port, secret, timeout=15)
    stop = time.monotonic() + BUDGET
    served = [0]

    @FUZZ
    @given(raw=st.one_of(requests, st.binary(max_size=300)))
    def one(raw: bytes) -> None:
        if time.monotonic() > stop:
            return
        answer = _send_and_read(server.port, raw)
        if answer:
            status = int(answer.split(b"\r\n", 1)[0].split()[1])
            assert 400 <= status < 500, (raw[:200], answer[:200])
        member.put("s", "alive", str(served[0]).encode())
        assert member.get("s", "alive") == str(served[0]).encode()
        served[0] += 1

    try:
        one()
        assert served[0] > 0 and server._thread.is_alive()
    finally:
        server.stop()
    assert _settle(baseline) <= baseline
