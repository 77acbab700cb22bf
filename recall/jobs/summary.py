"""What a Parquet job did: one summary for ``recall score`` (one or several vectors per user) and ``recall rescore``."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class JobSummary:
    """What a Parquet job did.

    Attributes
    ----------
    kind : {"score", "interests", "rescore"}
        Full searches of one vector per user, of several (``vectors``, ``aggregate``), or re-scoring of each
        user's own candidates (``candidates``).
    users, items, dim, k : int
    metric : str
    device : str
        "cpu" or "gpu".
    device_detail : str
        One line naming the device.
    seconds : float
        Wall time of the whole call, reading included.
    read_s, search_s, write_s : float
        Time spent in each stage. They overlap, so they add up to more than ``seconds`` when overlap works.
    batch_size : int
        Users per batch.
    pairs, unknown_pairs : int
        Exclusion (or candidate) pairs in the file, and of those the pairs ignored because their user or item id is
        unknown.
    out_path : str
    device_busy_s : float
        GPU time spent computing (CUDA events); 0 on the CPU.
    start_s : float
        From the call until users could be searched: items read, engine built, user ids read.
    early_users : int
        Users searched while the items were still being read (``recall.jobs.early``).
    vectors : int
        Interest vectors (kind "interests").
    aggregate : str
        "max" or "sum" (kind "interests").
    candidates : int
        Candidate pairs scored (kind "rescore"), repeats included: a repeated candidate is scored once and listed
        once.
    filter_ids, unknown_filter_ids : int
        Ids in the item filter files (``--allow``, ``--deny``), and of those the ids the items file does not have.
    empty_exclusions : str
        The exclusions file, where it has no pairs (a warning); else "".
    """

    kind: str
    users: int
    items: int
    dim: int
    k: int
    metric: str
    device: str
    device_detail: str
    seconds: float
    read_s: float
    search_s: float
    write_s: float
    batch_size: int
    pairs: int
    unknown_pairs: int
    out_path: str
    device_busy_s: float = 0.0
    start_s: float = 0.0
    early_users: int = 0
    vectors: int = 0
    aggregate: str = ""
    candidates: int = 0
    filter_ids: int = 0
    unknown_filter_ids: int = 0
    empty_exclusions: str = ""

    @property
    def users_per_s(self) -> float:
        return self.users / self.seconds if self.seconds > 0 else float("inf")

    def line(self) -> str:
        """The one-line summary the CLI prints."""
        if self.kind == "rescore":
            what = (f"rescored {self.users:,} users x {self.candidates:,} candidate pairs (of {self.items:,} items), "
                    f"dim {self.dim}")
        elif self.kind == "interests":
            what = (f"scored {self.users:,} users ({self.vectors:,} interest vectors, {self.aggregate}) x "
                    f"{self.items:,} items, dim {self.dim}")
        else:
            what = f"scored {self.users:,} users x {self.items:,} items, dim {self.dim}"
        return (f"{what}, k {self.k}, metric {self.metric}, on {self.device} in {self.seconds:.2f} s "
                f"({self.users_per_s:,.0f} users/s) -> {self.out_path}")

    def stages_line(self) -> str:
        """Per-stage times (overlapping), for ``--verbose``."""
        busy = (f"; GPU busy {self.device_busy_s:.2f} s ({self.device_busy_s / self.seconds:.0%} of wall)"
                if self.device_busy_s and self.seconds > 0 else "")
        return (
            f"start-up {self.start_s:.2f} s (items, engine, user ids"
            + (f"; {self.early_users:,} users searched meanwhile" if self.early_users else "") + "); "
            f"stages (overlapping): read {self.read_s:.2f} s, search {self.search_s:.2f} s, "
            f"write {self.write_s:.2f} s; batch {self.batch_size:,} users; device {self.device_detail}{busy}"
        )

    def warnings(self) -> list[str]:
        """The warnings for ids that are not in the input files (pairs, filter ids), one line each."""
        if self.kind == "rescore":
            pairs = "candidates name a user or item id that is not in the input files; they were skipped"
        else:
            pairs = "exclusion pairs name a user or item id that is not in the input files; they were ignored"
        return unknown_id_warnings(self.pairs, self.unknown_pairs, pairs, self.filter_ids, self.unknown_filter_ids,
                                   self.empty_exclusions)


def unknown_id_warnings(pairs: int, unknown_pairs: int, pairs_text: str, filter_ids: int,
                        unknown_filter_ids: int, empty_exclusions: str = "") -> list[str]:
    """The warning lines of a job whose pair or filter files name ids the input files do not have (every job's), or
    whose exclusions file (``empty_exclusions``, its path) has no pairs: an export that failed quietly would
    otherwise serve every user the items it has seen."""
    out = []
    if empty_exclusions:
        out.append(f"warning: {empty_exclusions}: the exclusions file has no pairs; no item was excluded for any user")
    if unknown_pairs:
        out.append(f"warning: {unknown_pairs:,} of {pairs:,} {pairs_text}")
    if unknown_filter_ids:
        out.append(f"warning: {unknown_filter_ids:,} of {filter_ids:,} item filter ids are not in the items file; "
                   f"they were ignored")
    return out
