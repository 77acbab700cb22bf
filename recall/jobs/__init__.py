"""The Parquet jobs: one runner (reader thread, engine, writer threads) behind ``recall score``, ``recall rescore``
and every shard of ``recall batch``."""
from .files import auto_batch_size, rescore_files, score_files
from .options import JobOptions
from .summary import JobSummary

__all__ = ["JobOptions", "JobSummary", "auto_batch_size", "rescore_files", "score_files"]
