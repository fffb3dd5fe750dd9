"""Store scopes and keys on the launcher's rendezvous service."""

from __future__ import annotations

__all__ = ["STORE_KEY", "ABANDONED_KEY", "ABANDONED_STORE", "ABANDON_POLL_SECONDS", "FUNC_SCOPE", "FUNC_KEY",
           "RESULT_SCOPE", "SPARK_TASK_SCOPE", "SPARK_ENV_SCOPE", "SPARK_AGENT_SCOPE",
           "SPARK_HEARTBEAT_SCOPE", "SPARK_COMMAND_SCOPE", "SPARK_EXIT_SCOPE", "SPARK_OUTPUT_SCOPE",
           "gloo_scope", "spark_agent_key", "spark_output_key", "round_scope"]

STORE_KEY = "store"  # rank 0's authenticated store, "host:port", under gloo_scope() / round_scope()
# Under a round's scope: why the driver gave the round up (one of its members died or left). Every
# member still forming the round (waiting for the store, creating the Gloo device or the process
# group) notices it within ABANDON_POLL_SECONDS and asks for the next round instead of waiting for
# a timeout; ABANDONED_STORE under STORE_KEY ends the wait of a member for rank 0's address.
ABANDONED_KEY = "abandoned"
ABANDONED_STORE = b"abandoned"
ABANDON_POLL_SECONDS = 0.25
# horovod.run(): the pickled FunctionCall (function_call.py) under FUNC_SCOPE/FUNC_KEY; every worker's
# pickled Outcome under RESULT_SCOPE/<rank or RESULT_KEY_ENV>.
FUNC_SCOPE = "runfunc"
FUNC_KEY = "func"
RESULT_SCOPE = "runfunc_result"
# horovod.spark.run: a task's executor (JSON) and the environment the driver computed for it.
SPARK_TASK_SCOPE = "spark_task"
SPARK_ENV_SCOPE = "spark_env"
# horovod.spark.run_elastic agents: registration, heartbeats, commands from the driver, exits.
SPARK_AGENT_SCOPE = "spark_agent"
SPARK_HEARTBEAT_SCOPE = "spark_agent_hb"
SPARK_COMMAND_SCOPE = "spark_agent_cmd"
SPARK_EXIT_SCOPE = "spark_agent_exit"
# Spark tasks' output lines, batched (horovod.spark.output).
SPARK_OUTPUT_SCOPE = "spark_output"


def gloo_scope(sequence: int) -> str:
    """The scope of the ``sequence``-th Gloo store a worker of a static job creates (every rank
    creates its stores in the same order: init, shutdown, init...)."""
    return f"gloo.{sequence}"


def spark_agent_key(agent: str, number: int) -> str:
    """The key of an elastic Spark agent's ``number``-th command (:data:`SPARK_COMMAND_SCOPE`), or
    of the exit of the worker it started ``number``-th (:data:`SPARK_EXIT_SCOPE`)."""
    return f"{agent}.{number}"


def spark_output_key(source: str | int, batch: int) -> str:
    """The key of the ``batch``-th output batch of a Spark task (``source``: its rank, or an
    elastic agent's name) under :data:`SPARK_OUTPUT_SCOPE`."""
    return f"{source}.{batch}"


def round_scope(round_number: int) -> str:
    """The rendezvous scope a round's members meet under (its store address, its abandon key)."""
    return f"elastic.{round_number}"
