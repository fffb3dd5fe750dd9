from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

from horovod.common.backends.registry import create_backend, select_backend_name
from horovod.common.config import EngineConfig
from horovod.common.engine.timeline import Timeline
from horovod.common.exceptions import ConfigError
from horovod.common.topology import homogeneous, topology_from_hostnames

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_config_defaults_match_upstream():
    c = EngineConfig.from_env({})
    assert c.fusion_threshold == 128 * 1024 * 1024
    assert c.cycle_time_ms == 1.0 and c.cache_capacity == 1024
    assert c.stall_check_time_seconds == 60 and c.stall_shutdown_time_seconds == 0


@pytest.mark.parametrize("var, value", [
    ("HOROVOD_FUSION_THRESHOLD", "abc"),
    ("HOROVOD_CYCLE_TIME", "fast"),
    ("HOROVOD_CACHE_CAPACITY", "-1"),
    ("HOROVOD_STALL_CHECK_DISABLE", "maybe"),
    ("HOROVOD_CONTROLLER", "carrier-pigeon"),
])
def test_config_bad_value_names_the_variable(var, value):
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_env({var: value})
    assert info.value.variable == var and var in str(info.value) and repr(value) in str(info.value)


def test_config_parses_flags_and_numbers():
    c = EngineConfig.from_env({"HOROVOD_FUSION_THRESHOLD": "0", "HOROVOD_STALL_CHECK_DISABLE": "1",
                               "HOROVOD_CYCLE_TIME": "0.5", "HOROVOD_LOG_LEVEL": "DEBUG",
                               "HOROVOD_CONTROLLER": "gloo"})
    assert c.fusion_threshold == 0 and c.stall_check_disable and c.cycle_time_ms == 0.5
    assert c.log_level == "debug" and c.controller == "GLOO"


def test_config_shutdown_shorter_than_warning_is_disabled():
    c = EngineConfig.from_env({"HOROVOD_STALL_CHECK_TIME_SECONDS": "10",
                               "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "5"})
    assert c.stall_shutdown_time_seconds == 0


def test_topology_local_and_cross_ranks_follow_upstream():
    hosts = ["a", "a", "b"]
    t = [topology_from_hostnames(hosts, r) for r in range(3)]
    assert [x.local_rank for x in t] == [0, 1, 0]
    assert [x.local_size for x in t] == [2, 2, 1]
    assert [x.cross_size for x in t] == [2, 1, 2]
    assert [x.cross_rank for x in t] == [0, 0, 1]
    assert not homogeneous(hosts) and t[2].hostname == "b"


def test_topology_interleaved_hosts():
    hosts = ["h1", "h2", "h1", "h2"]
    t = [topology_from_hostnames(hosts, r) for r in range(4)]
    assert [(x.local_rank, x.cross_rank) for x in t] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert homogeneous(hosts) and all(x.cross_size == 2 and x.local_size == 2 for x in t)


def test_backend_selection_order():
    c = EngineConfig.from_env({})
    assert select_backend_name(c, {}) == "local"
    assert select_backend_name(c, {"OMPI_COMM_WORLD_SIZE": "2"}) == "mpi"
    assert select_backend_name(c, {"HOROVOD_GLOO_RENDEZVOUS_ADDR": "x", "OMPI_COMM_WORLD_SIZE": "2"}) == "gloo"
    assert select_backend_name(EngineConfig.from_env({"HOROVOD_CONTROLLER": "mpi"}), {}) == "mpi"


def test_unknown_backend_suggests_the_closest_name():
    with pytest.raises(ValueError, match="Did you mean 'mpi'"):
        create_backend("mpj", EngineConfig.from_env({}), {})


def test_timeline_is_valid_json_after_each_flush(tmp_path):
    path = tmp_path / "tl.json"
    tl = Timeline(str(path), mark_cycles=True)
    tl.begin("allreduce.x", "NEGOTIATE_ALLREDUCE")
    tl.tick("allreduce.x", "0")
    tl.end("allreduce.x")
    tl.cycle()
    tl.flush()
    events = json.loads(path.read_text())
    assert any(e.get("name") == "NEGOTIATE_ALLREDUCE" for e in events)
    tl.begin("allreduce.x", "ALLREDUCE")
    tl.end("allreduce.x", {"dtype": "float32", "shape": "[[2]]"})
    tl.close()
    events = json.loads(path.read_text())
    names = [e.get("name") for e in events]
    assert "CYCLE_START" in names and "ALLREDUCE" in names
    assert events[0]["args"]["start_time_since_epoch_in_micros"] > 0


FRAMEWORKS = {"torch", "tensorflow", "keras", "jax", "tf_keras"}


def test_common_imports_no_framework_and_no_runner_at_module_level():
    for path in (ROOT / "horovod" / "common").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level only; lazy imports inside functions are allowed
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module]
            for m in mods:
                assert m.split(".")[0] not in FRAMEWORKS, f"{path} imports {m}"
                assert not m.startswith("horovod.runner"), f"{path} imports {m}"


def test_importing_horovod_common_loads_no_framework():
    code = ("import sys, horovod, horovod.common, horovod.numpy; "
            "bad = [m for m in ('torch', 'tensorflow', 'mpi4py') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
