"""The launching code, one module per role (CONTRIBUTING.md, "Layout").

* ``horovodrun``: check, plan and run one job (``launch``), the command line (``main``,
  ``run_commandline``: the ``horovodrun`` console script, ``horovod.runner.launch:run_commandline``
  as upstream names it);
* ``plan``: the launch plan, pure (per rank the host, the command, the environment);
* ``commands``: what a plan becomes (``Command``), made by ``local``, ``ssh`` and ``mpirun``;
* ``supervisor``: start the commands, stream their output, stop everything on the first failure;
* ``static_session``: the static job every launcher shares (``StaticSession``); ``elastic``:
  ``horovodrun``'s elastic job (its session is ``horovod.runner.elastic.session``);
* ``cluster_job``: the rendezvous service and ranks' environment of a job whose ranks Spark or
  Ray start (``FunctionJob``).
"""

from horovod.runner.launch.horovodrun import main, run_commandline

__all__ = ["main", "run_commandline"]
