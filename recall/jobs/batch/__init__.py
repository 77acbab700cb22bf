"""The nightly batch job (``recall batch``): shards, manifest, lock, resume, executors around the job runner."""
from .job import BatchProgress, BatchRequest, BatchSummary, parse_gpus, run_batch
from .outdir import LOCK, MANIFEST, METRICS, SUCCESS
from .worker import BatchError, JobSpec, ShardResult, ShardScorer, ShardTask, WorkerInfo, row_group_rows

__all__ = ["BatchError", "BatchProgress", "BatchRequest", "BatchSummary", "JobSpec", "LOCK", "MANIFEST", "METRICS",
           "SUCCESS", "ShardResult", "ShardScorer", "ShardTask", "WorkerInfo", "parse_gpus", "row_group_rows",
           "run_batch"]
