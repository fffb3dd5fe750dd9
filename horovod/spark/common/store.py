"""Where an estimator keeps its prepared data, checkpoints and logs (upstream's ``Store``).

Layout under ``prefix_path`` (upstream's)::

    intermediate_train_data.<idx>/   prepared training rows (Parquet) + _horovod_metadata.json
    intermediate_val_data.<idx>/     prepared validation rows
    intermediate_test_data.<idx>/
    runs/<run_id>/checkpoint/        the last completed epoch's checkpoint
    runs/<run_id>/logs/

Files are read and written through ``pyarrow.fs`` (local, HDFS, S3/GCS when pyarrow was built
with them) or through fsspec for any other URL scheme whose package is installed. A directory is
complete only once its marker file exists (written last), so an interrupted write is never
mistaken for a finished one.
"""

from __future__ import annotations

import json
import os
import posixpath
import uuid
from typing import Any
from urllib.parse import urlparse

__all__ = ["Store", "AbstractFilesystemStore", "FilesystemStore", "LocalStore", "HDFSStore",
           "DBFSLocalStore", "METADATA_FILE"]

METADATA_FILE = "_horovod_metadata.json"
DEFAULT_CHECKPOINT_FILENAME = "checkpoint"


class Store:
    """Base of the stores: ``Store.create(prefix_path)`` picks the right one."""

    @staticmethod
    def create(prefix_path: str, *args: Any, **kwargs: Any) -> AbstractFilesystemStore:
        """``HDFSStore`` for ``hdfs://``, ``DBFSLocalStore`` for ``dbfs:/`` or ``/dbfs/``, else a
        ``LocalStore`` for local paths and ``file://``, else a ``FilesystemStore`` (any scheme
        pyarrow or fsspec knows: ``s3://``, ``gs://``, ``abfs://``... with their packages)."""
        if HDFSStore.matches(prefix_path):
            return HDFSStore(prefix_path, *args, **kwargs)
        if DBFSLocalStore.matches(prefix_path):
            return DBFSLocalStore(prefix_path, *args, **kwargs)
        if urlparse(prefix_path).scheme in ("", "file"):
            return LocalStore(prefix_path, *args, **kwargs)
        return FilesystemStore(prefix_path, *args, **kwargs)


class AbstractFilesystemStore(Store):
    """A store on one filesystem (upstream's constructor and path methods)."""

    def __init__(self, prefix_path: str, train_path: str | None = None, val_path: str | None = None,
                 test_path: str | None = None, runs_path: str | None = None,
                 save_runs: bool = True, storage_options: dict[str, Any] | None = None,
                 checkpoint_filename: str | None = None) -> None:
        self.prefix_path = self.normalize(prefix_path)
        self.storage_options = dict(storage_options or {})
        self._train_path = train_path or self.join(self.prefix_path, "intermediate_train_data")
        self._val_path = val_path or self.join(self.prefix_path, "intermediate_val_data")
        self._test_path = test_path or self.join(self.prefix_path, "intermediate_test_data")
        self._runs_path = runs_path or self.join(self.prefix_path, "runs")
        self._save_runs = save_runs
        self._checkpoint_filename = checkpoint_filename or DEFAULT_CHECKPOINT_FILENAME
        self._fs: Any = None

    # -- paths ---------------------------------------------------------------------------------
    def normalize(self, path: str) -> str:
        return path.rstrip("/") if len(path) > 1 else path

    @staticmethod
    def join(*parts: str) -> str:
        return posixpath.join(*parts)

    def get_train_data_path(self, idx: Any = None) -> str:
        return f"{self._train_path}.{idx}" if idx is not None else self._train_path

    def get_val_data_path(self, idx: Any = None) -> str:
        return f"{self._val_path}.{idx}" if idx is not None else self._val_path

    def get_test_data_path(self, idx: Any = None) -> str:
        return f"{self._test_path}.{idx}" if idx is not None else self._test_path

    def get_runs_path(self) -> str:
        return self._runs_path

    def get_run_path(self, run_id: str) -> str:
        return self.join(self._runs_path, run_id)

    def get_checkpoint_path(self, run_id: str) -> str:
        return self.join(self.get_run_path(run_id), self._checkpoint_filename)

    def get_logs_path(self, run_id: str) -> str:
        return self.join(self.get_run_path(run_id), "logs")

    def get_checkpoint_filename(self) -> str:
        return self._checkpoint_filename

    def get_logs_subdir(self) -> str:
        return "logs"

    def saving_runs(self) -> bool:
        return self._save_runs

    def spark_path(self, path: str) -> str:
        """The path as Spark's DataFrame reader/writer wants it (a URL Hadoop understands)."""
        return path

    # -- filesystem ----------------------------------------------------------------------------
    @property
    def fs(self) -> Any:
        """A ``pyarrow.fs.FileSystem`` for this store (created on first use, in each process)."""
        if self._fs is None:
            self._fs = self._make_fs()
        return self._fs

    def _make_fs(self) -> Any:
        import pyarrow.fs as pafs

        url = urlparse(self.prefix_path)
        if url.scheme in ("", "file"):
            return pafs.LocalFileSystem()
        try:
            fs, _ = pafs.FileSystem.from_uri(self.prefix_path)
            return fs
        except Exception:  # noqa: BLE001 - try fsspec for the schemes pyarrow does not know
            pass
        try:
            import fsspec
        except ImportError as exc:
            raise ValueError(f"Store {self.prefix_path!r}: pyarrow has no filesystem for scheme "
                             f"{url.scheme!r} and fsspec is not installed (pip install fsspec "
                             "and the package for that scheme, e.g. s3fs or gcsfs).") from exc
        try:
            ffs = fsspec.filesystem(url.scheme, **self.storage_options)
        except (ImportError, ValueError) as exc:
            raise ValueError(f"Store {self.prefix_path!r}: no filesystem for scheme "
                             f"{url.scheme!r}: {exc}") from exc
        return pafs.PyFileSystem(pafs.FSSpecHandler(ffs))

    def fs_path(self, path: str) -> str:
        """``path`` as this store's pyarrow filesystem names it (no scheme)."""
        url = urlparse(path)
        if url.scheme in ("", "file"):
            return url.path if url.scheme else path
        return f"{url.netloc}{url.path}"

    def exists(self, path: str) -> bool:
        import pyarrow.fs as pafs

        return bool(self.fs.get_file_info(self.fs_path(path)).type != pafs.FileType.NotFound)

    def makedirs(self, path: str) -> None:
        self.fs.create_dir(self.fs_path(path), recursive=True)

    def rmtree(self, path: str) -> None:
        if self.exists(path):
            self.fs.delete_dir(self.fs_path(path))

    def read_bytes(self, path: str) -> bytes:
        with self.fs.open_input_stream(self.fs_path(path)) as f:
            return bytes(f.read())

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` atomically where the filesystem can rename (write a
        temporary sibling, then move it into place)."""
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        self.makedirs(posixpath.dirname(path) or ".")
        with self.fs.open_output_stream(self.fs_path(tmp)) as f:
            f.write(data)
        try:
            if self.exists(path):
                self.fs.delete_file(self.fs_path(path))
            self.fs.move(self.fs_path(tmp), self.fs_path(path))
        except Exception:
            self.fs.delete_file(self.fs_path(tmp))
            raise

    def read_json(self, path: str) -> Any:
        return json.loads(self.read_bytes(path).decode())

    def write_json(self, path: str, obj: Any) -> None:
        self.write_bytes(path, json.dumps(obj, indent=1, sort_keys=True).encode())

    def is_complete(self, data_path: str) -> bool:
        """Whether a prepared-data directory was fully written (its metadata marker exists)."""
        return self.exists(self.join(data_path, METADATA_FILE))

    def list_parquet_files(self, data_path: str) -> list[str]:
        import pyarrow.fs as pafs

        sel = pafs.FileSelector(self.fs_path(data_path), recursive=True)
        return sorted(i.path for i in self.fs.get_file_info(sel)
                      if i.type == pafs.FileType.File and i.base_name.endswith(".parquet")
                      and not i.base_name.startswith(("_", ".")))

    def get_local_output_dir_fn(self, run_id: str) -> Any:
        import contextlib
        import tempfile

        @contextlib.contextmanager
        def local_run_path() -> Any:
            with tempfile.TemporaryDirectory(prefix=f"hvd-{run_id}-") as d:
                yield d
        return local_run_path

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_fs"] = None  # filesystems are made again in each process
        return state

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.prefix_path!r})"


class FilesystemStore(AbstractFilesystemStore):
    """A store on a local/shared filesystem or any URL pyarrow or fsspec can open."""


class LocalStore(FilesystemStore):
    """A store on a filesystem every executor sees at the same path (upstream's LocalStore).

    On a cluster the path must be shared (NFS, or a FUSE mount); on one machine any directory."""

    def __init__(self, prefix_path: str, *args: Any, **kwargs: Any) -> None:
        if prefix_path.startswith("file://"):
            prefix_path = prefix_path[len("file://"):]
        super().__init__(os.path.abspath(prefix_path), *args, **kwargs)

    def spark_path(self, path: str) -> str:
        return f"file://{path}"


class HDFSStore(AbstractFilesystemStore):
    """A store on HDFS: ``hdfs://namenode:8020/path``, ``hdfs:///path`` or ``/path``."""

    def __init__(self, prefix_path: str, host: str | None = None, port: int | None = None,
                 user: str | None = None, kerb_ticket: str | None = None, driver: str = "libhdfs",
                 extra_conf: dict[str, str] | None = None, *args: Any, **kwargs: Any) -> None:
        url = urlparse(prefix_path)
        if url.scheme not in ("", "hdfs"):
            raise ValueError(f"HDFSStore: {prefix_path!r} is not an hdfs:// URL or absolute path.")
        self._host = host or url.hostname or "default"
        self._port = port if port is not None else (url.port or 0)
        self._user, self._kerb_ticket, self._extra_conf = user, kerb_ticket, extra_conf
        if driver != "libhdfs":
            raise ValueError(f"HDFSStore: driver={driver!r}: only 'libhdfs' exists in pyarrow today.")
        netloc = self._host if self._host != "default" else ""
        if self._port and netloc:
            netloc = f"{netloc}:{self._port}"
        super().__init__(f"hdfs://{netloc}{url.path}", *args, **kwargs)

    @staticmethod
    def matches(path: str) -> bool:
        return path.startswith("hdfs://")

    def _make_fs(self) -> Any:
        import pyarrow.fs as pafs

        return pafs.HadoopFileSystem(self._host, self._port, user=self._user,
                                     kerb_ticket=self._kerb_ticket, extra_conf=self._extra_conf)

    def fs_path(self, path: str) -> str:
        return urlparse(path).path or path


class DBFSLocalStore(FilesystemStore):
    """DBFS on Databricks through its local FUSE mount (``dbfs:/x`` is read as ``/dbfs/x``)."""

    def __init__(self, prefix_path: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(self.normalize_datbricks_path(prefix_path), *args, **kwargs)

    @staticmethod
    def matches(path: str) -> bool:
        return path.startswith(("dbfs:/", "/dbfs/"))

    @staticmethod
    def normalize_datbricks_path(path: str) -> str:
        if path.startswith("dbfs:/"):
            return "/dbfs" + path[len("dbfs:"):].replace("//", "/")
        return path

    def spark_path(self, path: str) -> str:
        return "dbfs:" + path[len("/dbfs"):] if path.startswith("/dbfs/") else path
