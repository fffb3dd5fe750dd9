"""Output splitting, prefixing and mpirun tag parsing (pure)."""

from __future__ import annotations

from horovod.runner.output import LineSplitter, TagParser, prefix_line


def feed_all(chunks: list[bytes]) -> list[tuple[str, str]]:
    s = LineSplitter()
    out: list[tuple[str, str]] = []
    for c in chunks:
        out += s.feed(c)
    return out + s.flush()


def test_partial_lines_are_held_until_complete() -> None:
    s = LineSplitter()
    assert s.feed(b"hel") == []
    assert s.feed(b"lo\nwor") == [("hello", "\n")]
    assert s.feed(b"ld") == []
    assert s.flush() == [("world", "")]


def test_unicode_split_across_reads_stays_whole() -> None:
    data = "héllo ✓ 日本\n".encode()
    chunks = [data[i:i + 1] for i in range(len(data))]
    assert feed_all(chunks) == [("héllo ✓ 日本", "\n")]


def test_invalid_utf8_becomes_replacement_character() -> None:
    assert feed_all([b"ok\xff\n"]) == [("ok\ufffd", "\n")]


def test_carriage_return_ends_a_line_and_crlf_is_one_newline() -> None:
    assert feed_all([b"10%\r20%\r", b"done\r\n"]) == [("10%", "\r"), ("20%", "\r"), ("done", "\n")]


def test_crlf_split_across_reads_is_still_one_newline() -> None:
    assert feed_all([b"a\r", b"\nb\r", b"c\n"]) == [("a", "\n"), ("b", "\r"), ("c", "\n")]


def test_trailing_carriage_return_at_eof() -> None:
    assert feed_all([b"50%\r"]) == [("50%", "\r")]


def test_prefix_format_matches_upstream() -> None:
    assert prefix_line(3, "stdout", "hi") == "[3]<stdout>:hi"
    assert prefix_line(0, "stderr", "") == "[0]<stderr>:"
    assert prefix_line(None, "stderr", "mpirun says") == "mpirun says"
    stamped = prefix_line(1, "stdout", "x", timestamp=True)
    assert stamped.endswith("[1]<stdout>:x") and len(stamped) > len("[1]<stdout>:x") + 10


def test_openmpi_tags_give_rank_and_stream() -> None:
    p = TagParser("openmpi")
    assert p.parse("[1,0]<stdout>: hello", "\n", "stdout") == [(0, "stdout", "hello", "\n")]
    assert p.parse("[1,12]<stderr>: oops", "\n", "stdout") == [(12, "stderr", "oops", "\n")]
    assert p.parse("[1,2]<stdout>:", "\n", "stdout") == [(2, "stdout", "", "\n")]
    assert p.parse("prterun noticed that ...", "\n", "stderr") == [
        (None, "stderr", "prterun noticed that ...", "\n")]


def test_openmpi_text_after_carriage_return_keeps_the_tag() -> None:
    p = TagParser("openmpi")
    assert p.parse("[1,3]<stdout>: 10%", "\r", "stdout") == [(3, "stdout", "10%", "\r")]
    assert p.parse("20%", "\n", "stdout") == [(3, "stdout", "20%", "\n")]
    # After a newline an untagged line is mpirun's own again.
    assert p.parse("mpirun line", "\n", "stdout") == [(None, "stdout", "mpirun line", "\n")]


def test_openmpi_unterminated_lines_of_several_ranks_are_split() -> None:
    p = TagParser("openmpi")
    got = p.parse("[1,0]<stdout>: tail a[1,1]<stdout>: tail b", "", "stdout")
    assert got == [(0, "stdout", "tail a", "\n"), (1, "stdout", "tail b", "")]


def test_hydra_tags() -> None:
    p = TagParser("mpich")
    assert p.parse("[4] hello", "\n", "stderr") == [(4, "stderr", "hello", "\n")]
