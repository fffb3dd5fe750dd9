"""``HVD_TEST_REQUIRE_FAKEHOSTS/SPARK/RAY/FRAMEWORKS=1``: a skipped test of that tier fails, naming the
flag and the reason (``tests/_require.py``); without the flag it stays a skip. A module of a tier's
directory that skips while it is collected fails too. PURE (one pytest subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_TESTS = """
    import pytest

    @pytest.mark.spark
    def test_spark_tier():
        pytest.skip("no java here")

    @pytest.mark.ray
    def test_ray_tier():
        pytest.importorskip("no_such_module_for_the_test")

    def test_fake_hosts(fakehosts_factory):
        pass

    def test_other_tier():
        pytest.skip("not a required tier")
"""

_CONFTEST = """
    import os
    from tests.conftest import pytest_runtest_makereport  # noqa: F401 - the hook under test
    import pytest

    @pytest.fixture
    def fakehosts_factory():
        pytest.skip("not root")
"""


# A module of the Spark directory and one of the frameworks tier's, both skipped at collection.
_MODULE_SKIPS = {"spark/test_spark_module_skip.py": 'import pytest\npytest.importorskip("no_such_pyspark")\n'
                 "def test_never():\n    pass\n",
                 "jax/test_jax_module_skip.py": 'import pytest\npytest.importorskip("no_such_jax")\n'
                 "def test_never():\n    pass\n"}


def _run(tmp_path: Path, env: dict[str, str]) -> str:
    (tmp_path / "test_tiers.py").write_text(textwrap.dedent(_TESTS))
    (tmp_path / "conftest.py").write_text(textwrap.dedent(_CONFTEST).replace(
        "pytest_runtest_makereport", "pytest_runtest_makereport, pytest_make_collect_report"))
    for name, text in _MODULE_SKIPS.items():
        (tmp_path / "tests" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "tests" / name).write_text(text)
    full = {k: v for k, v in os.environ.items() if not k.startswith("HVD_TEST_REQUIRE")}
    full.update(PYTHONPATH=str(REPO), **env)
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors", "-W",
            "ignore::pytest.PytestUnknownMarkWarning", str(tmp_path)]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=full, cwd=tmp_path)
    return res.stdout


@pytest.mark.parametrize("flags", [{}, {"HVD_TEST_REQUIRE_SPARK": "1", "HVD_TEST_REQUIRE_RAY": "1",
                                        "HVD_TEST_REQUIRE_FAKEHOSTS": "1",
                                        "HVD_TEST_REQUIRE_FRAMEWORKS": "1"}])
def test_required_tiers_fail_instead_of_skipping(tmp_path: Path, flags: dict[str, str]) -> None:
    out = _run(tmp_path, flags)
    if not flags:
        assert "6 skipped" in out, out
        return
    # a skip in a test's body fails it; a skip in its set-up (a fixture) or while its module is
    # collected is an error: all fail the run
    assert "2 failed, 1 skipped" in out and "3 errors" in out, out
    assert "HVD_TEST_REQUIRE_SPARK=1 but this spark test was skipped: no java here" in out, out
    assert "HVD_TEST_REQUIRE_RAY=1 but this ray test was skipped" in out, out
    assert "HVD_TEST_REQUIRE_FAKEHOSTS=1 but this fakehosts test was skipped: not root" in out, out
    assert "HVD_TEST_REQUIRE_SPARK=1 but this spark test was skipped: could not import 'no_such_pyspark'" in out, out
    assert ("HVD_TEST_REQUIRE_FRAMEWORKS=1 but this frameworks test was skipped: could not import "
            "'no_such_jax'") in out, out
