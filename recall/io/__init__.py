"""Parquet in and out: validated embedding and exclusion readers, and the atomic candidates writer."""
from __future__ import annotations

from .parquet import (
    EmbeddingFileInfo,
    Embeddings,
    ExclusionPairs,
    inspect_embeddings,
    inspect_exclusions,
    iter_embedding_batches,
    load_exclusions,
    open_parquet,
    read_embeddings,
    read_exclusions,
    read_ids,
)
from .writer import (
    COMPRESSIONS,
    DEFAULT_COMPRESSION,
    CandidateWriter,
    candidates_schema,
    check_compression,
    check_output_path,
)

__all__ = [
    "COMPRESSIONS",
    "DEFAULT_COMPRESSION",
    "CandidateWriter",
    "EmbeddingFileInfo",
    "Embeddings",
    "ExclusionPairs",
    "candidates_schema",
    "check_compression",
    "check_output_path",
    "inspect_embeddings",
    "inspect_exclusions",
    "iter_embedding_batches",
    "load_exclusions",
    "open_parquet",
    "read_embeddings",
    "read_exclusions",
    "read_ids",
]
