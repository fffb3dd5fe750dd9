"""Install the oldest and newest supported release of each framework into fresh virtual environments
and run the smoke tier in each; print the compatibility table (docs/compatibility.md quotes it).

For each framework and each end of its supported range the script:

1. creates a virtual environment (under ``--root``, a temporary directory by default) and installs the
   framework release alone, as a user's environment would already hold it;
2. asks pip what installing this package's extra would change (``pip install --dry-run ".[EXTRA]"``)
   and fails the row if it would replace that release;
3. installs ``".[EXTRA]"`` and checks the framework's version is still the one installed in step 1;
4. runs ``horovodrun -np 2 python scripts/_compat_smoke.py FRAMEWORK`` (a collective, a broadcast
   from rank 0, one ``DistributedOptimizer`` step, values checked on every rank);
5. removes the environment (``--keep`` keeps it).

::

    python scripts/compat_matrix.py                          # every framework, oldest and newest
    python scripts/compat_matrix.py --framework torch        # one framework
    python scripts/compat_matrix.py --framework torch --ends newest --out results.md

Frameworks are large (PyTorch's CUDA builds take several GB in each environment): run one framework
at a time on a small disk.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "scripts" / "_compat_smoke.py"

# framework -> (extra, {end: the releases a user's environment already holds}, the distribution to check)
MATRIX: dict[str, tuple[str, dict[str, list[str]], str]] = {
    "torch": ("torch", {"oldest": ["torch==2.9.1"], "newest": ["torch==2.14.1"]}, "torch"),
    "tensorflow": ("tensorflow", {"oldest": ["tensorflow==2.16.2"], "newest": ["tensorflow==2.21.0"]},
                   "tensorflow"),
    "jax": ("jax", {"oldest": ["jax[cpu]==0.4.38", "optax==0.2.4"], "newest": ["jax[cpu]==0.10.2"]}, "jax"),
    "lightning": ("lightning", {"oldest": ["torch==2.9.1", "lightning==2.6.0"],
                                "newest": ["torch==2.14.1", "lightning==2.6.6"]}, "lightning"),
}


@dataclass
class Row:
    framework: str
    end: str
    requested: str
    kept: str = ""
    smoke: str = ""
    seconds: float = 0.0

    def markdown(self) -> str:
        return (f"| {self.framework} | {self.end} | `{self.requested}` | {self.kept} | {self.smoke} "
                f"| {self.seconds:.0f} s |")


def _run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 3600) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)


def _version(python: Path, dist: str) -> str:
    out = _run([str(python), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"])
    return out.stdout.strip() if out.returncode == 0 else "not installed"


def check(framework: str, end: str, root: Path, keep: bool) -> Row:
    extra, ends, dist = MATRIX[framework]
    row = Row(framework, end, " ".join(ends[end]))
    started = time.monotonic()
    venv = root / f"{framework}-{end}"
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        python, pip = venv / "bin" / "python", [str(venv / "bin" / "python"), "-m", "pip"]
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PATH=f"{venv / 'bin'}:{env.get('PATH', '')}",
                   OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        out = _run([*pip, "install", *ends[end]], env=env)
        if out.returncode != 0:
            row.kept, row.smoke = "install failed", out.stderr.strip().splitlines()[-1][:160]
            return row
        before = _version(python, dist)
        dry = _run([*pip, "install", "--dry-run", f"{REPO}[{extra}]"], env=env)
        would = next((ln for ln in dry.stdout.splitlines() if ln.startswith("Would install")), "")
        replaced = re.search(rf"(?<![\w-]){re.escape(dist)}-\d", would)
        out = _run([*pip, "install", f"{REPO}[{extra}]"], env=env)
        after = _version(python, dist)
        if out.returncode != 0:
            row.kept, row.smoke = "extra failed to install", out.stderr.strip().splitlines()[-1][:160]
            return row
        row.kept = (f"yes ({dist} {after})" if after == before and not replaced
                    else f"NO: {dist} {before} -> {after}")
        smoke = _run([str(venv / "bin" / "horovodrun"), "-np", "2", str(python), str(SMOKE), framework],
                     env=env, timeout=900)
        oks = [ln for ln in smoke.stdout.splitlines() if "SMOKE OK" in ln]
        if smoke.returncode == 0 and len(oks) == 2:
            version = oks[0].split("version=", 1)[-1]
            row.smoke = f"passed (np=2; {version})"
        else:
            tail = (smoke.stdout + smoke.stderr).strip().splitlines()[-3:]
            row.smoke = f"FAILED rc={smoke.returncode}: " + " / ".join(tail)[:300]
        return row
    finally:
        row.seconds = time.monotonic() - started
        if not keep:
            shutil.rmtree(venv, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--framework", action="append", choices=sorted(MATRIX),
                        help="check this framework (repeatable; default: all)")
    parser.add_argument("--ends", default="oldest,newest", help="oldest, newest or both (default)")
    parser.add_argument("--root", type=Path, help="where the environments go (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the environments")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    root = args.root or Path(tempfile.mkdtemp(prefix="horovod-compat-"))
    root.mkdir(parents=True, exist_ok=True)
    rows = [check(fw, end, root, args.keep) for fw in (args.framework or sorted(MATRIX))
            for end in args.ends.split(",")]
    table = [f"Run {datetime.date.today()} on {platform.machine()}, Python {platform.python_version()}, "
             f"{os.cpu_count()} cores.", "",
             "| framework | end | installed first | extra kept it | smoke tier | time |",
             "|---|---|---|---|---|---|", *(r.markdown() for r in rows)]
    print("\n".join(table))
    if args.out:
        args.out.write_text("\n".join(table) + "\n")
    if not args.root and not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if all(r.smoke.startswith("passed") and r.kept.startswith("yes") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
