"""``horovod.common.util``: upstream's helpers with upstream's behaviour (scripts import them)."""

from __future__ import annotations

import os

import pytest

from horovod.common import util


def test_env_sets_and_restores_and_ignores_none() -> None:
    os.environ["HVD_UTIL_KEPT"] = "old"
    os.environ.pop("HVD_UTIL_NEW", None)
    with util.env(HVD_UTIL_KEPT="new", HVD_UTIL_NEW="1", HVD_UTIL_NONE=None):
        assert (os.environ["HVD_UTIL_KEPT"], os.environ["HVD_UTIL_NEW"]) == ("new", "1")
        assert "HVD_UTIL_NONE" not in os.environ
    assert os.environ.pop("HVD_UTIL_KEPT") == "old" and "HVD_UTIL_NEW" not in os.environ
    with pytest.raises(KeyError), util.env(HVD_UTIL_NEW="2"):
        raise KeyError("restored on error too")
    assert "HVD_UTIL_NEW" not in os.environ


def test_split_list_power_of_two_iterable() -> None:
    assert util.split_list(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert util.split_list([1, 2], 4) == [[1], [2], [], []]
    assert [n for n in range(20) if util.num_rank_is_power_2(n)] == [1, 2, 4, 8, 16]
    assert util.is_iterable([]) and util.is_iterable("ab") and not util.is_iterable(3)


def test_version_comparison() -> None:
    assert util.is_version_greater_equal_than("2.13.0", "2.4.0")
    assert not util.is_version_greater_equal_than("1.15.2", "2.0.0")
    with pytest.raises(ValueError, match="major.minor.patch"):
        util.is_version_greater_equal_than("2.1.0", "2.1")
    with pytest.raises(ValueError, match="two strings"):
        util.is_version_greater_equal_than(2, "2.1.0")


def test_average_backwards_compatibility() -> None:
    class Ops:
        Average, Sum, Adasum = "avg", "sum", "adasum"

    pick = util.get_average_backwards_compatibility_fun(Ops)
    assert pick(None, None) == "avg" and pick("adasum", None) == "adasum"
    with pytest.warns(DeprecationWarning, match="replaced with `op`"):
        assert pick(None, False) == "sum"
    with pytest.raises(ValueError, match="supersedes average"):
        pick("sum", True)


def test_the_average_rule_is_one_and_its_warning_names_the_users_line() -> None:
    """upstream's helper and the bindings' ``resolve_op`` share one rule; each warning points at the
    line that called the collective (two frames above the rule's caller), not into Horovod."""
    import inspect
    import warnings

    from horovod.common.collectives import resolve_op
    from horovod.common.types import ReduceOp

    class Ops:
        Average, Sum = "avg", "sum"

    pick = util.get_average_backwards_compatibility_fun(Ops)

    def upstream_style_allreduce(average: bool) -> str:
        return pick(None, average)

    def binding_allreduce(average: bool) -> ReduceOp:
        return resolve_op(average, None)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno  # type: ignore[union-attr]
        assert upstream_style_allreduce(False) == "sum"
        assert binding_allreduce(True) is ReduceOp.AVERAGE and binding_allreduce(False) is ReduceOp.SUM
    assert [(w.category, w.filename, w.lineno) for w in seen] == [
        (DeprecationWarning, __file__, line + 1)] + [(DeprecationWarning, __file__, line + 2)] * 2, seen
    with pytest.raises(ValueError, match="supersedes average"):
        resolve_op(True, ReduceOp.SUM)
    assert resolve_op(None, None, ReduceOp.SUM) is ReduceOp.SUM


def test_build_probes_answer_from_what_is_installed() -> None:
    import torch

    assert util.gloo_built() and util.mpi_built()
    assert util.nccl_built() == 0 or torch.cuda.is_available()
    assert util.gpu_available("torch") == torch.cuda.is_available()
    assert util.extension_available("torch") and util.extension_available("horovod.tensorflow")
    assert not util.extension_available("mxnet")
    assert not util.ddl_built() and not util.ccl_built()
    util.check_extension("horovod.torch", "HOROVOD_WITH_PYTORCH", "/x/__init__.py", "mpi_lib_v2")
    with pytest.raises(ImportError, match="PyTorch, TensorFlow and Keras only"):
        util.check_extension("horovod.mxnet", "HOROVOD_WITH_MXNET", "/x/__init__.py", "mpi_lib")
    assert util.get_extension_full_path("/p/torch/__init__.py", "mpi_lib_v2").startswith("/p/torch/mpi_lib_v2.")
    util.check_installed_version("torch", "0.0.1")  # nothing compiled, nothing to mismatch


def test_missing_upstream_internal_names_itself() -> None:
    with pytest.raises(ImportError, match="_check_extension_lambda is an internal of upstream"):
        from horovod.common.util import _check_extension_lambda  # noqa: F401
    with pytest.raises(ImportError, match="no_such_helper"):
        from horovod.common.util import no_such_helper  # noqa: F401
