"""Host parsing and slot assignment (pure)."""

from __future__ import annotations

import pytest

from horovod.common.exceptions import ConfigError
from horovod.runner.hosts import HostSpec, assign_slots, parse_hostfile, parse_hosts


def test_parse_hosts_reads_names_and_slots() -> None:
    assert parse_hosts("host1:2,host-2.example.com:4") == [HostSpec("host1", 2),
                                                          HostSpec("host-2.example.com", 4)]


@pytest.mark.parametrize("text, culprit", [
    ("host1", "host1"), ("host1:2,host2", "host2"), ("host1:x", "host1:x"), ("h1:2,,h2:2", ""),
    ("host 1:2", "host 1:2"), ("host1:-1", "host1:-1"),
])
def test_parse_hosts_rejects_malformed_entry_naming_it(text: str, culprit: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_hosts(text)
    assert err.value.entry == culprit
    assert "worker-0:2,worker-1:2" in str(err.value)


def test_parse_hosts_rejects_zero_slots_and_duplicates() -> None:
    with pytest.raises(ConfigError, match="0 slots"):
        parse_hosts("a:0")
    with pytest.raises(ConfigError, match="appears twice"):
        parse_hosts("a:1,b:1,a:2")


def test_parse_hostfile_lines_comments_and_default_slot() -> None:
    text = "# cluster\nnode1 slots=4\n\nnode2  slots = 2  # second\nnode3\n"
    assert parse_hostfile(text, "hf") == [HostSpec("node1", 4), HostSpec("node2", 2),
                                          HostSpec("node3", 1)]


def test_parse_hostfile_names_file_and_line_of_bad_line() -> None:
    with pytest.raises(ConfigError) as err:
        parse_hostfile("node1 slots=4\nnode2 slots=two\n", "/tmp/hosts.txt")
    assert err.value.path == "/tmp/hosts.txt" and err.value.line == 2
    assert "/tmp/hosts.txt:2" in str(err.value)


def test_parse_hostfile_empty_is_an_error() -> None:
    with pytest.raises(ConfigError, match="lists no hosts"):
        parse_hostfile("# nothing\n", "hf")


def test_assign_slots_fills_hosts_in_order_with_local_and_cross_ranks() -> None:
    slots = assign_slots([HostSpec("a", 2), HostSpec("b", 2)], 4)
    assert [(s.hostname, s.rank, s.local_rank, s.cross_rank) for s in slots] == [
        ("a", 0, 0, 0), ("a", 1, 1, 0), ("b", 2, 0, 1), ("b", 3, 1, 1)]
    assert {(s.size, s.local_size, s.cross_size) for s in slots} == {(4, 2, 2)}


def test_assign_slots_uneven_hosts_cross_size_per_local_rank() -> None:
    # Upstream's example: 2 hosts with 2 and 1 processes.
    slots = assign_slots([HostSpec("a", 2), HostSpec("b", 1)], 3)
    got = [(s.hostname, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots]
    assert got == [("a", 0, 2, 0, 2), ("a", 1, 2, 0, 1), ("b", 0, 1, 1, 2)]


def test_assign_slots_uses_only_needed_hosts() -> None:
    slots = assign_slots([HostSpec("a", 4), HostSpec("b", 4)], 3)
    assert {s.hostname for s in slots} == {"a"}
    assert all(s.local_size == 3 and s.cross_size == 1 for s in slots)


def test_assign_slots_rejects_np_above_slots() -> None:
    with pytest.raises(ConfigError) as err:
        assign_slots([HostSpec("a", 2), HostSpec("b", 1)], 4)
    assert err.value.np == 4 and err.value.slots == 3
    assert "a:2,b:1" in str(err.value)


def test_slot_env_uses_upstream_names() -> None:
    env = assign_slots([HostSpec("a", 1), HostSpec("b", 1)], 2)[1].env()
    assert env == {"HOROVOD_HOSTNAME": "b", "HOROVOD_RANK": "1", "HOROVOD_SIZE": "2",
                   "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "1", "HOROVOD_CROSS_RANK": "1",
                   "HOROVOD_CROSS_SIZE": "2"}
