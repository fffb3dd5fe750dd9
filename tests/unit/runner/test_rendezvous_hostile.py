"""The rendezvous service against a hostile peer (loopback only, bounded in bytes and time).

Unsigned bodies are never buffered (the server's memory stays flat while strangers stream
hundreds of MiB at it), every malformed request gets a 4xx and no traceback, slow and idle
strangers are bounded, and members are served throughout.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from horovod.common import rendezvous as protocol
from horovod.runner.rendezvous import RendezvousClient, RendezvousServer, make_secret
from tests._logs import records_of

MiB = 1 << 20


@pytest.fixture
def server():
    srv = RendezvousServer(make_secret())
    yield srv
    srv.stop()


def _exchange(port: int, raw: bytes, timeout: float = 10.0) -> bytes:
    """Send ``raw``, half-close, return what comes back (until the server closes)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        try:
            s.sendall(raw)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        out = b""
        while True:
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


def _status(answer: bytes) -> int:
    line = answer.split(b"\r\n", 1)[0].split()
    assert len(line) >= 2 and line[0].startswith(b"HTTP/1."), answer[:200]
    return int(line[1])


def _signed_head(secret: str, method: str, path: str, body: bytes, *, ts: float | None = None,
                 length: int | None = None, digest: str | None = None) -> bytes:
    ts_s = f"{time.time() if ts is None else ts:.6f}"
    nonce = make_secret()[:32]
    length = len(body) if length is None else length
    digest = hashlib.sha256(body).hexdigest() if digest is None else digest
    mac = protocol.sign_header(secret, method, path, ts_s, nonce, length, digest)
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n"
            f"{protocol.AUTH_HEADER}: {ts_s}:{nonce}:{mac}\r\n"
            f"{protocol.DIGEST_HEADER}: {digest}\r\n\r\n").encode()


def _malformed(secret: str) -> dict[str, bytes]:
    body = b"value"
    good_auth = _signed_head(secret, "PUT", "/kv/s/k", body).decode().split("\r\n")[3]
    head = "PUT /kv/s/k HTTP/1.1\r\nHost: x\r\n"
    return {
        "unsigned": b"GET /kv/s/k HTTP/1.1\r\nHost: x\r\n\r\n",
        "non-ascii auth": (head + "Content-Length: 5\r\n").encode()
        + protocol.AUTH_HEADER.encode() + b": 1.0:\xff\xfe:\xe9\xe9\r\n\r\nvalue",
        "auth of 2 parts": (head + f"{protocol.AUTH_HEADER}: 1:2\r\nContent-Length: 0\r\n\r\n").encode(),
        "letters for a length": (head + "Content-Length: abc\r\n\r\n").encode(),
        "negative length": (head + "Content-Length: -5\r\n\r\nvalue").encode(),
        "huge length": (head + "Content-Length: 99999999999999999999\r\n\r\n").encode(),
        "10 GiB": (head + f"Content-Length: {10 << 30}\r\n{good_auth}\r\n\r\n").encode(),
        "two lengths": (head + "Content-Length: 5\r\nContent-Length: 6\r\n\r\nvalue").encode(),
        "chunked": (head + "Transfer-Encoding: chunked\r\n\r\n5\r\nvalue\r\n0\r\n\r\n").encode(),
        "unknown method": b"FROB /kv/s/k HTTP/1.1\r\nHost: x\r\n\r\n",
        "bad version": b"GET /kv/s/k HTTP/9.9\r\nHost: x\r\n\r\n",
        "garbage line": b"\x00\x01\x02 \xff\r\n\r\n",
        "long header": (head + "X-Pad: " + "a" * 70000 + "\r\n\r\n").encode(),
        "many headers": (head + "".join(f"X-{i}: {i}\r\n" for i in range(150)) + "\r\n").encode(),
        "non-ascii path": "GET /kv/\u00e9/k HTTP/1.1\r\nHost: x\r\n\r\n".encode("latin-1"),
        "bad digest header": (head + "Content-Length: 5\r\n" + good_auth
                              + f"\r\n{protocol.DIGEST_HEADER}: zz\r\n\r\nvalue").encode(),
        "body not the signed one": _signed_head(secret, "PUT", "/kv/s/k", body)[:-2]
        + b"\r\n" + b"VALUE",
        "stale": _signed_head(secret, "GET", "/kv/s/k", b"", ts=time.time() - 3600),
        "signed for another length": _signed_head(secret, "PUT", "/kv/s/k", body, length=3) + body,
    }


def test_every_malformed_request_gets_a_4xx_and_no_traceback(server: RendezvousServer) -> None:
    secret = server._server.secret
    with records_of("horovod.runner.rendezvous.server") as records:
        statuses = {name: _status(_exchange(server.port, raw)) for name, raw in _malformed(secret).items()}
    assert all(400 <= s < 500 for s in statuses.values()), statuses
    assert statuses["unsigned"] == 403 and statuses["10 GiB"] == 413
    assert statuses["chunked"] == 411 and statuses["unknown method"] == 405
    assert not [r for r in records if r.exc_info], [r.getMessage() for r in records]
    assert server.get("s", "k") is None  # nothing of it was stored
    # Refusals: named once per address, the rest summed up (not one line each).
    warnings = [r for r in records if r.levelno >= logging.WARNING]
    assert 1 <= len(warnings) <= 3
    member = RendezvousClient("127.0.0.1", server.port, secret, timeout=10)
    member.put("s", "k", b"ok")
    assert member.get("s", "k") == b"ok"


def test_header_is_checked_before_the_body_is_read(server: RendezvousServer) -> None:
    # A signed header with an honest length: the 1 MiB body is read and stored.
    secret = server._server.secret
    body = b"x" * MiB
    assert _status(_exchange(server.port, _signed_head(secret, "PUT", "/kv/s/big", body) + body)) == 200
    assert server.get("s", "big") == body
    # Over the limit of its path even when signed: 413 before reading.
    head = _signed_head(secret, "PUT", "/kv/s/huge", b"", length=65 * MiB,
                        digest=hashlib.sha256(b"").hexdigest())
    assert _status(_exchange(server.port, head + b"y" * MiB)) == 413
    # The results of horovod.run() workers may be larger (the launcher expects them).
    from horovod.runner.rendezvous import server as srv_mod

    assert srv_mod.body_limit("PUT", ["kv", "runfunc_result", "0"]) == srv_mod.LARGE_BODY
    assert srv_mod.body_limit("PUT", ["kv", "gloo", "0"]) == srv_mod.MAX_BODY < 100 * MiB


_SERVER = textwrap.dedent("""
    import sys
    from horovod.runner.rendezvous import RendezvousServer, make_secret
    srv = RendezvousServer(make_secret(), host="127.0.0.1")
    print(srv.port, flush=True)
    sys.stdin.read()
""")


def _stream(port: int, head: bytes, total: int, sent: list[int]) -> None:
    """Send ``head`` and up to ``total`` bytes of body, 1 MiB at a time; stop when refused."""
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
    except OSError:
        return
    chunk = b"z" * MiB
    try:
        s.sendall(head)
        n = 0
        while n < total:
            s.sendall(chunk)
            n += len(chunk)
    except OSError:
        pass
    finally:
        sent.append(n if "n" in locals() else 0)
        s.close()


def test_streaming_unsigned_bodies_does_not_grow_the_server() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        ps = psutil.Process(proc.pid)
        # Warm up the handler path (threads, imports) before the baseline.
        _exchange(port, b"GET /kv/s/k HTTP/1.1\r\n\r\n")
        base = ps.memory_info().rss
        peak = base
        total = 200 * MiB
        forged = (f"PUT /kv/s/k HTTP/1.1\r\nHost: x\r\nContent-Length: {total}\r\n"
                  f"{protocol.AUTH_HEADER}: {time.time():.6f}:abcd:{'0' * 64}\r\n\r\n").encode()
        unsigned = f"PUT /kv/runfunc_result/0 HTTP/1.1\r\nContent-Length: {total}\r\n\r\n".encode()
        sent: list[int] = []
        streams = [threading.Thread(target=_stream, args=(port, h, total, sent), daemon=True)
                   for h in (forged, unsigned, forged, unsigned)]
        for t in streams:
            t.start()
        while any(t.is_alive() for t in streams):
            peak = max(peak, ps.memory_info().rss)
            time.sleep(0.05)
        for t in streams:
            t.join()
        peak = max(peak, ps.memory_info().rss)
        growth = (peak - base) / MiB
        print(f"rendezvous RSS: base {base / MiB:.1f} MiB, peak {peak / MiB:.1f} MiB "
              f"(+{growth:.1f} MiB); bytes the 4 streams got out: {[n // MiB for n in sent]} MiB")
        assert growth < 100, growth
        assert len(sent) == 4
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_slow_strangers_are_bounded_and_members_served() -> None:
    secret = make_secret()
    srv = RendezvousServer(secret, max_unauthenticated=16, max_per_address=8, header_seconds=1.0)
    socks: list[socket.socket] = []
    try:
        for _ in range(40):  # idle strangers: only 8 from one address are kept
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.sendall(b"GET /kv/s/k HTTP/1.1\r\n")  # and never finish their header
            socks.append(s)
        member = RendezvousClient("127.0.0.1", srv.port, secret, timeout=30)
        member.put("s", "k", b"v")
        assert member.get("s", "k") == b"v"
        assert srv._server.unauthenticated <= 8
        assert srv._server.evicted >= 40 - 8
        # A stranger that trickles its header is closed at the deadline of the whole header.
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.settimeout(30)
        closed = False
        for _ in range(100):
            try:
                s.send(b"X")
                time.sleep(0.3)
                if s.recv(64, socket.MSG_DONTWAIT) == b"":
                    closed = True
                    break
            except BlockingIOError:
                continue
            except OSError:
                closed = True
                break
        s.close()
        assert closed, "a trickling header was never closed"
    finally:
        for s in socks:
            s.close()
        srv.stop()


_LOW_FD_SERVER = textwrap.dedent("""
    import resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    from horovod.runner.rendezvous import RendezvousServer
    # Caps above the descriptors: the flood reaches EMFILE (the default caps stop it before).
    srv = RendezvousServer(sys.argv[1], host="127.0.0.1", max_unauthenticated=1000,
                           max_per_address=1000)
    print(srv.port, flush=True)
    for line in sys.stdin:
        print(srv._thread.is_alive(), srv._server.accept_errors, flush=True)
""")


def test_running_out_of_file_descriptors_does_not_stop_the_service() -> None:
    secret = make_secret()
    proc = subprocess.Popen([sys.executable, "-c", _LOW_FD_SERVER, secret], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    socks: list[socket.socket] = []
    try:
        assert proc.stdout is not None and proc.stdin is not None
        port = int(proc.stdout.readline())
        for _ in range(200):  # idle strangers, far more than the 64 descriptors it may open
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            socks.append(s)
        deadline = time.monotonic() + 60
        while True:
            proc.stdin.write("?\n")
            proc.stdin.flush()
            alive, errors = proc.stdout.readline().split()
            if int(errors) > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert alive == "True" and int(errors) > 0, "the flood never exhausted its descriptors"
        member = RendezvousClient("127.0.0.1", port, secret, timeout=60)
        member.put("s", "k", b"v")
        assert member.get("s", "k") == b"v"
    finally:
        for s in socks:
            s.close()
        proc.kill()
        proc.wait(timeout=30)
