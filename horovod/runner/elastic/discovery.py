"""Where an elastic job may run: a discovery script (or a fixed host list) and the blacklist.

``HostDiscoveryScript`` runs the user's script and parses its output: one host per line,
``hostname:slots`` or ``hostname`` (then ``--slots-per-host``); blank lines and duplicates are
ignored. ``HostDiscovery`` is upstream's base class of every discovery: user code subclasses it
(e.g. for a Ray job's ``settings.discovery``) and implements ``find_available_hosts_and_slots``.
``HostManager`` keeps the discovered hosts in first-seen order and the blacklist of
hosts whose worker failed, with upstream's cooldown: a blacklisted host may come back after
``clamp(MIN * 2^failures + U(0,1) * MIN, MIN, MAX)`` (upstream's rule) seconds with
``--blacklist-cooldown-range MIN MAX``; without it, never. All time comes from ``clock``.
"""

from __future__ import annotations

import random
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from horovod.common import exceptions as errors

__all__ = ["FindsHosts", "HostDiscovery", "HostDiscoveryScript", "FixedHosts", "HostManager", "parse_discovery_output",
           "cooldown_seconds"]


def parse_discovery_output(text: str, default_slots: int | None, source: str) -> dict[str, int]:
    """``{host: slots}`` in the order printed.

    Raises:
        ConfigError: a malformed line, or a line without slots and no ``--slots-per-host``.
    """
    hosts: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, slots_text = line.rpartition(":")
        if not sep:
            name, slots_text = line, ""
        if not name or any(c.isspace() for c in name):
            raise errors.ConfigError(f"{source}: line {lineno} {raw!r} is not 'hostname:slots' or "
                                     "'hostname'.", line=lineno)
        if slots_text:
            if not slots_text.isdigit() or int(slots_text) < 1:
                raise errors.ConfigError(f"{source}: line {lineno} {raw!r}: slots must be a positive "
                                         "integer.", line=lineno)
            slots = int(slots_text)
        elif default_slots is not None:
            slots = default_slots
        else:
            raise errors.ConfigError(f"{source}: line {lineno} {raw!r} gives no slots; print "
                                     "'hostname:slots' or pass --slots-per-host.", line=lineno)
        hosts.setdefault(name, slots)
    return hosts


class FindsHosts(Protocol):
    """What ``HostManager`` asks of a discovery: the hosts available now and their slots."""

    def find_available_hosts_and_slots(self) -> dict[str, int]: ...


class HostDiscovery:
    """Where an elastic job may run now; subclasses implement ``find_available_hosts_and_slots``."""

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        """Returns a dict mapping each available host name to its number of slots."""
        raise NotImplementedError(f"{type(self).__name__} must implement find_available_hosts_and_slots()")


class HostDiscoveryScript(HostDiscovery):
    """Runs ``script`` (no arguments) and returns its hosts."""

    def __init__(self, script: str, default_slots: int | None, timeout: float = 30.0) -> None:
        self.script, self.default_slots, self.timeout = script, default_slots, timeout

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        """Raises ConfigError (bad output) or RuntimeError (script failed)."""
        try:
            res = subprocess.run([self.script], capture_output=True, text=True, timeout=self.timeout,
                                 stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"host discovery script {self.script} could not run: {exc}") from exc
        if res.returncode != 0:
            raise RuntimeError(f"host discovery script {self.script} exited with code "
                               f"{res.returncode}: {res.stderr.strip()[-300:]}")
        return parse_discovery_output(res.stdout, self.default_slots, self.script)


class FixedHosts(HostDiscovery):
    """The hosts of ``-H``/``--hostfile`` in an elastic job: always the same."""

    def __init__(self, hosts: dict[str, int]) -> None:
        self.hosts = dict(hosts)

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        return dict(self.hosts)


def cooldown_seconds(failures: int, cooldown_range: tuple[float, float] | None,
                     rand: Callable[[], float] = random.random) -> float | None:
    """How long a host stays blacklisted after its ``failures``-th failure (None: for ever).

    Upstream's rule: ``lo * 2**failures`` plus up to ``lo`` of jitter, within ``[lo, hi]``, counting
    from the first failure (so the first cooldown is ``2 * lo`` to ``3 * lo``).
    """
    if cooldown_range is None:
        return None
    lo, hi = cooldown_range
    delay = lo * (2 ** max(failures, 1)) + rand() * lo
    return float(min(max(delay, lo), hi))


@dataclass
class _Blacklisted:
    failures: int
    until: float | None  # None: permanently


@dataclass
class HostManager:
    """Discovered hosts (first-seen order) minus blacklisted ones."""

    discovery: FindsHosts
    cooldown_range: tuple[float, float] | None = None
    clock: Callable[[], float] = time.monotonic
    rand: Callable[[], float] = random.random
    discovered: dict[str, int] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    blacklist: dict[str, _Blacklisted] = field(default_factory=dict)

    def update(self) -> tuple[list[str], list[str]]:
        """Run discovery once; return (hosts that appeared, hosts that disappeared)."""
        found = self.discovery.find_available_hosts_and_slots()
        return self.set_discovered(found)

    def set_discovered(self, found: dict[str, int]) -> tuple[list[str], list[str]]:
        added = [h for h in found if h not in self.discovered]
        removed = [h for h in self.discovered if h not in found]
        for h in found:
            if h not in self.order:
                self.order.append(h)
        self.discovered = dict(found)
        return added, removed

    def is_blacklisted(self, host: str) -> bool:
        entry = self.blacklist.get(host)
        if entry is None:
            return False
        return entry.until is None or self.clock() < entry.until

    def blacklist_host(self, host: str) -> float | None:
        """Blacklist ``host``; return its cooldown in seconds (None: permanent)."""
        entry = self.blacklist.get(host)
        failures = (entry.failures if entry else 0) + 1
        cooldown = cooldown_seconds(failures, self.cooldown_range, self.rand)
        self.blacklist[host] = _Blacklisted(failures, None if cooldown is None
                                            else self.clock() + cooldown)
        return cooldown

    def available(self) -> dict[str, int]:
        """Usable hosts and their slots, in first-seen order."""
        return {h: self.discovered[h] for h in self.order
                if h in self.discovered and not self.is_blacklisted(h)}

    def all_blacklisted(self) -> bool:
        return bool(self.discovered) and all(self.is_blacklisted(h) for h in self.discovered)


def order_hosts(available: dict[str, int], first: Sequence[str]) -> list[tuple[str, int]]:
    """Hosts in ``first``'s order (those still available), then the others in discovery order."""
    out = [(h, available[h]) for h in first if h in available]
    seen = {h for h, _ in out}
    out += [(h, s) for h, s in available.items() if h not in seen]
    return out
