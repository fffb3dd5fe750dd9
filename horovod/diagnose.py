"""``python -m horovod.diagnose``: which launcher started this process and how Horovod joins it.

Run it the way the training script is run (``torchrun ... -m horovod.diagnose``, ``srun -n 2
python -m horovod.diagnose``, ``horovodrun -np 2 python -m horovod.diagnose``): each
process prints the launcher Horovod detects, the transport it will use, the launcher variables it
read and what is missing, without starting Horovod. ``--init`` also runs ``hvd.init()`` and prints
the ranks it got. Exit status 1 when the launcher cannot be joined. Secrets are never printed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from horovod.common.backends.registry import detect_launch
from horovod.common.config import EngineConfig
from horovod.common.launcher_detection import LauncherError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m horovod.diagnose", description=__doc__)
    parser.add_argument("--init", action="store_true", help="also run hvd.init() and print the ranks")
    args = parser.parse_args(argv)
    print(f"torch (Gloo transport): {'yes' if importlib.util.find_spec('torch') else 'no'}; "
          f"mpi4py (MPI transport): {'yes' if importlib.util.find_spec('mpi4py') else 'no'}")
    try:
        launch = detect_launch(EngineConfig.from_env(os.environ), os.environ)
    except LauncherError as exc:
        print(f"cannot join: {exc}")
        return 1
    print(launch.describe())
    if args.init:
        from horovod.common import basics as hvd

        hvd.init()
        print(f"hvd.init(): rank {hvd.rank()} of {hvd.size()}, local rank {hvd.local_rank()} of "
              f"{hvd.local_size()}, cross rank {hvd.cross_rank()} of {hvd.cross_size()}")
        hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
