"""The job (``JobState.job()``) as Prometheus text exposition (format 0.0.4)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["render", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**labels: Any) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _num(v: float) -> str:
    return repr(float(v)) if isinstance(v, float) else str(int(v))


def _family(kind: str, name: str, help: str, samples: Iterable[tuple[dict[str, Any], float]]) -> list[str]:
    """One metric family: its HELP and TYPE lines, then a line per ``(labels, value)`` sample."""
    return [f"# HELP {name} {help}", f"# TYPE {name} {kind}",
            *(f"{name}{_labels(**labels)} {_num(value)}" for labels, value in samples)]


_gauge = functools.partial(_family, "gauge")
_counter = functools.partial(_family, "counter")


def render(job: dict[str, Any]) -> str:
    """The exposition of ``job``: one family per metric, each with its HELP and TYPE lines."""
    ranks = job["ranks"]
    elastic = job.get("elastic") or {}

    def per_rank(value: Callable[[dict[str, Any]], float]) -> list[tuple[dict[str, Any], float]]:
        return [({"rank": row["rank"]}, value(row)) for row in ranks]

    def per_op(field: str, convert: Callable[[Any], float] = lambda v: v) -> list[tuple[dict[str, Any], float]]:
        return [({"rank": row["rank"], "op": op}, convert(row[field].get(op, 0)))
                for row in ranks for op in sorted(row["collectives"])]

    families = [
        _gauge("horovod_world_size", "Number of ranks in the job (the current round, in elastic jobs).",
               [({}, job["world_size"])]),
        _gauge("horovod_rank_info", "One series per rank with its host and local rank; always 1.",
               [({"rank": row["rank"], "host": row["host"], "local_rank": row["local_rank"]}, 1) for row in ranks]),
        _counter("horovod_collectives_total", "Tensors this rank has run through collectives, by op.",
                 per_op("collectives")),
        _counter("horovod_collective_bytes_total", "Bytes this rank submitted to collectives, by op.",
                 per_op("collective_bytes")),
        _counter("horovod_collective_seconds_total",
                 "Seconds this rank spent in the transport running collectives, by op.",
                 per_op("collective_seconds", float)),
        _counter("horovod_wait_seconds_total", "Seconds this rank's submitted tensors waited for the other ranks.",
                 per_rank(lambda row: float(row["wait_seconds"]))),
        _counter("horovod_steps_total", "Steps of this rank (a step ends when it has nothing left in flight).",
                 per_rank(lambda row: row["steps"])),
        _gauge("horovod_straggler", "1 for a rank the others have been waiting for in most recent steps, else 0.",
               per_rank(lambda row: 1 if row["straggler"] else 0)),
        _gauge("horovod_straggler_score", "Share of a step the other ranks spent waiting for this rank, smoothed.",
               per_rank(lambda row: float(row["straggler_score"]))),
        _gauge("horovod_stalled_tensors",
               "Tensors this rank submitted that have waited longer than the stall warning time.",
               per_rank(lambda row: row["stalled_tensors"])),
        _gauge("horovod_rank_up", "1 while the rank reports, 0 once it failed or went silent.",
               per_rank(lambda row: 0 if row["state"] in ("failed", "silent", "starting") else 1)),
        _counter("horovod_elastic_rounds_total", "Rounds an elastic job has formed (0 for a static job).",
                 [({}, int(elastic.get("rounds", 0)))]),
        _gauge("horovod_elastic_workers", "Workers of an elastic job by state.",
               [({"state": state}, count) for state, count in sorted((elastic.get("workers") or {}).items())]),
    ]
    return "\n".join(line for family in families for line in family) + "\n"
