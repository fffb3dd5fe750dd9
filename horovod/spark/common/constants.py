"""Upstream's ``horovod.spark.common.constants``: names user code and upstream's tests import.

The intermediate formats name how a vector column is kept between the DataFrame and the
readers (``ARRAY``: dense, ``CUSTOM_SPARSE``: indices and values, ``NOCHANGE``: as written);
the buffer figures bound the readers' memory.
"""

PETASTORM_HDFS_DRIVER = "libhdfs"
METRIC_PRINT_FREQUENCY = 100

ARRAY = "array"
CUSTOM_SPARSE = "custom_sparse_format"
NOCHANGE = "nochange"

MIXED_SPARSE_DENSE_VECTOR = "mixed_sparse_dense_vector"
SPARSE_VECTOR = "sparse_vector"
DENSE_VECTOR = "dense_vector"

TOTAL_BUFFER_MEMORY_CAP_GIB = 4
BYTES_PER_GIB = 1 << 30
