#!/usr/bin/env python3
"""Uninstall what another PyTorch left behind: its GPU companions that nothing installed needs.

PyPI's CUDA builds of PyTorch bring ``triton`` and the CUDA libraries as wheels (``nvidia-*``,
``cuda-toolkit``, ``cuda-bindings``, ...). When pip replaces such a build by another torch (the
test command's ``-c constraints/ci.txt`` takes the pinned CPU build after the README's main
command installed the newest CUDA one), it uninstalls torch alone: the companions stay, required
by nothing. They are not harmless: PyTorch imports ``triton`` whenever it finds one
(``torch._dynamo``, ``torch._inductor``), and a ``triton`` built for another PyTorch crashes the
process (a segmentation fault in the test suite). The test command runs this script after its
install::

    pip install -e ".[test,docs]" -c constraints/ci.txt && python scripts/prune_torch_leftovers.py && ...

A distribution is removed only when all of these hold, so a working GPU environment (a CUDA
PyTorch with its ``triton``, TensorFlow's or JAX's CUDA wheels, a ``triton`` the user installed
by name) is left as it is:

- its name is one of PyTorch's GPU companions: ``triton``, ``pytorch-triton*``, ``cuda-toolkit``,
  ``cuda-bindings``, ``cuda-pathfinder`` and NVIDIA's CUDA library wheels (``nvidia-cublas*``,
  ``nvidia-cuda-*``, ``nvidia-cudnn*``, ... ``nvidia-nvtx*``; not ``nvidia-ml-py`` and the like);
- pip installed it (its ``INSTALLER`` says ``pip``) as a dependency, not by name (no
  ``REQUESTED`` marker: pip writes one for the requirements a user names);
- no installed distribution that stays requires it, whatever the requirement's environment
  marker or extra (a requirement under any marker keeps it: never too few kept).

Standard library only (it runs before anything else is known to work). ``--dry-run`` lists what
would go; ``--path DIR`` looks at another ``site-packages`` (listing only). Exit status: 0 when
nothing is left to remove (or with ``--dry-run``), pip's own status when its uninstall fails.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["Dist", "COMPANIONS", "is_companion", "installed", "leftovers", "main"]

# PyTorch's GPU companions on PyPI (torch's Requires-Dist on Linux, and theirs).
COMPANIONS = re.compile(r"^(triton|pytorch-triton(-.+)?|cuda-toolkit|cuda-bindings|cuda-pathfinder"
                        r"|nvidia-(cublas|cuda|cudnn|cufft|cufile|curand|cusolver|cusparse|cusparselt|nccl|nvjitlink"
                        r"|nvshmem|nvtx|nvvm)(-.+)?)$")

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def canonical(name: str) -> str:
    """PEP 503's normalized name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def is_companion(name: str) -> bool:
    return COMPANIONS.match(canonical(name)) is not None


@dataclass(frozen=True)
class Dist:
    """What the pruning needs of an installed distribution."""

    name: str  # canonical
    version: str
    requires: frozenset[str] = field(default_factory=frozenset)  # canonical names, any marker
    installer: str = ""
    requested: bool = False


def _requirement_names(lines: Iterable[str] | None) -> frozenset[str]:
    out = set()
    for line in lines or ():
        m = _NAME.match(line)
        if m:
            out.add(canonical(m.group(1)))
    return frozenset(out)


def installed(path: list[str] | None = None) -> list[Dist]:
    """The distributions installed on ``path`` (default: this interpreter's ``sys.path``)."""
    dists: dict[str, Dist] = {}
    for d in md.distributions(path=path) if path is not None else md.distributions():
        name = d.metadata["Name"]
        if not name:
            continue
        key = canonical(name)
        if key in dists:  # shadowed by an earlier entry of the path, as import would see it
            continue
        dists[key] = Dist(name=key, version=d.version, requires=_requirement_names(d.requires),
                          installer=(d.read_text("INSTALLER") or "").strip(),
                          requested=d.read_text("REQUESTED") is not None)
    return list(dists.values())


def leftovers(dists: Iterable[Dist]) -> list[Dist]:
    """The companions that nothing kept requires (the greatest such set: companions that only
    require each other, as the CUDA wheels do, all go), in name order."""
    dists = list(dists)
    removable = {d.name for d in dists
                 if is_companion(d.name) and d.installer == "pip" and not d.requested}
    while True:
        held = set().union(*(d.requires for d in dists if d.name not in removable))
        kept = removable & held
        if not kept:
            break
        removable -= kept
    return sorted((d for d in dists if d.name in removable), key=lambda d: d.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    parser.add_argument("--path", action="append", help="a site-packages folder to look at (implies --dry-run)")
    args = parser.parse_args(argv)
    found = leftovers(installed(args.path))
    if not found:
        print("prune_torch_leftovers: no GPU companion of another PyTorch is left", flush=True)
        return 0
    names = [f"{d.name}=={d.version}" for d in found]
    print("prune_torch_leftovers: installed as dependencies and required by nothing installed now "
          f"(left by another PyTorch): {' '.join(names)}", flush=True)
    if args.dry_run or args.path:
        return 0
    return subprocess.call([sys.executable, "-m", "pip", "uninstall", "-y", *[d.name for d in found]])


if __name__ == "__main__":
    sys.exit(main())
