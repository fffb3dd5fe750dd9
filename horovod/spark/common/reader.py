"""The estimators' data reader: Parquet row groups -> shuffled numpy batches, on pyarrow alone.

Each rank reads its own share of the row groups (every ``size``-th of the sorted list, starting
at its rank). Every pass over them uses a new order (``random_seed``, the pass and the rank seed
it) and shuffles the rows of each row group. ``num_workers`` threads read and decode row groups
ahead of the consumer; a batching thread cuts the decoded rows into batches and hands them over a
bounded queue (one hand-over per row group), so at most ``num_workers + 1`` row groups being
decoded and ``queue_size + 1`` row groups' worth of batches are in memory whatever the size of
the dataset.

The stream is endless (one pass after another): the training loop takes a fixed number of steps
per epoch on every rank, which keeps the ranks' collectives in step even when their shares of
rows differ.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

__all__ = ["ParquetReader", "row_groups"]

_SPARSE = ("__sparse_indices", "__sparse_values")
_DONE = object()


def row_groups(fs: Any, files: list[str]) -> list[tuple[str, int, int]]:
    """``(file, row group index, rows)`` of every row group of ``files``, in a stable order."""
    import pyarrow.parquet as pq

    out = []
    for f in sorted(files):
        with fs.open_input_file(f) as fh:
            md = pq.ParquetFile(fh).metadata
        out += [(f, i, md.row_group(i).num_rows) for i in range(md.num_row_groups)]
    return out


class ParquetReader:
    """An endless iterator of batches ``{column: np.ndarray}`` from this rank's row groups."""

    def __init__(self, fs: Any, files: list[str], columns: list[str], metadata: dict[str, Any],
                 batch_size: int, rank: int = 0, size: int = 1, shuffle: bool = True,
                 seed: int | None = None, num_workers: int = 2, queue_size: int = 2,
                 transformation_fn: Callable[[Any], Any] | None = None,
                 cache_in_memory: bool = False, drop_remainder: bool = False) -> None:
        groups = row_groups(fs, files)
        if not groups:
            raise ValueError("No Parquet row groups to read (the prepared data is empty).")
        self.mine = groups[rank::size] or [groups[rank % len(groups)]]
        self.rows = sum(g[2] for g in self.mine)
        self.fs, self.columns, self.metadata = fs, list(columns), metadata
        self.batch_size, self.shuffle, self.rank = int(batch_size), shuffle, rank
        self.seed = 0 if seed is None else int(seed)
        self.num_workers = max(1, int(num_workers))
        self.transformation_fn = transformation_fn
        self.cache: list[dict[str, np.ndarray]] | None = [] if cache_in_memory else None
        self.drop_remainder = drop_remainder
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, queue_size))
        self._ready: collections.deque[dict[str, np.ndarray]] = collections.deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.peak_decoded_rows = 0  # the most rows held decoded at once (a memory bound check)

    # -- decoding ------------------------------------------------------------------------------
    def _read_columns(self) -> list[str]:
        cols = []
        for c in self.columns:
            m = self.metadata.get(c, {})
            cols += [c + s for s in _SPARSE] if m.get("kind") == "vector" and m.get("sparse") else [c]
        return cols

    def _decode(self, group: tuple[str, int, int]) -> dict[str, np.ndarray]:
        import pyarrow.parquet as pq

        path, index, _ = group
        with self.fs.open_input_file(path) as fh:
            table = pq.ParquetFile(fh).read_row_group(index, columns=self._read_columns())
        if self.transformation_fn is not None:
            frame = self.transformation_fn(table.to_pandas())
            return {c: _stack(frame[c].to_numpy()) for c in frame.columns}
        out: dict[str, np.ndarray] = {}
        for c in self.columns:
            m = self.metadata.get(c, {})
            if m.get("kind") == "vector" and m.get("sparse"):
                out[c] = _densify(table.column(c + _SPARSE[0]), table.column(c + _SPARSE[1]),
                                  table.num_rows, int(m["shape"][0]))
            else:
                out[c] = _column(table.column(c), table.num_rows)
        return out

    def _passes(self) -> Iterator[dict[str, np.ndarray]]:
        """Decoded row groups, pass after pass, decoded ahead by the worker threads."""
        epoch = 0
        with ThreadPoolExecutor(self.num_workers, thread_name_prefix="hvd-reader") as pool:
            while not self._stop.is_set():
                if self.cache is not None and epoch > 0:
                    order = self._order(len(self.cache), epoch)
                    for i in order:
                        yield self.cache[i]
                    epoch += 1
                    continue
                order = self._order(len(self.mine), epoch)
                pending: collections.deque[Future[dict[str, np.ndarray]]] = collections.deque()
                it = iter(order)
                for i in it:
                    pending.append(pool.submit(self._decode, self.mine[i]))
                    if len(pending) > self.num_workers:
                        break
                while pending:
                    chunk = pending.popleft().result()
                    nxt = next(it, None)
                    if nxt is not None:
                        pending.append(pool.submit(self._decode, self.mine[nxt]))
                    if self.cache is not None:
                        self.cache.append(chunk)
                    yield chunk
                    if self._stop.is_set():
                        return
                epoch += 1

    def _order(self, n: int, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch, self.rank]).permutation(n)

    def _batches(self) -> None:
        rng = np.random.default_rng([self.seed, 1 << 20, self.rank])
        carry: dict[str, np.ndarray] | None = None
        b = self.batch_size
        try:
            for chunk in self._passes():
                n = len(next(iter(chunk.values())))
                # Shuffled rows are gathered batch by batch (one copy of the data in all);
                # unshuffled batches are views of the decoded row group.
                perm = rng.permutation(n) if self.shuffle and n > 1 else None

                held = len(next(iter(carry.values()))) if carry is not None else 0
                self.peak_decoded_rows = max(self.peak_decoded_rows, n + held)
                start, ready = 0, []
                if carry is not None:
                    k = min(b - held, n)
                    head = _take(chunk, perm, 0, k)
                    carry = {key: np.concatenate([carry[key], head[key]]) for key in head}
                    start = k
                    if held + k < b:
                        continue
                    ready.append(carry)
                    carry = None
                while n - start >= b:
                    ready.append(_take(chunk, perm, start, start + b))
                    start += b
                # One hand-over per row group (not per batch): the queue's cost stays off the
                # training step.
                if ready and not self._put(ready):
                    return
                if start < n:
                    rest = _take(chunk, perm, start, n)
                    carry = {k: np.array(v) for k, v in rest.items()}
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            self._put(exc)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    # -- consumer ------------------------------------------------------------------------------
    def __iter__(self) -> ParquetReader:
        if self._thread is None:
            self._thread = threading.Thread(target=self._batches, name="hvd-reader-batches",
                                            daemon=True)
            self._thread.start()
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._ready:
            return self._ready.popleft()
        if self._thread is None:
            iter(self)
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise RuntimeError(f"horovod.spark reader (rank {self.rank}) failed: {item}") from item
        self._ready.extend(item)
        return self._ready.popleft()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            while self._thread.is_alive():
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    self._thread.join(0.05)

    def __enter__(self) -> ParquetReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _take(chunk: dict[str, np.ndarray], perm: np.ndarray | None, lo: int,
          hi: int) -> dict[str, np.ndarray]:
    """Rows ``lo:hi`` of a decoded row group: views in order, or gathered through ``perm``."""
    if perm is None:
        return {k: v[lo:hi] for k, v in chunk.items()}
    sel = perm[lo:hi]
    return {k: v[sel] for k, v in chunk.items()}


def _column(col: Any, n: int) -> np.ndarray:
    import pyarrow as pa

    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    t = col.type
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        flat = col.flatten().to_numpy(zero_copy_only=False)
        if len(flat) % max(n, 1):
            raise ValueError(f"a list column holds {len(flat)} values for {n} rows: rows have "
                             "different lengths")
        return flat.reshape(n, -1) if n else flat.reshape(0, 0)
    return col.to_numpy(zero_copy_only=False)


def _densify(indices: Any, values: Any, n: int, width: int) -> np.ndarray:
    import pyarrow as pa

    idx = indices.combine_chunks() if isinstance(indices, pa.ChunkedArray) else indices
    val = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    out = np.zeros((n, width), dtype=np.float64)
    offsets = idx.offsets.to_numpy()
    rows = np.repeat(np.arange(n), np.diff(offsets))
    out[rows, idx.flatten().to_numpy()] = val.flatten().to_numpy()
    return out


def _stack(values: np.ndarray) -> np.ndarray:
    if values.dtype == object and len(values) and isinstance(values[0], (np.ndarray, list)):
        return np.stack([np.asarray(v) for v in values])
    return values
