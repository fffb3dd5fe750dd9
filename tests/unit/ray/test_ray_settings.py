"""The Ray executors' settings: every field has a reader; upstream's other keywords are accepted,
an unknown one is an error (not a setting stored for nobody)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from horovod.ray.elastic import ElasticRayExecutor, ElasticSettings
from horovod.ray.runner import MiniSettings, RayExecutor


def test_elastic_settings_take_upstream_keywords_and_refuse_unknown_ones() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=4, verbose=2,
                                               cooldown_range=(1, 5), discovery="d")
    assert (s.min_num_proc, s.max_num_proc, s.cooldown_range, s.discovery) == (2, 4, (1, 5), "d")
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['cooldown'\]"):
        ElasticRayExecutor.create_settings(cooldown=(1, 5))


def test_no_settings_field_without_a_reader() -> None:
    assert "extra" not in {f.name for f in dataclasses.fields(ElasticSettings)}
    assert "extra" not in {f.name for f in dataclasses.fields(MiniSettings)}
    s = RayExecutor.create_settings(timeout_s=7, placement_group_timeout_s=9)
    assert (s.timeout_s, s.placement_group_timeout_s) == (7, 9)
