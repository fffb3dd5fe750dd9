"""Utilities at upstream Horovod's ``horovod.runner.common.util`` path."""
