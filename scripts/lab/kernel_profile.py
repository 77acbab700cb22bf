"""Where a search's time goes in the cells where it is weakest: each cell timed as shipped and with options
changed, then once with CUDA graphs off and an event pair around every launch of the search (GEMM, fused filter,
merges, mask, seed; fast mode also its re-scoring), summed per kernel. A measurement, not an option: the launches
are wrapped in this process only.

Run from the project root on a GPU machine::

    PYTHONPATH=. python3 scripts/lab/kernel_profile.py [--cells k8192,gpu-fast:4,skewed:200000:20000:32:10:l2,...]
        [--precision fast]
        [--counts] [--host-users] [--json $OUT/kernel_profile.json]

``--counts``: one more search, every fused launch synchronised and the survivors it appended counted per user
(mean, max, users over the buffer's capacity) with the users' mean finite threshold: where a seed starts too low.

With ``--precision fast`` every variant also runs exact mode once (as shipped) for the ratio, and the answers of fast
mode are compared with exact mode's (rows equal, share of users); ``--no-exact-first`` leaves that search out, so
that fast mode runs first in the process.

Median of 3 timed searches after a warm-up (``--repeat``; device users and results, or with ``--host-users`` host
ones; data from ``recall.bench.workloads`` seed 0). ``--interleave``: every variant's engine made first, then rounds of
one search of each in turn, each variant's ratio to the first's taken round by round: for host-bound cells, whose
medians drift by more than the differences measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import inspect
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

from recall import Engine
from recall.bench import exclusions as bench_exclusions
from recall.bench.workloads import generate
from recall.core.options import EngineOptions

# name: (kind, users, items, dim, k, metric, exclusions per user)
CELLS = {
    "S1": ("clustered", 100_000, 1_000_000, 64, 100, "ip", 0),
    "S1-x200": ("clustered", 100_000, 1_000_000, 64, 100, "ip", 200),
    "k8192": ("clustered", 10_000, 1_000_000, 64, 8192, "ip", 0),
    "k4096": ("skewed", 10_000, 1_000_000, 64, 4096, "ip", 0),
    "k2048-l2": ("skewed", 20_000, 1_000_000, 64, 2048, "l2", 0),
    "k1000-cos": ("popular", 20_000, 1_000_000, 64, 1000, "cosine", 0),
    "d256": ("clustered", 20_000, 1_000_000, 256, 100, "ip", 0),
    "k1": ("skewed", 20_000, 1_000_000, 64, 1, "ip", 0),
    "uh-l2-k1000": ("popular", 200_000, 100_000, 32, 1000, "l2", 0),
    "uh-k100": ("skewed", 1_000_000, 100_000, 64, 100, "ip", 0),
    "uh-l2-k2048": ("popular", 200_000, 100_000, 32, 2048, "l2", 0),  # 2,561 candidates a user: 2.6% of the items
    "uh-ip-k1000": ("skewed", 200_000, 100_000, 64, 1000, "ip", 0),  # 1.25% under ip
    "uh-ip-k4096": ("skewed", 100_000, 100_000, 64, 4096, "ip", 0),  # the float32 search, seeded from a bound
    "cos-k2048-130k": ("popular", 100_000, 130_000, 64, 2048, "cosine", 0),
    "cos-k1000-65k": ("skewed", 100_000, 65_536, 64, 1000, "cosine", 0),  # 1.9% of the smallest catalogue ruled on
    "uh-20k-k100": ("skewed", 200_000, 20_000, 64, 100, "ip", 0),  # a small catalogue's threshold sample at k = 100
    # Re-scored shares between 2.6% and 4% (fast.MAX_CANDIDATE_SHARE), every pass on the fused float32-sum path:
    "ip-k3000": ("skewed", 200_000, 100_000, 64, 3000, "ip", 0),  # 3,751 candidates a user: 3.75%
    "cos-k2048-65k": ("skewed", 100_000, 65_536, 64, 2048, "cosine", 0),  # 3.9%
    "l2-k2048-65k": ("popular", 200_000, 65_536, 32, 2048, "l2", 0),  # 3.9%
    "d128-k2500-80k": ("clustered", 100_000, 80_000, 128, 2500, "ip", 0),  # 3.9% of rows of 128
    "l2-k2048-d64": ("skewed", 200_000, 100_000, 64, 2048, "l2", 0),  # 2.6%
    # k above 2,048 within 2% (the re-scoring keeps a K_pad of 4,096 keys a user: one block an SM)
    "ip-k3000-200k": ("skewed", 200_000, 200_000, 64, 3000, "ip", 0),  # 1.9%
    "d128-k2500-160k": ("clustered", 100_000, 160_000, 128, 2500, "ip", 0),  # 1.95%
    "l2-k4000-1m": ("skewed", 20_000, 1_000_000, 64, 4000, "l2", 0),  # 0.5%
    "ip-k3000-400k": ("skewed", 100_000, 400_000, 64, 3000, "ip", 0),  # 0.94%
    "d128-k2500-320k": ("clustered", 50_000, 320_000, 128, 2500, "ip", 0),  # 0.98%
    "ip-k2048-65k": ("skewed", 200_000, 65_536, 64, 2048, "ip", 0),  # 3.9%, k within 2,048
    "d128-k2048-65k": ("clustered", 100_000, 65_536, 128, 2048, "ip", 0),  # 3.9%
    "ties": ("ties", 50_000, 1_000_000, 64, 100, "ip", 0),
    "d32-k10": ("normal", 20_000, 1_000_000, 32, 10, "ip", 0),
    "l2-adv": ("adversarial", 50_000, 1_000_000, 64, 100, "l2", 0),
    "ip-adv": ("adversarial", 50_000, 1_000_000, 64, 100, "ip", 0),  # l2-adv's shape in ip: what l2 costs more
    "d48": ("clustered", 20_000, 1_000_000, 48, 100, "ip", 0),
    "d128-l2": ("clustered", 20_000, 1_000_000, 128, 100, "l2", 0),
    "k1000-sk": ("skewed", 20_000, 1_000_000, 64, 1000, "ip", 0),
    "pop-k100": ("popular", 50_000, 1_000_000, 64, 100, "ip", 0),
    "x20": ("skewed", 20_000, 1_000_000, 64, 100, "ip", 20),  # gpu-quick cell 21
    "k1000-x200": ("skewed", 20_000, 1_000_000, 64, 1000, "ip", 200),  # gpu-quick cell 17
    "d50": ("clustered", 20_000, 1_000_000, 50, 100, "ip", 0),  # rows of 50 floats: not float4 rows
    "d50-k1000-cos": ("skewed", 20_000, 1_000_000, 50, 1000, "cosine", 0),
    "d64": ("clustered", 20_000, 1_000_000, 64, 100, "ip", 0),
    "d96": ("clustered", 10_000, 1_000_000, 96, 100, "ip", 0),  # gpu-quick cell 22
    "d128": ("clustered", 20_000, 1_000_000, 128, 100, "ip", 0),
    "d128-cos": ("normal", 20_000, 1_000_000, 128, 100, "cosine", 0),  # no bound columns: 128 of 136 multiplied
    "d160": ("clustered", 20_000, 1_000_000, 160, 100, "ip", 0),
    "d192-l2": ("skewed", 20_000, 1_000_000, 192, 100, "l2", 0),
    "d256-k1000-cos": ("skewed", 10_000, 1_000_000, 256, 1000, "cosine", 0),  # gpu-quick cell 18
    "d256-x200": ("skewed", 20_000, 1_000_000, 256, 100, "ip", 200),
}

def _size(n: int) -> str:
    """A sample's size in a variant's name: 512, 1k, 16k."""
    return f"{n >> 10}k" if n >= 1024 else str(n)


VARIANTS = {
    "shipped": {},
    "old-plan": {"tiles": (2048, 256, 1), "fused": "off"},  # what k = 8192 ran before the plan kept wide tiles
    "no-seed": {"seed_thresholds": False, "fused": "force"},
    "cublas": {"fused": "off"},
    "seg256k": {"fused_segment": 262_144},
    "seg16k": {"fused_segment": 16_384},
    # Fused searches in segments of 2,048-8,192 items (one of 65,536 as shipped), each followed by a merge that folds
    # the candidates in (and raises the thresholds) only past fused.merge_high_water a user, in the route and the
    # float32 search alone.
    **{f"{pre}seg{n >> 10}k": {"fused_segment": n, **({"certified_exact": "off"} if pre else {})}
       for pre in ("", "float32-") for n in (2048, 4096, 8192)},
    "cta4": {"fused_tiles_per_block": 4},
    "cta16": {"fused_tiles_per_block": 16},
    "cta32": {"fused_tiles_per_block": 32},
    "cta64": {"fused_tiles_per_block": 64},
    "mma": {"warpgroup_mma": False},  # the float16 fused kernel on mma.sync (fused_h.cu) on Hopper too
    # Threshold samples of 2k to 128k items; from 64k on, a segment of the cuBLAS path is widened to hold one.
    **{f"seed{_size(n)}": {"seed_sample": n, **({"tiles": (2048, n // 4, 4)} if n > 32768 else {})}
       for n in (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)},
    # The same samples in the float32 search alone.
    **{f"float32-seed{_size(n)}": {"seed_sample": n, "certified_exact": "off"}
       for n in (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)},
    # The cuBLAS path seeded on a catalogue of fewer than 8 samples (a requested sample needs only 2).
    **{f"cublas-seed{n >> 10}k": {"seed_sample": n, "fused": "off"} for n in (8192, 16384, 32768)},
    "ub4096": {"tiles": (4096, 8192, 4)},  # blocks of 4,096 users: half the launches of a user-heavy search
    # Blocks of 8,192-65,536 users with 3 or 4 tiles of 8,192 items a call, pinned for every pass (the plan's
    # block was 4,096 users before 2026-12-04; 200k x 20k takes 3 tiles), in the route and the float32 search alone.
    **{f"{pre}ub{n}-{t}": {"tiles": (n, 8192, t), **({"certified_exact": "off"} if pre else {})}
       for pre in ("", "float32-") for n in (8192, 16384, 32768, 65536) for t in (3, 4)},
    "nosample": {"fast_sample": 0},  # fast mode without its sample of users searched first
    "float32": {"certified_exact": "off"},  # exact mode's float32 search only
    "route-on": {"certified_exact": "on"},  # the certified route whatever "auto" would choose (no staging decline)
    "walk": {"fused_walk": True},  # float16 passes of k + m + 1 <= 32 walked (walk_w.cu), not sampled and segmented
    # float16 passes of k + m + 1 <= 32 seeded by cuBLAS's GEMM and a select of its scores (as before seed_w.cu)
    "gemm-seed": {"fused_seed": False},
    "gemm-seed-float32": {"fused_seed": False, "certified_exact": "off"},
    "certified": {"certified_exact": "on"},  # exact mode's certified route wherever the backend can take it
    "no-estimate": {"seed_estimate": False},  # the float16 passes seeded from lower bounds only
    # HOOKS: l2's float16 passes sampled evenly (before metrics.centroid_ranks); passes that start where k + n items
    # lie above (fast.NEED_SLACK, 1 shipped), or at their k + m + 1 (before 2026-12-06 23:xx).
    "l2-even": {}, **{f"need{n}": {} for n in (1, 2, 3, 4, 6)}, "need-k": {},
    "ip-uniform": {},  # HOOKS: an inner-product engine's float16 passes sampled evenly, so that they estimate
    # HOOKS: the estimate's rank at 3 or 4 standard deviations above its expected count (selection.ESTIMATE_SIGMAS,
    # 5 as shipped), alone and with a threshold sample of 32k items.
    "sigma3": {}, "sigma4": {}, "sigma3-seed32k": {"seed_sample": 32768},
    # HOOKS: at k = 2,048 of 100k items the rule's sample of 8,192 puts the estimate at rank 236 (the block-a-user
    # select); 4,096 items at 4 standard deviations put it at 124, within the warp-a-user select's 128.
    "sigma4-seed4k": {"seed_sample": 4096},
    # HOOKS: seeded searches on the fused path up to k = 4,096 only, float32 and float16 passes alike (before
    # fused.FUSED_SEEDED_MAX_K / FUSED_HALF_SEEDED_MAX_K took k = 8,192): as shipped, and the float32 search alone.
    "seeded-k4k": {}, "float32-k4k": {"certified_exact": "off"},
    # HOOKS: passes that may start at an estimate (not ``bound``) with the rule's whole threshold sample (before
    # selection.ESTIMATE_SAMPLE_SHARE, 2026-12-05), or a quarter of it, where the estimate applies.
    "est-whole": {}, "est-quarter": {},
    # HOOKS: the first pass's margin (certificate.margin) narrowed: 16 at every k, 64, or where k + 17 candidates fit
    # a smaller power of two than k + k/4 + 1, up to that power (k = 1,000: 23).
    "m16": {}, "m64": {}, "m-pow2": {},
    # HOOKS: a first margin of 2, 4 or 8 up to k = 64 (16 from there, k/4 from k = 64 on as shipped), now that passes
    # start at the need (scripts/lab/need_counts.py --margins: 2-4 certified every user counted at k = 10 and 50).
    "m2-small": {}, "m4-small": {}, "m8-small": {},
    # HOOKS: the first margin where passes start at the need below k = 64 (fast.NEED_MARGIN, 2026-12-07) off (the
    # certificate's, as before), or within the power of two holding k + 5.
    "need-margin-off": {}, "need-margin-4": {},
    # HOOKS: the warp merges' K-th key found one bit a step, every register counted (topk.cu RECALL_MERGE_BITWISE,
    # before 2026-12-07: two bits a step over the registers in use), in the route and the float32 search; and the
    # fused path's candidate buffers at the rule's room whatever the catalogue (selection.fused_capacity without
    # its items, before 2026-12-07: 16,384 keys a user at k <= 512).
    # HOOKS: threshold samples sized as for a search that starts at its sample's bound (selection.seed_size's
    # bound=True): no halving for an estimate, which a pass that then starts at a ranked sample's bound does not use
    # (4,096 items at k = 50: 1,024 sampled, not 512; counted on the CPU, 75 scores a user pass, not 135).
    "sample-bound-size": {}, "float32-sample-bound-size": {"certified_exact": "off"},
    # HOOKS: small catalogues' samples halved for a pass that may start at an estimate whether or not it would
    # estimate from the half, whatever the items' norms (selection.seed_size before 2026-12-07: 512 items at k = 50
    # on 4,096 under ip; since, 1,024 where the items' norms are close, DeviceItems.loose_ranking).
    "sample-halved": {},
    # HOOKS: a pass whose sample is ranked starts at the need's rank of it (a bound) even where the rule would
    # estimate over evenly spaced rows (selection.start_rank's ESTIMATE_EVEN_MU): with sample-bound-size, k = 50 on
    # 4,096 items starts at the 53rd of 1,024 ranked rows, not the 35th of 1,024 evenly spaced ones (counted on the
    # CPU: 75 scores a user pass on clustered ip against 210).
    "ranked-bound": {},
    # HOOKS: ranked threshold samples (ip's largest norms, l2's items nearest the centroid) that keep a half, a
    # quarter, an eighth or none of their rows evenly spaced whatever the users (tiled.EVEN_EVERY 2, 4, 8, 0; as
    # shipped, a half or none, whichever tiled.probed_even_every finds passes fewer scores; even2: the rule before
    # 2026-12-07), in the route and in the float32 search.
    **{f"{pre}even{n}": ({"certified_exact": "off"} if pre else {}) for pre in ("", "float32-")
       for n in (2, 4, 8, 0)},
    "merge-bitwise": {}, "float32-merge-bitwise": {"certified_exact": "off"}, "cap-off": {},
    # HOOKS: the warp merges' users of more than 8 x 32 keys by the radix select (topk.cu RECALL_MERGE_NO_STREAM,
    # before 2026-12-07: since, up to 1,023 keys the rest are read from the buffer at each count). The route's float16
    # merge (recall_merge_fused_hw8) builds so with 61 registers and no spill (64 streaming); the float32 search's
    # (recall_merge_fused_w8) spills there (48 registers), so no float32 variant.
    "merge-radix": {},
    "float32-cap-off": {"certified_exact": "off"},
    # HOOKS: row norms (l2's finished scores) and cosine's scaling on the device as array operations over a float64
    # copy of the rows (before the one-pass metrics.row_norms and _normalise, 2026-12-07), also in the float32 search.
    "norms-copy": {}, "float32-norms-copy": {"certified_exact": "off"},
    # HOOKS: a probe that narrows only within a smaller power of two (before fast.NARROW_FLAT, 2026-12-05).
    "narrow-pow2": {},
    # HOOKS: the threshold sample's select one block a user at every rank (before the warp-a-user select of ranks up
    # to selection.SEED_WARP_RANK), also in the float32 search alone.
    "seed-block": {}, "float32-seed-block": {"certified_exact": "off"},
    # HOOKS: float16 passes that keep float32 scores shifted where users hold bound or bias columns (the rule before
    # 2026-12-04: fast._prepare).
    "shift32": {},
    # HOOKS: the users' float16 copies by certificate.prepare_users' array operations (before Backend.fast_users'
    # kernel).
    "users-arrays": {},
    # HOOKS: the warp re-scoring's short lists sorted four keys a lane over 128, as every list was before rescore.cu's
    # RS_WARP_SHORT (2026-12-06).
    "rescore-sort128": {},
    # HOOKS: the warp re-scoring's rows read a piece of 32 columns in 8 load instructions whatever its width
    # (rescore.cu's RS_ORD_WHOLE_PIECES; before 2026-12-07 l2's last piece of 4 columns took 8, since one).
    "rescore-pieces": {},
    # HOOKS: the fused path's merge of a small state (fused.MERGE_SMALL_K) in blocks of 32, 128 or 256 threads (64
    # shipped; 256 before 2026-12-05), in both searches.
    **{f"{pre}merge{n}": ({"certified_exact": "off"} if pre else {}) for pre in ("", "float32-")
       for n in (32, 128, 256)},
    # HOOKS: fused searches' user blocks (cupy.backend.FUSED_USER_BLOCK, and FUSED_SMALL_USER_BLOCK over at most
    # 4,096 items) of 4,096 users (before 2026-12-04), 8,192 or 16,384, in both searches; and small catalogues' blocks
    # of 32,768 users as before 2026-12-07 (`small-users-off`).
    **{f"{pre}users{n}": ({"certified_exact": "off"} if pre else {}) for pre in ("", "float32-")
       for n in (4096, 8192, 16384, 32768, 65536)},
    **{f"{pre}small-users-off": ({"certified_exact": "off"} if pre else {}) for pre in ("", "float32-")},
    # A seeded fused search's first launch over 2,048-16,384 items (EngineOptions.fused_first_segment; shipped: a
    # whole segment), then the rest in launches of fused_segment: the first launch's merge raises the thresholds from
    # the sample's k-th best to those items' k-th best. sqrt(sample x items) would pass the fewest scores in all
    # (about 2 k sqrt(items / sample) a user, against k items / sample in one launch), in both searches.
    **{f"{pre}first{n >> 10}k": {"fused_first_segment": n, **({"certified_exact": "off"} if pre else {})}
       for pre in ("", "float32-") for n in (2048, 4096, 8192, 16384)},
    # The same at sqrt(sample x items) where the pass starts from evenly spaced sampled rows (l2, cosine, and an
    # inner-product pass that starts at an estimate; fused_first_segment="auto", fused.first_launch;
    # scripts/lab/pass_counts.py counts what passes on the CPU).
    "first-rule": {"fused_first_segment": "auto"},
    "float32-first-rule": {"fused_first_segment": "auto", "certified_exact": "off"},
    # HOOKS (l2 only): the float32 search's samples half from the items nearest the items' centroid, as ip's from
    # the largest norms (scripts/lab/pass_counts.py: 1.3-2.9x fewer scores pass on the CPU's count), alone and with
    # a first launch of sqrt(sample x items).
    "float32-l2-centroid": {"certified_exact": "off"},
    "float32-l2-centroid-first-rule": {"fused_first_segment": "auto", "certified_exact": "off"},
    # HOOKS: fused_w.cu built with -DRW_DIRECT_APPEND: a global atomic a survivor (before commit 2d5939c,
    # 2026-12-04), where the kernel now keeps each user's survivors in shared memory and asks one atomic for many.
    "direct-append": {},
    # HOOKS: fused_w.cu built with -DRW_SBO_PAD=16: each row group of 8 rows of a tile 16 bytes further on, so that
    # the row groups start on other shared-memory banks (shipped: 16 * columns bytes apart, a multiple of 128).
    "sbo-pad16": {}, "sbo-pad16-cta32": {"fused_tiles_per_block": 32},
    # HOOKS: the warp-a-user threshold select built with -DRECALL_SEED_BISECT (topk.cu): the bisection at every rank
    # (before 2026-12-05, when ranks up to 32 took the pops), in both searches.
    "seed-bisect": {}, "float32-seed-bisect": {"certified_exact": "off"},
    # HOOKS: the warp-a-user select keeping 16 keys a lane at every rank (before 2026-12-06: 8 up to rank 64 since)
    "seed-m16": {}, "float32-seed-m16": {"certified_exact": "off"},
    # HOOKS: the 8-key warp select up to rank 16 or 32 only (64 since 2026-12-06 07:xx; the route's rank at k = 10 is
    # 27: k + its margin + 1)
    "seed-m8r16": {}, "seed-m8r32": {}, "float32-seed-m8r16": {"certified_exact": "off"},
    # HOOKS: fused_w.cu built with -DRW_A_REGS=1: the users' operand in registers (wgmma's RS form), each product
    # reading only the items' tile from shared memory.
    "a-regs": {}, "a-regs-cta32": {"fused_tiles_per_block": 32},
    # HOOKS: passes of more than 32 candidates (k = 50's 64) seeded by cuBLAS's GEMM and recall_seed_warp, as before
    # seed_w.cu's `_wide` kernels (fused.SEED_W_MAX_K 32).
    "seed-w-narrow": {},
    # HOOKS: seed_w.cu built with -DRS_LOWER: the sampled scores lowered by their margins (the rule before 2026-12-07:
    # as recall_seed_warp's over cuBLAS's sums).
    "seed-lower": {},
    # HOOKS: seed_w.cu's lanes push each key into their kept ones in turn (-DRS_PUSH; before a tile's 32 keys a user
    # were taken a batch at a time, recall_seed_take).
    "seed-push": {},
    # HOOKS: fused_w.cu's stage of 32 survivors a user up to 80 columns (-DRW_STAGE32; before 2026-12-07, since as many
    # as two blocks an SM leave room for: 96 at 16 columns down to 32 at 80, fused.wgmma_staged).
    "stage32": {},
    # HOOKS: fused_w.cu's scores tested in groups of 4, 8 (before 2026-12-07) or 32 a user (-DRW_GROUP; 16 shipped).
    "group4": {}, "group8": {}, "group32": {},
    # HOOKS: fused_h.cu's recall_append_group (both float16 kernels) with a group's survivors' bits from a comparison
    # and a predicated or a score (-DRH_BITS_SET: 45 instructions against 52 at d = 32, sass_epilogue.py), its slots
    # taken with one atomic a group (-DRH_GROUP_RESERVE), or both.
    "bits-set": {}, "group-reserve": {}, "bits-set-reserve": {},
    # HOOKS: every block's results through the state's buffers and a copy (before pipeline.DIRECT_OUT_USERS).
    "copy-out": {},
    # HOOKS: in-place blocks copy device users into their slot first (before they were read where they are).
    "slot-users": {}, "float32-slot-users": {"certified_exact": "off"},
    # HOOKS: the backend's row norms by metrics.row_norms' array operations (before CupyBackend.row_norms' kernel).
    "norms-ops": {}, "float32-norms-ops": {"certified_exact": "off"},
    # HOOKS: l2's finished scores by two array operations (2·s, then less |u|²), as before CupyBackend.finish_l2's one
    # kernel (2026-12-07), in both searches.
    "l2-finish-ops": {}, "float32-l2-finish-ops": {"certified_exact": "off"},
    # HOOKS: ordered re-scoring a block a user at every list length (before rescore.WARP_KEYS's warp a user).
    "block-rescore": {},
    "direct-append-block-rescore": {},
    # HOOKS: the fused path's merge one block a user at every k (before 2026-12-06 17:xx: fused.MERGE_WARP_K 0), or
    # one warp a user holding 8 or 16 keys a lane in registers (MERGE_WARP_HELD), in the route and the float32 search
    # alone.
    **{f"{pre}merge-{v}": ({"certified_exact": "off"} if pre else {}) for pre in ("", "float32-")
       for v in ("block", "held8", "held16")},
    # HOOKS: the host's passes (core.host_threads: the pipeline's copies of excluded rows into pinned memory) on at
    # most 1, 2 or 4 threads (8 shipped), in both searches: whether those copies and the uploads from pinned memory
    # slow each other.
    **{f"{pre}copy{n}": ({"certified_exact": "off"} if pre else {}) for pre in ("", "float32-") for n in (1, 2, 4)},
}


def _parts(vname):
    """The variants a variant name combines ("a+b+c"; most names are one)."""
    parts = vname.split("+")
    unknown = [p for p in parts if p not in VARIANTS]
    if unknown:
        raise KeyError(f"unknown variant {', '.join(unknown)} (in {vname!r})")
    return parts


def variant_options(vname):
    """EngineOptions of variant ``vname``; of "a+b", a's options and then b's (the later part's value of an option
    wins)."""
    spec = {}
    for part in _parts(vname):
        spec.update(VARIANTS[part])
    return dataclasses.replace(EngineOptions(), **spec)


def variant_hooks(vname):
    """The hooks of ``vname``'s parts, in order. Two parts that rebuild the same kernels (each hook's ``builds``: two
    fused_w.cu builds, say) do not combine: the later would replace the earlier's kernels, so that is an error."""
    hooks = [HOOKS[p] for p in _parts(vname) if p in HOOKS]
    built = [h.builds for h in hooks if getattr(h, "builds", None)]
    if len(built) != len(set(built)):
        raise ValueError(f"{vname!r}: two of its parts rebuild the same kernels ({', '.join(built)})")
    return hooks


def _l2_centroid(engine):
    """A hook (l2 engines): exact mode's threshold samples (the float32 search's, which start at a bound) take half
    their rows from the items nearest the items' centroid (the largest 2 c.v - |v|^2), as ip's take the largest
    norms. The float16 passes keep theirs: evenly spaced, where they start at an estimate, passed fewer scores on the
    CPU's count than ranked rows at a bound (scripts/lab/pass_counts.py)."""
    import cupy

    from recall.backends import tiled
    from recall.backends.cupy import items as device_items

    vecs = cupy.asarray(engine.prepared_items)[:, :engine.dim].astype(cupy.float64)
    key = -((vecs - vecs.mean(axis=0)) ** 2).sum(axis=1)
    device_items.sample_rows = lambda xp, n, size, norms=None: tiled.sample_rows(
        xp, n, size, None if norms is None else key[:n])
    engine._items.norms_rank = True


def _uniform_samples(engine):
    from recall.engine import fast as fast_mode

    fast_mode._state(engine).resident.norms_rank = False


def _l2_even(engine):
    """A hook: an l2 engine's float16 passes sampled evenly (as before metrics.centroid_ranks, 2026-12-06)."""
    from recall.engine import fast as fast_mode

    resident = fast_mode._state(engine).resident
    if resident.ranks is not None:  # (once: a later round's searches keep the same samples, and their graphs)
        resident.ranks = None
        resident._samples.clear()


#: Variants that change an engine (or a constant of the process) once it is made (lab only): what a rule of the
#: product would choose. Every variant starts from the shipped constants (``main`` restores them).
def _setting(module, **values):
    """A hook: constants of ``recall.<module>`` set to ``values``."""
    def hook(engine):
        mod = importlib.import_module(f"recall.{module}")
        for name, value in values.items():
            setattr(mod, name, value)

    return hook


def _slot_users(engine):
    """A hook: a block given device users to read in place (``_search_slot``'s ``own``) copies them into its slot
    on the compute stream and reads the copy, as every block did before."""
    from recall.backends.cupy import pipeline

    shipped = pipeline.BlockPipeline._search_slot
    sig = inspect.signature(shipped)

    def search_slot(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        own = bound.arguments.get("own")
        if own is not None:
            bound.arguments["slot"].users[:bound.arguments["n"]] = own
            bound.arguments["own"] = None
        return shipped(*bound.args, **bound.kwargs)

    pipeline.BlockPipeline._search_slot = search_slot


def _margin(rule):
    def hook(engine):
        from recall.core import certificate

        certificate.margin = rule

    return hook


def _pow2_margin(k):
    m = max(16, k // 4)
    p = 1 << (k + 16).bit_length()  # the power of two that holds k + 17
    return p - k - 1 if p < 1 << (k + m).bit_length() else m


def _narrow_pow2_only(engine):
    from recall.engine import fast as fast_mode

    fast_mode.NARROW_FLAT = 1 << 30


def _shift_float32(engine):
    import numpy as np

    from recall.core import certificate
    from recall.engine import fast as fast_mode

    def prepare(engine, users, k, margin=None):
        uxp = np if isinstance(users, np.ndarray) else engine.backend.xp
        items = fast_mode._state(engine).items
        half = fast_mode._tiles16(engine, int(users.shape[0]), k, margin)
        held = items.bias_at is not None or (items.norms_at is not None and items.max_resid > 0)
        shift = (fast_mode._sampled_best(engine, users, uxp, fast_mode._first_wide(engine, k, margin))
                 if half or held else None)
        return certificate.prepare_users(uxp, users, items, half_scores=half, shift=shift)

    fast_mode._prepare = prepare


def _users_by_arrays(engine):
    from recall.core import certificate
    from recall.engine import fast as fast_mode

    def prepare_users(engine, users, uxp, half, shift):
        return certificate.prepare_users(uxp, users, fast_mode._state(engine).items, half_scores=half, shift=shift)

    fast_mode._prepare_users = prepare_users


def _direct_append(engine):
    from recall.backends.cupy import kernels

    mod = kernels.hopper_module(kernels.HOPPER_FUSED_SOURCES, ("-DRW_DIRECT_APPEND",))
    assert engine.backend.selection.fused_w  # the shipped module's kernels first (seed_w's stay)
    engine.backend.selection._fused_w = {16 * ks: mod.get_function(f"recall_fused_filter_w{ks}") for ks in range(1, 10)}


_direct_append.builds = "fused_w"


def _seed_bisect(engine):
    """A hook: the warp-a-user threshold select (``recall_seed_warp*``) built with -DRECALL_SEED_BISECT: the rank-th
    largest kept key found by bisection at every rank, where the shipped select pops ranks up to 32."""
    from recall.backends.cupy import kernels, selection

    mod = kernels.module(kernels.SELECTION_SOURCES, ("-DRECALL_SEED_BISECT",))
    engine.backend.selection.seed_warp = selection.seed_warp_kernels(mod)


_seed_bisect.builds = "seed_warp"


def _stage32_smem(padded):
    """fused.wgmma_smem as before 2026-12-07 (fused_w.cu's RW_STAGE32): 32 survivors a user's stage up to 80 columns."""
    from recall.backends.cupy import fused

    ks = padded // 16
    return fused.seed_w_smem(padded) + 128 * (8 * (32 if ks <= 5 else fused.wgmma_staged(padded)) + 4)


def _fused_w_built(*defines, pad=0, smem=None):
    """A hook: the engine's wgmma kernels built with ``defines`` (fused_w.cu's measurement macros); ``pad``: their
    RW_SBO_PAD, whose shared memory fused.wgmma_smem is told of; ``smem``: fused.wgmma_smem's stand-in."""
    def hook(engine):
        from recall.backends.cupy import fused, kernels

        mod = kernels.hopper_module(kernels.HOPPER_FUSED_SOURCES, defines)
        assert engine.backend.selection.fused_w  # the shipped module's kernels first (seed_w's stay)
        engine.backend.selection._fused_w = {16 * ks: mod.get_function(f"recall_fused_filter_w{ks}")
                                             for ks in range(1, 10)}
        if pad:
            shipped = fused.wgmma_smem
            # The padded tiles, less one survivor's stage a user (fused_w.cu's STAGED): no more than shipped.
            fused.wgmma_smem = lambda padded: shipped(padded) + (1 + (2 if padded > 96 else 3)) * 16 * pad - 8 * 128
        if smem is not None:
            fused.wgmma_smem = smem

    hook.builds = "fused_w"
    return hook


def _seed_built(*defines):
    """A hook: the engine's seed_w.cu kernels built with ``defines`` (its measurement macros)."""
    def hook(engine):
        from recall.backends.cupy import kernels, selection

        mod = kernels.hopper_module(kernels.HOPPER_FUSED_SOURCES, defines)
        assert engine.backend.selection.seed_w  # the shipped module's kernels first (fused_w's stay)
        engine.backend.selection._seed_w = selection.seed_w_kernels(mod)

    hook.builds = "seed_w"
    return hook


_seed_lower = _seed_built("-DRS_LOWER")


def _warp_rescore_built(*defines):
    """A hook: the warp re-scoring (rescore.py's ``_warp_kernel``) built with ``defines`` (rescore.cu's measurement
    macros): ``-DRS_WARP_SHORT=0``, every list sorted four keys a lane over 128, as before lists of at most 32 (64) at
    k <= 32 (64) took 1 (2) keys a lane; ``-DRS_ORD_WHOLE_PIECES``, every piece of a row read in 8 load instructions,
    as before a short last piece (l2's 4 columns) took fewer."""
    def hook(engine):
        from recall.backends.cupy import kernels, rescore

        def built(vec):
            expr = f"recall_rescore_warp_t<{int(vec)}>"
            return kernels.module(("rescore.cu",), defines, (expr,)).get_function(expr)

        rescore._warp_kernel = built

    return hook


def _l2_finish_ops(engine):
    """A hook: l2's finished scores by CuPy's two array operations (2·s, then less |u|²), as before
    ``CupyBackend.finish_l2``'s one kernel."""
    from recall.backends.cupy.backend import CupyBackend
    from recall.core import metrics

    CupyBackend.finish_l2 = lambda self, scores, sq: metrics.l2_finished(self.xp, scores, sq)


def _norms_ops(engine):
    from recall.backends.cupy.backend import CupyBackend
    from recall.core import metrics

    CupyBackend.row_norms = lambda self, vecs: metrics.row_norms(self.xp.get_array_module(vecs), vecs)


def _norms_copy(engine):
    import numpy as np

    from recall.backends.cupy import items as device_items
    from recall.core import metrics

    one_pass, one_pass_normalise = metrics.row_norms, metrics._normalise

    def row_norms(xp, vecs):
        if isinstance(vecs, np.ndarray):
            return one_pass(xp, vecs)
        out = xp.empty(vecs.shape[0], dtype=xp.float64)
        for start in range(0, vecs.shape[0], 65_536):
            block = vecs[start:start + 65_536].astype(xp.float64)
            block *= block
            out[start:start + block.shape[0]] = block.sum(axis=1)
        return xp.sqrt(out, out=out)

    def normalise(xp, vecs, what, first_row=0):
        if isinstance(vecs, np.ndarray):
            return one_pass_normalise(xp, vecs, what, first_row)
        norms = row_norms(xp, vecs)
        if bool((norms == 0).any()):
            return one_pass_normalise(xp, vecs, what, first_row)  # (its error)
        return (vecs / norms[:, None]).astype(xp.float32)

    metrics.row_norms = device_items.row_norms = row_norms
    metrics._normalise = normalise


def _warp_merges_built(*defines):
    """A hook: the engine's warp merges (its own backend's) built with ``defines`` (topk.cu's measurement macros)."""
    def hook(engine):
        from recall.backends.cupy import kernels

        mod = kernels.module(kernels.SELECTION_SOURCES, defines)
        sel = engine.backend.selection
        sel.merge_fused_warp = {held: mod.get_function(f"recall_merge_fused_w{held}") for held in (8, 16)}
        sel.merge_fused_h_warp = {held: mod.get_function(f"recall_merge_fused_hw{held}") for held in (8, 16)}

    return hook


_merge_bitwise = _warp_merges_built("-DRECALL_MERGE_BITWISE")


def _seed_size_with(**forced):
    """A hook: selection.seed_size with some of its flags forced (``bound``, ``loose``) whatever the caller passes."""
    def hook(engine):
        from recall.backends.cupy import selection

        rule = selection.seed_size

        def seed_size(n_items, k, capacity, seeded=True, requested=0, bound=False, loose=False):
            return rule(n_items, k, capacity, seeded, requested, **{"bound": bound, "loose": loose, **forced})

        selection.seed_size = seed_size

    return hook


_sample_bound_size, _sample_halved = _seed_size_with(bound=True), _seed_size_with(loose=False)


def _ranked_bound(engine):
    from recall.backends.cupy import pipeline

    rule = pipeline.start_rank

    def start_rank(k, need, size, n_items, ranked=False):
        if not ranked:
            return rule(k, need, size, n_items, ranked)
        need = k if need <= 0 else min(need, k)
        return (need if need < k else 0), False

    pipeline.start_rank = start_rank


def _cap_off(engine):
    from recall.backends.cupy import backend, pipeline, selection

    backend.fused_capacity = pipeline.fused_capacity = lambda k, n_items=0: selection.fused_capacity(k)


def _block_rescore(engine):
    from recall.backends.cupy import rescore

    rescore.takes_warp = lambda *args: False


SELECTION, FUSED = "backends.cupy.selection", "backends.cupy.fused"
SIGMA3, SIGMA4 = _setting(SELECTION, ESTIMATE_SIGMAS=3.0), _setting(SELECTION, ESTIMATE_SIGMAS=4.0)
K4K = _setting(FUSED, FUSED_SEEDED_MAX_K=4096, FUSED_HALF_SEEDED_MAX_K=4096)
BLOCK_SELECT = _setting(SELECTION, SEED_WARP_RANK=0, SEED_WARP_MAX_SIZE=0)
HOOKS = {"direct-append": _direct_append, "block-rescore": _block_rescore,
         "rescore-sort128": _warp_rescore_built("-DRS_WARP_SHORT=0"),
         "rescore-pieces": _warp_rescore_built("-DRS_ORD_WHOLE_PIECES"),
         "direct-append-block-rescore": lambda engine: (_direct_append(engine), _block_rescore(engine)),
         "sbo-pad16": _fused_w_built("-DRW_SBO_PAD=16", pad=16),
         "sbo-pad16-cta32": _fused_w_built("-DRW_SBO_PAD=16", pad=16),
         "seed-bisect": _seed_bisect, "float32-seed-bisect": _seed_bisect,
         **{v: _setting(SELECTION, SEED_WARP_SMALL_RANK=0) for v in ("seed-m16", "float32-seed-m16")},
         **{v: _setting(SELECTION, SEED_WARP_SMALL_RANK=16) for v in ("seed-m8r16", "float32-seed-m8r16")},
         "seed-m8r32": _setting(SELECTION, SEED_WARP_SMALL_RANK=32),
         "a-regs": _fused_w_built("-DRW_A_REGS=1"), "seed-w-narrow": _setting("backends.cupy.fused", SEED_W_MAX_K=32),
         "seed-lower": _seed_lower,
         "seed-push": _seed_built("-DRS_PUSH"),
         "stage32": _fused_w_built("-DRW_STAGE32", smem=_stage32_smem),
         **{f"group{n}": _fused_w_built(f"-DRW_GROUP={n}") for n in (4, 8, 32)},
         "bits-set": _fused_w_built("-DRH_BITS_SET"), "group-reserve": _fused_w_built("-DRH_GROUP_RESERVE"),
         "bits-set-reserve": _fused_w_built("-DRH_BITS_SET", "-DRH_GROUP_RESERVE"),
         "copy-out": _setting("backends.cupy.pipeline", DIRECT_OUT_USERS=2 ** 62),
         **{v: _slot_users for v in ("slot-users", "float32-slot-users")},
         **{v: _norms_ops for v in ("norms-ops", "float32-norms-ops")},
         **{v: _l2_finish_ops for v in ("l2-finish-ops", "float32-l2-finish-ops")},
         "a-regs-cta32": _fused_w_built("-DRW_A_REGS=1"),
         "m16": _margin(lambda k: 16), "m64": _margin(lambda k: max(16, min(64, k // 4))),
         **{f"m{n}-small": _margin(lambda k, n=n: n if k < 64 else max(16, k // 4)) for n in (2, 4, 8)},
         "need-margin-off": _setting("engine.fast", NEED_MARGIN_MAX_K=0),
         "need-margin-4": _setting("engine.fast", NEED_MARGIN=4),
         "norms-copy": _norms_copy, "float32-norms-copy": _norms_copy,
         "merge-bitwise": _merge_bitwise, "float32-merge-bitwise": _merge_bitwise, "cap-off": _cap_off,
         "merge-radix": _warp_merges_built("-DRECALL_MERGE_NO_STREAM"),
         "float32-cap-off": _cap_off, "sample-bound-size": _sample_bound_size, "sample-halved": _sample_halved,
         "float32-sample-bound-size": _sample_bound_size,
         "m-pow2": _margin(_pow2_margin), "narrow-pow2": _narrow_pow2_only,
         "est-whole": _setting(SELECTION, ESTIMATE_SAMPLE_SHARE=1), "ranked-bound": _ranked_bound,
         **{f"{pre}even{n}": _setting("backends.tiled", EVEN_EVERY=n, EVEN_CHOICES=(n,))
            for pre in ("", "float32-") for n in (2, 4, 8, 0)},
         "est-quarter": _setting(SELECTION, ESTIMATE_SAMPLE_SHARE=4),
         "l2-even": _l2_even, **{f"need{n}": _setting("engine.fast", NEED_SLACK=n) for n in (1, 2, 3, 4, 6)},
         "need-k": _setting("engine.fast", NEED_SLACK=1 << 20),
         "ip-uniform": _uniform_samples, "sigma3": SIGMA3, "sigma4": SIGMA4, "sigma3-seed32k": SIGMA3,
         "sigma4-seed4k": SIGMA4, "seeded-k4k": K4K, "float32-k4k": K4K, "seed-block": BLOCK_SELECT,
         "float32-seed-block": BLOCK_SELECT, "shift32": _shift_float32, "users-arrays": _users_by_arrays,
         **{f"{pre}users{n}": _setting("backends.cupy.backend", FUSED_USER_BLOCK=n, FUSED_SMALL_USER_BLOCK=n)
            for pre in ("", "float32-") for n in (4096, 8192, 16384, 32768, 65536)},
         **{f"{pre}small-users-off": _setting("backends.cupy.backend", FUSED_SMALL_USER_BLOCK=32768)
            for pre in ("", "float32-")},
         **{f"{pre}merge{n}": _setting(FUSED, MERGE_SMALL_THREADS=n)
            for pre in ("", "float32-") for n in (32, 128, 256)},
         **{f"{pre}merge-block": _setting(FUSED, MERGE_WARP_K=0) for pre in ("", "float32-")},
         **{f"{pre}merge-held{n}": _setting(FUSED, MERGE_WARP_HELD=n) for pre in ("", "float32-") for n in (8, 16)},
         **{v: _l2_centroid for v in ("float32-l2-centroid", "float32-l2-centroid-first-rule")},
         **{f"{pre}copy{n}": _setting("core.host_threads", MAX_THREADS=n)
            for pre in ("", "float32-") for n in (1, 2, 4)}}


def cell_spec(name):
    """A cell of CELLS, of a bench matrix grid as ``GRID:INDEX`` (e.g. ``gpu-fast:4``), or spelled out as
    ``KIND:USERS:ITEMS:DIM:K:METRIC[:EXCLUSIONS]`` (e.g. ``skewed:200000:20000:32:10:l2``, or with 50 exclusions a
    user ``skewed:200000:20000:32:10:l2:50``; KIND may carry parameters, ``normal:offset=300:1000000:4096:64:10:ip``):
    (kind, users, items, dim, k, metric, exclusions per user)."""
    if name in CELLS:
        return CELLS[name]
    parts = name.split(":")
    metrics = ("ip", "cosine", "l2")
    excl = 1 if len(parts) >= 7 and parts[-2] in metrics else 0
    if len(parts) >= 6 and parts[-1 - excl] in metrics:
        kind = ":".join(parts[:-5 - excl])
        nu, ni, dim, k, metric = parts[len(parts) - 5 - excl:len(parts) - excl]
        return kind, int(nu), int(ni), int(dim), int(k), metric, int(parts[-1]) if excl else 0
    from recall.bench import matrix

    grid, _, index = name.rpartition(":")
    c = matrix.get(grid).cells[int(index)]
    return c.kind, c.n_users, c.n_items, c.dim, c.k, c.metric, c.excl


class _Wrapped:
    """A kernel (or method) standing in for ``fn``: attributes read and set pass through to it; ``log`` collects what
    a subclass's ``__call__`` records under ``name``."""

    def __init__(self, fn, name, log):
        self.fn, self.name, self.log = fn, name, log

    def __getattr__(self, attr):
        return getattr(self.fn, attr)

    def __setattr__(self, attr, value):
        if attr in ("fn", "name", "log"):
            object.__setattr__(self, attr, value)
        else:
            setattr(self.fn, attr, value)


class Timed(_Wrapped):
    """A launch wrapped in an event pair on the current stream, its elapsed time summed under ``name``."""

    def __call__(self, *args, **kwargs):
        import cupy

        stream = cupy.cuda.get_current_stream()
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record(stream)
        out = self.fn(*args, **kwargs)
        b.record(stream)
        self.log.append((self.name, a, b))
        return out


def instrument(backend, log):
    sel = backend.selection
    for name in ("fused", "merge_fused", "merge_fused_h"):
        setattr(sel, name, Timed(getattr(sel, name), name, log))
    if not isinstance(sel.fused_h, dict):  # an older tree's selection (.oldtree/): one float16 kernel
        sel.fused_h = Timed(sel.fused_h, "fused_h", log)
    for table in ("mask", "filter", "merge", "seed_kth", "seed_warp", "fused_h", "fused_w", "seed_w",
                  "merge_fused_warp", "merge_fused_h_warp"):
        d = getattr(sel, table, None)
        if not isinstance(d, dict):  # an older tree's selection (.oldtree/)
            continue
        for dt in list(d):
            label = "/".join(map(str, dt)) if isinstance(dt, tuple) else str(dt)  # (score type, vector type) keys
            d[dt] = Timed(d[dt], f"{table}[{label}]", log)
    backend.gemm_strided_batched = Timed(backend.gemm_strided_batched, "gemm", log)
    backend.rescore = Timed(backend.rescore, "rescore (all its launches)", log)
    if hasattr(backend, "fast_users"):
        backend.fast_users = Timed(backend.fast_users, "users' float16 copies (all its launches)", log)


class Counted(_Wrapped):
    """A fused launch followed by a synchronisation and its survivors counted per user (the kernel's ``cnt``, its last
    argument, read before and after; ``C``, the buffer's capacity, the one before it; ``thr`` four before the end)."""

    def __call__(self, grid, block, args, **kwargs):
        import cupy

        cnt, cap, thr = args[-1], int(args[-2]), args[-4]
        before = cnt.copy()
        out = self.fn(grid, block, args, **kwargs)
        cupy.cuda.Device().synchronize()
        added = (cnt - before).astype(cupy.float64)
        fin = thr[cupy.isfinite(thr)]
        # The shares of users past 4 and 8 keys a lane of the warp merge (fused.MERGE_WARP_HELD: 8 x 32 keys held in
        # registers; more go through the radix select, a warp a user).
        self.log.append((self.name, float(added.mean()), float(added.max()), float((cnt > cap).mean()), cap,
                         float(fin.mean()) if fin.size else float("nan"), int(fin.size),
                         float((added > 128).mean()), float((added > 256).mean())))
        return out


def count_survivors(backend, log):
    """Every fused launch of ``backend`` wrapped in :class:`Counted`."""
    sel = backend.selection
    sel.fused = Counted(sel.fused, "fused", log)
    for table in ("fused_h", "fused_w"):
        d = getattr(sel, table, None) or {}
        for chunk in list(d):
            d[chunk] = Counted(d[chunk], f"{table}[{chunk}]", log)


def phases(log):
    """Fast mode's Python-level phases, each bracketed by device synchronisations (inclusive wall times; the
    sampled users' search nests its own phases): where a search's time outside the timed blocks goes. Returns the
    undo."""
    import cupy

    from recall.engine import fast

    saved = []

    def wrap(module, name, label):
        fn = getattr(module, name)

        def timed_phase(*args, **kw):
            cupy.cuda.Device().synchronize()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                cupy.cuda.Device().synchronize()
                log.append((label, time.perf_counter() - t0))

        saved.append((module, name, fn))
        setattr(module, name, timed_phase)

    wrap(fast, "_search_fast", "fast pass (sampled users, then all)")
    wrap(fast, "_sampled_best", "score shift (sampled items)")
    wrap(fast, "_prepare_users", "users' float16 copies")
    wrap(fast, "_certified_pass", "certified pass (blocks, re-scoring, certificate)")
    wrap(fast, "_search_exact", "exact search (declined or fallback users)")

    def undo():
        for module, name, fn in saved:
            setattr(module, name, fn)

    return undo


def timed_search(engine, users, k, excl):
    """(seconds, result) of one search, the device idle before it and done after it."""
    import cupy

    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    result = engine.search(users, k, exclude=excl)
    cupy.cuda.Device().synchronize()
    return time.perf_counter() - t0, result


def timed(engine, users, k, excl, repeat=3):
    """(median seconds of ``repeat`` searches after a warm-up, the last search's rows)."""
    engine.search(users, k, exclude=excl)
    times = []
    for _ in range(repeat):
        t, result = timed_search(engine, users, k, excl)
        times.append(t)
    return statistics.median(times), result


def interleaved(cell, names, items, users, k, excl, metric, prec, rounds, restore):
    """``--interleave``: each variant's engine made once (every one with the first one's memory budget: a later
    engine's default, a share of the memory left, would halve its plan's user block) and warmed up; then ``rounds``
    rounds of one search of every variant in turn, its hooks applied before each, so that the process's drift
    (a host-bound cell's medians moved 3-6 ms within one process, docs/benchmarks.md) falls on every variant
    alike. Prints and returns, per variant, the median time and the median and range of its ratio to the first
    variant's search of the same round."""
    names = list(dict.fromkeys(names))  # a name given twice is one engine
    engines, budget = {}, None
    for name in names:
        if any(getattr(h, "builds", None) for h in variant_hooks(name)):
            raise ValueError(f"{name!r} rebuilds kernels for the process: it cannot be interleaved")
        restore()
        engine = Engine(items, metric=metric, device="gpu", options=variant_options(name), precision=prec,
                        memory_budget=budget)
        budget = budget or engine.memory_budget
        for hook in variant_hooks(name):
            hook(engine)
        engine.search(users, k, exclude=excl)  # the warm-up: kernels built, graphs captured
        engines[name] = engine
    times = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            restore()
            for hook in variant_hooks(name):
                hook(engines[name])
            times[name].append(timed_search(engines[name], users, k, excl)[0])
    restore()
    out = []
    for name in names:
        ratios = [t / b for t, b in zip(times[name], times[names[0]])]
        st = engines[name].stats
        print(f"| {cell} | {name} | interleaved, {rounds} rounds | median {statistics.median(times[name]):.4f} s | "
              f"x {names[0]} median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f}) | "
              f"route {st.get('route')} busy {st.get('gpu_busy_s', 0):.4f} tiles {st.get('tiles')} even "
              f"{st.get('seed_even_every')} | widened "
              f"{st.get('widened_users')} fallbacks {st.get('fallback_users')} estimate {st.get('seed_estimate')} "
              f"need {st.get('seed_need_rank')} short {st.get('estimate_short_users')} |", flush=True)
        out.append({"cell": cell, "variant": name, "interleaved": rounds, "median_s": statistics.median(times[name]),
                    "ratio_to_first": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
                    "times_s": times[name], "stats": {"route": st.get("route"), "gpu_busy_s": st.get("gpu_busy_s"),
                                                     "tiles": st.get("tiles")}})
    return out


def main() -> None:
    import cupy

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", default=",".join(CELLS))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--precision", default="exact", choices=("exact", "fast"))
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--repeat", type=int, default=3, help="searches timed per variant (their median is reported)")
    p.add_argument("--interleave", action="store_true",
                   help="make every variant's engine first, then time --repeat rounds of one search of each in "
                        "turn, with each variant's ratio to the first's per round (no per-kernel run)")
    p.add_argument("--no-per-kernel", action="store_true", help="skip the run with every launch timed")
    p.add_argument("--per-kernel-variants", default="shipped",
                   help="the variants whose launches are each timed (graphs off), comma-separated")
    p.add_argument("--no-exact-first", action="store_true",
                   help="with --precision fast: no exact-mode search before the variants (fast mode first in the "
                        "process; the first variant is then the reference)")
    p.add_argument("--host-users", action="store_true",
                   help="users (and results) in host memory, as a job's batches and `recall score` give them: the "
                        "route uploads them whole, the float32 search stages them block by block")
    p.add_argument("--counts", action="store_true",
                   help="one more search (graphs off), every fused launch synchronised and its survivors counted")
    p.add_argument("--max-candidate-share", type=float, default=None,
                   help="fast.MAX_CANDIDATE_SHARE and its lower limits (_TILES16, _LARGE_K, _TWO_CHUNKS) for "
                        "this process (1.0: fast mode never declines for its share of re-scored candidates), to "
                        "measure what the decline rule spares")
    a = p.parse_args()
    if a.max_candidate_share is not None:
        from recall.engine import fast as fast_mode

        fast_mode.MAX_CANDIDATE_SHARE = fast_mode.MAX_CANDIDATE_SHARE_TILES16 = a.max_candidate_share
        fast_mode.MAX_CANDIDATE_SHARE_LARGE_K = fast_mode.MAX_CANDIDATE_SHARE_TWO_CHUNKS = a.max_candidate_share
    from recall.backends.cupy import backend as gpu_backend
    from recall.backends.cupy import fused, pipeline, selection
    from recall.backends.cupy import items as device_items
    from recall.backends import tiled
    from recall.backends.cupy import rescore as gpu_rescore
    from recall.core import certificate, host_threads, metrics
    from recall.engine import fast as fast_mode

    # What a variant's hook may change: (module, attribute) and the shipped value, put back before every variant.
    shipped = [(m, name, getattr(m, name)) for m, name in (
        (certificate, "margin"), (selection, "SEED_WARP_RANK"), (selection, "SEED_WARP_MAX_SIZE"),
        (selection, "SEED_WARP_SMALL_RANK"),
        (selection, "ESTIMATE_SIGMAS"), (selection, "ESTIMATE_SAMPLE_SHARE"), (fused, "FUSED_SEEDED_MAX_K"),
        (fused, "FUSED_HALF_SEEDED_MAX_K"), (fused, "SEED_W_MAX_K"),
        (fast_mode, "_prepare"), (fast_mode, "_prepare_users"), (fast_mode, "NARROW_FLAT"),
        (gpu_backend, "FUSED_USER_BLOCK"), (gpu_backend, "FUSED_SMALL_USER_BLOCK"), (gpu_rescore, "takes_warp"),
        (gpu_rescore, "_warp_kernel"),
        (fused, "wgmma_smem"),
        (fused, "MERGE_SMALL_THREADS"), (fused, "MERGE_WARP_K"), (fused, "MERGE_WARP_HELD"),
        (device_items, "sample_rows"), (host_threads, "MAX_THREADS"), (fast_mode, "NEED_SLACK"),
        (fast_mode, "NEED_MARGIN"), (fast_mode, "NEED_MARGIN_MAX_K"), (metrics, "row_norms"),
        (metrics, "_normalise"), (device_items, "row_norms"), (gpu_backend, "fused_capacity"),
        (pipeline, "fused_capacity"), (selection, "seed_size"), (tiled, "EVEN_EVERY"),
        (tiled, "EVEN_CHOICES"), (pipeline, "start_rank"), (pipeline, "DIRECT_OUT_USERS"),
        (getattr(pipeline, "BlockPipeline", None), "_search_slot"),
        (getattr(gpu_backend, "CupyBackend", None), "row_norms"),
        (getattr(gpu_backend, "CupyBackend", None), "finish_l2"))
        if hasattr(m, name)]  # (an older tree's modules lack the newer ones)

    def restore_shipped():
        for module, name, value in shipped:
            setattr(module, name, value)

    prec = a.precision
    out = []
    for cell in a.cells.split(","):
        kind, nu, ni, dim, k, metric, per = cell_spec(cell)
        users, items = generate(kind, nu, ni, dim, seed=0, device="gpu")
        excl = None
        if per:
            ex = bench_exclusions.generate(users, items, per, k=k, seed=0, metric=metric)
            excl = ex.host()
        if a.host_users:
            users = cupy.asnumpy(users)
        base = None
        want = None
        if prec == "fast" and not a.no_exact_first:
            exact = Engine(items, metric=metric, device="gpu")
            t_exact, want = timed(exact, users, k, excl)
            want = want.indices
            print(f"| {cell} | exact mode | {t_exact:.4f} s |", flush=True)
            out.append({"cell": cell, "variant": "exact", "median_s": t_exact})
            del exact
        if a.interleave:
            out.extend(interleaved(cell, a.variants.split(","), items, users, k, excl, metric, prec, a.repeat,
                                   restore_shipped))
            del users, items, excl, want
            gc.collect()
            cupy.get_default_memory_pool().free_all_blocks()
            continue
        for vname in a.variants.split(","):
            restore_shipped()
            # The last variant's engine freed first: the default memory budget is a share of the free memory, and a
            # smaller one halves the plan's user block.
            gc.collect()
            cupy.get_default_memory_pool().free_all_blocks()
            opts = variant_options(vname)
            try:
                engine = Engine(items, metric=metric, device="gpu", options=opts, precision=prec)
                for hook in variant_hooks(vname):
                    hook(engine)
                t, res = timed(engine, users, k, excl, a.repeat)
            except Exception as exc:  # a variant that cannot run this cell says why
                print(f"| {cell} | {vname} | error {type(exc).__name__}: {exc} |", flush=True)
                continue
            base = base or t
            st = engine.stats
            # Fast mode against exact mode; an exact variant against the first variant of the cell (rows, and every
            # score bit for bit).
            got = res.indices
            if want is None:  # the cell's first variant: the reference of the others, compared with nothing
                want, want_scores = got, res.scores
                same = f" | the reference of the cell's other variants, route {st.get('route')}"
            else:
                same = f" | rows equal {'exact' if prec == 'fast' and not a.no_exact_first else 'the first variant'}'s for " \
                       f"{float((got == want).all(axis=1).mean()):.4f} of users"
                if prec == "exact":
                    same += f", scores bit for bit {bool((res.scores == want_scores).all())} route {st.get('route')}"
            print(f"| {cell} | {vname} | {t:.4f} s | x shipped {t / base:.3f} | fused {st.get('fused')} tiles "
                  f"{st.get('tiles')} seed {st.get('seed_sample')} even {st.get('seed_even_every')} busy "
                  f"{st.get('gpu_busy_s', 0):.4f} | scores "
                  f"{st.get('score_dtype')} precision {st.get('precision')} fallbacks {st.get('fallback_users')} "
                  f"widened {st.get('widened_users')} margin {st.get('first_margin')} estimate "
                  f"{st.get('seed_estimate')} need {st.get('seed_need_rank')} short {st.get('estimate_short_users')}"
                  f"{same} |", flush=True)
            keys = ("fused", "tiles", "seed_sample", "gpu_busy_s", "blocks", "score_dtype", "precision",
                    "fallback_users", "widened_users", "first_margin", "seed_estimate", "seed_need_rank",
                    "estimate_short_users", "route", "seed_even_every")
            out.append({"cell": cell, "variant": vname, "median_s": t, "stats": {kk: st.get(kk) for kk in keys}})
            del engine
        restore_shipped()
        if a.no_per_kernel:
            del users, items, excl, want
            cupy.get_default_memory_pool().free_all_blocks()
            continue
        # One search with graphs off, every launch timed (of each of --per-kernel-variants).
        for vname in a.per_kernel_variants.split(","):
            restore_shipped()
            engine = Engine(items, metric=metric, device="gpu", precision=prec,
                            options=dataclasses.replace(variant_options(vname), cuda_graphs=False))
            for hook in variant_hooks(vname):
                hook(engine)
            engine.search(users, k, exclude=excl)
            log = []
            instrument(engine.backend, log)
            cupy.cuda.Device().synchronize()
            t0 = time.perf_counter()
            engine.search(users, k, exclude=excl)
            cupy.cuda.Device().synchronize()
            wall = time.perf_counter() - t0
            per_kernel = defaultdict(lambda: [0, 0.0])
            for name, ev_a, ev_b in log:
                per_kernel[name][0] += 1
                per_kernel[name][1] += cupy.cuda.get_elapsed_time(ev_a, ev_b) / 1e3
            print(f"| {cell} | {vname}: launches timed, graphs off | wall {wall:.4f} s | "
                  + " ; ".join(f"{n} x{c} {s:.4f} s"
                               for n, (c, s) in sorted(per_kernel.items(), key=lambda x: -x[1][1])) + " |", flush=True)
            out.append({"cell": cell, "variant": f"per-kernel {vname}", "wall_s": wall,
                        "kernels": {n: {"launches": c, "s": s} for n, (c, s) in per_kernel.items()}})
        restore_shipped()
        if prec == "fast":  # once more, its phases bracketed by synchronisations
            plog = []
            undo = phases(plog)
            try:
                t0 = time.perf_counter()
                engine.search(users, k, exclude=excl)
                cupy.cuda.Device().synchronize()
                wall = time.perf_counter() - t0
            finally:
                undo()
            per_phase = defaultdict(list)
            for name, sec in plog:
                per_phase[name].append(sec)
            print(f"| {cell} | phases, synchronised | wall {wall:.4f} s | "
                  + " ; ".join(f"{n} " + " + ".join(f"{s:.4f}" for s in secs) + " s" for n, secs in per_phase.items())
                  + " |", flush=True)
            out.append({"cell": cell, "variant": "phases", "wall_s": wall,
                        "phases": {n: {"calls": len(secs), "s": sum(secs), "each_s": secs}
                                   for n, secs in per_phase.items()}})
        if a.counts:
            engine = Engine(items, metric=metric, device="gpu", options=EngineOptions(cuda_graphs=False),
                            precision=prec)
            clog = []
            count_survivors(engine.backend, clog)
            engine.search(users, k, exclude=excl)
            by = defaultdict(list)
            for name, *row in clog:
                by[name].append(row)
            for name, rows in by.items():
                mean = [r[0] for r in rows]
                second = mean[1] if len(mean) > 1 else 0.0
                print(f"| {cell} | survivors {name} x{len(rows)} | per user a launch: mean of means "
                      f"{statistics.mean(mean):.1f}, first launch {mean[0]:.1f}, second {second:.1f},"
                      f" max {max(r[1] for r in rows):.0f}, over 128 {statistics.mean(r[6] for r in rows):.4f}, "
                      f"over 256 {statistics.mean(r[7] for r in rows):.4f} | users over capacity "
                      f"{max(r[2] for r in rows):.4f} "
                      f"(C {rows[0][3]}) | mean finite threshold first / last {rows[0][4]:.4g} / {rows[-1][4]:.4g} |",
                      flush=True)
            out.append({"cell": cell, "variant": "counts", "launches": clog})
        del engine, users, items, excl, want
        cupy.get_default_memory_pool().free_all_blocks()
    if a.json:
        a.json.write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
