"""The authenticated rendezvous service (a server thread in this process, no subprocess)."""

from __future__ import annotations

import http.client
import time

import pytest

from horovod.common import rendezvous as auth  # the signing protocol, shared with the workers
from horovod.common import rendezvous_handlers
from horovod.runner.rendezvous import RendezvousClient, RendezvousError, RendezvousServer, make_secret


@pytest.fixture
def server():
    srv = RendezvousServer(make_secret())
    yield srv
    srv.stop()


def test_put_get_and_wait(server: RendezvousServer) -> None:
    c = RendezvousClient("127.0.0.1", server.port, server._server.secret, timeout=5)
    assert c.get("s", "k") is None
    c.put("s", "k", b"\x00value")
    assert c.get("s", "k") == b"\x00value"
    assert c.wait("s", "k", timeout=1) == b"\x00value"
    with pytest.raises(RendezvousError, match="Timed out"):
        c.wait("s", "missing", timeout=0.1)


def test_wrong_secret_can_neither_write_nor_read(server: RendezvousServer) -> None:
    server.put("s", "fn", b"secret payload")
    intruder = RendezvousClient("127.0.0.1", server.port, make_secret(), timeout=5)
    with pytest.raises(RendezvousError, match="refused"):
        intruder.get("s", "fn")
    with pytest.raises(RendezvousError, match="refused"):
        intruder.put("s", "fn", b"evil")
    assert server.get("s", "fn") == b"secret payload"
    assert server.rejected == 2


def test_unsigned_and_replayed_requests_get_nothing(server: RendezvousServer) -> None:
    server.put("s", "fn", b"secret payload")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    conn.request("GET", "/kv/s/fn")
    resp = conn.getresponse()
    assert resp.status == 403 and resp.read() == b""
    conn.close()
    # A captured, correctly signed request cannot be sent again.
    secret = server._server.secret
    ts, nonce = f"{time.time():.6f}", "abcd"
    mac = auth.sign_request(secret, "GET", "/kv/s/fn", ts, nonce, b"")
    statuses = []
    for _ in range(2):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        conn.request("GET", "/kv/s/fn", headers={auth.AUTH_HEADER: f"{ts}:{nonce}:{mac}"})
        r = conn.getresponse()
        statuses.append((r.status, r.read()))
        conn.close()
    assert statuses == [(200, b"secret payload"), (403, b"")]


def test_stale_timestamp_is_refused(server: RendezvousServer) -> None:
    secret = server._server.secret
    ts = f"{time.time() - 3600:.6f}"
    mac = auth.sign_request(secret, "GET", "/kv/s/k", ts, "n1", b"")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    conn.request("GET", "/kv/s/k", headers={auth.AUTH_HEADER: f"{ts}:n1:{mac}"})
    assert conn.getresponse().status == 403
    conn.close()


def test_workers_and_runner_share_one_protocol_module() -> None:
    # The signing is written once, in horovod.common.rendezvous; both sides use that code.
    from horovod.common import rendezvous as protocol

    for fn in ("sign_request", "sign_response"):
        assert getattr(auth, fn) is getattr(protocol, fn)
    assert RendezvousClient is protocol.RendezvousClient
    assert rendezvous_handlers.RendezvousClient is protocol.RendezvousClient
    secret = make_secret()
    args = ("PUT", "/kv/gloo.0/store", "123.5", "nonce", b"10.0.0.1:555")
    assert protocol.sign_request(secret, *args) != protocol.sign_request(make_secret(), *args)


def test_launcher_service_round_trip(server: RendezvousServer) -> None:
    rdv = rendezvous_handlers.LauncherService("127.0.0.1", server.port, server._server.secret, rank=0)
    rdv.put("gloo.7", "store", b"1.2.3.4:5")
    assert rdv.wait("gloo.7", "store", timeout=1) == b"1.2.3.4:5"
    bad = rendezvous_handlers.LauncherService("127.0.0.1", server.port, make_secret(), rank=1)
    with pytest.raises(Exception, match="refused rank 1"):
        bad.wait("gloo.7", "store", timeout=1)


def test_a_client_gone_mid_answer_is_one_debug_line_other_faults_keep_their_traceback(
        server: RendezvousServer) -> None:
    import logging

    # Listen on the server's own logger: horovodrun's logging setup (run by other tests in this
    # process) stops "horovod" records from reaching the root logger, where caplog listens.
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("horovod.runner.rendezvous.server")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        # What socketserver calls, inside its except block, when a request's handler raised.
        for exc in (BrokenPipeError(32, "Broken pipe"), ConnectionResetError(104, "reset")):
            try:
                raise exc
            except ConnectionError:
                server._server.handle_error(None, ("10.1.2.3", 4567))
        gone = [r for r in records if "closed its connection" in r.getMessage()]
        assert [r.levelname for r in gone] == ["DEBUG", "DEBUG"]
        assert all(r.exc_info is None and "10.1.2.3" in r.getMessage() for r in gone)
        assert "BrokenPipeError" in gone[0].getMessage()
        records.clear()
        try:
            raise ValueError("a bug of ours")
        except ValueError:
            server._server.handle_error(None, ("10.1.2.3", 4567))
        [fault] = records
        assert fault.levelname == "WARNING" and fault.exc_info is not None
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
