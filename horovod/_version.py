"""The package version (a module of its own: the launcher reads it without importing ``horovod``)."""

__version__ = "0.30.0"
