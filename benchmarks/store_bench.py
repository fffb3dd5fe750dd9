"""Cost of the authenticated store: start-up and elastic re-formation against another checkout.

Runs, interleaved (A, B, B, A, A, B ...) so that the machine's load hits both alike:

* ``startup``: ``horovodrun --gloo -np 2 python -c 'hvd.init(); hvd.shutdown()'``: the command's
  wall time and ``hvd.init()`` (transport, store, topology, engine) of the last rank to arrive
  (the cost itself) and of the first (which also waits for the other's process start).
* ``reform``: ``benchmarks/elastic_bench.py``'s ``recovery`` scenario of each checkout
  (``-np 3 --min-np 2``, a worker SIGKILLs itself at step 20): from its death to the survivors'
  first step in the re-formed round (the new round's store is opened and joined in between).

* ``formation`` (no baseline needed): in two long-lived processes, rank 0 opens a store, rank 1
  connects, both build a ``ProcessGroupGloo`` on it and run one allreduce; the time on rank 0 from
  opening the store to the allreduce's end, Horovod's authenticated store against torch's
  ``TCPStore``, alternating, many times (no process start or import in the figure).

``--baseline`` is a checkout of the version to compare with, e.g. the commit before the
authenticated store::

    mkdir /tmp/base && git archive 425b2ee | tar -x -C /tmp/base
    python benchmarks/store_bench.py --baseline /tmp/base --repeats 5
    python benchmarks/store_bench.py --only formation --repeats 40
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

INIT = ("import time; t0 = time.perf_counter(); import horovod.torch as hvd; t1 = time.perf_counter(); "
        "hvd.init(); t2 = time.perf_counter(); print('INIT', hvd.rank(), t2 - t1, flush=True); hvd.shutdown()")

REFORM = ("import json, sys, tempfile; sys.path.insert(0, sys.argv[1] + '/benchmarks'); import elastic_bench; "
          "print('REFORM ' + json.dumps(elastic_bench.recovery(tempfile.mkdtemp())), flush=True)")


def _env(tree: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    env["PYTHONPATH"] = tree
    return env


def startup(tree: str) -> dict[str, float]:
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "horovod.runner", "--gloo", "-np", "2", sys.executable, "-c", INIT],
                         env=_env(tree), capture_output=True, text=True, timeout=300, cwd=tree)
    wall = time.perf_counter() - t0
    inits = [float(x) for x in re.findall(r"INIT \d ([\d.e-]+)", res.stdout)]
    if res.returncode != 0 or len(inits) != 2:
        raise SystemExit(f"startup run in {tree} failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    # The last rank to arrive waits for nobody: its init() is the cost; the first one's includes
    # the other's later process start (skew), which dominates on a loaded machine.
    return {"wall_s": wall, "init_last_rank_s": min(inits), "init_first_rank_s": max(inits)}


def reform(tree: str) -> dict[str, float]:
    res = subprocess.run([sys.executable, "-c", REFORM, tree], env=_env(tree), capture_output=True, text=True,
                         timeout=600, cwd=tree)
    m = re.search(r"REFORM (\{.*\})", res.stdout)
    if res.returncode != 0 or m is None:
        raise SystemExit(f"reform run in {tree} failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    return {"reform_s": float(json.loads(m.group(1))["death_to_first_step_s"])}


def _formation_rank(rank: int, conn, repeats: int, out) -> None:  # noqa: ANN001
    import datetime

    import torch
    import torch.distributed as dist

    from horovod.common.backends import authstore

    key = authstore.derive_key("ab" * 32)
    timeout = datetime.timedelta(seconds=60)
    times: dict[str, list[float]] = {"authenticated": [], "tcpstore": []}
    for i in range(2 * repeats):
        kind = "authenticated" if i % 2 == 0 else "tcpstore"
        t0 = time.perf_counter()
        if rank == 0:
            if kind == "authenticated":
                store = authstore.open_store("127.0.0.1", key, 60)
                port = store.server.port
            else:
                store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timeout, wait_for_workers=False)
                port = store.port
            conn.send(port)
        else:
            port = conn.recv()
            store = (authstore.connect_store("127.0.0.1", port, key, 60) if kind == "authenticated"
                     else dist.TCPStore("127.0.0.1", port, 2, False, timeout=timeout))
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        pg = dist.ProcessGroupGloo(dist.PrefixStore(f"r{i}", store), rank, 2, opts)
        pg.allreduce([torch.ones(4)]).wait()
        times[kind].append(time.perf_counter() - t0)
        conn.send("done")
        conn.recv()  # both finished this repetition before either tears down
        pg.shutdown()
        if kind == "authenticated":
            store.close()
        del pg, store
    if rank == 0:
        out.put(times)


def formation(repeats: int) -> dict[str, float]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    q = ctx.Queue()
    procs = [ctx.Process(target=_formation_rank, args=(r, c, repeats, q)) for r, c in ((0, a), (1, b))]
    for p in procs:
        p.start()
    times = q.get(timeout=600)
    for p in procs:
        p.join(60)
    return {f"formation_{k}_median_s": statistics.median(v) for k, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", help="checkout to compare with (its PYTHONPATH root)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", choices=["startup", "reform", "formation"])
    ap.add_argument("--json", help="write the figures here as JSON")
    args = ap.parse_args()
    if args.only in (None, "formation"):
        print(json.dumps(formation(max(args.repeats, 20)), indent=2), flush=True)
    if args.only == "formation" or args.baseline is None:
        return 0
    trees = {"authenticated": REPO, "baseline": os.path.abspath(args.baseline)}
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    for i in range(args.repeats):
        # alternate which goes first, so that neither always runs right after the other's load
        for name, tree in (list(trees.items()) if i % 2 == 0 else list(trees.items())[::-1]):
            figures: dict[str, float] = {}
            if args.only in (None, "startup"):
                figures.update(startup(tree))
            if args.only in (None, "reform"):
                figures.update(reform(tree))
            for k, v in figures.items():
                samples[name].setdefault(k, []).append(v)
            print(name, {k: round(v, 3) for k, v in figures.items()}, flush=True)
    out = {name: {k: {"median": statistics.median(v), "samples": v} for k, v in s.items()}
           for name, s in samples.items()}
    out["delta_median_s"] = {k: out["authenticated"][k]["median"] - out["baseline"][k]["median"]
                             for k in out["authenticated"]}
    print(json.dumps(out["delta_median_s"], indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
