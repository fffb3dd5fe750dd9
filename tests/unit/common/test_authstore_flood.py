"""The authenticated store under a flood of strangers (loopback only, bounded in count and time).

An outsider holds thousands of idle or trickling connections, or exhausts the server's file
descriptors; members must still join, the accept thread must live, and the server must not
keep a thread or a descriptor per stranger.
"""

from __future__ import annotations

import resource
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from horovod.common.backends import authstore as A

KEY = A.derive_key("ab" * 32)
OUTSIDERS = 3000


@pytest.fixture
def fd_limit():
    """Raise this process's soft descriptor limit to what a test asks (restored afterwards)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    def raise_to(want: int) -> None:
        if soft < want:
            if hard != resource.RLIM_INFINITY and hard < want:
                pytest.skip(f"needs {want} file descriptors, the hard limit is {hard}")
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))

    yield raise_to
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _open_many(port: int, n: int) -> list[socket.socket]:
    """Start ``n`` connections without waiting for each (a full backlog must not block us)."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        socks.append(s)
    return socks


def _trickle(socks: list[socket.socket], stop: threading.Event) -> None:
    """One byte every 2 s on each socket, as a slow-loris handshake would (bounded: until stop)."""
    while not stop.wait(2.0):
        for s in socks:
            try:
                s.send(b"H")
            except OSError:
                pass


def _churn(port: int, out: list[socket.socket], n: int, stop: threading.Event) -> None:
    """Open ``n`` more connections, one every 2 ms (until ``stop``)."""
    for _ in range(n):
        if stop.wait(0.002):
            return
        out += _open_many(port, 1)


def test_a_member_joins_while_an_outsider_holds_3000_connections(fd_limit) -> None:
    fd_limit(2 * OUTSIDERS + 1024)
    server = A.StoreServer("127.0.0.1", KEY)
    threads_before = threading.active_count()
    stop = threading.Event()
    churn = threading.Thread()
    churned: list[socket.socket] = []
    socks = _open_many(server.port, OUTSIDERS)
    trickler = threading.Thread(target=_trickle, args=(socks[::2], stop), daemon=True)
    trickler.start()
    try:
        seen, deadline = -1, time.monotonic() + 60
        while seen != server.evicted + server.pending and time.monotonic() < deadline:
            seen = server.evicted + server.pending
            time.sleep(1.0)  # until the server has taken in what of the flood reached it
        assert server.evicted > 1000 and server.pending <= server.max_per_address
        # The outsider keeps opening connections while the member joins (bounded: 2000 more).
        churn = threading.Thread(target=_churn, args=(server.port, churned, 2000, stop), daemon=True)
        churn.start()
        member = A.connect_store("127.0.0.1", server.port, KEY, timeout=60)
        member.set("late", b"joined")
        assert member.get("late") == b"joined"
        member.close()
        assert server._thread.is_alive()
        # No thread per stranger: the flood left the thread count where it was (+ the trickler,
        # the churner and the member's serving thread, which may still be ending).
        assert threading.active_count() <= threads_before + 3
        assert server.pending <= server.max_pending
    finally:
        stop.set()
        trickler.join(timeout=10)
        if churn.ident is not None:
            churn.join(timeout=30)
        for s in socks + churned:
            s.close()
        server.close()


def test_one_deadline_for_the_whole_handshake() -> None:
    server = A.StoreServer("127.0.0.1", KEY, handshake_seconds=1.0)
    s = socket.create_connection(("127.0.0.1", server.port))
    try:
        assert s.recv(40)[:8] == b"HVDSTOR1"
        s.settimeout(30)
        closed = False
        for _ in range(60):  # one byte each 0.3 s: each read alone would meet a per-read deadline
            try:
                s.send(b"H")
                time.sleep(0.3)
                data = s.recv(64, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            except OSError:
                closed = True
                break
            if data == b"" or data == A._BUSY:
                closed = True
                break
        # 60 bytes never complete the 72-byte answer: only a deadline on the whole handshake
        # (1 s here) can end it; a per-read deadline would wait for ever.
        assert closed, "a trickling handshake was never closed"
        assert server.refusals == 1
    finally:
        s.close()
        server.close()


_LOW_FD_SERVER = textwrap.dedent("""
    import resource, sys, time
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    from horovod.common.backends import authstore as A
    server = A.StoreServer("127.0.0.1", A.derive_key("ab" * 32))
    print(server.port, flush=True)
    for line in sys.stdin:
        print(server._thread.is_alive(), server.accept_errors, server.pending, server.admitted,
              flush=True)
""")


def test_running_out_of_file_descriptors_does_not_kill_the_accept_thread() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _LOW_FD_SERVER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    socks: list[socket.socket] = []
    try:
        assert proc.stdout is not None and proc.stdin is not None
        port = int(proc.stdout.readline())
        socks = _open_many(port, 200)  # far more than the 64 descriptors the server may open
        deadline = time.monotonic() + 60
        while True:
            proc.stdin.write("?\n")
            proc.stdin.flush()
            alive, errors, pending, admitted = proc.stdout.readline().split()
            if int(errors) > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert alive == "True"
        assert int(errors) > 0, "the flood never exhausted the server's descriptors"
        member = A.connect_store("127.0.0.1", port, KEY, timeout=60)
        member.set("k", b"v")
        assert member.get("k") == b"v"
        member.close()
        proc.stdin.write("?\n")
        proc.stdin.flush()
        alive, errors, pending, admitted = proc.stdout.readline().split()
        assert alive == "True" and int(admitted) >= 1
    finally:
        for s in socks:
            s.close()
        proc.kill()
        proc.wait(timeout=30)


def _fake_store(answer: bytes | None) -> tuple[socket.socket, threading.Thread]:
    """A listener that plays the server's side of one handshake per connection and then sends
    ``answer`` instead of its proof (None: closes without a word)."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = lsock.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.sendall(A._HELLO + b"n" * A._NONCE)
                    conn.recv(len(A._HELLO) + A._NONCE + A._MAC)
                    if answer is not None:
                        conn.sendall(answer)
                except OSError:
                    pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return lsock, t


def _stop(lsock: socket.socket, t: threading.Thread) -> None:
    try:
        lsock.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close alone does not)
    except OSError:
        pass
    lsock.close()
    t.join(timeout=10)


@pytest.mark.parametrize("answer", [A._BUSY, None], ids=["busy", "closed"])
def test_a_busy_store_is_not_reported_as_a_wrong_key(answer) -> None:
    lsock, t = _fake_store(answer)
    try:
        with pytest.raises(A.StoreError) as err:
            A.StoreClient("127.0.0.1", lsock.getsockname()[1], KEY, timeout=5, connect_timeout=1.5)
    finally:
        _stop(lsock, t)
    text = str(err.value)
    assert "too busy" in text and "HOROVOD_SECRET_KEY" not in text, text
    assert "attempts" in text  # it tried again before giving up


def test_a_wrong_key_is_reported_at_once() -> None:
    lsock, t = _fake_store(A._REFUSED)
    try:
        with pytest.raises(A.StoreError, match="wrong HOROVOD_SECRET_KEY"):
            A.StoreClient("127.0.0.1", lsock.getsockname()[1], KEY, timeout=5, connect_timeout=30)
    finally:
        _stop(lsock, t)
