"""The bindings' state between calls lives in the job's ``Context`` (``Context.state``): a
``shutdown()`` and a new ``init()`` start it from nothing, as a rank joining a running job does."""

from __future__ import annotations

import horovod.numpy as hvd
from horovod.common.context import get_context
from horovod.common.job_state import JobState, next_number


def test_numbers_count_per_name_and_start_again_after_init() -> None:
    hvd.shutdown()
    assert next_number("checkpoint.save") == 0  # no job: nothing for ranks to agree on
    hvd.init()
    try:
        assert [next_number("checkpoint.save") for _ in range(3)] == [1, 2, 3]
        assert next_number("fully_shard") == 1  # one count per name
        get_context().state.traced_error = RuntimeError("the last job's")
        hvd.shutdown()
        hvd.init()
        assert next_number("checkpoint.save") == 1
        assert get_context().state.traced_error is None
    finally:
        hvd.shutdown()


def test_a_new_state_is_empty() -> None:
    s = JobState()
    assert (s.join_device, s.traced_error) == (None, None)
    assert s.next_number("x") == 1 and s.next_number("x") == 2 and s.next_number("y") == 1
