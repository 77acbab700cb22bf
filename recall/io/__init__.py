"""Parquet in and out: one embeddings reader (one or several vectors per user), one id reader (exclusion and
candidate pairs, item filters), one atomic candidates writer; the durable-file helpers every writer uses."""
from __future__ import annotations

from .embeddings import (
    EmbeddingFileInfo,
    Embeddings,
    InterestUsers,
    embedding_dim,
    inspect_embeddings,
    inspect_interest_users,
    iter_embedding_batches,
    read_embedding_rows,
    read_embeddings,
    read_ids,
    read_interest_users,
)
from .pairs import IdPairs, ItemSet, inspect_item_set, inspect_pairs, read_item_filter, read_item_set, read_pairs
from .parquet import open_parquet
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
    "IdPairs",
    "ItemSet",
    "InterestUsers",
    "candidates_schema",
    "embedding_dim",
    "check_compression",
    "check_output_path",
    "inspect_embeddings",
    "inspect_interest_users",
    "inspect_item_set",
    "inspect_pairs",
    "iter_embedding_batches",
    "open_parquet",
    "read_embedding_rows",
    "read_embeddings",
    "read_ids",
    "read_interest_users",
    "read_item_filter",
    "read_item_set",
    "read_pairs",
]
