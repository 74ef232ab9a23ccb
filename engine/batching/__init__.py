"""Many sequences at once on the torch engine (continuous batching): see scheduler.py."""

from .scheduler import UNLIMITED, BatchConfig, BatchScheduler, QueueFullError, SequenceStream

__all__ = ["UNLIMITED", "BatchConfig", "BatchScheduler", "QueueFullError", "SequenceStream"]
