"""Start the ranks of a plan that run on this machine as local processes (Gloo mode)."""

from __future__ import annotations

from collections.abc import Mapping

from horovod.runner.launch.commands import Command, shim_argv
from horovod.runner.launch.plan import SECRET_ENV, LaunchPlan, RankPlan

__all__ = ["LocalLauncher", "local_command"]


def local_command(plan: LaunchPlan, rank: RankPlan, environ: Mapping[str, str],
                  secret: str | None = None, python: str | None = None) -> Command:
    """The command of one local rank: the shim running the user command with the rank's env."""
    env = dict(environ)
    env.update(plan.job_env)
    env.update(rank.env)
    if secret is not None:
        env[SECRET_ENV] = secret
    return Command(argv=shim_argv(rank.argv, python=python, watch_stdin=True), env=env,
                   ranks=(rank.slot.rank,), host=rank.slot.hostname, lifeline=True,
                   shown_env={**plan.job_env, **rank.env})


class LocalLauncher:
    """Local processes; always available."""

    name = "local"

    def __init__(self, environ: Mapping[str, str], secret: str | None = None) -> None:
        self.environ = environ
        self.secret = secret

    def is_available(self) -> tuple[bool, str]:
        return True, ""

    def commands(self, plan: LaunchPlan) -> list[Command]:
        return [local_command(plan, r, self.environ, self.secret) for r in plan.ranks if r.local]
