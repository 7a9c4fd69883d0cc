"""hidden-harvest: the job, its intake, the storage format and the offline tools (ARCHITECTURE.md)."""

from pipeline.format.shards import open_shards

__all__ = ["open_shards"]
