"""Run-time tuning of the engine's speed knobs (``HOROVOD_AUTOTUNE``): see ``manager`` and ``docs/autotune.md``."""

from horovod.common.autotune.bayes import BayesianOptimizer, GaussianProcess
from horovod.common.autotune.manager import CSV_HEADER, KNOBS, ParameterManager, from_config

__all__ = ["BayesianOptimizer", "GaussianProcess", "CSV_HEADER", "KNOBS", "ParameterManager", "from_config"]
