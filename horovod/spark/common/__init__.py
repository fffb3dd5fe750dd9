"""Shared parts of the Spark ML estimators: the store, the backend, data preparation, the
Parquet reader, parameters and persistence."""
