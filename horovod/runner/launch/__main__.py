"""``python -m horovod.runner.launch`` is ``horovodrun``."""

from horovod.runner.launch.horovodrun import run_commandline

if __name__ == "__main__":
    run_commandline()
