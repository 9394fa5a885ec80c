"""An in-process nearest-neighbour index over L2-normalised float32 vectors (inner product =
cosine), for the semantic cache: exact while small, faiss IVF once it grows, retrained in the
background as it grows.

Layout. An index is up to three kinds of parts, searched together and merged:
  * `ivf`: a faiss `IndexIVFFlat` (inner product, spherical k-means, nlist ~ 4*sqrt(n), a
    hashtable direct map so adds and removes cost O(1) lists, not a scan), built once the index
    holds `ivf_threshold` vectors and rebuilt each time it doubles;
  * `delta`: an exact part (numpy blocks, O(1) add and swap-remove, one matrix-vector product per
    block to search) that holds everything while the index is small, and what was added while a
    rebuild ran (folded into the next rebuild; one starts by itself once it holds
    `ivf_threshold` rows);
  * `frozen`: while a rebuild runs, the parts it reads (the old IVF index and the old delta) are
    frozen: nothing writes them, so the rebuild thread reads them without a lock while searches
    keep using them. Removals of their vectors go to a `removed` set that filters their results
    and is applied to the new index when it is swapped in.

Invariants callers rely on:
- Every vector added and not removed is found by an exact search of the parts it lives in;
  only the IVF part is approximate, with `nprobe` tuned after each build to `target_recall` at
  k=1 on queries made from stored vectors perturbed to cosine ~0.93 (the regime of a cache hit).
- Adds and removes made while a rebuild runs are never lost: adds land in the delta, removes in
  the removed set, and the swap applies both; the swap itself is O(removed) under the lock.
- Rebuilds (k-means training, bulk adds, the nprobe tuning's exact search) run on one
  process-wide daemon thread, one index at a time, with `train_threads` OpenMP threads (default:
  all cores but one, so the event loop keeps a core): never on the caller's thread. A failed
  rebuild is logged, leaves the index searchable as it was, and is retried after a backoff.
- Ids are int64, unique: adding an id that is present raises ValueError; an id must not be
  reused after it was removed while a rebuild ran (the caller hands out fresh ids).
- All public methods are thread-safe (one lock per index; searches hold it for their own
  duration, which is sub-millisecond on the IVF path: see docs/benchmarks.md, "Gateway caches").
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import faiss
import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["VectorIndex"]

_BLOCK = 4096  # rows per block of an exact part (the first block grows to it by doubling)
FIRST_BLOCK_ROWS = 16  # rows an exact part allocates first, however few it holds
_TRAIN_POINTS_PER_LIST = 32  # k-means sample: faiss warns below 39, quality is flat above ~30
_MIN_POINTS_PER_LIST = 8
_NPROBES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
_TUNE_QUERIES = 200
_TUNE_NOISE = 0.4  # perturbation norm: cosine ~0.93 to the stored vector
_RETRY_BACKOFF_S = 30.0
# faiss's bundled stubs lack the DirectMap enum (it exists at run time).
_HASHTABLE: int = faiss.DirectMap.Hashtable  # type: ignore[attr-defined]


class _Flat:
    """An exact part: rows in blocks (the first grows by doubling, later ones are _BLOCK rows),
    so adds never copy more than one block and removes swap the last row into the hole. It holds
    at most 3 rows per live row (or FIRST_BLOCK_ROWS): a lone first block is halved once a third
    or less of it is used (not at half: an add and a remove at the boundary would each copy it),
    and a trailing block goes once the rows fit in the blocks before it."""

    __slots__ = ("_blocks", "_ids", "_n", "_row", "dim")

    def __init__(self, dim: int):
        self.dim = dim
        self._blocks: list[np.ndarray] = []
        self._ids: list[np.ndarray] = []
        self._n = 0
        self._row: dict[int, int] = {}

    def __len__(self) -> int:
        return self._n

    def __contains__(self, item: int) -> bool:
        return item in self._row

    def capacity(self) -> int:
        if not self._blocks:
            return 0
        return (len(self._blocks) - 1) * _BLOCK + len(self._blocks[-1])

    def _grow(self, need: int) -> None:
        while self.capacity() < need:
            if not self._blocks:
                self._blocks.append(np.empty((FIRST_BLOCK_ROWS, self.dim), np.float32))
                self._ids.append(np.empty(FIRST_BLOCK_ROWS, np.int64))
            elif len(self._blocks) == 1 and len(self._blocks[0]) < _BLOCK:
                size = min(_BLOCK, 2 * len(self._blocks[0]))
                vecs = np.empty((size, self.dim), np.float32)
                ids = np.empty(size, np.int64)
                vecs[: self._n] = self._blocks[0][: self._n]
                ids[: self._n] = self._ids[0][: self._n]
                self._blocks[0], self._ids[0] = vecs, ids
            else:
                self._blocks.append(np.empty((_BLOCK, self.dim), np.float32))
                self._ids.append(np.empty(_BLOCK, np.int64))

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        self._grow(self._n + len(ids))
        done = 0
        while done < len(ids):
            row = self._n
            block, offset = divmod(row, _BLOCK)
            take = min(len(ids) - done, len(self._blocks[block]) - offset)
            self._blocks[block][offset : offset + take] = vectors[done : done + take]
            self._ids[block][offset : offset + take] = ids[done : done + take]
            for i, key in enumerate(ids[done : done + take].tolist()):
                self._row[key] = row + i
            self._n += take
            done += take

    def remove(self, key: int) -> bool:
        row = self._row.pop(key, None)
        if row is None:
            return False
        last = self._n - 1
        if row != last:
            rb, ro = divmod(row, _BLOCK)
            lb, lo = divmod(last, _BLOCK)
            self._blocks[rb][ro] = self._blocks[lb][lo]
            moved = int(self._ids[lb][lo])
            self._ids[rb][ro] = moved
            self._row[moved] = row
        self._n = last
        if len(self._blocks) > 1 and self._n <= (len(self._blocks) - 1) * _BLOCK:
            self._blocks.pop()
            self._ids.pop()
        elif len(self._blocks) == 1 and len(self._blocks[0]) > FIRST_BLOCK_ROWS:
            size = len(self._blocks[0])
            if 3 * self._n < size:
                size //= 2
                self._blocks[0] = self._blocks[0][:size].copy()
                self._ids[0] = self._ids[0][:size].copy()
        return True

    def _live(self) -> Iterable[tuple[np.ndarray, np.ndarray]]:
        left = self._n
        for vecs, ids in zip(self._blocks, self._ids, strict=True):
            if left <= 0:
                break
            m = min(left, len(vecs))
            yield vecs[:m], ids[:m]
            left -= m

    def search(self, query: np.ndarray, k: int, removed: set[int] | None) -> list[tuple[int, float]]:
        if self._n == 0:
            return []
        parts = list(self._live())
        if len(parts) == 1:
            scores, ids = parts[0][0] @ query, parts[0][1]
        else:
            scores = np.concatenate([vecs @ query for vecs, _ in parts])
            ids = np.concatenate([i for _, i in parts])
        return _best(scores, ids, k, removed)

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        parts = list(self._live())
        if not parts:
            return np.empty(0, np.int64), np.empty((0, self.dim), np.float32)
        return np.concatenate([i for _, i in parts]), np.concatenate([v for v, _ in parts])


def _best(scores: np.ndarray, ids: np.ndarray, k: int, removed: set[int] | None) -> list[tuple[int, float]]:
    """Top k (id, score) of one exact part, best first, skipping `removed`."""
    n = len(scores)
    want = min(n, k + (min(len(removed), 64) if removed else 0))
    while True:
        top = np.argpartition(-scores, want - 1)[:want] if want < n else np.arange(n)
        top = top[np.argsort(-scores[top], kind="stable")]
        out = [
            (key, float(s))
            for key, s in zip(ids[top].tolist(), scores[top].tolist(), strict=True)
            if not removed or key not in removed
        ]
        if len(out) >= k or want >= n:
            return out[:k]
        want = min(n, want * 4)


def _ivf_search(index: Any, query: np.ndarray, k: int, removed: set[int] | None) -> list[tuple[int, float]]:
    total = int(index.ntotal)
    if total == 0:
        return []
    want = min(total, k + (min(len(removed), 64) if removed else 0))
    q = query.reshape(1, -1)
    while True:
        scores, ids = index.search(q, want)
        out = [
            (key, float(s))
            for key, s in zip(ids[0].tolist(), scores[0].tolist(), strict=True)
            if key >= 0 and (not removed or key not in removed)
        ]
        # Fewer than asked with slots unfilled (-1) means the probed lists ran out: widening k
        # would not find more.
        if len(out) >= k or want >= total or int(ids[0][-1]) < 0:
            return out[:k]
        want = min(total, want * 4)


def _ivf_snapshot(index: Any, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Every (id, vector) of an IVF-Flat index, read from its inverted lists (no copy kept in
    the index's owner: the lists are the only copy of the vectors)."""
    invlists = index.invlists
    id_parts: list[np.ndarray] = []
    vec_parts: list[np.ndarray] = []
    for list_no in range(index.nlist):
        size = invlists.list_size(list_no)
        if size == 0:
            continue
        id_parts.append(faiss.rev_swig_ptr(invlists.get_ids(list_no), size).copy())
        codes = faiss.rev_swig_ptr(invlists.get_codes(list_no), size * invlists.code_size)
        vec_parts.append(codes.copy().view(np.float32).reshape(size, dim))
    if not id_parts:
        return np.empty(0, np.int64), np.empty((0, dim), np.float32)
    return np.concatenate(id_parts), np.concatenate(vec_parts)


class _Rebuilder:
    """One daemon thread that runs every index's rebuilds, one at a time (a 2-core box cannot
    train two k-means at once and keep serving)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="paved-ann-rebuild", daemon=True)
                self._thread.start()
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job()
            except Exception:  # a job reports its own failure; this only keeps the thread alive
                logger.exception("ANN rebuild job failed")


_REBUILDER = _Rebuilder()


def _default_train_threads() -> int:
    return max(1, (os.cpu_count() or 2) - 1)


class VectorIndex:
    """k-NN by inner product over L2-normalised vectors; see the module docstring."""

    def __init__(
        self,
        dim: int,
        *,
        ivf_threshold: int = 8192,
        target_recall: float = 0.99,
        train_threads: int | None = None,
        seed: int = 1234,
    ):
        if dim <= 0:
            raise ValueError("dim must be positive")
        if ivf_threshold < 2 * _MIN_POINTS_PER_LIST:
            raise ValueError(f"ivf_threshold must be at least {2 * _MIN_POINTS_PER_LIST}")
        self.dim = dim
        self.ivf_threshold = ivf_threshold
        self.target_recall = target_recall
        self.train_threads = train_threads or _default_train_threads()
        self._seed = seed
        self._lock = threading.Lock()
        self._ids: set[int] = set()
        self._ivf: Any = None  # faiss.IndexIVFFlat
        self._quantizer: Any = None  # kept alive beside the IVF index that points at it
        self._delta = _Flat(dim)
        self._frozen_flat: list[_Flat] = []
        self._ivf_frozen = False
        self._removed: set[int] = set()
        self._trained_n = 0
        self._rebuilding = False
        self._retry_at = 0.0
        self._closed = False
        self._idle = threading.Event()
        self._idle.set()
        self.builds = 0  # completed IVF builds
        self.last_build_s = 0.0
        self.last_recall = 1.0  # the tuning's measured recall@1 at the chosen nprobe

    # ---- introspection -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, key: int) -> bool:
        return key in self._ids

    @property
    def rows_held(self) -> int:
        """Rows the index holds memory for: its exact parts' capacity and its IVF part's vectors
        (faiss keeps each IVF list's peak allocation after removals, which this does not see;
        the rebuild once it shrinks below two thirds of its build bounds that)."""
        with self._lock:
            rows = self._delta.capacity() + sum(f.capacity() for f in self._frozen_flat)
            return rows + (int(self._ivf.ntotal) if self._ivf is not None else 0)

    @property
    def kind(self) -> str:
        return "flat" if self._ivf is None else "ivf"

    @property
    def nlist(self) -> int:
        return 0 if self._ivf is None else int(self._ivf.nlist)

    @property
    def nprobe(self) -> int:
        return 0 if self._ivf is None else int(self._ivf.nprobe)

    @property
    def exact_rows(self) -> int:
        """Rows a search scans exactly (the delta and frozen exact parts): its cost beyond the
        IVF probe, for a caller deciding whether to search on its own thread."""
        return len(self._delta) + sum(len(f) for f in self._frozen_flat)

    @property
    def rebuilding(self) -> bool:
        return self._rebuilding

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Until no rebuild is pending or running (True), or the timeout passed (False)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._idle.wait(left):
                return False
            with self._lock:
                if not self._rebuilding:
                    return True

    def close(self) -> None:
        """Drop the vectors; a queued rebuild of this index then does nothing."""
        with self._lock:
            self._closed = True
            self._ids.clear()
            self._ivf = self._quantizer = None
            self._delta = _Flat(self.dim)
            self._frozen_flat.clear()
            self._removed.clear()

    # ---- mutation --------------------------------------------------------------------------------
    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.ndim == 1:
            vectors = vectors.reshape(1, -1)
        if vectors.shape != (len(ids), self.dim):
            raise ValueError(f"vectors must have shape ({len(ids)}, {self.dim}), not {vectors.shape}")
        if not np.isfinite(vectors).all():
            raise ValueError("vectors must be finite")
        keys = ids.tolist()
        if len(set(keys)) != len(keys):
            raise ValueError("ids must be unique")
        with self._lock:
            if self._closed:
                raise ValueError("the index is closed")
            present = [key for key in keys if key in self._ids]
            if present:
                raise ValueError(f"ids already present: {present[:5]}")
            if self._ivf is not None and not self._ivf_frozen:
                self._ivf.add_with_ids(vectors, ids)
            else:
                self._delta.add(ids, vectors)
            self._ids.update(keys)
            self._maybe_rebuild()

    def remove(self, ids: Iterable[int]) -> int:
        """Remove the ids present; returns how many were."""
        removed = 0
        to_ivf: list[int] = []
        with self._lock:
            for key in ids:
                key = int(key)
                if key not in self._ids:
                    continue
                self._ids.discard(key)
                removed += 1
                if self._delta.remove(key):
                    continue
                if self._rebuilding or self._ivf_frozen or self._frozen_flat:
                    self._removed.add(key)
                else:
                    to_ivf.append(key)
            if to_ivf:
                self._ivf.remove_ids(faiss.IDSelectorArray(np.array(to_ivf, dtype=np.int64)))
            if removed:
                self._maybe_rebuild()
        return removed

    # ---- search ----------------------------------------------------------------------------------
    def search(self, vector: np.ndarray, k: int = 1) -> list[tuple[int, float]]:
        """The k best (id, inner product) pairs, best first."""
        query = np.ascontiguousarray(vector, dtype=np.float32).reshape(-1)
        if query.shape != (self.dim,):
            raise ValueError(f"the query must have {self.dim} dimensions, not {query.shape[0]}")
        if k <= 0:
            return []
        with self._lock:
            removed = self._removed or None
            results = self._delta.search(query, k, None)
            for part in self._frozen_flat:
                results += part.search(query, k, removed)
            if self._ivf is not None:
                results += _ivf_search(self._ivf, query, k, removed if self._ivf_frozen else None)
        if len(results) > k:
            results.sort(key=lambda pair: -pair[1])
            del results[k:]
        elif len(results) > 1:
            results.sort(key=lambda pair: -pair[1])
        return results

    # ---- rebuilds --------------------------------------------------------------------------------
    def _maybe_rebuild(self) -> None:
        """Called with the lock held: start a rebuild when the index outgrew its layout."""
        if self._rebuilding or self._closed or time.monotonic() < self._retry_at:
            return
        if self._ivf is None:
            if len(self._delta) + sum(len(f) for f in self._frozen_flat) < self.ivf_threshold:
                return
        elif not self._ids:
            # Emptied: nothing to build from; back to an empty exact part (memory freed).
            self._ivf = self._quantizer = None
            self._trained_n = 0
            return
        elif (
            len(self._ids) < 2 * self._trained_n
            and self.exact_rows < self.ivf_threshold
            # Shrunk below two thirds of its build: rebuilt compact, so the memory of removed
            # vectors (an IVF list keeps its peak) stays under 3 rows per live one.
            and 3 * len(self._ids) >= 2 * self._trained_n
        ):
            return
        if len(self._delta):
            self._frozen_flat.append(self._delta)
            self._delta = _Flat(self.dim)
        if self._ivf is not None:
            self._ivf_frozen = True
        self._rebuilding = True
        self._idle.clear()
        _REBUILDER.submit(self._rebuild)

    def _rebuild(self) -> None:
        started = time.perf_counter()
        try:
            with self._lock:
                if self._closed:
                    return
                # Frozen: nothing writes these until the swap below.
                sources_flat = list(self._frozen_flat)
                source_ivf = self._ivf
            faiss.omp_set_num_threads(self.train_threads)
            parts = [f.snapshot() for f in sources_flat]
            if source_ivf is not None:
                parts.append(_ivf_snapshot(source_ivf, self.dim))
            ids = np.concatenate([p[0] for p in parts]) if parts else np.empty(0, np.int64)
            vecs = np.concatenate([p[1] for p in parts]) if parts else np.empty((0, self.dim), np.float32)
            del parts
            with self._lock:
                gone = np.fromiter(self._removed, dtype=np.int64, count=len(self._removed))
            if len(gone):
                keep = ~np.isin(ids, gone)
                ids, vecs = ids[keep], vecs[keep]
            quantizer, index, recall = self._build(ids, vecs)
            del vecs
            with self._lock:
                if self._closed:
                    return
                # Removed while the build ran (or before, from a failed build): O(removed).
                if self._removed:
                    gone = np.fromiter(self._removed, dtype=np.int64, count=len(self._removed))
                    index.remove_ids(faiss.IDSelectorArray(gone))
                self._ivf, self._quantizer = index, quantizer
                self._ivf_frozen = False
                self._frozen_flat = []
                self._removed = set()
                self._trained_n = max(len(ids), 1)
                self.builds += 1
                self.last_build_s = time.perf_counter() - started
                self.last_recall = recall
                self._rebuilding = False
                self._retry_at = 0.0
                self._maybe_rebuild()
                if not self._rebuilding:
                    self._idle.set()
            logger.debug(
                "ANN index rebuilt: %d vectors, nlist %d, nprobe %d, recall %.3f, %.2f s",
                len(ids), index.nlist, index.nprobe, recall, time.perf_counter() - started,
            )  # fmt: skip
        except Exception:
            logger.exception("ANN index rebuild failed; retrying in %.0f s", _RETRY_BACKOFF_S)
            with self._lock:
                self._rebuilding = False
                self._retry_at = time.monotonic() + _RETRY_BACKOFF_S
                self._idle.set()

    def _build(self, ids: np.ndarray, vecs: np.ndarray) -> tuple[Any, Any, float]:
        n = len(ids)
        rng = np.random.default_rng(self._seed + n)
        nlist = max(1, min(int(4 * math.sqrt(max(n, 1))), n // _MIN_POINTS_PER_LIST))
        quantizer = faiss.IndexFlatIP(self.dim)
        index = faiss.IndexIVFFlat(quantizer, self.dim, nlist, faiss.METRIC_INNER_PRODUCT)
        index.cp.spherical = True  # centroids on the sphere, like the data
        index.cp.niter = 10
        index.cp.seed = int(self._seed)
        index.cp.min_points_per_centroid = 1  # the sample is sized below; no warning spam
        index.cp.max_points_per_centroid = _TRAIN_POINTS_PER_LIST
        sample = min(n, nlist * _TRAIN_POINTS_PER_LIST)
        train = vecs if sample == n else vecs[np.sort(rng.choice(n, sample, replace=False))]
        index.train(np.ascontiguousarray(train))
        index.set_direct_map_type(_HASHTABLE)
        if n:
            index.add_with_ids(vecs, ids)
        recall = self._tune(index, vecs, rng)
        return quantizer, index, recall

    def _tune(self, index: Any, vecs: np.ndarray, rng: np.random.Generator) -> float:
        """The smallest nprobe reaching `target_recall` at k=1 against an exact search, on
        stored vectors perturbed to cosine ~0.93; returns the recall it measured."""
        n = len(vecs)
        if n == 0:
            index.nprobe = 1
            return 1.0
        count = min(_TUNE_QUERIES, n)
        base = vecs[rng.choice(n, count, replace=False)]
        noise = rng.standard_normal(base.shape, dtype=np.float32)
        noise *= _TUNE_NOISE / np.linalg.norm(noise, axis=1, keepdims=True)
        queries = base + noise
        queries /= np.linalg.norm(queries, axis=1, keepdims=True)
        exact, _ = faiss.knn(queries, vecs, 1, metric=faiss.METRIC_INNER_PRODUCT)
        recall = 0.0
        for nprobe in [p for p in _NPROBES if p < index.nlist] + [index.nlist]:
            index.nprobe = nprobe
            found, _ = index.search(queries, 1)
            # By score, so a tie between two stored vectors is not a miss.
            recall = float(np.mean(found[:, 0] >= exact[:, 0] - 1e-5))
            if recall >= self.target_recall:
                break
        return recall
