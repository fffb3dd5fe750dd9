"""Spark ML persistence of estimators and models: ``obj.save(path)`` / ``Cls.load(path)``.

A saved object is a directory: ``metadata.json`` (class, uid, the parameters that are plain
values, for people and tools) and ``params.pkl`` (every parameter, cloudpickled; the framework
classes turn models and optimizers into bytes first through ``_params_to_bytes``). The pickle is
written first and ``metadata.json`` last, so a directory without it is an unfinished save.
Loading runs pickled code: load only what you or your team saved.
"""

from __future__ import annotations

import json
from typing import Any

from pyspark.ml.util import MLReadable, MLReader, MLWritable, MLWriter

__all__ = ["HorovodWriter", "HorovodReader", "HorovodWritable", "HorovodReadable"]


def _plain(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


class HorovodWriter(MLWriter):
    def __init__(self, instance: Any) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:  # noqa: N802 - Spark ML naming
        import cloudpickle

        from horovod.spark.common.store import Store

        store = Store.create(path)
        root = store.prefix_path
        done = store.join(root, "metadata.json")
        if store.exists(done) and not self.shouldOverwrite:
            raise FileExistsError(f"{path} already holds a saved object; use "
                                  ".write().overwrite().save(path) to replace it.")
        if store.exists(done):
            store.fs.delete_file(store.fs_path(done))
        values = self.instance.param_values()
        blob = cloudpickle.dumps(type(self.instance)._params_to_bytes(values))
        store.write_bytes(store.join(root, "params.pkl"), blob)
        store.write_json(done, {
            "class": f"{type(self.instance).__module__}.{type(self.instance).__qualname__}",
            "uid": self.instance.uid,
            "params": {k: v for k, v in values.items() if _plain(v)}})


class HorovodReader(MLReader):
    def __init__(self, cls: type[Any]) -> None:  # a HorovodReadable estimator or model class
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> Any:
        import pickle

        from horovod.spark.common.store import Store

        store = Store.create(path)
        root = store.prefix_path
        done = store.join(root, "metadata.json")
        if not store.exists(done):
            raise FileNotFoundError(f"{path} holds no saved estimator or model (no metadata.json: "
                                    "never saved there, or the save did not finish).")
        info = store.read_json(done)
        want = f"{self.cls.__module__}.{self.cls.__qualname__}"
        if info["class"] != want:
            raise TypeError(f"{path} holds a {info['class']}, not a {want}; load it with that class.")
        values = self.cls._params_from_bytes(pickle.loads(store.read_bytes(store.join(root, "params.pkl"))))
        obj = self.cls(**values)
        obj._resetUid(info["uid"])
        return obj


class HorovodWritable(MLWritable):
    """``obj.save(path)`` / ``obj.write()`` through ``HorovodWriter`` (upstream's ``*ParamsWritable``)."""

    def write(self) -> HorovodWriter:
        return HorovodWriter(self)


class HorovodReadable(MLReadable):
    """``Cls.load(path)`` / ``Cls.read()`` through ``HorovodReader`` (upstream's ``*ParamsReadable``)."""

    @classmethod
    def read(cls) -> HorovodReader:
        return HorovodReader(cls)
