"""The pandas UDF behind ``HorovodModel.transform``: batched inference on the executors.

(No ``from __future__ import annotations`` here: Spark reads this UDF's type hints.)"""

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pandas as pd


def _as_array(series: pd.Series) -> np.ndarray:
    if series.dtype == object:
        return np.stack([np.asarray(v) for v in series.to_numpy()])
    return series.to_numpy()


def make_udf(make_predict: Callable[[], Callable[[list[np.ndarray]], list[np.ndarray]]],
             outputs: list[tuple[str, int]], return_type: Any) -> Any:
    """A scalar-iterator pandas UDF: the model is built once per task (``make_predict()``), then
    each Arrow batch of rows goes through it. ``outputs``: (name, size) of each prediction."""
    from pyspark.sql.functions import pandas_udf

    def predict(batches: Iterator[tuple[pd.Series, ...]]) -> Iterator[pd.DataFrame]:
        fn = make_predict()
        for cols in batches:
            if isinstance(cols, pd.Series):
                cols = (cols,)
            preds = fn([_as_array(c) for c in cols])
            out = {}
            for (name, size), p in zip(outputs, preds):
                p = np.asarray(p, dtype=np.float64).reshape(len(p), -1)
                out[name] = p[:, 0] if size == 1 else list(p)
            yield pd.DataFrame(out)

    return pandas_udf(predict, return_type)  # type: ignore[call-overload]
