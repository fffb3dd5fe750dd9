"""The elastic settings, read in one place for ``horovodrun``, Spark and Ray.

Every elastic driver builds its ``ElasticDriver`` from ``DriverSettings.from_env``: the
launcher's own arguments (``--elastic-timeout``, ``--reset-limit``, ``elastic_timeout=`` ...) win,
then the environment, then the defaults below.

============================================  ========  ==================================================
Variable                                      Default   Meaning
============================================  ========  ==================================================
``HOROVOD_ELASTIC_TIMEOUT``                   600       seconds to wait for enough hosts (``--elastic-timeout``)
``HOROVOD_ELASTIC_NOTIFY_WHEN_READY``         0         tell members about new workers only once these wait
``HOROVOD_ELASTIC_REJOIN_TIMEOUT``            90        seconds a member may take to come back after the
                                                        others did (a hung worker is stopped after it)
``HOROVOD_ELASTIC_FINISH_GRACE``              30        seconds the other workers get to end after one
                                                        finished training
``HOROVOD_ELASTIC_HEARTBEAT_TIMEOUT``          5         seconds without a worker's heartbeat after which it
                                                        is declared hung, killed and left behind
``HOROVOD_ELASTIC_HEARTBEAT_INTERVAL``         0.5       seconds between a worker's heartbeats (read by the
                                                        workers: ``horovod.common.elastic.heartbeat``)
============================================  ========  ==================================================

The elastic path has no other timeout: a round that loses a member is abandoned at once (see
``horovod.common.elastic.worker.form_round``), and the Gloo timeout (``HOROVOD_GLOO_TIMEOUT_SECONDS``)
bounds a collective waiting on a peer that stopped without dying.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["DriverSettings", "DEFAULT_ELASTIC_TIMEOUT"]

DEFAULT_ELASTIC_TIMEOUT = 600.0
DEFAULT_REJOIN_TIMEOUT = 90.0
DEFAULT_FINISH_GRACE = 30.0
DEFAULT_HEARTBEAT_TIMEOUT = 5.0


def _flag(value: str | None) -> bool:
    return (value or "0").strip().lower() not in ("", "0", "false", "no", "off")


def _seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name)
    if raw in (None, ""):
        return default
    try:
        value = float(raw)
    except ValueError:
        from horovod.common import exceptions as errors

        raise errors.ConfigError(f"{name}={raw!r} is not a number of seconds.") from None
    if value <= 0:
        from horovod.common import exceptions as errors

        raise errors.ConfigError(f"{name}={raw!r} must be positive.")
    return value


@dataclass(frozen=True)
class DriverSettings:
    """What an ``ElasticDriver`` needs beyond the hosts and the process counts."""

    timeout: float = DEFAULT_ELASTIC_TIMEOUT
    reset_limit: int | None = None
    notify_when_ready: bool = False
    rejoin_timeout: float = DEFAULT_REJOIN_TIMEOUT
    finish_grace: float = DEFAULT_FINISH_GRACE
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, timeout: float | None = None,
                 reset_limit: int | None = None) -> DriverSettings:
        """The launcher's arguments (not None) over the environment over the defaults.

        Raises:
            ConfigError: a variable that is not a positive number of seconds.
        """
        environ = os.environ if environ is None else environ
        return cls(
            timeout=float(timeout) if timeout is not None else _seconds(
                environ, "HOROVOD_ELASTIC_TIMEOUT", DEFAULT_ELASTIC_TIMEOUT),
            reset_limit=reset_limit,
            notify_when_ready=_flag(environ.get("HOROVOD_ELASTIC_NOTIFY_WHEN_READY")),
            rejoin_timeout=_seconds(environ, "HOROVOD_ELASTIC_REJOIN_TIMEOUT",
                                    DEFAULT_REJOIN_TIMEOUT),
            finish_grace=_seconds(environ, "HOROVOD_ELASTIC_FINISH_GRACE", DEFAULT_FINISH_GRACE),
            heartbeat_timeout=_seconds(environ, "HOROVOD_ELASTIC_HEARTBEAT_TIMEOUT",
                                       DEFAULT_HEARTBEAT_TIMEOUT))
