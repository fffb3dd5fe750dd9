"""Horovod on Spark: run a training function as a Horovod job of Spark tasks.

``horovod.spark.run(fn, num_proc=...)`` and ``horovod.spark.run_elastic(fn, ...)`` as upstream;
PySpark is imported when they are called (``pip install 'horovod-py[spark]'``).
"""

from horovod.spark.elastic import run_elastic
from horovod.spark.runner import run

__all__ = ["run", "run_elastic"]
