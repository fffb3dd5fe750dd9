"""Helpers kept at upstream Horovod's paths under ``horovod.runner.common``."""
