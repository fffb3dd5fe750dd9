"""Run several example scripts one after the other in this process (one TensorFlow start-up for all).

    python run_recipes.py LABEL SCRIPT [ARGS...] -- LABEL SCRIPT [ARGS...] ...

Each script runs as ``__main__`` with its own ``sys.argv``; its ``RESULT rank=...`` lines are printed
again as ``RESULT LABEL rank=...`` so that the caller tells the recipes apart. A script that raises
is reported (``FAILED LABEL`` and its traceback) and the next one still runs.
"""
import contextlib
import io
import runpy
import sys
import traceback
from collections.abc import Iterator


def _recipes(argv: list[str]) -> Iterator[list[str]]:
    recipe: list[str] = []
    for arg in argv:
        if arg == "--":
            yield recipe
            recipe = []
        else:
            recipe.append(arg)
    if recipe:
        yield recipe


for label, script, *args in _recipes(sys.argv[1:]):
    out = io.StringIO()
    sys.argv = [script, *args]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(script, run_name="__main__")
    except BaseException:  # noqa: BLE001 - reported; the caller's check for this recipe fails
        print(f"FAILED {label}\n{traceback.format_exc()}", flush=True)
    for line in out.getvalue().splitlines():
        print(line.replace("RESULT ", f"RESULT {label} ", 1) if line.startswith("RESULT ") else line,
              flush=True)
