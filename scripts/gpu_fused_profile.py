"""Where exact mode's fused path spends its time (run on a GPU machine: PYTHONPATH=. python3 scripts/gpu_fused_profile.py).

Runs the launches of CupyBackend's fused search block by block, eagerly, with CUDA events between the phases (the
threshold seed, the users' transpose, each segment's fused kernel, each segment's merge, the final merge) and prints
the time of each phase summed over the blocks, beside the search's own time. Env: PROFILE_KIND (clustered),
PROFILE_USERS (100000), PROFILE_DIM (64), PROFILE_K (100). Writes fused_profile.json to $OUT if set.
"""
from __future__ import annotations

import json
import os
import time
from collections import defaultdict

import numpy as np


def main() -> None:
    import cupy

    from recall import Engine, scoring
    from recall.backends.cupy_backend import _FUSED_TILE
    from recall.bench.workloads import generate

    kind = os.environ.get("PROFILE_KIND", "clustered")
    n_users, dim, k = (int(os.environ.get(n, d)) for n, d in
                       (("PROFILE_USERS", "100000"), ("PROFILE_DIM", "64"), ("PROFILE_K", "100")))
    users, items = generate(kind, n_users, 1_000_000, dim, seed=0, device="gpu")
    engine = Engine(items, device="gpu")
    engine.search(users[:5000], k)
    cupy.cuda.Device().synchronize()
    t = time.perf_counter()
    engine.search(users, k)
    cupy.cuda.Device().synchronize()
    whole = time.perf_counter() - t
    be = engine.backend
    plan = scoring.plan_tiles(n_users, engine.n_items, dim, k, engine.memory_budget, be.preferred_tiles(dim, k),
                              be.state_bytes(k))
    ws = next(w for w in be._ws.values() if w.users_t is not None)
    state, slot = ws.state, ws.slots[0]
    seed = be._refresh_sample(ws, plan, items, engine.n_items, k, dim)
    items_t = be._transpose_items(items, engine.n_items, dim)
    no_excl = slot.ex_items[:0]
    slot.ex_ptr.fill(0)
    phases: dict[str, float] = defaultdict(float)
    stream = be.compute_stream
    with stream:
        for s0 in range(0, n_users, plan.user_block):
            n = min(plan.user_block, n_users - s0)
            slot.users[:n] = users[s0:s0 + n]
            marks = [("start", stream.record())]
            block_users = slot.users[:n]
            be.topk_reset(state, n)
            be.topk_seed(state, block_users, *seed, ws.scores, slot.ex_ptr, no_excl)
            marks.append(("seed", stream.record()))
            ws.users_t[:dim, :n] = block_users.T
            marks.append(("transpose", stream.record()))
            dp, ldu = ws.users_t.shape
            smem = 4 * _FUSED_TILE * (dp + 64)
            tiles = -(-engine.n_items // _FUSED_TILE)
            seg, per_cta = be.fused_segment // _FUSED_TILE, be.fused_tiles_per_cta
            for t0 in range(0, tiles, seg):
                nt = min(seg, tiles - t0)
                be._fused((-(-nt // per_cta), -(-n // _FUSED_TILE)), (256,),
                          (ws.users_t, np.int32(ldu), items_t, np.int64(items_t.shape[1]), np.int32(dp), np.int32(t0),
                           np.int32(nt), np.int32(per_cta), np.int32(engine.n_items), np.int32(n), state.thr,
                           state.cand, np.int32(state.cand_capacity), state.cnt), shared_mem=smem)
                marks.append(("fused kernel", stream.record()))
                start = t0 * _FUSED_TILE
                be._launch_merge_fused(state, ws.users_t, items_t, n, start, min(nt * _FUSED_TILE,
                                       engine.n_items - start), engine.n_items, False, slot.ex_ptr, slot.ex_items,
                                       False)
                marks.append(("segment merges", stream.record()))
            be._launch_merge_fused(state, ws.users_t, items_t, n, 0, 0, engine.n_items, True, slot.ex_ptr,
                                   slot.ex_items, False)
            marks.append(("final merge", stream.record()))
            marks[-1][1].synchronize()
            for (_, a), (name, b) in zip(marks, marks[1:]):
                phases[name] += cupy.cuda.get_elapsed_time(a, b) / 1e3
    total = sum(phases.values())
    print(f"{kind} {n_users} users x {engine.n_items} items x {dim}, k={k}; search {whole:.4f} s "
          f"(tiles {plan.user_block}x{plan.item_tile}x{plan.tiles_per_call}, segment {be.fused_segment}, "
          f"{be.fused_tiles_per_cta} tiles per kernel block)")
    print("| phase | seconds | share |\n| --- | ---: | ---: |")
    for name, sec in phases.items():
        print(f"| {name} | {sec:.4f} | {sec / total:.1%} |")
    print(f"| all (eager, per-phase sync) | {total:.4f} | |")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "fused_profile.json"), "w") as f:
            json.dump({"kind": kind, "users": n_users, "dim": dim, "k": k, "search_s": whole, "phases": phases}, f)


if __name__ == "__main__":
    main()
