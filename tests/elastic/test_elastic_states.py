"""Framework states of elastic training in one process (a job of one): what commit, restore and
sync keep, for PyTorch and Keras."""

from __future__ import annotations

import numpy as np
import pytest


def test_torch_restore_twice_gives_the_committed_state() -> None:
    # torch's Optimizer.load_state_dict keeps the tensors it is given: restoring the saved copy
    # itself would let the next steps overwrite the commit, and a second restore would not undo.
    import torch

    import horovod.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step() -> None:
        opt.zero_grad()
        model(torch.ones(4, 3)).pow(2).sum().backward()
        opt.step()

    step()
    state = hvd.elastic.TorchState(model, opt, epoch=1)
    state.commit()
    want_w = [p.detach().clone() for p in model.parameters()]
    want_m = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    for _ in range(2):
        step()
        step()
        state.epoch = 7
        state.restore()
        assert state.epoch == 1
        for p, w, m in zip(model.parameters(), want_w, want_m):
            assert torch.equal(p.detach(), w)
            assert torch.equal(opt.state[p]["momentum_buffer"], m)


def test_torch_commit_reuses_its_buffers() -> None:
    import torch

    import horovod.torch as hvd

    hvd.init()
    model = torch.nn.Linear(3, 2)
    state = hvd.elastic.TorchState(model)
    handler = state._handlers["model"]
    before = {k: v.data_ptr() for k, v in handler._saved.items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    state.commit()
    assert {k: v.data_ptr() for k, v in handler._saved.items()} == before
    assert torch.equal(handler._saved["weight"], model.weight.detach())


def test_elastic_sampler_repartitions_the_rest_of_the_epoch() -> None:
    import horovod.torch as hvd

    hvd.init()
    sampler = hvd.elastic.ElasticSampler(list(range(10)), shuffle=False)
    state = hvd.elastic.TorchState(sampler=sampler)
    assert list(sampler) == list(range(10))
    sampler.record_batch(0, 4)
    state.commit()
    sampler.record_batch(1, 4)
    state.restore()
    assert sampler.processed_num == 4 and list(sampler) == [4, 5, 6, 7, 8, 9]
    sampler.set_epoch(1)
    assert len(sampler) == 10


def test_keras_state_restores_and_builds_a_fresh_optimizer_on_sync() -> None:
    # Upstream #2652: a new worker's optimizer has no slot variables before its first step.
    import keras

    import horovod.tensorflow.keras as hvd

    hvd.init()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    opt = keras.optimizers.Adam(0.01)
    assert len(opt.variables) == 2  # iteration and learning rate only
    state = hvd.elastic.KerasState(model, opt, batch=3)
    state.sync()
    assert len(opt.variables) == 2 + 2 * len(model.trainable_variables)
    saved = [w.copy() for w in model.get_weights()]
    model.set_weights([w + 1 for w in saved])
    state.batch = 9
    state.restore()
    assert state.batch == 3
    for got, want in zip(model.get_weights(), saved):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="built"):
        hvd.elastic.KerasState(keras.Sequential([keras.layers.Dense(2)]))


def test_keras_callbacks_commit_an_epochs_last_batch_as_the_next_epochs_start() -> None:
    # A reset whose last commit was an epoch's last batch (CommitStateCallback commits at batch
    # end, before on_epoch_end) must resume at the next epoch: committed as (epoch e, every batch
    # done), the resumed fit ran one more batch of epoch e (a flake of the Keras elastic test:
    # 25 optimizer steps instead of 24). Keras's calls are played by hand, without Keras.
    from horovod._keras.elastic import (
        CommitStateCallbackImpl,
        UpdateBatchStateCallbackImpl,
        UpdateEpochStateCallbackImpl,
    )

    class State:
        def __init__(self) -> None:
            self.batch, self.epoch, self.commits = 0, 0, []

        def commit(self) -> None:
            self.commits.append((self.epoch, self.batch))

    class Model:
        stop_training = False

    spe, epochs = 6, 3

    def fit(state: State, interrupt_after: int | None = None) -> int:
        """Run ``model.fit(epochs=epochs - state.epoch, steps_per_epoch=spe)``'s callback calls;
        stop (a reset) right after the commit of global batch ``interrupt_after``. Returns the
        batches run."""
        cbs = [UpdateBatchStateCallbackImpl(None, state), UpdateEpochStateCallbackImpl(None, state),
               CommitStateCallbackImpl(None, state)]
        model = Model()

        def call(name: str, *args: int) -> None:  # keras.callbacks.Callback's methods do nothing
            for cb in cbs:
                getattr(cb, name, lambda *_: None)(*args)

        for cb in cbs:
            cb.params, cb.model = {"steps": spe}, model
        call("on_train_begin")
        ran = 0
        for epoch in range(epochs - state.epoch):
            call("on_epoch_begin", epoch)
            for batch in range(spe):
                ran += 1
                call("on_batch_end", batch)
                if interrupt_after is not None and ran == interrupt_after:
                    return ran
                if model.stop_training:
                    break
            call("on_epoch_end", epoch)
        return ran

    for cut in range(1, spe * epochs):
        state = State()
        first = fit(state, interrupt_after=cut)
        state.epoch, state.batch = state.commits[-1]  # the reset restores the last commit
        rest = fit(state)
        assert first + rest == spe * epochs, (cut, state.commits[-1], first, rest)
        assert (state.epoch, state.batch) == (epochs, 0)
