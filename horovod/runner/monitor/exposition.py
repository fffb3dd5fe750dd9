"""The job (``JobState.job()``) as Prometheus text exposition (format 0.0.4)."""

from __future__ import annotations

from typing import Any

__all__ = ["render", "CONTENT_TYPE", "METRICS"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name -> (type, help)
METRICS = {
    "horovod_world_size": ("gauge", "Number of ranks in the job (the current round, in elastic jobs)."),
    "horovod_rank_info": ("gauge", "One series per rank with its host and local rank; always 1."),
    "horovod_collectives_total": ("counter", "Tensors this rank has run through collectives, by op."),
    "horovod_collective_bytes_total": ("counter", "Bytes this rank submitted to collectives, by op."),
    "horovod_collective_seconds_total": ("counter",
                                         "Seconds this rank spent in the transport running collectives, by op."),
    "horovod_wait_seconds_total": ("counter",
                                   "Seconds this rank's submitted tensors waited for the other ranks."),
    "horovod_steps_total": ("counter", "Steps of this rank (a step ends when it has nothing left in flight)."),
    "horovod_straggler": ("gauge", "1 for a rank the others have been waiting for in most recent steps, else 0."),
    "horovod_straggler_score": ("gauge",
                                "Share of a step the other ranks spent waiting for this rank, smoothed."),
    "horovod_stalled_tensors": ("gauge",
                                "Tensors this rank submitted that have waited longer than the stall warning time."),
    "horovod_rank_up": ("gauge", "1 while the rank reports, 0 once it failed or went silent."),
    "horovod_elastic_rounds_total": ("counter", "Rounds an elastic job has formed (0 for a static job)."),
    "horovod_elastic_workers": ("gauge", "Workers of an elastic job by state."),
}


def _escape(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**labels: Any) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _num(v: float) -> str:
    return repr(float(v)) if isinstance(v, float) else str(int(v))


def render(job: dict[str, Any]) -> str:
    samples: dict[str, list[str]] = {name: [] for name in METRICS}

    def add(name: str, value: float, **labels: Any) -> None:
        samples[name].append(f"{name}{_labels(**labels)} {_num(value)}")

    add("horovod_world_size", job["world_size"])
    for row in job["ranks"]:
        rank = row["rank"]
        add("horovod_rank_info", 1, rank=rank, host=row["host"], local_rank=row["local_rank"])
        for op in sorted(row["collectives"]):
            add("horovod_collectives_total", row["collectives"][op], rank=rank, op=op)
            add("horovod_collective_bytes_total", row["collective_bytes"].get(op, 0), rank=rank, op=op)
            add("horovod_collective_seconds_total", float(row["collective_seconds"].get(op, 0.0)),
                rank=rank, op=op)
        add("horovod_wait_seconds_total", float(row["wait_seconds"]), rank=rank)
        add("horovod_steps_total", row["steps"], rank=rank)
        add("horovod_straggler", 1 if row["straggler"] else 0, rank=rank)
        add("horovod_straggler_score", float(row["straggler_score"]), rank=rank)
        add("horovod_stalled_tensors", row["stalled_tensors"], rank=rank)
        add("horovod_rank_up", 0 if row["state"] in ("failed", "silent", "starting") else 1, rank=rank)
    elastic = job.get("elastic") or {}
    add("horovod_elastic_rounds_total", int(elastic.get("rounds", 0)))
    for state, count in sorted((elastic.get("workers") or {}).items()):
        add("horovod_elastic_workers", count, state=state)
    out: list[str] = []
    for name, (kind, text) in METRICS.items():
        out.append(f"# HELP {name} {text}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(samples[name])
    return "\n".join(out) + "\n"
