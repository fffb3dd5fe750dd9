"""The timeline reaches its file on a timer, off the engine thread, and always parses."""

from __future__ import annotations

import json
import threading
import time

from horovod.common.engine.timeline import FLUSH_SECONDS, Timeline


def _wait_for(path, predicate, limit):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        events = json.loads(path.read_text())  # valid JSON at every moment we look
        if predicate(events):
            return events
        time.sleep(0.005)
    return json.loads(path.read_text())


def test_events_reach_the_file_without_any_flush_call(tmp_path):
    path = tmp_path / "tl.json"
    tl = Timeline(str(path), mark_cycles=True)
    try:
        t0 = time.monotonic()
        tl.begin("allreduce.x", "NEGOTIATE_ALLREDUCE")
        tl.tick("allreduce.x", "0")
        tl.end("allreduce.x")
        tl.cycle()
        events = _wait_for(path, lambda ev: any(e.get("name") == "CYCLE_START" for e in ev), 1.0)
        waited = time.monotonic() - t0
        names = [e.get("name") for e in events]
        assert "NEGOTIATE_ALLREDUCE" in names and "CYCLE_START" in names, names
        assert waited < 4 * FLUSH_SECONDS + 0.1, f"events took {waited:.3f} s to reach the file"
    finally:
        tl.close()
    assert json.loads(path.read_text())[-1] == {}


def test_file_parses_while_events_stream_in(tmp_path):
    """A reader polling the file while another thread emits sees a JSON array every time, short
    of a read that races one write (then the next read, 10 ms later, parses)."""
    path = tmp_path / "tl.json"
    tl = Timeline(str(path))
    stop = threading.Event()

    def produce():
        i = 0
        while not stop.is_set():
            tl.begin(f"t{i % 50}", "ALLREDUCE", {"i": i})
            tl.end(f"t{i % 50}")
            i += 1
            if i % 200 == 0:
                time.sleep(0.001)

    thread = threading.Thread(target=produce)
    thread.start()
    reads = torn = 0
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            try:
                json.loads(path.read_text())
            except ValueError:
                torn += 1
                time.sleep(0.01)
                json.loads(path.read_text())
            reads += 1
    finally:
        stop.set()
        thread.join()
        tl.close()
    events = json.loads(path.read_text())
    begins = sum(1 for e in events if e.get("ph") == "B")
    ends = sum(1 for e in events if e.get("ph") == "E")
    assert reads > 10 and begins == ends > 100, (reads, begins, ends)
    assert torn <= max(2, reads // 20), f"{torn} of {reads} reads did not parse"


def test_close_stops_the_writer_thread(tmp_path):
    tl = Timeline(str(tmp_path / "tl.json"))
    tl.begin("a", "ALLREDUCE")
    tl.end("a")
    tl.close()
    tl.close()  # harmless twice
    assert not any(t.name == "horovod-timeline" and t.is_alive() for t in threading.enumerate())
