"""Many sequences at once on the torch engine (continuous batching): see scheduler.py."""

from .scheduler import BatchConfig, BatchScheduler, QueueFullError, SequenceStream

__all__ = ["BatchConfig", "BatchScheduler", "QueueFullError", "SequenceStream"]
