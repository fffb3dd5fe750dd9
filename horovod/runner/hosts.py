"""Parse ``-H``/``--hostfile`` host lists and assign ranks to slots (pure functions).

Ranks are assigned the way ``mpirun -map-by slot`` does and the way upstream Horovod's Gloo
launcher does: host by host in the order given, filling every slot of a host before the next.
``local_rank`` is the index of a rank on its host; ``cross_rank`` is the index of its host among
the hosts that have a rank with the same ``local_rank``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from horovod.common import exceptions as errors
from horovod.common import protocol

if TYPE_CHECKING:
    from horovod.runner.settings import LaunchSettings

__all__ = ["HostSpec", "SlotInfo", "parse_hosts", "parse_hostfile", "assign_slots", "hosts_text", "resolve_hosts"]

_HOST_ENTRY = re.compile(r"^[\w.-]+:[0-9]+$")
_HOSTFILE_LINE = re.compile(r"^(?P<host>[\w.-]+)(?:\s+slots\s*=\s*(?P<slots>[0-9]+))?\s*$")


@dataclass(frozen=True)
class HostSpec:
    """One host of the job and how many processes it may run."""

    name: str
    slots: int

    def __str__(self) -> str:
        return f"{self.name}:{self.slots}"


# Where one rank runs and its place in the job's topology (upstream's name for it).
SlotInfo = protocol.RankIdentity


def parse_hosts(text: str) -> list[HostSpec]:
    """Parse ``host1:2,host2:4`` into host specs.

    Raises:
        ConfigError: an entry is not ``name:slots``, has zero slots, or a host repeats.
    """
    entries = [e.strip() for e in text.split(",")]
    hosts: list[HostSpec] = []
    for entry in entries:
        if not _HOST_ENTRY.match(entry):
            raise errors.ConfigError(
                f"Invalid host entry {entry!r} in -H/--hosts {text!r}: each entry must be "
                "<hostname>:<slots>, for example 'worker-0:2,worker-1:2'.", entry=entry, value=text)
        name, slots = entry.rsplit(":", 1)
        hosts.append(HostSpec(name, int(slots)))
    return _validated(hosts, source="-H/--hosts")


def parse_hostfile(text: str, path: str = "<hostfile>") -> list[HostSpec]:
    """Parse hostfile lines ``<hostname> slots=<n>`` (``#`` comments and blank lines are skipped).

    A line with only a host name means one slot, as in Open MPI hostfiles.

    Raises:
        ConfigError: a line is malformed (the message names the file and line number).
    """
    hosts: list[HostSpec] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _HOSTFILE_LINE.match(line)
        if match is None:
            raise errors.ConfigError(
                f"{path}:{lineno}: invalid hostfile line {raw.strip()!r}; expected "
                "'<hostname> slots=<n>', for example 'worker-0 slots=4'.", path=path, line=lineno)
        slots = int(match.group("slots")) if match.group("slots") is not None else 1
        hosts.append(HostSpec(match.group("host"), slots))
    if not hosts:
        raise errors.ConfigError(f"Hostfile {path} lists no hosts; add lines like 'worker-0 slots=4'.",
                          path=path)
    return _validated(hosts, source=path)


def _validated(hosts: list[HostSpec], source: str) -> list[HostSpec]:
    seen: set[str] = set()
    for h in hosts:
        if h.slots < 1:
            raise errors.ConfigError(f"Host {h.name!r} in {source} has {h.slots} slots; give at least 1.",
                              entry=str(h))
        if h.name in seen:
            raise errors.ConfigError(f"Host {h.name!r} appears twice in {source}; list each host once "
                              "with its total number of slots.", entry=h.name)
        seen.add(h.name)
    return hosts


def hosts_text(hosts: list[HostSpec]) -> str:
    """Format hosts as ``-H`` text (``h1:2,h2:2``)."""
    return ",".join(str(h) for h in hosts)


def used_hosts(hosts: list[HostSpec], np: int) -> list[HostSpec]:
    """The hosts that receive at least one of ``np`` ranks, with the slots actually used."""
    out: list[HostSpec] = []
    left = np
    for h in hosts:
        if left <= 0:
            break
        take = min(h.slots, left)
        out.append(HostSpec(h.name, take))
        left -= take
    return out


def assign_slots(hosts: list[HostSpec], np: int) -> list[SlotInfo]:
    """Assign ``np`` ranks to the slots of ``hosts`` in order; return one ``SlotInfo`` per rank.

    Raises:
        ConfigError: ``np`` is less than 1 or larger than the number of slots.
    """
    total = sum(h.slots for h in hosts)
    if np < 1:
        raise errors.ConfigError(f"-np {np}: the number of processes must be at least 1.", value=np)
    if np > total:
        raise errors.ConfigError(
            f"Requested more processes ({np}) than there are available slots ({total}) on hosts "
            f"{hosts_text(hosts)}. Lower -np or add slots/hosts to -H or --hostfile.",
            np=np, slots=total)
    used = used_hosts(hosts, np)
    # cross_size for local_rank i = number of hosts with more than i ranks.
    cross_sizes = {i: sum(1 for h in used if h.slots > i) for i in range(max(h.slots for h in used))}
    slots: list[SlotInfo] = []
    rank = 0
    for host_index, h in enumerate(used):
        for local_rank in range(h.slots):
            cross_rank = sum(1 for prev in used[:host_index] if prev.slots > local_rank)
            slots.append(SlotInfo(hostname=h.name, rank=rank, local_rank=local_rank,
                                  cross_rank=cross_rank, size=np, local_size=h.slots,
                                  cross_size=cross_sizes[local_rank]))
            rank += 1
    return slots


def resolve_hosts(settings: LaunchSettings) -> list[HostSpec]:
    """Hosts from ``-H``, ``--hostfile`` or ``localhost:<np>``.

    Raises:
        ConfigError: a malformed entry or line, an unreadable hostfile.
    """
    if settings.hosts:
        return parse_hosts(settings.hosts)
    if settings.hostfile:
        try:
            with open(settings.hostfile, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise errors.ConfigError(f"--hostfile {settings.hostfile}: cannot read it: {exc}",
                              path=settings.hostfile) from exc
        return parse_hostfile(text, settings.hostfile)
    if settings.np is None:
        raise errors.ConfigError("-np is required: give the total number of processes, e.g. -np 4.")
    return [HostSpec("localhost", max(settings.np, 1))]
