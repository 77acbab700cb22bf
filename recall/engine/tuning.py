"""Per-shape autotuning of the search tiling, with a persistent cache (``recall tune``; ``Engine(tune=...)``).

Like cuDNN's benchmark mode: for one shape of search, try a small grid of tilings (user block x item tile width x
item tiles per strided-batched GEMM call), time each with the engine itself, and keep the fastest. The result is
stored in ``$XDG_CACHE_HOME/recall/tune.json`` (default ``~/.cache/recall/tune.json``) under a key made of

- the device (GPU name, driver, CUDA runtime; on the CPU: CPU model and core count, NumPy and its BLAS),
- the backend ("cpu" / "gpu") and the metric,
- the scored dimension, k rounded up to a power of two, and the numbers of users and items rounded up to powers of
  two; users beyond :data:`USERS_BUCKET_CAP` share one bucket, because past a few user blocks a search's time grows
  linearly in users and the best tiling no longer changes.

An engine (``tune="auto"``, the default) takes the tiling of a matching entry instead of its backend's heuristic
(``Backend.preferred_tiles``); the memory budget still caps it (``scoring.plan_tiles``). ``tune="off"`` ignores the
cache. ``tune="force"`` tunes each new key on its first search in this process (on at most
:data:`USERS_BUCKET_CAP` of the search's users), stores the result, and uses it. A corrupt cache, or one written
with another schema version, is ignored with one warning; writes are atomic (temporary file + rename, under a lock
file), so a reader never sees a torn file and concurrent writers keep each other's entries.

An engine's own ``EngineOptions(tiles=...)`` wins over the cache.
"""
from __future__ import annotations

import contextlib
import contextvars
import datetime as _dt
import functools
import json
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..core.errors import InputError
from ..core.exclusions import Exclusions
from ..core.tiling import TilePlan, plan_tiles
from ..core.version import __version__
from ..io import atomic

log = logging.getLogger("recall")

MODES = ("auto", "force", "off")
SCHEMA_VERSION = 1
"""Version of the cache file's layout; a file with another version is ignored (and replaced by the next write)."""
USERS_BUCKET_CAP = 1 << 14
"""Searches of this many users or more share one users bucket; ``tune="force"`` times at most this many users."""
NOISE = 0.02
"""A candidate must beat the heuristic by more than this fraction to be kept: smaller gains are timing noise."""
FORCE_REPEAT = 2
"""Timed runs per candidate (after one warm-up) when ``tune="force"`` tunes inside a search."""

Tiles = tuple[int, int, int]

_lock = threading.RLock()  # guards the module's state below and serialises writes within the process
_force_lock = threading.Lock()  # one tune="force" tuning at a time
_loaded: dict[str, tuple[tuple[int, int, int], dict[str, Any]]] = {}  # path -> (stat signature, entries)
_warned: set[tuple[str, str]] = set()
_announced: set[str] = set()  # keys whose cached tiling was logged as used
_forced: dict[str, Tiles] = {}  # key -> tiles tuned in this process (tune="force")


def reset_state() -> None:
    """Forget what this process has read, warned about and tuned (for tests)."""
    with _lock:
        _loaded.clear()
        _warned.clear()
        _announced.clear()
        _forced.clear()


def check_mode(mode: Any) -> str:
    """``mode`` if it is one of "auto", "force", "off".

    Raises
    ------
    InputError
        For anything else.
    """
    if not isinstance(mode, str) or mode not in MODES:
        raise InputError(f"tune must be one of {', '.join(repr(m) for m in MODES)}, got {mode!r}")
    return mode


# -- keys -----------------------------------------------------------------------------------------------------------

def cache_path() -> Path:
    """``$XDG_CACHE_HOME/recall/tune.json``; ``~/.cache/recall/tune.json`` when that is unset or not absolute.

    Raises
    ------
    InputError
        When there is no absolute ``XDG_CACHE_HOME`` and no home directory either (``HOME`` unset and a user id
        without a passwd entry, as in a container run with ``--user 1234``).
    """
    path = _cache_path(os.environ.get("XDG_CACHE_HOME", ""), os.environ.get("HOME", ""))
    if isinstance(path, str):
        raise InputError(path)
    return path


@functools.lru_cache(maxsize=16)
def _cache_path(base: str, home: str) -> Path | str:
    """The cache's path, or why there is none. Per environment: every search looks its tiling up, and building the
    path took 55 us a search under cProfile (a one-user CPU search of 100k items: 0.75 ms); a missing home directory
    is remembered too, so that a search does not ask the passwd database (NSS, maybe LDAP) every time."""
    if base and os.path.isabs(base):
        return Path(base) / "recall" / "tune.json"
    try:
        root = Path.home() / ".cache"
    except RuntimeError:  # Path.home(): HOME unset and no passwd entry for this user id
        return (f"no directory for the tune cache: XDG_CACHE_HOME is unset or relative, HOME is unset, and user id "
                f"{os.getuid()} has no home directory; set XDG_CACHE_HOME or HOME")
    return root / "recall" / "tune.json"


def _usable_cache_path() -> Path | None:
    """:func:`cache_path`, or None (warned once) when there is none: a search then uses the heuristic."""
    try:
        return cache_path()
    except InputError as exc:
        _warn_once(Path(), "no-cache-dir", f"{exc}; searches use the heuristic tiling")
        return None


def bucket(n: int, cap: int | None = None) -> int:
    """``n`` rounded up to a power of two (at least 1), and at most ``cap``."""
    b = 1 << max(0, int(n) - 1).bit_length()
    return min(b, cap) if cap is not None else b


def make_key(backend: Any, metric: str, dim: int, k: int, n_users: int, n_items: int,
             dtype: str = "float32") -> dict[str, Any]:
    """The cache key of one tiled pass: device identity, metric, the scored dtype ("float32"; "float16" for the
    first pass of ``precision="fast"``) and dimension, and the k / users / items buckets."""
    return {**backend.identity(), "metric": metric, "dtype": str(dtype), "dim": int(dim),
            "k_bucket": bucket(k), "users_bucket": bucket(n_users, USERS_BUCKET_CAP), "items_bucket": bucket(n_items)}


def key_string(key: dict[str, Any]) -> str:
    """One line naming a key, used as the entry's name in the cache file."""
    users = key["users_bucket"]
    users_text = f">={users}" if users >= USERS_BUCKET_CAP else f"<={users}"
    return (f"{key['backend']}|{key['device']}|{key['driver']}|{key['runtime']}|{key['metric']}|{key['dtype']}|"
            f"dim={key['dim']}|k<={key['k_bucket']}|users{users_text}|items<={key['items_bucket']}")


# -- the cache file -------------------------------------------------------------------------------------------------

def _warn_once(path: Path, what: str, message: str) -> None:
    with _lock:
        if (str(path), what) in _warned:
            return
        _warned.add((str(path), what))
    log.warning("recall: %s", message)


def _read(path: Path) -> tuple[str, dict[str, Any]]:
    """(status, entries) of the file at ``path``: status "missing", "ok", "corrupt: ..." or "stale: ..."."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return "missing", {}
    except (OSError, UnicodeDecodeError) as exc:
        return f"corrupt: cannot be read ({type(exc).__name__}: {exc})", {}
    try:
        data = json.loads(text)
    except ValueError as exc:
        return f"corrupt: not valid JSON ({exc})", {}
    except RecursionError:  # deeply nested arrays or objects: the decoder gives up
        return "corrupt: not valid JSON (nested too deeply)", {}
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        return "corrupt: not a recall tune cache (no 'entries' object)", {}
    if data.get("schema") != SCHEMA_VERSION:
        return f"stale: schema version {data.get('schema')!r}, this recall reads version {SCHEMA_VERSION}", {}
    return "ok", data["entries"]


def load(path: Path | None = None) -> dict[str, Any]:
    """The entries of the cache file (empty when it is missing, corrupt or stale; the latter two warned once).

    Re-read only when the file changed (size, modification time, inode), so a lookup per search costs one ``stat``.
    """
    path = path or _usable_cache_path()
    if path is None:
        return {}
    try:
        st = path.stat()
    except OSError:
        return {}
    sig = (st.st_mtime_ns, st.st_size, st.st_ino)
    with _lock:
        hit = _loaded.get(str(path))
        if hit is not None and hit[0] == sig:
            return hit[1]
    status, entries = _read(path)
    if status != "ok" and status != "missing":
        _warn_once(path, status.split(":")[0],
                   f"ignoring the tune cache {path}: {status.split(': ', 1)[1]}; the next `recall tune` replaces it")
    with _lock:
        _loaded[str(path)] = (sig, entries)
    return entries


def _tiles_of(entry: Any) -> Tiles | None:
    tiles = entry.get("tiles") if isinstance(entry, dict) else None
    if (isinstance(tiles, list) and len(tiles) == 3
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in tiles)):
        return int(tiles[0]), int(tiles[1]), int(tiles[2])
    return None


def lookup(key: dict[str, Any], path: Path | None = None) -> Tiles | None:
    """The cached (user block, item tile, tiles per call) for ``key``, or None. A malformed entry is warned once."""
    path = path or _usable_cache_path()
    if path is None:
        return None
    name = key_string(key)
    entry = load(path).get(name)
    if entry is None:
        return None
    tiles = _tiles_of(entry)
    if tiles is None:
        _warn_once(path, "entry:" + name, f"ignoring a malformed entry of the tune cache {path}: {name}")
    return tiles


def store(key: dict[str, Any], tiles: Tiles, record: dict[str, Any] | None = None, path: Path | None = None) -> Path:
    """Add or replace the entry of ``key`` (other entries are kept; a corrupt or stale file is started afresh).

    Raises
    ------
    OSError
        If the cache directory cannot be created or written.
    InputError
        If there is no cache directory (:func:`cache_path`).
    """
    path = path or cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {**(record or {}), "key": dict(key), "tiles": [int(t) for t in tiles]}
    # Serialised within the process (the lock) and between processes (the lock file), so concurrent writers keep
    # each other's entries.
    with _lock, atomic.FileLock(path.with_name(path.name + ".lock")):
        status, entries = _read(path)
        if status not in ("ok", "missing"):
            log.warning("recall: replacing the tune cache %s (%s)", path, status)
        entries = dict(entries)
        entries[key_string(key)] = entry
        atomic.write_json(path, {"schema": SCHEMA_VERSION, "entries": entries})
    return path


def cache_info(path: Path | None = None) -> dict[str, Any]:
    """{"path", "status", "entries"}: where the cache is, whether it is usable, how many entries it holds
    (path None and status "unavailable: ..." when there is no cache directory)."""
    if path is None:
        try:
            path = cache_path()
        except InputError as exc:
            return {"path": None, "status": f"unavailable: {exc}", "entries": 0}
    status, entries = _read(path)
    return {"path": str(path), "status": status, "entries": len(entries)}


# -- candidates and timing ------------------------------------------------------------------------------------------

@dataclass
class _Trying:
    tiles: Tiles | None  # None: the backend's heuristic
    seen: list[tuple[int, int, int, str]] = field(default_factory=list)  # (n_users, dim, k, dtype) of each pass


_override: contextvars.ContextVar[_Trying | None] = contextvars.ContextVar("recall_tune_override", default=None)


@contextlib.contextmanager
def trying(tiles: Tiles | None) -> Iterator[list[tuple[int, int, int, str]]]:
    """Within this block, every engine search in this thread plans with ``tiles`` as preferred (the budget still
    caps it; None: the backend's heuristic), cache and mode aside. Yields the list of the (n_users, dim, k, dtype)
    of every tiled pass planned inside, in order.
    """
    state = _Trying(None if tiles is None else (int(tiles[0]), int(tiles[1]), int(tiles[2])))
    token = _override.set(state)
    try:
        yield state.seen
    finally:
        _override.reset(token)


@dataclass
class Trial:
    """One candidate tiling and its times."""

    tiles: Tiles
    plan: Tiles  # what plan_tiles made of it under the budget: (user block, item tile, tiles per call)
    workers: int
    seconds: float  # median of the timed runs
    warmup_seconds: float
    times: list[float]
    heuristic: bool = False


@dataclass
class TuneResult:
    """The outcome of tuning one shape."""

    key: dict[str, Any]
    shape: dict[str, int]
    heuristic: Tiles
    best: Tiles
    trials: list[Trial]
    repeat: int
    tuning_seconds: float  # time spent in the trials, warm-ups included
    cold_seconds: float  # the first search of all (kernel compilation or loading, allocations)
    saved_to: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def heuristic_seconds(self) -> float:
        return next(t.seconds for t in self.trials if t.heuristic)

    @property
    def best_seconds(self) -> float:
        return next(t.seconds for t in self.trials if t.tiles == self.best)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["heuristic_seconds"] = self.heuristic_seconds
        out["best_seconds"] = self.best_seconds
        out["key_string"] = key_string(self.key)
        return out


def _plan(engine: Any, n_users: int, dim: int, k: int, tiles: Tiles) -> TilePlan:
    backend = engine.backend
    return plan_tiles(n_users, engine.n_items, dim, k, engine.memory_budget, tiles,
                      backend.state_bytes(k, engine.n_items), backend.workers)


def tune_engine(engine: Any, users: Any, k: int, *, repeat: int = 3, n_users: int | None = None, save: bool = True,
                path: Path | None = None, progress: Callable[[Trial, int, int], None] | None = None,
                prepared: bool = False) -> TuneResult:
    """Time every candidate tiling on ``engine`` searching ``users`` and keep the fastest.

    The first search (the heuristic's warm-up) also finds out which tiled pass the engine plans: its number of
    users, dimension, k and dtype make the key, the heuristic and the plans (``precision="fast"`` plans a float16
    pass for more than k candidates; that first pass is the one tuned).

    Parameters
    ----------
    engine : recall.Engine
    users : array, shape (n, dim)
        Users as ``Engine.search`` takes them (float32, NumPy or, on a GPU engine, CuPy); with ``prepared``, already
        prepared for the engine's metric (``metrics.prepare_users``), searched in one exact tiled pass.
    k : int
        Items per user, >= 1.
    repeat : int
        Timed searches per candidate, after one warm-up; the median counts. On the GPU each is bracketed by device
        synchronisations.
    n_users : int, optional
        The number of users the key is made for (default: ``len(users)``; ``tune="force"`` times a sample).
    save : bool
        Store the best in the cache (``path``, default :func:`cache_path`).
    progress : callable(trial, index, total), optional
        Called after each candidate.

    Returns
    -------
    TuneResult
        Candidates whose plans coincide under the budget are timed once. The best is the fastest candidate, unless
        it beats the heuristic by no more than :data:`NOISE`, in which case the heuristic is kept.

    Raises
    ------
    InputError
        ``repeat`` < 1 or no users.
    OSError
        If ``save`` and the cache cannot be written.
    """
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise InputError(f"repeat must be an integer >= 1, got {repeat!r}")
    backend = engine.backend
    n = int(users.shape[0])
    if n < 1:
        raise InputError("tuning needs at least one user")
    excl = Exclusions.empty(n)

    def search() -> None:
        if not prepared:
            engine.search(users, k)
            return
        k_sel = min(k, engine.n_items)
        vals = backend.empty_out((n, k_sel), np.float32, False)
        rows = backend.empty_out((n, k_sel), np.int64, False)
        engine.run(users, k_sel, excl, vals, rows)()

    def once(tiles: Tiles | None) -> tuple[float, list[tuple[int, int, int, str]]]:
        with trying(tiles) as seen:
            backend.synchronize()
            start = time.perf_counter()
            search()
            backend.synchronize()
            return time.perf_counter() - start, seen

    started = time.perf_counter()
    cold, seen = once(None)
    if not seen:
        raise InputError("the engine planned no tiled pass for these users: nothing to tune")
    pass_users, dim, pass_k, dtype = seen[0]
    heuristic: Tiles = tuple(int(t) for t in backend.preferred_tiles(  # type: ignore[assignment]
        dim, pass_k, dtype, pass_users, engine.n_items, engine.options))
    key_users = pass_users if n_users is None else int(n_users)
    key = make_key(backend, engine.metric, dim, pass_k, key_users, engine.n_items, dtype)

    plans: dict[tuple[int, ...], Tiles] = {}
    todo: list[tuple[Tiles, TilePlan]] = []
    for tiles in backend.tune_candidates(heuristic):
        plan = _plan(engine, pass_users, dim, pass_k, tiles)
        sig = (plan.user_block, plan.item_tile, plan.tiles_per_call, plan.workers)
        if sig not in plans:
            plans[sig] = tiles
            todo.append((tiles, plan))

    trials: list[Trial] = []
    for i, (tiles, plan) in enumerate(todo):
        warm = cold if i == 0 else once(tiles)[0]
        times = [once(tiles)[0] for _ in range(repeat)]
        trial = Trial(tiles, (plan.user_block, plan.item_tile, plan.tiles_per_call), plan.workers,
                      statistics.median(times), warm, times, heuristic=(i == 0))
        trials.append(trial)
        if progress is not None:
            progress(trial, i, len(todo))
    tuning_seconds = time.perf_counter() - started

    base, fastest = trials[0], min(trials, key=lambda t: t.seconds)
    best, notes = fastest.tiles, []
    if fastest is not base and fastest.seconds > base.seconds * (1.0 - NOISE):
        best = base.tiles
        notes.append(f"the fastest candidate was within {NOISE:.0%} of the heuristic (timing noise): "
                     f"keeping the heuristic")
    shape = {"users": key_users, "timed_users": n, "items": int(engine.n_items), "dim": dim, "k": int(pass_k)}
    result = TuneResult(key=key, shape=shape, heuristic=heuristic, best=best, trials=trials, repeat=repeat,
                        tuning_seconds=tuning_seconds, cold_seconds=cold, notes=notes)
    if save:
        result.saved_to = str(store(key, best, _record(result), path))
    return result


def _record(result: TuneResult) -> dict[str, Any]:
    """What a cache entry keeps besides its key and tiles: the evidence."""
    return {"seconds": result.best_seconds, "heuristic": list(result.heuristic),
            "heuristic_seconds": result.heuristic_seconds, "shape": result.shape, "repeat": result.repeat,
            "candidates": len(result.trials), "tuning_seconds": result.tuning_seconds, "recall": __version__,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}


# -- the engine's hook ----------------------------------------------------------------------------------------------

def _force(engine: Any, users: Any, k: int, key: dict[str, Any]) -> Tiles:
    name = key_string(key)
    with _force_lock:  # one tuning at a time; a second search of the same shape waits for the first one's result
        if name in _forced:
            return _forced[name]
        log.info("recall: tuning the tiling for %s (tune='force')", name)
        result = tune_engine(engine, users[:USERS_BUCKET_CAP], k, repeat=FORCE_REPEAT,
                             n_users=int(users.shape[0]), save=False, prepared=True)
        try:
            store(key, result.best, _record(result))
        except InputError as exc:  # no cache directory: the tiling is still used in this process
            _warn_once(Path(), "no-cache-dir", str(exc))
        except OSError as exc:
            _warn_once(cache_path(), "write", f"could not write the tune cache {cache_path()}: {exc}")
        log.info("recall: tuned %s: %s (%.4f s) vs heuristic %s (%.4f s); tuning took %.2f s", name,
                 "x".join(map(str, result.best)), result.best_seconds, "x".join(map(str, result.heuristic)),
                 result.heuristic_seconds, result.tuning_seconds)
        _forced[name] = result.best
        return result.best


def few_users_area(backend: Any, options: Any) -> int:
    """The ``few_users_area`` a plan widens its item tiles with (``tiling.plan_tiles``): the backend's, or 0 where
    ``options.tiles`` pins the tiling (a search then runs exactly those tiles) or ``options.few_user_tiles`` is
    off."""
    return 0 if options.tiles or not options.few_user_tiles else int(backend.few_users_area)


def preferred_tiles(engine: Any, users: Any, n_items: int, k: int) -> Tiles:
    """The (user block, item tile, tiles per call) ``engine`` should plan a tiled pass of ``users`` against ``n_items``
    items for ``k`` with.

    Inside :func:`trying`: the tiling being tried. Else, by ``engine.tune_mode``: "off" -> the backend's heuristic
    (``backend.preferred_tiles``); "auto" -> the cached tiling of a matching key, else the heuristic; "force" -> the
    tiling tuned for this key in this process, tuning it now (on up to :data:`USERS_BUCKET_CAP` of ``users``) the
    first time (exact precision only: a fast-precision engine reads the cache as in "auto"). Never raises for a
    cache problem: a bad cache is warned about once and the heuristic used.

    Parameters
    ----------
    engine : recall.Engine
    users : array, shape (n_users, dim)
        The users of the pass (host or device), already prepared; only their shape and dtype are read, except when
        ``tune="force"`` tunes.
    n_items : int
        Items the pass searches.
    k : int
        Items kept per user in this pass.
    """
    backend = engine.backend
    n_users, dim = int(users.shape[0]), int(users.shape[1])
    dtype = str(getattr(users, "dtype", "float32"))
    heuristic = functools.partial(backend.preferred_tiles, dim, k, dtype, n_users, n_items, engine.options)
    trying_now = _override.get()
    if trying_now is not None:
        trying_now.seen.append((n_users, dim, int(k), dtype))
        return trying_now.tiles if trying_now.tiles is not None else heuristic()
    mode = engine.tune_mode
    if mode == "off":
        return heuristic()
    key = make_key(backend, engine.metric, dim, k, n_users, engine.n_items, dtype)
    if mode == "force":
        # Tuning re-runs whole searches of these users; only in exact precision (and fast precision where it
        # declines at once: the CPU, streamed items) is a float32 tiled pass a whole search (fast mode's passes,
        # and exact mode's certified route's, score float16 copies and fallback subsets), so those read the cache
        # as "auto" does.
        if (engine.precision == "exact" or engine._fast_declined() is not None) and dtype == "float32":
            return _force(engine, users, k, key)
        _warn_once(_usable_cache_path() or Path(), "force-fast", "tune='force' tunes exact-precision engines "
                   "only; for precision='fast' run `recall tune --precision fast` once (its result is used here)")
    tiles = lookup(key)
    if tiles is None:
        return heuristic()
    name = key_string(key)
    with _lock:
        first = name not in _announced
        _announced.add(name)
    if first:
        log.info("recall: tiling %s from the tune cache (%s)", "x".join(map(str, tiles)), name)
    return tiles
