"""Many sequences at once on the torch engine (continuous batching): see scheduler.py."""

from .scheduler import (
    DEFAULT_QUEUE,
    UNLIMITED,
    BatchConfig,
    BatchScheduler,
    QueueFullError,
    SequenceStream,
)

__all__ = [
    "DEFAULT_QUEUE",
    "UNLIMITED",
    "BatchConfig",
    "BatchScheduler",
    "QueueFullError",
    "SequenceStream",
]
