"""What a logger emitted during a block, for tests.

A handler on the named logger itself, not pytest's ``caplog``: ``hvd.init()`` in an earlier test
of the same pytest process stops the ``horovod`` logger from propagating to the root logger,
where ``caplog`` listens, and some of horovod's loggers never propagate (the elastic session's).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["records_of"]


class _Kept(logging.Handler):
    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def records_of(name: str, level: int = logging.DEBUG) -> Iterator[list[logging.LogRecord]]:
    """The records logger ``name`` emits at ``level`` and above inside the block (the list fills
    as they come); the logger's level is lowered to ``level`` meanwhile where it was higher, and
    put back after."""
    logger = logging.getLogger(name)
    kept, saved = _Kept(level), logger.level
    logger.addHandler(kept)
    if logger.getEffectiveLevel() > level:
        logger.setLevel(level)
    try:
        yield kept.records
    finally:
        logger.removeHandler(kept)
        logger.setLevel(saved)
