"""Elastic training worker for the tests: a deterministic model whose final weights show a lost or
doubled step, and an optimizer that stopped averaging.

Every rank feeds its own batch (a function of the step and its rank), so the weights depend on
the averaging: the state records the world size each committed step was trained at
(``state.sizes``), and the weights after N steps equal those of ``reference(sizes)`` in one process,
which averages the gradients of ranks 0..size-1 itself.

Environment:
  STEPS           steps to train (default 30)
  STEP_SLEEP      seconds per step (default 0.1)
  KILL / RAISE    "<host>[<slot>]@<step>": that worker SIGKILLs itself / raises at that step
                  ("*@<step>": every worker; several specs separated by commas)
  KILL_AT         "<host>[<slot>]@<point>@<n>": that worker SIGKILLs itself (SIGSTOPs itself for
                  point "hang") at a chosen point of the elastic protocol:
                    step@<n>    in training, before step n
                    commit@<n>  inside the commit of step n (state saved, host check not made)
                    sync@<n>    at its n-th state sync (the first is at the start, before
                                training; the others after each reset), before it
                    join@<n>    when the driver has placed it in round n, before it connects
                    notice@<n>  when the n-th host notice reaches it
                    hang@<n>    stops (SIGSTOP) before step n instead of dying (once per job:
                                a worker started later on that slot goes on)
                  It prints "KILLING <point> pid <pid>" first (the test times the recovery from
                  there) and leaves the file HOSTS_FILE.killed (WAIT_FOR_KILL).
  BUSY            "<host>[<slot>]@<step>@<seconds>": that worker computes in pure Python for that
                  long before that step (its main thread never waits)
  HOSTS_FILE, HOSTS_AT   JSON {"<step>": "<file content>"}: rank 0 writes the discovery file
                  when it first reaches that step
  WAIT_FOR_SIZE   "<n>@<step>[,<n>@<step>...]": the workers wait at that step (at most 90 s)
                  until the job has n workers
  WAIT_FOR_KILL   "<step>": the workers wait at that step (at most 90 s, before WAIT_FOR_SIZE's
                  wait) until the KILL_AT worker has reached its point: a kill that waits for
                  the driver (a host notice, a new worker's sync) happens however fast the
                  others train
  BLOCK_AT        "<step>@<dir>": every worker, before that step, prints "READY <me> rank <r>"
                  and blocks in ``blocked_until_released`` until it reads the end of the FIFO
                  <dir>/<me> (<me>: "<host>[<slot>]"; the test makes the FIFOs and writes them
                  to release the workers)
  ZERO            "1": a ZeroRedundancyOptimizer (stage 1) instead of DistributedOptimizer
  FULLY_SHARD     "1": the model fully sharded (hvd.fully_shard on both Linear layers, then the
                  model) and a plain SGD over its shards instead of DistributedOptimizer
  HIDDEN          the hidden layer's width (default 3; read by ``reference`` too)
  REPLICAS        TorchState's replicas= (default: its default, "buddy")
  CHECK_RESTORE   "1" (with ZERO or FULLY_SHARD): after every commit print "COMMITTED {json}", the
                  whole committed weights and momentum (gathered), and at every start of the
                  training function (after each sync) "RESTORED {json}", the same of the state
                  it starts from
Prints "COMMIT {json}" after every commit and "FINAL {json}" at the end.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch

import horovod.torch as hvd


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    hidden = int(os.environ.get("HIDDEN", "3"))
    model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
    # A parameter the forward pass never uses: the optimizer of a trained worker has no state for
    # it, while a fresh optimizer initialised by a zero-gradient step would (upstream #2652's
    # shape: a new worker waiting in broadcasts the others never make).
    model.unused = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 4, generator=g) + rank  # each rank's data differs (also in its mean)
    return x, x.sum(dim=1, keepdim=True) * 0.5


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    x, y = batch(step, rank)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def reference(sizes: list[int]) -> list[list[float]]:
    """The weights after one step per entry of ``sizes`` in one process: step ``s`` averages the
    gradients of ranks ``0..sizes[s]-1`` on their batches (summed in rank order, then divided)."""
    model, opt = make_model()
    params = list(model.parameters())
    for step, n in enumerate(sizes):
        total = [torch.zeros_like(p) for p in params]
        for rank in range(n):
            x, y = batch(step, rank)
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            for t, p in zip(total, params):
                if p.grad is not None:
                    t += p.grad
        for t, p in zip(total, params):
            p.grad = t / n if p.grad is not None else None
        opt.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def _matches(spec: str, me: str, step: int) -> bool:
    for one in filter(None, spec.split(",")):
        who, _, at = one.rpartition("@")
        if who in ("*", me) and int(at) == step:
            return True
    return False


def whole_state(model: torch.nn.Module, opt: torch.optim.Optimizer, fully: bool) -> tuple[list, list]:
    """The whole weights and momentum, gathered from the shards (collective)."""
    if fully:
        from horovod.torch.fully_shard import full_optim_state_dict

        whole = model.full_state_dict()
        weights = [whole[n].flatten().tolist() for n, _ in model.named_parameters()]
        full = full_optim_state_dict(model, opt)["state"]
    else:
        weights = [p.detach().flatten().tolist() for p in model.parameters()]
        full = opt.full_state_dict(None)["state"]
    return weights, [full[i]["momentum_buffer"].flatten().tolist() for i in sorted(full)]


def _kill_at(me: str, point: str, n: int) -> None:
    spec = os.environ.get("KILL_AT", "")
    if not spec:
        return
    who, p, at = spec.split("@")
    if who == me and p == point and int(at) == n:
        if point == "hang" and os.environ.get("HOSTS_FILE"):  # once per job: not its replacement
            marker = os.environ["HOSTS_FILE"] + ".hung"
            if os.path.exists(marker):
                return
            open(marker, "w").close()
        if os.environ.get("HOSTS_FILE"):
            open(os.environ["HOSTS_FILE"] + ".killed", "w").close()
        print(f"KILLING {point} pid {os.getpid()}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP if point == "hang" else signal.SIGKILL)


def _busy(me: str, step: int) -> None:
    spec = os.environ.get("BUSY", "")
    if not spec:
        return
    who, at, seconds = spec.split("@")
    if who == me and int(at) == step:
        print(f"BUSY from step {step} for {seconds} s pid {os.getpid()}", flush=True)
        end = time.monotonic() + float(seconds)
        n = 0
        while time.monotonic() < end:
            n = (n * 31 + 7) % 1000003  # pure Python: holds the GIL between switches
        print(f"BUSY done ({n})", flush=True)


def blocked_until_released(me: str, step: int) -> None:
    """BLOCK_AT: wait here (a frame the test looks for in the stacks on demand) until released."""
    spec = os.environ.get("BLOCK_AT", "")
    if not spec:
        return
    at, _, where = spec.partition("@")
    if int(at) != step:
        return
    print(f"READY {me} rank {hvd.rank()}", flush=True)
    with open(os.path.join(where, me), "rb") as fifo:
        fifo.read()  # until the test's writer closes it


def _install_protocol_hooks(me: str) -> None:
    """KILL_AT's join and notice points: wrap the elastic worker's calls (the test's hook)."""
    from horovod.common.elastic import worker as elastic_worker

    join_round = elastic_worker.join_round

    def joining(*args, **kwargs):  # type: ignore[no-untyped-def]
        info = join_round(*args, **kwargs)
        _kill_at(me, "join", info.round)
        return info

    elastic_worker.join_round = joining  # type: ignore[assignment]
    handle_notice = elastic_worker.notification_manager.handle_notice
    seen = [0]

    def noticed(version: int, update: int) -> None:
        seen[0] += 1
        _kill_at(me, "notice", seen[0])
        handle_notice(version, update)

    elastic_worker.notification_manager.handle_notice = noticed  # type: ignore[method-assign]


def main() -> None:
    steps = int(os.environ.get("STEPS", "30"))
    pause = float(os.environ.get("STEP_SLEEP", "0.1"))
    me = f"{os.environ['HOROVOD_ELASTIC_HOST']}[{os.environ['HOROVOD_ELASTIC_SLOT']}]"
    hosts_at = json.loads(os.environ.get("HOSTS_AT", "{}"))
    wait_for = os.environ.get("WAIT_FOR_SIZE", "")
    wait_kill = int(os.environ.get("WAIT_FOR_KILL", "-1"))
    killed = os.environ.get("HOSTS_FILE", "") + ".killed"
    syncs = [0]
    _install_protocol_hooks(me)

    hvd.init()
    model, opt = make_model()
    zero = os.environ.get("ZERO") == "1"
    fully = os.environ.get("FULLY_SHARD") == "1"
    if fully:
        hvd.fully_shard(model[0])
        hvd.fully_shard(model[2])
        hvd.fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    elif zero:
        opt = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, stage=1, lr=0.05,
                                          momentum=0.9, named_parameters=model.named_parameters())
    else:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())

    def on_reset() -> None:
        print(f"RESET {json.dumps({'me': me, 'rank': hvd.rank(), 'size': hvd.size()})}",
              flush=True)

    check_restore = os.environ.get("CHECK_RESTORE") == "1" and (fully or zero)

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        if check_restore:
            w, m = whole_state(model, opt, fully)
            restored = {'me': me, 'rank': hvd.rank(), 'size': hvd.size(), 'step': state.step,
                        'w': w, 'momentum': m}
            print(f"RESTORED {json.dumps(restored)}", flush=True)
        while state.step < steps:
            _kill_at(me, "step", state.step)
            _kill_at(me, "hang", state.step)
            _busy(me, state.step)
            blocked_until_released(me, state.step)
            if _matches(os.environ.get("KILL", ""), me, state.step):
                os.kill(os.getpid(), signal.SIGKILL)
            if _matches(os.environ.get("RAISE", ""), me, state.step):
                raise RuntimeError(f"worker {me} raises at step {state.step} (test)")
            content = hosts_at.get(str(state.step))
            marker = f"{os.environ.get('HOSTS_FILE', '')}.done{state.step}"
            if hvd.rank() == 0 and content is not None and not os.path.exists(marker):
                with open(os.environ["HOSTS_FILE"] + ".tmp", "w") as fh:
                    fh.write(content)
                os.replace(os.environ["HOSTS_FILE"] + ".tmp", os.environ["HOSTS_FILE"])
                open(marker, "w").close()
            # Rank 0's view of the kill decides (broadcast): every rank loops the same number of times.
            for _ in range(450 if state.step == wait_kill else 0):
                if hvd.broadcast_object(os.path.exists(killed), 0, name="wait_for_kill"):
                    break
                time.sleep(0.2)
                state.check_host_updates()
            for spec in filter(None, wait_for.split(",")):
                n, _, at = spec.partition("@")
                # Every rank loops the same number of times (check_host_updates is collective).
                for _ in range(450):
                    if state.step != int(at) or hvd.size() == int(n):
                        break
                    time.sleep(0.2)
                    state.check_host_updates()
            state.sizes = state.sizes + [hvd.size()]  # a new list: a reset restores the committed one
            train_step(model, opt, state.step, hvd.rank())
            state.step += 1
            state.commit()
            commit = {'me': me, 'rank': hvd.rank(), 'size': hvd.size(), 'step': state.step,
                      'pid': os.getpid()}
            print(f"COMMIT {json.dumps(commit)}", flush=True)
            if check_restore:
                w, m = whole_state(model, opt, fully)
                print(f"COMMITTED {json.dumps({'me': me, 'step': state.step, 'w': w, 'momentum': m})}",
                      flush=True)
            time.sleep(pause)

    extra = {"replicas": os.environ["REPLICAS"]} if os.environ.get("REPLICAS") else {}
    state = hvd.elastic.TorchState(model, opt, step=0, sizes=[], **extra)
    check_host_updates = state.check_host_updates

    def commit_hook() -> None:  # commit() = save(), then check_host_updates(): die in between
        _kill_at(me, "commit", state.step)
        check_host_updates()

    state.check_host_updates = commit_hook  # type: ignore[method-assign]
    sync = state.sync

    def sync_hook() -> None:
        syncs[0] += 1
        _kill_at(me, "sync", syncs[0])
        sync()

    state.sync = sync_hook  # type: ignore[method-assign]
    state.register_reset_callbacks([on_reset])
    train(state)
    weights = [p.detach().flatten().tolist() for p in model.parameters()]
    if fully or zero:  # the whole model and state, gathered from the rows / shards
        weights, momentum = whole_state(model, opt, fully)
        if fully:
            print(f"SHARDS {json.dumps({'me': me, 'rows': [p.shape[0] for p in model.parameters()]})}",
                  flush=True)
    else:
        momentum = [opt.state[p]["momentum_buffer"].flatten().tolist() for p in model.parameters()
                    if p in opt.state]
    final = {"me": me, "rank": hvd.rank(), "size": hvd.size(), "step": state.step,
             "w": weights, "momentum": momentum,
             "sizes": state.sizes}
    print(f"FINAL {json.dumps(final)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
