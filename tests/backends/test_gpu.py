"""GPU-only behaviour of the CuPy backend: streams, pinned staging, graph replay, workspaces, device arrays.

The shared engine tests run on the GPU through the ``device`` fixture; these cover what only the GPU path has.
Integer-valued data makes float32 scores exact, so GPU results must equal the CPU backend's bit for bit.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from recall import Engine, EngineOptions
from recall.backends import cuda_status
from recall.core.errors import ResourceError

from oracle import as_numpy, assert_same_result as _same, assert_topk_close, int_matrix as _ints

usable, reason = cuda_status()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not usable, reason=f"no usable GPU: {reason}")]


@pytest.fixture
def small_tiles():
    """Many blocks and segments on a small problem: both pipeline slots, graph capture and replay all run."""
    return EngineOptions(tiles=(64, 300, 3))


def test_many_blocks_equal_cpu_exactly(small_tiles):
    rng = np.random.default_rng(0)
    items, users = _ints(rng, 2500, 12), _ints(rng, 700, 12)
    excl = {u: rng.choice(2500, 40, replace=False).tolist() for u in range(0, 700, 3)}
    gpu = Engine(items, device="gpu", options=small_tiles)
    got = gpu.search(users, 37, exclude=excl)
    want = Engine(items, device="cpu").search(users, 37, exclude=excl)
    _same(got, want)
    assert gpu.stats["blocks"] == 11 and gpu.stats["graph_blocks"] >= 9


@pytest.mark.parametrize("wire_rows", [2 ** 31, 0], ids=["int32-wire", "int64-wire"])
@pytest.mark.parametrize("fused", ["auto", "off"])
def test_exclusions_staged_in_either_wire_dtype_equal_cpu(small_tiles, monkeypatch, wire_rows, fused):
    """Excluded rows cross to the device as int32 (widened there) or int64 (WIRE32_ROWS): blocks with many, then
    few, then no exclusions reuse the slots' buffers (rows past a block's own are stale), a user excludes every
    item, another the last row."""
    from recall.backends.cupy import pipeline

    monkeypatch.setattr(pipeline, "WIRE32_ROWS", wire_rows)
    rng = np.random.default_rng(3)
    n_items = 900
    items, users = _ints(rng, n_items, 12), _ints(rng, 700, 12)
    excl = {u: rng.choice(n_items, 300, replace=False).tolist() for u in range(0, 128)}  # blocks 0-1: many
    excl.update({u: rng.choice(n_items, 3, replace=False).tolist() for u in range(200, 400, 7)})  # then few
    excl[5] = list(range(n_items))  # every item
    excl[250] = [n_items - 1]
    options = replace(small_tiles, fused=fused)
    gpu = Engine(items, device="gpu", options=options)
    cpu = Engine(items, device="cpu")
    for k in (1, 37):
        got = gpu.search(users, k, exclude=excl)
        _same(got, cpu.search(users, k, exclude=excl))
        assert np.all(as_numpy(got.indices)[5] == -1)
    assert gpu.stats["blocks"] == 11


def test_graph_replay_equals_eager_launches(small_tiles):
    rng = np.random.default_rng(1)
    items, users = rng.standard_normal((3000, 16), dtype=np.float32), rng.standard_normal((500, 16), dtype=np.float32)
    graphs = Engine(items, device="gpu", options=small_tiles)
    with_graphs = graphs.search(users, 50, exclude={4: [1, 2, 3]})
    assert graphs.stats["graph_blocks"] > 0
    eager = Engine(items, device="gpu", options=replace(small_tiles, cuda_graphs=False))
    without = eager.search(users, 50, exclude={4: [1, 2, 3]})
    assert eager.stats["graph_blocks"] == 0
    _same(with_graphs, without)


def test_workspace_and_graphs_reused_across_searches(small_tiles):
    rng = np.random.default_rng(2)
    items = _ints(rng, 2000, 8)
    engine = Engine(items, device="gpu", options=small_tiles)
    cpu = Engine(items, device="cpu")
    for seed in range(3):
        users = _ints(np.random.default_rng(10 + seed), 300 + 50 * seed, 8)
        excl = {0: [5, 6]} if seed == 1 else None
        _same(engine.search(users, 20, exclude=excl), cpu.search(users, 20, exclude=excl))


def test_a_small_catalogues_buffers_and_blocks_follow_its_items():
    # selection.fused_capacity of the search's items: 3,000 items give candidate buffers of 4,096 keys a user (the
    # rule's room 16,384 at k = 20), fused blocks of FUSED_SMALL_USER_BLOCK users; a larger catalogue on the same
    # backend gets its own workspace of the rule's room, not the small one's. Answers the CPU's, fused and not.
    from recall.backends.cupy import backend as gpu_backend

    rng = np.random.default_rng(4)
    small, large = _ints(rng, 3000, 8), _ints(rng, 20000, 8)
    users = _ints(rng, 700, 8)
    engine = Engine(small, device="gpu", options=EngineOptions(fused="force"))
    backend = engine.backend
    for n_items, want in ((3000, gpu_backend.FUSED_SMALL_USER_BLOCK), (4096, gpu_backend.FUSED_SMALL_USER_BLOCK),
                          (4097, gpu_backend.FUSED_USER_BLOCK), (20000, gpu_backend.FUSED_USER_BLOCK)):
        assert backend.preferred_tiles(8, 20, np.float32, 200_000, n_items, engine.options)[0] == want
    _same(engine.search(users, 20), Engine(small, device="cpu").search(users, 20))
    assert {ws.state.cand_capacity for ws in backend.pipeline._ws.values()} == {4096}
    other = Engine(large, device=backend, options=EngineOptions(fused="force"))
    _same(other.search(users, 20), Engine(large, device="cpu").search(users, 20))
    assert 16384 in {ws.state.cand_capacity for ws in backend.pipeline._ws.values()}  # (the small one's may be let go)
    assert backend.state_bytes(20, 3000) < backend.state_bytes(20, 20000) == backend.state_bytes(20)


def test_a_sample_ranked_by_close_norms_is_not_halved_for_a_bound():
    # Under ip a sample takes half its rows from the largest norms; over items of close norms (normal rows: their
    # norms spread 0.12 of their mean, DeviceItems.loose_ranking) that sorts few of a user's best first, and the
    # route's pass at k = 50 over 4,096 items samples 1,024 of them; where the rows' norms spread (log-normal), 512.
    # Exact answers either way.
    rng = np.random.default_rng(5)
    close = rng.standard_normal((4096, 32)).astype(np.float32)
    spread = close * np.exp(0.5 * rng.standard_normal((4096, 1))).astype(np.float32)
    users = rng.standard_normal((600, 32)).astype(np.float32)
    for items, want in ((close, 1024), (spread, 512)):
        gpu = Engine(items, device="gpu", options=EngineOptions(certified_exact="on"))
        got = gpu.search(users, 50)
        assert gpu.stats["route"] == "certified" and gpu.stats["seed_sample"] == want
        assert_topk_close(got.indices, got.scores, users, items, 50)


@pytest.mark.parametrize("options", [EngineOptions(tiles=(64, 300, 3)), EngineOptions(fused="force"),
                                     EngineOptions(certified_exact="on")], ids=["blocks", "fused", "route"])
def test_a_search_without_exclusions_after_one_with_them_excludes_nothing(options):
    # A search without exclusions stages no CSR: its slots must hold zeros again after a search that wrote some.
    # The first search excludes every user's 30 best items, so a slot left as it was would change every row.
    rng = np.random.default_rng(3)
    items, users = _ints(rng, 2500, 12), _ints(rng, 700, 12)
    gpu, cpu = Engine(items, device="gpu", options=options), Engine(items, device="cpu")
    plain = cpu.search(users, 30)
    best = {u: row.tolist() for u, row in enumerate(as_numpy(plain.indices))}
    for exclude in (best, None, best, None):
        _same(gpu.search(users, 30, exclude=exclude), cpu.search(users, 30, exclude=exclude))


def test_the_most_recent_workspaces_are_kept(small_tiles):
    # A fast search runs up to four shapes every time (its sample, all users, the widened users, the exact fallback):
    # searches of three shapes in turn keep all three workspaces, the same objects, and stay exact.
    from recall.backends.cupy import pipeline as pipeline_module

    rng = np.random.default_rng(5)
    items = _ints(rng, 2000, 8)
    engine = Engine(items, device="gpu", options=small_tiles)
    cpu = Engine(items, device="cpu")
    pipe = engine.backend.pipeline
    batches = [_ints(np.random.default_rng(20 + i), n, 8) for i, n in enumerate((300, 40, 7))]
    kept = None
    for round_ in range(3):
        for users in batches:
            _same(engine.search(users, 20), cpu.search(users, 20))
        if kept is None:
            kept = {key: id(ws) for key, ws in pipe._ws.items()}
    assert len(kept) == 3 and {key: id(ws) for key, ws in pipe._ws.items()} == kept
    assert len(pipe._ws) <= pipeline_module._WORKSPACES


def test_a_new_workspace_lets_the_kept_ones_go_before_failing(small_tiles, monkeypatch):
    # Out of memory for a new shape while others are kept: the kept buffers go, and the allocation is tried again.
    import cupy

    from recall.backends.cupy import pipeline as pipeline_module

    rng = np.random.default_rng(6)
    items = _ints(rng, 2000, 8)
    engine = Engine(items, device="gpu", options=small_tiles)
    cpu = Engine(items, device="cpu")
    first, second = _ints(rng, 300, 8), _ints(rng, 41, 8)
    _same(engine.search(first, 20), cpu.search(first, 20))
    assert engine.backend.pipeline._ws
    real = pipeline_module.GpuTopK.allocate
    failures = []

    def allocate(*args, **kwargs):
        if engine.backend.pipeline._ws:  # fails while any other workspace is kept
            failures.append(args)
            raise cupy.cuda.memory.OutOfMemoryError(1 << 40, 1 << 30, 0)
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline_module.GpuTopK, "allocate", staticmethod(allocate))
    _same(engine.search(second, 20), cpu.search(second, 20))
    assert len(failures) == 1 and len(engine.backend.pipeline._ws) == 1


def test_pinned_staging_does_not_alias_between_blocks(small_tiles):
    # Each block's users go through one of two pinned buffers: a result computed from a buffer the host had
    # already overwritten with a later block would show up as rows equal to another block's rows.
    rng = np.random.default_rng(3)
    items = _ints(rng, 1200, 6)
    users = np.repeat(_ints(rng, 10, 6), 64, axis=0)  # block b holds 64 copies of user b
    res = Engine(items, device="gpu", options=small_tiles).search(users, 10)
    rows = as_numpy(res.indices).reshape(10, 64, 10)
    want = as_numpy(Engine(items, device="cpu").search(users[::64], 10).indices)
    for b in range(10):
        assert (rows[b] == want[b]).all()


def test_tiny_budget_on_gpu_equals_default():
    rng = np.random.default_rng(4)
    items, users = _ints(rng, 20000, 16), _ints(rng, 1500, 16)
    small = Engine(items, device="gpu", memory_budget=300_000)
    _same(small.search(users, 25), Engine(items, device="gpu").search(users, 25))
    assert small.stats["blocks"] > 1


def test_k_8192_exact_against_cpu():
    rng = np.random.default_rng(5)
    items, users = _ints(rng, 30000, 8), _ints(rng, 40, 8)
    _same(Engine(items, device="gpu").search(users, 8192), Engine(items, device="cpu").search(users, 8192))


@pytest.mark.parametrize("fused", ["auto", "off"])
def test_small_catalogue_large_k_is_seeded_and_exact(fused):
    # 20,000 items at k = 300: fewer than 8 samples of the usual size, so the sample is a quarter's power of two
    # (4,096 items: an exact search starts at a bound), on the fused path and on cuBLAS + filter; integer data ties
    # everywhere, some users have every sampled row excluded, one has all but 100 items excluded (fewer than k left).
    rng = np.random.default_rng(12)
    n_items, k = 20000, 300
    items, users = _ints(rng, n_items, 24), _ints(rng, 500, 24)
    sample = _sample_rows(items, k, 3 * 8192, bound=True)
    assert sample.size == 4096
    excl = {0: sample.tolist(), 1: list(range(100, n_items))}
    for u in range(2, 500, 3):
        excl[u] = rng.choice(n_items, 400, replace=False).tolist()
    gpu = Engine(items, device="gpu", options=EngineOptions(fused=fused))
    got = gpu.search(users, k, exclude=excl)
    assert gpu.stats["seed_sample"] == 4096 and gpu.stats["fused"] == (fused == "auto")
    _same(got, Engine(items, device="cpu").search(users, k, exclude=excl))


@pytest.mark.parametrize("n_items, k, size", [(4_096, 1, 512), (2_048, 5, 256), (8_000, 10, 512)])
def test_catalogues_under_8192_items_at_small_k_are_seeded_and_exact(n_items, k, size):
    # Under 8,192 items at k of at most a 256th of them the threshold sample is an eighth of the catalogue, up to 512
    # items (selection.SMALL_K_MIN_SAMPLE): such searches went unseeded onto cuBLAS before. Integer data ties
    # everywhere; one user has every sampled row excluded, one all but k - 1 items (none at k = 1), some a tenth.
    rng = np.random.default_rng(n_items + k)
    items, users = _ints(rng, n_items, 16), _ints(rng, 700, 16)
    sample = _sample_rows(items, k, n_items, bound=True)
    assert sample.size == size
    excl = {0: sample.tolist(), 1: list(range(k - 1, n_items))}
    for u in range(2, 700, 5):
        excl[u] = rng.choice(n_items, n_items // 10, replace=False).tolist()
    want = Engine(items, device="cpu").search(users, k, exclude=excl)
    gpu = Engine(items, device="gpu", options=EngineOptions(certified_exact="off"))
    _same(gpu.search(users, k, exclude=excl), want)
    assert gpu.stats["seed_sample"] == size and gpu.stats["fused"], gpu.stats
    _same(Engine(items, device="gpu").search(users, k, exclude=excl), want)  # the certified route where it applies


@pytest.mark.parametrize("fused", ["auto", "off"])
def test_small_catalogue_bound_search_doubles_its_sample_and_is_exact(fused):
    # 50,000 items at k = 600: the rule's sample (8,192 items) holds fewer than 16 k, so the float32 search, which
    # starts at the sample's k-th best, takes 16,384 (selection.BOUND_SAMPLE_PER_K); integer data ties everywhere,
    # one user has every sampled row excluded, one every other, one all but 200 items (fewer than k left).
    rng = np.random.default_rng(15)
    n_items, k = 50000, 600
    items, users = _ints(rng, n_items, 24), _ints(rng, 500, 24)
    sample = _sample_rows(items, k, 4 * 8192, bound=True)
    assert sample.size == 16384
    excl = {0: sample.tolist(), 1: list(range(200, n_items)), 2: sample[::2].tolist()}
    for u in range(3, 500, 3):
        excl[u] = rng.choice(n_items, 400, replace=False).tolist()
    gpu = Engine(items, device="gpu", options=EngineOptions(fused=fused, certified_exact="off"))
    got = gpu.search(users, k, exclude=excl)
    assert gpu.stats["seed_sample"] == 16384 and gpu.stats["fused"] == (fused == "auto")
    _same(got, Engine(items, device="cpu").search(users, k, exclude=excl))


@pytest.mark.parametrize("fused", ["auto", "off"])
def test_k_8192_seeded_against_cpu(fused):
    # 600,000 items at k = 8,192, 200 users (a block of few users: more tiles a call, and room for a sample of 16 k
    # items): seeded searches of k up to 8,192 take the fused kernel (fused.FUSED_SEEDED_MAX_K), else cuBLAS + filter.
    rng = np.random.default_rng(13)
    items, users = _ints(rng, 600_000, 8), _ints(rng, 200, 8)
    gpu = Engine(items, device="gpu", options=EngineOptions(fused=fused))
    excl = {3: list(range(0, 600_000, 2)), 7: list(range(600_000 - 5000))}  # user 7: 5,000 items left
    got = gpu.search(users, 8192, exclude=excl)
    assert gpu.stats["seed_sample"] == 131072 and gpu.stats["fused"] == (fused == "auto")
    assert (got.indices[7, 5000:] == -1).all()
    _same(got, Engine(items, device="cpu").search(users, 8192, exclude=excl))


def test_adversarial_rising_order_exact(small_tiles):
    rng = np.random.default_rng(6)
    users = _ints(rng, 300, 10)
    items = _ints(rng, 4000, 10)
    items = items[np.argsort(items @ users.mean(0), kind="stable")]  # every tile beats the last
    _same(Engine(items, device="gpu", options=small_tiles).search(users, 64), Engine(items, device="cpu").search(users, 64))


def test_device_users_give_device_results():
    import cupy

    rng = np.random.default_rng(7)
    items, users = _ints(rng, 3000, 8), _ints(rng, 200, 8)
    engine = Engine(cupy.asarray(items), device="gpu")
    res = engine.search(cupy.asarray(users), 15)
    assert isinstance(res.indices, cupy.ndarray) and isinstance(res.scores, cupy.ndarray)
    host = engine.search(users, 15)
    assert isinstance(host.indices, np.ndarray)
    _same(res, host)


def test_torch_cuda_tensor_users_used_in_place():
    torch = pytest.importorskip("torch")
    import cupy

    rng = np.random.default_rng(8)
    items, users = _ints(rng, 3000, 8), _ints(rng, 100, 8)
    res = Engine(items, device="gpu").search(torch.from_numpy(users).cuda(), 12)
    assert isinstance(res.indices, cupy.ndarray)
    _same(res, Engine(items, device="cpu").search(users, 12))


def test_stats_report_gpu_busy_time(small_tiles):
    rng = np.random.default_rng(9)
    engine = Engine(_ints(rng, 2000, 8), device="gpu", options=small_tiles)
    engine.search(_ints(rng, 400, 8), 10)
    st = engine.stats
    assert st["wall_s"] > 0 and 0 < st["gpu_busy_s"] <= st["wall_s"] * 1.05
    assert 0 < st["busy_fraction"] <= 1.05 and st["h2d_s"] >= 0
    assert st["d2h_s"] > 0  # host users: each block's results were fetched into page-locked host memory


def test_host_results_fetched_per_block_match_device_results(small_tiles):
    # Host users: results travel back block by block on the fetch stream while later blocks are searched; device
    # users: results stay on the device. Both must be the same answer, with k < n_items and k > n_items (padding).
    import cupy

    rng = np.random.default_rng(11)
    items = _ints(rng, 700, 8)
    users = _ints(rng, 900, 8)
    engine = Engine(items, device="gpu", options=small_tiles)
    for k in (33, 800):
        host = engine.search(users, k, exclude={3: [1, 2], 899: list(range(700))})
        dev = engine.search(cupy.asarray(users), k, exclude={3: [1, 2], 899: list(range(700))})
        assert isinstance(host.indices, np.ndarray) and isinstance(dev.indices, cupy.ndarray)
        _same(host, dev)
        _same(host, Engine(items, device="cpu").search(users, k, exclude={3: [1, 2], 899: list(range(700))}))


def test_out_of_memory_is_a_resource_error(monkeypatch):
    import cupy

    from recall.backends.cupy import selection as cupy_backend

    def refuse(*args, **kwargs):
        raise cupy.cuda.memory.OutOfMemoryError(1 << 40, 0)

    monkeypatch.setattr(cupy_backend.GpuTopK, "allocate", classmethod(lambda cls, *a: refuse()))
    rng = np.random.default_rng(10)
    with pytest.raises(ResourceError, match="GPU out of memory"):
        Engine(_ints(rng, 100, 4), device="gpu").search(_ints(rng, 10, 4), 5)


def _sample_rows(items, k, capacity, bound=False):
    # The rows an ip search's threshold sample takes (integer items: their float64 norms are exact on either side).
    from recall.backends.cupy.selection import seed_size
    from recall.backends.tiled import sample_rows
    from recall.core.metrics import row_norms

    size = seed_size(items.shape[0], k, capacity, bound=bound)
    return sample_rows(np, items.shape[0], size, row_norms(np, items))


def test_seeded_threshold_exact_with_ties_and_excluded_sample(small_tiles):
    # Integer scores from {-1, 0, 1} components tie everywhere, also at the sampled k-th best. Some users have every
    # sampled row excluded (no seed), some the sample's best rows, some the rows just above and below the seed.
    rng = np.random.default_rng(7)
    n_items, k = 20000, 37
    items, users = _ints(rng, n_items, 12, -1, 2), _ints(rng, 300, 12, -1, 2)
    sample = _sample_rows(items, k, 300 * 3)
    assert sample.size > 0
    excl = {0: sample.tolist(), 1: sample[:400].tolist(), 2: []}
    for u in range(3, 300, 4):
        excl[u] = rng.choice(n_items, 500, replace=False).tolist()
    gpu = Engine(items, device="gpu", options=small_tiles)
    got = gpu.search(users, k, exclude=excl)
    assert gpu.stats["seed_sample"] == sample.size
    _same(got, Engine(items, device="cpu").search(users, k, exclude=excl))


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_seed_of_the_largest_norms_exact_with_them_excluded(small_tiles, precision):
    # Under ip half the threshold sample is the items of the largest norms: integer items scaled by 1, 2, 4 or 8 a
    # row, the largest excluded for some users (all of them, the best few hundred, every other row), fewer than k
    # items left for one; exact and fast mode against the CPU, bit for bit.
    rng = np.random.default_rng(14)
    n_items, k = 20000, 40
    items = _ints(rng, n_items, 16) * (2.0 ** rng.integers(0, 4, (n_items, 1))).astype(np.float32)
    users = _ints(rng, 400, 16)
    largest = np.argsort(-np.linalg.norm(items.astype(np.float64), axis=1), kind="stable")[:2500]
    excl = {0: largest.tolist(), 1: largest[:300].tolist(), 2: list(range(0, n_items, 2)),
            3: list(range(30, n_items))}
    for u in range(4, 400, 5):
        excl[u] = rng.choice(largest, 200, replace=False).tolist()
    # Fast mode's own passes at this size too (float16_min_scores: a search this small declines by default).
    gpu = Engine(items, device="gpu", options=replace(small_tiles, float16_min_scores=0), precision=precision)
    got = gpu.search(users, k, exclude=excl)
    assert gpu.stats["seed_sample"] > 0
    _same(got, Engine(items, device="cpu").search(users, k, exclude=excl))


def test_seeded_equals_unseeded_on_rising_order(small_tiles):
    # Items sorted by rising score against the mean user: every tile beats the last, the case the seed is for.
    rng = np.random.default_rng(8)
    items, users = rng.standard_normal((30000, 16), dtype=np.float32), rng.standard_normal((400, 16), dtype=np.float32)
    users += 2.0
    items = items[np.argsort(items @ users.mean(axis=0), kind="stable")]
    seeded = Engine(items, device="gpu", options=small_tiles)
    got = seeded.search(users, 50, exclude={5: list(range(29000, 30000))})
    assert seeded.stats["seed_sample"] > 0
    plain = Engine(items, device="gpu", options=replace(small_tiles, seed_thresholds=False))
    want = plain.search(users, 50, exclude={5: list(range(29000, 30000))})
    assert plain.stats["seed_sample"] == 0
    _same(got, want)
    assert_topk_close(got.indices, got.scores, users, items, 50, exclude={5: list(range(29000, 30000))})


def test_queued_async_searches_equal_cpu(small_tiles):
    # Batches queued on the device one after the other before any result is collected (the Parquet pipeline's
    # pattern), with a batch of another shape in between (a second workspace) and exclusions; seeded and fused.
    rng = np.random.default_rng(9)
    items = _ints(rng, 20000, 16)
    sizes = [500, 500, 10, 500, 333]
    batches = [_ints(rng, n, 16) for n in sizes]
    excl = [{u: rng.choice(20000, 30, replace=False).tolist() for u in range(0, n, 4)} for n in sizes]
    engine = Engine(items, device="gpu", options=small_tiles)
    pending = [engine.search_async(b, 40, exclude=e) for b, e in zip(batches, excl)]
    cpu = Engine(items, device="cpu")
    for b, e, p in zip(batches, excl, pending):
        _same(p.result(), cpu.search(b, 40, exclude=e))
        # Fewer users than a fused kernel's tile of 128 take cuBLAS (fused.applies).
        assert engine.stats["fused"] == (len(b) >= 128) and engine.stats["gpu_busy_s"] > 0
    assert engine.stats["blocks"] == 6  # the last batch: 333 users in blocks of 64


def test_a_graph_follows_the_items_memory_not_the_python_object():
    # Streamed segments and filtered views are item objects freed after their search, whose id() the next one can
    # take while its vectors live elsewhere: a graph keyed by the object replayed the old vectors' addresses. Here
    # one engine's item object is given other vectors of the same shape after its graph was captured: the answer
    # must be the new vectors'.
    rng = np.random.default_rng(32)
    a, b = _ints(rng, 20_000, 16), _ints(rng, 20_000, 16)
    users = _ints(rng, 40, 16)
    gpu, other = Engine(a, device="gpu"), Engine(b, device="gpu")
    for _ in range(3):
        gpu.search(users, 30)
    assert gpu.stats["graph_blocks"] == 1 and not gpu.stats["fused"], gpu.stats
    gpu._items.vecs, gpu.prepared_items = other._items.vecs, other.prepared_items
    _same(gpu.search(users, 30), Engine(b, device="cpu").search(users, 30))


@pytest.mark.parametrize("fused", ["auto", "off"])
def test_fused_searches_take_blocks_of_32768_users(fused):
    # A fused search shares each block's launches over 32,768 users; the cuBLAS path keeps blocks of 4,096; a
    # budget that cannot hold the larger block's top-k state halves it. Integer data: the answers equal the CPU's
    # bit for bit, whatever the blocks (33,000 users: a last block of 232).
    rng = np.random.default_rng(33)
    items, users = _ints(rng, 20_000, 16), _ints(rng, 33_000, 16)  # seeded at k = 100: the fused kernel
    exclude = {0: list(range(20_000)), 16_384: list(range(0, 20_000, 2)), 32_768: [1, 2], 32_999: [5, 6, 7]}
    want = Engine(items, device="cpu").search(users, 100, exclude=exclude)
    gpu = Engine(items, device="gpu", options=EngineOptions(fused=fused, certified_exact="off"))
    _same(gpu.search(users, 100, exclude=exclude), want)
    assert gpu.stats["fused"] == (fused == "auto"), gpu.stats
    assert gpu.stats["tiles"][0] == (32768 if fused == "auto" else 4096), gpu.stats
    assert gpu.stats["blocks"] == (2 if fused == "auto" else 9), gpu.stats
    if fused == "auto":
        tight = Engine(items, device="gpu", memory_budget=64 << 20, options=EngineOptions(certified_exact="off"))
        _same(tight.search(users, 100, exclude=exclude), want)
        assert tight.stats["fused"] and tight.stats["tiles"][0] < 32768, tight.stats


@pytest.mark.parametrize("n_users", [1, 32])
def test_small_batches_replay_their_graph_from_the_third_search(n_users):
    # An embedded engine answering the same shape again and again: the first search runs eagerly, the second
    # captures the block's launches, the third and later replay them, each with its own users (the slot is
    # refilled before the replay). Fewer than 128 users take cuBLAS, one user's tiles one GEMM; integer data: the
    # answers equal the CPU's bit for bit, ties to the lower row.
    rng = np.random.default_rng(31)
    items = _ints(rng, 50_000, 16)
    gpu, cpu = Engine(items, device="gpu"), Engine(items, device="cpu")
    graphs = []
    for call in range(5):
        users = _ints(np.random.default_rng(100 + call), n_users, 16)
        exclude = {0: list(range(0, 50_000, 3))} if call == 3 else None
        _same(gpu.search(users, 40, exclude=exclude), cpu.search(users, 40, exclude=exclude))
        assert not gpu.stats["fused"] and gpu.stats["tiles"][2] > 4, gpu.stats
        graphs.append(gpu.stats["graph_blocks"])
    # Call 3 has exclusions: a kind of its own, run eagerly the first time.
    assert graphs == [0, 1, 1, 0, 1], graphs
