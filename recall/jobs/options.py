"""Options of the Parquet jobs, as one typed object (the CLI sets the ones a user needs; the rest are for
measurements, ``scripts/lab/``)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..core.checks import check_budget, check_choice, check_int
from ..core.options import EngineOptions

EARLY_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class JobOptions:
    """How a Parquet job runs; none of these change its output.

    Attributes
    ----------
    early : {"auto", "on", "off"}
        Search the first user batches while the item file is still being read (``recall.jobs.early``): "auto" where
        the backend searches while the host goes on (a GPU) and the job qualifies (``score_files`` in exact
        precision, one vector per user, no item filter, items resident); "on" also on the CPU (tests); "off" never.
    early_parts : int
        Item parts searched while they load: a part closes each time another 1/parts of the rows has arrived (the
        first at 1/(2 parts)). More parts hide more of the decoding, at the cost of one more threshold seed and merge
        per block and part (8 measured best on the S4 job, docs/benchmarks.md).
    engine : EngineOptions
        The engine's options.
    item_memory : int, optional
        Bytes the resident items may take on the device (``recall.Engine``'s ``item_memory``; ``--item-memory``):
        a catalogue that needs more is read into host memory and streamed to the device at every batch. Default:
        what the device holds beside the search's memory budget.
    """

    early: str = "auto"
    early_parts: int = 8
    engine: EngineOptions = field(default_factory=EngineOptions)
    item_memory: int | None = None

    def __post_init__(self) -> None:
        check_choice(self.early, EARLY_MODES, "early-search mode")
        check_int(self.early_parts, "early_parts")
        check_budget(self.item_memory, "item_memory")


DEFAULT_JOB_OPTIONS = JobOptions()
