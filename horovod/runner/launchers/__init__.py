"""Launchers turn a ``LaunchPlan`` into the commands ``execute.py`` runs: mpirun, local, ssh."""

from horovod.runner.launchers.base import Command, Launcher, shim_argv

__all__ = ["Command", "Launcher", "shim_argv"]
