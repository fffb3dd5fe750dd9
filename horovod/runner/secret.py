"""``python -m horovod.runner.secret``: print a fresh job secret for ``HOROVOD_SECRET_KEY``.

For launchers that do not make one (Slurm's ``srun``): ``export HOROVOD_SECRET_KEY=$(python -m
horovod.runner.secret)`` in the batch script, before ``srun``, so that every task keys the job's
store with it (docs/security.md). Keep it out of command lines and logs.
"""

from __future__ import annotations

from horovod.common.rendezvous import make_secret

if __name__ == "__main__":
    print(make_secret())
