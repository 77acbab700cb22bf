"""Tuning options of an engine: one typed object instead of settings read from the environment.

Every field has the default the measurements in ``docs/benchmarks.md`` chose; a caller changes one to compare
(``scripts/lab/``), to test a code path on small data (the tests), or to pin a tiling. ``Engine(options=...)`` takes
it; the backend reads the fields that concern it from the engine's calls.
"""
from __future__ import annotations

from dataclasses import dataclass

from .checks import check_choice, check_int, is_int
from .errors import InputError

FUSED_MODES = ("auto", "force", "off")
RESCORE_PATHS = ("fused", "gemm")
CERTIFIED_EXACT_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class EngineOptions:
    """How an engine searches; none of these change an answer.

    Attributes
    ----------
    tiles : (int, int, int), optional
        (users per block, items per tile, item tiles per strided-batched GEMM call) every search starts from before
        the memory budget caps it; None: the ``recall tune`` cache, else the backend's heuristic.
    min_user_block : int
        Users per block at least (0: no minimum). Searches of a part of the items (the job runner's search while
        the items load) are short per block: larger blocks keep the host's launching from holding the device back.
    cuda_graphs : bool
        GPU: replay each block's launches as a CUDA graph from the second block on (False: launch eagerly).
    seed_thresholds : bool
        Start each user block's thresholds at its k-th best score over a sample of the items (False: at -inf). On
        the CPU from k = 300 on (``numpy.backend.seed_size``).
    seed_estimate : bool
        GPU, fast mode's float16 passes (and exact mode's certified route): start each seeded user at an *estimate*
        of its k-th best (a rank of a sample of evenly spaced items, ``selection.estimate_rank``: cosine, l2, and
        inner-product passes where it is tight) rather than a lower bound, so that fewer items a user pass the
        filter (at k = 2,048 of 1M items, about 4,100 expected instead of 78,000). The certificate checks every user
        as before, counting the items below the estimate as left out; a user whose estimate was too high is widened.
        CPU, exact searches seeded from a sample (k >= 300): start each user at an estimate of its k-th best over as
        many evenly spaced items (``NumpyBackend._seed``); a user left with fewer than k items above it is
        searched again from the lower bound, so the answer is the same. False: lower bounds only.
    fused : {"auto", "force", "off"}
        GPU: score and filter in one kernel where it applies ("auto": seeded searches of exact mode's float32
        vectors of at most 256 dimensions (``fused.cu``, k up to 8,192) or fast mode's float16 ones of at most 128
        columns (``fused_h.cu``, tensor cores; 144 on Hopper, ``fused_w.cu``), and unseeded ones whose candidate
        buffer holds two segments; "force": also other unseeded ones; "off": cuBLAS + filter).
    fused_segment : int
        GPU fused path: items per launch (each followed by a merge of the candidates).
    fused_first_segment : int or "auto"
        GPU fused path, searches seeded from a threshold sample: items of the first launch, whose merge raises each
        user's threshold from the sample's k-th best (about the (k x items / sample)-th best of the catalogue) to
        the k-th best of those items before the rest are scored (0: a whole segment; rounded up to whole tiles of
        128 items, at most a segment). Fewer scores then pass the filter, at the cost of one more merge. "auto":
        sqrt(sample x items) where the sample is evenly spaced and that is at most half the catalogue, else a whole
        segment (``fused.first_launch``: the fewest scores passed on the CPU's count; not yet timed on a GPU).
    fused_tiles_per_block : int
        GPU fused path: item tiles of 128 rows each thread block walks.
    warpgroup_mma : bool
        GPU fused path of float16 rows: on Hopper (compute capability 9.0), the kernel on the warpgroup tensor-core
        instruction (``fused_w.cu``, wgmma); False: ``fused_h.cu``'s mma.sync kernel, which other GPUs run.
    fused_walk : bool
        GPU fused path on Hopper, for development: True takes *the walk* for float16 passes of fast mode and the
        certified route that keep at most 32 candidates a user (k up to 15) of rows of at most 80 columns, in
        searches of at least 16,384 users: each block of 128 users scores the whole catalogue in one kernel and
        keeps its candidates in shared memory (``walk_w.cu``), with no threshold sample and no merges. The answers
        are the same; as of 2026-12-06 the walk is slower than the sampled, segmented search (False, the default)
        in every cell measured (docs/benchmarks.md).
    fused_seed : bool
        GPU fused path on Hopper: float16 passes of fast mode and the certified route that keep at most 32
        candidates a user (k up to 23 where they start at the need, ``fast.NEED_MARGIN``; 15 otherwise), in
        searches without exclusions, score their threshold sample and select each user's threshold in one kernel
        (``seed_w.cu``), no sampled score written to memory. False: cuBLAS's GEMM writes the sample's scores and a
        select reads them back (other GPUs, larger k, exclusions). The thresholds are lower bounds either way, and
        the answers the same.
    rescore : {"fused", "gemm"}
        GPU re-scoring: one fused gather + dot + select kernel, or gather + strided-batched GEMM + select (the
        CPU's path).
    few_user_tiles : bool
        CPU: a search of fewer users than the preferred user block takes item tiles as much wider (score tiles of
        1 MiB, at most 8,192 items): one user against 100,000 items runs 13 tiles instead of 196. A batch job's
        engines turn it off, so that a short last batch keeps the tiles its item shards are cut on.
    seed_sample : int
        Items in each block's threshold sample (``seed_thresholds``). CPU (k >= 300): 0: the rule
        (``numpy.backend.seed_size``); a size asked for is taken from catalogues of at least twice it, if it is at
        least 2 k. GPU: 0: the rule, 8,192 or 32 k, whichever is more, from a catalogue of at least 8 times that,
        else (where k is large for the catalogue) the largest power of two at most a quarter of it. At most one
        segment of the cuBLAS path (``tiles``' items per tile x tiles per call); a size asked for here is taken
        from a catalogue of at least twice it. A larger sample costs its products and selection, and passes fewer
        scores on.
    fast_sample : int
        Fast precision: the most users a large search scores first, to find out whether the certificate pays (1/50
        of the users, at most this many, when that is at least 128); where too many of them fall back, the other
        users are searched in exact mode (``stats["fast_declined"]``). A search too small to sample declines where
        the engine's last fast search of the same k did not pay, but for a recheck after 16 such searches (twice as
        many after each recheck that did not pay, up to 256), which finds out afresh. 0: never sample, nor decline
        for the last search.
    certified_exact : {"auto", "on", "off"}
        Exact precision: find each user's candidates with fast mode's certified float16 pass and re-score them with
        the exact search's own float32 arithmetic (every dimension in order, one FMA each: the fused kernel's sums,
        bit for bit), so that the answer is exact mode's, scores included (``stats["route"]`` says "certified").
        "auto": where the backend finds it faster (the GPU: wherever exact mode's search would run its fused
        kernel, and wherever the vectors are wider than that kernel takes, more than 256 dimensions, in searches of
        at least ``float16_min_scores`` scores whose users are on the device or fit in the memory budget; above 256
        dimensions exact mode's other search is cuBLAS's GEMM, whose order of summation is its own choice per shape:
        the route's ordered sums are exact float32 sums as much as cuBLAS's are, and may differ from them in the
        last bit);
        "on": wherever the backend can repeat its exact arithmetic (the CPU emulates the fused kernel's sums: for
        tests); "off": never. The float16 copy of the items (half the float32 matrix) is kept by the engine.
    float16_min_scores : int, optional
        Searches of fewer user x item scores than this run no float16 pass: fast precision searches in exact
        precision (``stats["fast_declined"]`` says why) and exact precision's "auto" keeps its float32 search. None
        (the default): the measured rule (``fast.min_scores``): 2^29 scores on catalogues of fewer than 65,536 items,
        2^30 on larger ones, at up to 64 dimensions (lower for wider rows: 2^27 from 256 on), below which the
        float16 pass's own steps (its threshold sample, the users' float16 copies, the re-scoring, the certificate's
        checks) cost more than its products save. 0: every search (tests, and studying the route on small data).
    fast_emulation : bool
        Fast precision on a backend whose float16 arithmetic is no faster than its float32 search (the CPU:
        ``Backend.float16_faster``): True runs fast mode's passes there, the GPU's float16 arithmetic emulated, with
        their certificates, widened passes and fallbacks (for tests and for studying the certificate: about twice
        exact precision's time). False (the default): such a backend searches in exact precision, whose answer fast
        mode certifies equal, at exact precision's speed, and ``stats["fast_declined"]`` says so.
    """

    tiles: tuple[int, int, int] | None = None
    min_user_block: int = 0
    cuda_graphs: bool = True
    seed_thresholds: bool = True
    seed_estimate: bool = True
    fused: str = "auto"
    fused_segment: int = 65_536
    fused_first_segment: int | str = 0
    fused_tiles_per_block: int = 8
    warpgroup_mma: bool = True
    fused_walk: bool = False
    fused_seed: bool = True
    rescore: str = "fused"
    few_user_tiles: bool = True
    seed_sample: int = 0
    fast_sample: int = 2048
    certified_exact: str = "auto"
    float16_min_scores: int | None = None
    fast_emulation: bool = False

    def __post_init__(self) -> None:
        if self.tiles is not None:
            if not (isinstance(self.tiles, tuple) and len(self.tiles) == 3 and all(is_int(t) and t >= 1
                                                                                   for t in self.tiles)):
                raise InputError(f"options.tiles must be three integers >= 1 (users, items per tile, tiles per "
                                 f"call), got {self.tiles!r}")
        check_int(self.min_user_block, "options.min_user_block", 0)
        check_choice(self.fused, FUSED_MODES, "options.fused mode")
        check_int(self.fused_segment, "options.fused_segment")
        if self.fused_first_segment != "auto" and not (is_int(self.fused_first_segment)
                                                       and self.fused_first_segment >= 0):
            raise InputError(f"options.fused_first_segment must be an integer >= 0 or 'auto', got "
                             f"{self.fused_first_segment!r}")
        check_int(self.fused_tiles_per_block, "options.fused_tiles_per_block")
        check_choice(self.rescore, RESCORE_PATHS, "options.rescore path")
        check_choice(self.certified_exact, CERTIFIED_EXACT_MODES, "options.certified_exact mode")
        check_int(self.fast_sample, "options.fast_sample", 0)
        check_int(self.seed_sample, "options.seed_sample", 0)
        if self.float16_min_scores is not None:
            check_int(self.float16_min_scores, "options.float16_min_scores", 0)
        for name in ("cuda_graphs", "seed_thresholds", "seed_estimate", "few_user_tiles", "warpgroup_mma",
                     "fused_walk", "fused_seed", "fast_emulation"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"options.{name} must be True or False, got {getattr(self, name)!r}")


DEFAULT_OPTIONS = EngineOptions()
