"""Entry point of one rank for ``horovod.testing.run_ranks``: ``python -m horovod.testing.worker DIR``."""

from __future__ import annotations

import os
import pickle
import sys
import traceback


def _rank() -> int:
    from horovod.common.protocol import env_rank

    return int(env_rank() or 0)


def main() -> None:
    tmp = sys.argv[1]
    rank = _rank()
    with open(os.path.join(tmp, "fn.pkl"), "rb") as f:
        fn, args = pickle.load(f)
    try:
        result = (True, fn(*args))
        code = 0
    except BaseException:  # report everything, including assertion failures and SystemExit
        result = (False, f"{traceback.format_exc()}")
        code = 1
    with open(os.path.join(tmp, f"result.{rank}.tmp"), "wb") as f:
        try:
            pickle.dump(result, f)
        except Exception:  # noqa: BLE001 - an unpicklable result is reported as text
            pickle.dump((code == 0, repr(result[1])), f)
    os.replace(os.path.join(tmp, f"result.{rank}.tmp"), os.path.join(tmp, f"result.{rank}"))
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)  # let mpirun stop the other ranks now instead of letting them wait for this one
    try:
        import horovod.common.basics as basics

        basics.shutdown()
    except Exception:  # noqa: BLE001
        pass
    _end_without_teardown()


def _end_without_teardown() -> None:
    """Exit 0 now, the result written and Horovod shut down, without the interpreter's teardown.

    Tearing down a process that imported torch or TensorFlow (their modules' objects freed one by
    one, their atexit hooks) takes 0.3-2 s of CPU per rank on a small machine, for nothing a test
    reads: every rank body's outcome is in its result file already. What the launcher and the
    other ranks do need is done first: MPI finalized where mpi4py started it (``mpirun`` counts a
    rank that exits without it as failed), output still buffered in Python or in C's stdio (a
    framework's native logging) flushed."""
    import ctypes

    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library to ask: Python's own buffers are flushed
        pass
    os._exit(0)


if __name__ == "__main__":
    main()
