"""The authenticated store (horovod.common.backends.authstore): protocol and torch adaptor, in process."""

from __future__ import annotations

import datetime
import logging
import socket
import struct

import pytest

from horovod.common.backends import authstore as A
from tests._logs import records_of

KEY = A.derive_key("ab" * 32)


@pytest.fixture
def server():
    srv = A.StoreServer("127.0.0.1", KEY)
    yield srv
    srv.close()


def test_torch_store_operations(server):
    store = A.connect_store("127.0.0.1", server.port, KEY, timeout=5)
    store.set("a", b"1")
    assert store.get("a") == b"1"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.compare_set("c", b"", b"x") == b"x" and store.compare_set("c", b"y", b"z") == b"x"
    assert store.check(["a", "n"]) and not store.check(["nope"])
    store.wait(["a"])
    with pytest.raises(A.StoreError, match="timed out waiting for key"):
        store.wait(["nope"], datetime.timedelta(seconds=0.2))
    store.multi_set(["k1", "k2"], [b"v1", b"v2"])
    assert store.multi_get(["k1", "k2"]) == [b"v1", b"v2"]
    store.append("a", b"2")
    assert store.get("a") == b"12"
    assert store.num_keys() == 5
    assert store.delete_key("a") and not store.delete_key("a")
    store.close()


def test_wrong_key_is_refused_and_logged_once_per_address(server):
    with records_of("horovod", logging.WARNING) as records:
        for _ in range(3):
            with pytest.raises(A.StoreError, match="refused"):
                A.StoreClient("127.0.0.1", server.port, A.derive_key("cd" * 32), timeout=2)
        good = A.StoreClient("127.0.0.1", server.port, KEY, timeout=2)  # the job is unaffected
        assert good.call(A.NUMKEYS, []) == [b"0"]
    assert server.refusals == 3
    messages = [r.getMessage() for r in records]
    lines = [m for m in messages if "refused a connection from 127.0.0.1" in m]
    assert len(lines) == 1 and "not signed with this job's secret" in lines[0]
    text = "\n".join(messages)
    assert ("ab" * 32) not in text and KEY.hex() not in text


def test_silent_or_garbage_peers_never_hold_up_members(server):
    idle = socket.create_connection(("127.0.0.1", server.port))  # never answers the challenge
    junk = socket.create_connection(("127.0.0.1", server.port))
    junk.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"\0" * 80)
    store = A.connect_store("127.0.0.1", server.port, KEY, timeout=5)
    store.set("k", b"v")
    assert store.get("k") == b"v"
    assert junk.recv(100)[:8] == b"HVDSTOR1"
    with pytest.raises(ConnectionResetError):  # closed after the bad answer (unread bytes: reset)
        while junk.recv(100):
            pass
    idle.close()
    junk.close()


def test_a_forged_frame_ends_the_connection(server):
    client = A.StoreClient("127.0.0.1", server.port, KEY, timeout=5)
    body = A._pack(A.SET, [b"k", b"forged"])
    client._sock.sendall(struct.pack("!I", len(body)) + body + b"\0" * 32)  # wrong MAC
    assert client._sock.recv(10) == b""
    other = A.connect_store("127.0.0.1", server.port, KEY, timeout=5)
    assert not other.check(["k"])


def test_listens_on_the_given_address_only(server):
    assert server._sock.getsockname()[0] == "127.0.0.1"


def test_members_ticket_with_and_without_job_secret():
    for secret in ("ef" * 32, None):
        store, ticket = A.open_for_members("127.0.0.1", 5, secret)
        assert (KEY.hex() not in ticket.decode()) and (("ef" * 32) not in ticket.decode())
        other = A.join_members(ticket, 5, secret)
        other.set("x", b"1")
        assert store.get("x") == b"1"
        other.close()
        store.close()


class _Tap:
    """A socket whose ``sendall`` also records each frame (everything else is the socket's)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.frames = sock, []

    def sendall(self, data: bytes) -> None:
        self.frames.append(data)
        self.sock.sendall(data)

    def __getattr__(self, name: str):
        return getattr(self.sock, name)


def _closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


def test_a_replayed_valid_frame_ends_the_connection_and_changes_nothing(server):
    """A member's own SET, captured and sent again later on the same connection (its MAC is
    valid for the frame's original place in the sequence): refused, so the key is not rolled back
    to the old value. Covers the MAC's sequence number: without it the replay is accepted."""
    client = A.StoreClient("127.0.0.1", server.port, KEY, timeout=5)
    tap = _Tap(client._sock)
    client._chan.sock = tap
    client.call(A.SET, [b"k", b"old"])
    client.call(A.SET, [b"k", b"new"])
    assert len(tap.frames) == 2
    client._sock.sendall(tap.frames[0])  # SET k=old again
    assert _closed_by_server(client._sock), "the store answered a replayed frame"
    other = A.connect_store("127.0.0.1", server.port, KEY, timeout=5)
    assert other.get("k") == b"new"


def test_reordered_valid_frames_end_the_connection(server):
    """Two valid frames of a connection (the next two of its sequence) sent in the other order:
    the first to arrive is refused and neither is applied."""
    client = A.StoreClient("127.0.0.1", server.port, KEY, timeout=5)
    client.call(A.SET, [b"k", b"0"])  # one frame each way first: sequence numbers 1 and 2 next
    recorder = _Tap(socket.socket())  # records, then fails to send: nothing reaches the store
    chan = A._Channel(recorder, client._chan.session, b"c2s", b"s2c")
    chan.sent = client._chan.sent
    for value in (b"1", b"2"):
        with pytest.raises(OSError):
            chan.send(A._pack(A.SET, [b"k", value]))
    recorder.sock.close()
    client._sock.sendall(recorder.frames[1])  # SET k=2 (sequence 2) where 1 is due
    assert _closed_by_server(client._sock), "the store answered an out-of-order frame"
    other = A.connect_store("127.0.0.1", server.port, KEY, timeout=5)
    assert other.get("k") == b"0"
