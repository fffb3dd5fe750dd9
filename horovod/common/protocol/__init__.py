"""What the launcher and its workers say to each other, spelled once (standard library only).

(The messages the ranks' engines exchange during negotiation are another protocol:
``horovod/common/engine/negotiation_codec.py``.)

Both sides import this module: the workers (``horovod.common.lifecycle``, the rendezvous handlers,
the elastic worker, ``horovod.runner.run_task``, the Spark tasks), the worker shim
(``horovod/runner/_shim.py``, which runs by file path and loads this package by path too), and the
launchers (``horovodrun``'s static and elastic jobs, the elastic driver, Spark, Ray).

* **Variables**: where a process finds its rank (:data:`RANK_VARS`, in the order every reader
  checks them; :data:`RANK_SIZE_VARS` pairs each with its size variable), the identity of a
  worker's slot (:meth:`RankIdentity.env`), where ``horovod.run()``'s workers find the launcher
  (:data:`RUNNER_ADDR_ENV`, :data:`RUNNER_PORT_ENV`, :data:`SECRET_ENV`), where Gloo workers find
  the rendezvous service (:data:`RENDEZVOUS_ADDR_ENV`, :data:`RENDEZVOUS_PORT_ENV`), the file
  named by :data:`EXIT_RECORD_ENV` that a failing rank writes its failure record to, the
  fail-fast switch (:data:`LIFECYCLE_ENV`).
* **Rank identity**: :class:`RankIdentity`, where one rank sits in its job (host, global, local and
  cross ranks and sizes): a launcher's slot, a round's member, an initialised rank's topology.
* **Store scopes and keys** on the launcher's rendezvous service (``horovod.common.rendezvous``):
  the Gloo store address (:data:`STORE_KEY` under :func:`gloo_scope` or :func:`round_scope`), an
  abandoned elastic round (:data:`ABANDONED_KEY`, :data:`ABANDONED_STORE`), ``horovod.run()``'s
  function and results (:data:`FUNC_SCOPE`, :data:`RESULT_SCOPE`), the Spark tasks' scopes.
* **Elastic calls** (``POST /elastic/<call>``, JSON both ways): :class:`ReadyRequest` answered by
  :class:`Wait`, :class:`RoundInfo`, :class:`Removed` or :class:`Stop` (:func:`ready_answer`
  reads one back); :class:`NoticeRequest` answered by :class:`Notice`.
* **Function calls**: the function a launcher runs on every rank and its arguments
  (:class:`FunctionCall`), as ``horovod.run``, ``horovod.spark.run`` and ``run_elastic`` store it
  under :data:`FUNC_SCOPE` and ``RayExecutor.run`` sends it to its actors; :func:`function_call`
  checks what a worker read.
* **Outcomes**: what a worker's function ended with (:data:`TaskOutcome`: :class:`Returned`,
  :class:`Raised`, :class:`Exited`), as ``horovod.runner.run_task`` stores it under
  :data:`RESULT_SCOPE` and a Ray worker returns it; :class:`Died`, the launcher's record of a
  worker that never reported (:data:`WorkerOutcome`: any of the four). :func:`task_outcome`
  checks what a launcher read.
* **Spark messages** (JSON in the rendezvous store, ``encode()``/``decode()``): a barrier task's
  :class:`SparkTaskStarted`, answered by :class:`SparkRankAssignment`, and its row
  :class:`SparkRankExit`; an elastic agent's :class:`SparkAgentRegistration`, the driver's
  :data:`AgentCommand` (:class:`StartWorker`, :class:`StopWorker`, :class:`KillWorker`,
  :class:`ExitAgent`; :func:`agent_command` reads one), :class:`SparkWorkerExit`, and a task's
  output lines, :class:`SparkOutputBatch`.
* **Markers**: two stderr lines a launcher removes from the output it shows.
  ``__HOROVOD_RANK_ERROR__ {json}`` is written by a failing Horovod rank the moment it fails
  (:class:`FailureRecord`: whether its error is its own or the consequence of a peer leaving);
  ``__HOROVOD_RUNNER_EXIT__ {json}`` is the shim's last line about a rank (:class:`ExitReport`:
  rank, host, pid, exit code or signal, why the shim stopped it, the failure record).
  :func:`strip_markers` is the one function that finds and removes them, and reads both.
* **Life line**: a launcher gives a remote shim its worker's environment as the first line of its
  stdin (:func:`env_line`, read with :func:`parse_env_line`), and stops the worker by writing
  :func:`signal_line` there, then closing it.
* **Monitor reports**: a rank's counters for the launcher's monitor (:class:`MonitorReport`,
  ``POST /api/report`` on the monitor or the job's rendezvous service).

One module per kind of message (imported here: ``from horovod.common import protocol`` is the one
way in); the submodules import only the standard library and one another, relatively, so that
the shim can load the package by its path without importing ``horovod``.
"""

from __future__ import annotations

from .elastic_calls import *  # noqa: F403
from .elastic_calls import __all__ as _elastic_calls
from .function_call import *  # noqa: F403
from .function_call import __all__ as _function_call
from .identity import *  # noqa: F403
from .identity import __all__ as _identity
from .markers import *  # noqa: F403
from .markers import __all__ as _markers
from .monitor_report import *  # noqa: F403
from .monitor_report import __all__ as _monitor_report
from .outcomes import *  # noqa: F403
from .outcomes import __all__ as _outcomes
from .scopes import *  # noqa: F403
from .scopes import __all__ as _scopes
from .spark_messages import *  # noqa: F403
from .spark_messages import __all__ as _spark_messages
from .variables import *  # noqa: F403
from .variables import __all__ as _variables

__all__ = [*_variables, *_markers, *_identity, *_scopes, *_elastic_calls, *_outcomes, *_function_call,
           *_spark_messages,
           *_monitor_report]
