"""What the drivers of ``horovod.spark.run`` and ``horovod.spark.run_elastic`` share: the Spark
context, the rendezvous address the executors reach, the start timeout, Spark's failure text."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from horovod.common.exceptions import ConfigError

__all__ = ["DEFAULT_START_TIMEOUT", "default_start_timeout", "spark_failure_reason"]

log = logging.getLogger("horovod.spark")

DEFAULT_START_TIMEOUT = 600.0


def default_start_timeout() -> float:
    """``HOROVOD_SPARK_START_TIMEOUT`` seconds, else 600 (upstream's default)."""
    raw = os.environ.get("HOROVOD_SPARK_START_TIMEOUT")
    if not raw:
        return DEFAULT_START_TIMEOUT
    try:
        return float(raw)
    except ValueError as exc:
        raise ConfigError(f"HOROVOD_SPARK_START_TIMEOUT={raw!r} is not a number of seconds.") from exc


def _spark_context() -> Any:
    try:
        from pyspark import SparkContext
    except ImportError as exc:
        raise ImportError("horovod.spark needs PySpark: pip install 'horovod-py[spark]' "
                          f"(import failed: {exc}).") from exc
    sc = SparkContext._active_spark_context
    if sc is None:
        raise RuntimeError("Could not find an active SparkContext, are you running in a PySpark "
                           "session? Create one first (SparkSession.builder.getOrCreate()).")
    return sc


def _driver_address(sc: Any, nics: list[str] | None) -> tuple[str, str]:
    """(bind address, address the executors use) for the rendezvous service."""
    if nics and "/" not in nics[0]:
        from horovod.runner.network import interface_address

        addr = interface_address(nics[0])
        return addr, addr
    host = sc.getConf().get("spark.driver.host") or "127.0.0.1"
    return "0.0.0.0", host


def spark_failure_reason(text: str) -> str:
    """The useful lines of a Spark job failure: Spark's reason and the task's Python error."""
    import re

    picked: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        m = re.search(r"(Most recent failure reason|Reason): (.*)", line)
        if m:
            picked.append(m.group(2))
        elif re.match(r"^[\w.]+(Error|Exception|Failure|Interrupt)\b.*:", line) and "SparkException" not in line:
            picked.append(line)
        elif "ExecutorLostFailure" in line or "Lost executor" in line:
            picked.append(line)
    seen: dict[str, None] = {}
    for p in picked:
        seen.setdefault(p[:300], None)
    return " | ".join(seen)


def _configure_logging(verbose: int) -> None:
    if verbose >= 2 and not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("horovod.spark: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.DEBUG)
