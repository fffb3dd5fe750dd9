"""Tiers that must not skip: ``HVD_TEST_REQUIRE_<TIER>=1`` turns a skipped test of that tier into a
failure that names the flag and the skip's reason (``.ci/run`` sets them; ``HVD_TEST_REQUIRE_GPU``
works the same way in ``tests/gpu/conftest.py``).

A test belongs to a tier by its marker (``-m fakehosts``, ``spark``, ``ray``, ``slurm``), by its
directory (``tests/spark``, ``tests/ray``; ``tests/tensorflow``, ``tests/keras``, ``tests/jax`` and
``tests/lightning`` for the frameworks tier, whose packages the ``test`` extra installs), or, for fake
hosts, by using the ``fakehosts_factory`` fixture. A skip while a module is collected (a module-level
``pytest.importorskip``) counts as well as one in a test. Tests marked ``upstream`` need upstream
Horovod's source (from GitHub, which no package registry serves) and are never required.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["REQUIRE_FLAGS", "TIER_DIRS", "required_tier", "enforce"]

#: tier -> the variable that makes its skips failures
REQUIRE_FLAGS = {"fakehosts": "HVD_TEST_REQUIRE_FAKEHOSTS", "spark": "HVD_TEST_REQUIRE_SPARK",
                 "ray": "HVD_TEST_REQUIRE_RAY", "slurm": "HVD_TEST_REQUIRE_SLURM",
                 "frameworks": "HVD_TEST_REQUIRE_FRAMEWORKS"}
#: tier -> the directories under tests/ whose tests belong to it
TIER_DIRS = {"spark": ("spark",), "ray": ("ray",),
             "frameworks": ("tensorflow", "keras", "jax", "lightning")}


def required_tier(item: Any, environ: Mapping[str, str]) -> str | None:
    """The tier of ``item`` whose require flag is set, else None."""
    if item.get_closest_marker("upstream") is not None:
        return None  # needs upstream Horovod's source, which no package registry serves
    parts = Path(str(getattr(item, "path", ""))).parts
    for tier, flag in REQUIRE_FLAGS.items():
        if environ.get(flag) != "1":
            continue
        if item.get_closest_marker(tier) is not None:
            return tier
        if "tests" in parts and set(TIER_DIRS.get(tier, ())) & set(parts[parts.index("tests"):]):
            return tier
        if tier == "fakehosts" and "fakehosts_factory" in getattr(item, "fixturenames", ()):
            return tier
    return None


def enforce(item: Any, report: Any, environ: Mapping[str, str]) -> None:
    """Make ``report`` (of ``item``, a test or a collected module) a failure if it is a skip of a
    required tier."""
    if not report.skipped or getattr(report, "wasxfail", None) is not None:
        return
    tier = required_tier(item, environ)
    if tier is None:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    report.outcome = "failed"
    report.longrepr = (f"{REQUIRE_FLAGS[tier]}=1 but this {tier} test was skipped: {reason}. "
                       f"Fix the {tier} set-up, or unset {REQUIRE_FLAGS[tier]} where the tier cannot run.")
