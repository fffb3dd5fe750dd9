"""Environment variables between a launcher and its workers, and the functions that read them."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

__all__ = ["EXIT_RECORD_ENV", "LIFECYCLE_ENV", "RANK_VARS", "RANK_SIZE_VARS", "RUNNER_ADDR_ENV",
           "RUNNER_PORT_ENV", "SECRET_ENV", "RENDEZVOUS_ADDR_ENV", "RENDEZVOUS_PORT_ENV", "ELASTIC_ENV",
           "ELASTIC_HOST_ENV", "ELASTIC_SLOT_ENV", "RESULT_KEY_ENV", "MONITOR_ADDR_ENV", "MONITOR_PORT_ENV",
           "MONITOR_INTERVAL_ENV", "elastic_env", "job_secret", "env_rank"]

EXIT_RECORD_ENV = "HOROVOD_EXIT_RECORD"
# 0 in a worker's environment: no fail-fast hook (see horovod.common.lifecycle); a failed rank
# takes the normal exit path, and the launcher stops the job when the rank's process ends.
LIFECYCLE_ENV = "HOROVOD_FAIL_FAST"

# horovodrun / Open MPI / PMIx / PMI (MPICH, Intel MPI): the first one set names the rank.
RANK_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
# (rank variable, size variable) per launcher, in the order upstream's helper checks them.
RANK_SIZE_VARS = (("HOROVOD_RANK", "HOROVOD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                  ("PMI_RANK", "PMI_SIZE"))
# Where horovod.run()'s workers (horovod.runner.run_task) find the launcher's service, and its key.
RUNNER_ADDR_ENV = "HOROVOD_RUNNER_ADDR"
RUNNER_PORT_ENV = "HOROVOD_RUNNER_PORT"
SECRET_ENV = "HOROVOD_SECRET_KEY"
# Where a Gloo worker of a Horovod launcher (horovodrun --gloo, horovod.run, Spark, Ray) finds the
# launcher's rendezvous service (horovod.common.rendezvous), which it signs its requests for with
# SECRET_ENV.
RENDEZVOUS_ADDR_ENV = "HOROVOD_GLOO_RENDEZVOUS_ADDR"
RENDEZVOUS_PORT_ENV = "HOROVOD_GLOO_RENDEZVOUS_PORT"
# An elastic worker (not "0"), and the slot the driver knows it by (host name, local rank).
ELASTIC_ENV = "HOROVOD_ELASTIC"
ELASTIC_HOST_ENV = "HOROVOD_ELASTIC_HOST"
ELASTIC_SLOT_ENV = "HOROVOD_ELASTIC_SLOT"
# The key a horovod.run() worker stores its outcome under, where not its rank (an elastic worker
# of horovod.spark.run_elastic changes rank between rounds; its slot name does not).
RESULT_KEY_ENV = "HOROVOD_RUN_TASK_RESULT_KEY"
# Where a rank pushes its counters (``horovodrun --monitor-port``; see horovod/common/reporter.py).
MONITOR_ADDR_ENV = "HOROVOD_MONITOR_ADDR"
MONITOR_PORT_ENV = "HOROVOD_MONITOR_PORT"
MONITOR_INTERVAL_ENV = "HOROVOD_MONITOR_INTERVAL"


def elastic_env(host: str, slot: int) -> dict[str, str]:
    """The variables of an elastic worker the driver knows as slot ``host[slot]`` for its life."""
    return {ELASTIC_ENV: "1", ELASTIC_HOST_ENV: host, ELASTIC_SLOT_ENV: str(slot)}


def job_secret(backend: Any = None, env: Mapping[str, str] | None = None) -> str | None:
    """The secret every rank of this job holds and no outsider does, or None (MPI, torchrun).

    ``HOROVOD_SECRET_KEY`` (horovodrun, horovod.run, Spark, Ray, a batch script), else the one the
    CPU transport established at init (``backend.job_secret``: an srun step's secret from MUNGE
    or a key file). Stores keyed from it need no key sent over the network.
    """
    env = os.environ if env is None else env
    return env.get(SECRET_ENV) or getattr(backend, "job_secret", None) or None


def env_rank(env: Mapping[str, str] | None = None) -> str | None:
    """The rank the launcher put in ``env`` (default ``os.environ``), as written, or None."""
    env = os.environ if env is None else env
    return next((env[v] for v in RANK_VARS if v in env), None)
