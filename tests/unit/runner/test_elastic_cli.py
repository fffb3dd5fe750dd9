"""Elastic options of horovodrun and horovod.run: spellings, defaults, validation, dry run."""

from __future__ import annotations

import pytest

from horovod.common.exceptions import ConfigError
from horovod.runner.cli import parse_args, settings_from_args
from horovod.runner.launch.horovodrun import main


def settings(*argv: str):  # noqa: ANN201
    return settings_from_args(parse_args([*argv, "python", "train.py"]))


def test_elastic_flags_and_upstream_spellings() -> None:
    s = settings("-np", "4", "--min-np", "2", "--max-np", "8", "--host-discovery-script", "./d.sh",
                 "--slots-per-host", "2", "--elastic-timeout", "30", "--reset-limit", "3",
                 "--blacklist-cooldown-range", "5", "60")
    assert s.elastic and s.controller == "gloo"
    assert (s.np, s.min_np, s.max_np, s.slots_per_host) == (4, 2, 8, 2)
    assert (s.elastic_timeout, s.reset_limit, s.blacklist_cooldown_range) == (30.0, 3, (5.0, 60.0))
    s = settings("-np", "2", "--min-num-proc", "1", "--max-num-proc", "3", "-H", "a:1,b:2")
    assert s.elastic and (s.min_np, s.max_np, s.hosts) == (1, 3, "a:1,b:2")
    s = settings("-np", "3", "--host-discovery-script", "./d.sh")
    assert s.min_np == 3 and s.max_np is None  # --min-np defaults to -np
    assert not settings("-np", "2").elastic


@pytest.mark.parametrize("argv,message", [
    (["-np", "2", "--min-np", "3"], "larger than -np"),
    (["-np", "4", "--max-np", "3"], "smaller than -np"),
    (["-np", "2", "--min-np", "1", "--mpi"], "runs on Gloo"),
    (["-np", "2", "--min-np", "1", "--blacklist-cooldown-range", "0", "10"], "1 <= MIN"),
    (["-np", "2", "--min-np", "1", "--blacklist-cooldown-range", "10", "4000"], "<= 3600"),
    (["-np", "2", "--host-discovery-script", "d.sh", "-H", "a:2"], "not both"),
    (["-np", "2", "--min-np", "1", "--reset-limit", "-1"], ">= 0"),
])
def test_invalid_elastic_options_say_why(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        settings(*argv)


def test_dry_run_describes_the_elastic_job(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-np", "2", "--min-np", "1", "--max-np", "4", "-H", "a:2,b:2", "--dry-run",
                 "python", "train.py"]) == 0
    out = capsys.readouterr().out
    assert "Elastic job: start 2 processes (at least 1, at most 4)" in out and "Gloo" in out


def test_missing_discovery_script_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-np", "1", "--host-discovery-script", "/nonexistent/discover.sh",
                 "python", "train.py"]) == 2
    assert "not an executable file" in capsys.readouterr().err
