"""Worker of ``horovod.run()``: fetch the function from the launcher, run it, send back the result.

Started as ``python -m horovod.runner.run_task`` on every rank. The function, its arguments and
the results travel through the launcher's authenticated rendezvous service
(``HOROVOD_RUNNER_ADDR``/``HOROVOD_RUNNER_PORT`` and ``HOROVOD_SECRET_KEY``); the result is a
pickled ``protocol.Returned`` or ``protocol.Raised`` (a ``sys.exit(0)``, as an elastic worker the
job went on without, stores none; another exit code ends the process with it).
"""

from __future__ import annotations

import os
import sys
import traceback

from horovod.common.protocol import FUNC_KEY, FUNC_SCOPE, RESULT_KEY_ENV, RESULT_SCOPE, env_rank

__all__ = ["FUNC_SCOPE", "RESULT_SCOPE", "RESULT_KEY_ENV", "main"]


def _rank() -> int:
    return int(env_rank() or 0)


def main() -> int:
    import cloudpickle

    from horovod.common import protocol
    from horovod.common.protocol import Raised, Returned
    from horovod.runner.rendezvous import RendezvousClient

    client = RendezvousClient(os.environ[protocol.RUNNER_ADDR_ENV], int(os.environ[protocol.RUNNER_PORT_ENV]),
                              os.environ[protocol.SECRET_ENV])
    # The key the result is stored under: the rank, or a name the launcher chose (an elastic
    # worker of horovod.spark.run_elastic changes rank between rounds; its slot name does not).
    key = os.environ.get(RESULT_KEY_ENV) or str(_rank())
    call = protocol.function_call(cloudpickle.loads(client.wait(FUNC_SCOPE, FUNC_KEY, timeout=60)),
                                  f"the worker of rank {_rank()}")
    try:
        value = call()
        payload = cloudpickle.dumps(Returned(value))
    except SystemExit as exc:
        if exc.code in (0, None):
            return 0  # an elastic worker the job went on without: no result
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
        tb = traceback.format_exc()
        print(f"User function raise error: {exc!r}\n{tb}", file=sys.stderr, flush=True)
        try:
            payload = cloudpickle.dumps(Raised(exc, tb))
        except Exception:  # noqa: BLE001 - an exception that cannot be pickled goes as text
            payload = cloudpickle.dumps(Raised(RuntimeError(repr(exc)), tb))
        client.put(RESULT_SCOPE, key, payload)
        return 1
    client.put(RESULT_SCOPE, key, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
