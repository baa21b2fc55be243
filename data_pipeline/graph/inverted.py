"""Approximate top-k inner-product neighbours of every row of a store, in time that grows
about linearly with its size: an inverted file (IVF, Jégou et al. 2011) whose lists keep a
constant size, searched list by list with matrix products.

1. **Centroids** from a tree of spherical k-means splits (branching ``BRANCHING``, each
   split trained on ``SAMPLE_PER_CENTROID`` rows a centroid), split until a leaf holds at
   most ``LIST_SIZE`` rows; a leaf's centroid is its normalised mean. Cost per level is one
   pass over the rows against ``BRANCHING`` centroids, and there are log(U / LIST_SIZE)
   levels, where flat k-means over U / LIST_SIZE centroids would cost U^2 / LIST_SIZE.
2. **Probes**: every row's ``PROBE`` nearest centroids through an HNSW graph over the
   centroids (Malkov & Yashunin 2018; log of their number a row). A row's list is its
   nearest centroid's.
3. **Scan**: rows in list order, in blocks of ``QUERY_BLOCK``; for every list a block
   probes, one product [block rows probing it, list size] (``faiss.knn``: BLAS plus a heap
   top-k) merged into the block's running top-(k + 1). Work is U x PROBE x LIST_SIZE
   products, linear in U. The scan reads a copy of the rows laid out list by list
   (:func:`list_ordered`), so a list or a block is one range of rows, not rows scattered
   over the store.

FAISS's own ``IndexIVF`` scores a query against its lists one code at a time; batching the
queries of a list into one product is ~3x faster on 2 CPU cores at 1M rows
(docs/benchmarks.md). The store may be a float16 memory map: rows are read in chunks and
converted by torch (numpy's float16 conversion is ~7x slower).

Given a ``device`` (a GPU when present, :func:`search_device`), the scan's products run
there as torch products (:func:`nearest`) and the tree's k-means on FAISS's GPUs when its
build has them; the probes stay on HNSW (exact probes against every centroid would cost
U^2 / LIST_SIZE). Without one, everything runs on the CPU as above.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import faiss
import numpy as np
import torch
from torch import Tensor

from data_pipeline.graph.pages import PagedRows, drop_pages

LIST_SIZE = 256  # rows a list holds at most when the tree is cut
BRANCHING = 16  # children of a split
SAMPLE_PER_CENTROID = 64  # rows a split's k-means trains on, per centroid
PROBE = 16  # lists a row's neighbours are searched in
EF_SEARCH = 32  # HNSW beam width of the centroid search (>= PROBE)
QUERY_BLOCK = 65_536  # rows whose queries and running top-k are held at a time
CHUNK = 65_536  # rows read and converted at a time


def search_device() -> torch.device | None:
    """The GPU the search runs its products on, or None (the CPU path) without one."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def nearest(queries: Tensor, base: Tensor, k: int,
            device: torch.device) -> tuple[Tensor, Tensor]:
    """The ``k`` largest inner products of each of ``queries`` [q, d] against ``base``
    [b, d], computed on ``device``: (scores [q, k], rows of ``base`` [q, k]), best first,
    returned on the CPU."""
    top = (queries.to(device) @ base.to(device).T).topk(k, dim=1)
    return top.values.cpu(), top.indices.cpu()


def float_rows(vectors: np.ndarray, rows: np.ndarray | slice) -> np.ndarray:
    """``vectors[rows]`` as contiguous float32 (torch converts float16 ~7x faster)."""
    return torch.from_numpy(np.array(vectors[rows])).float().numpy()


def scratch_array(scratch: Path | None, name: str, shape: tuple[int, ...],
                  dtype: type) -> np.ndarray:
    """An empty array: a memory-mapped ``scratch/<name>.npy`` (whose pages its writers
    drop, ``pages.py``, so a store's per-row arrays need not stay resident), or in memory
    without a ``scratch`` folder."""
    if scratch is None:
        return np.empty(shape, dtype)
    return np.lib.format.open_memmap(scratch / f"{name}.npy", mode="w+", dtype=dtype,
                                     shape=shape)


def split_tree(vectors: np.ndarray, list_size: int, seed: int = 0,
               gpu: bool = False) -> list[np.ndarray]:
    """The rows [U, d] cut into leaves of at most ``list_size`` rows by recursive spherical
    k-means (on FAISS's GPUs with ``gpu``); returns each leaf's row numbers, leaves in
    depth-first order."""
    rng = np.random.default_rng(seed)
    dim = vectors.shape[1]
    leaves, pending = [], [np.arange(len(vectors))]
    while pending:
        rows = pending.pop()
        if len(rows) <= list_size:
            leaves.append(rows)
            continue
        parts = min(BRANCHING, math.ceil(len(rows) / list_size))
        sample = np.sort(rng.choice(len(rows), min(len(rows), parts * SAMPLE_PER_CENTROID),
                                    replace=False))
        kmeans = faiss.Kmeans(dim, parts, niter=10, spherical=True, min_points_per_centroid=1,
                              seed=int(rng.integers(1 << 30)), gpu=gpu)
        kmeans.train(float_rows(vectors, rows[sample]))
        centres = torch.from_numpy(kmeans.centroids)
        side = np.concatenate([
            (torch.from_numpy(float_rows(vectors, rows[s:s + CHUNK])) @ centres.T).argmax(1).numpy()
            for s in range(0, len(rows), CHUNK)])
        order = np.argsort(side, kind="stable")
        bounds = np.searchsorted(side[order], np.arange(parts + 1))
        children = [rows[order[a:b]] for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
        if len(children) == 1:  # identical rows: k-means cannot split them
            children = [rows[: len(rows) // 2], rows[len(rows) // 2:]]
        pending.extend(reversed(children))
    return leaves


def centroids_of(vectors: np.ndarray, leaves: list[np.ndarray]) -> np.ndarray:
    """[len(leaves), d] float32: each leaf's mean row, normalised."""
    sums = torch.zeros((len(leaves), vectors.shape[1]), dtype=torch.float64)
    leaf_of = np.empty(len(vectors), np.int64)
    for number, rows in enumerate(leaves):
        leaf_of[rows] = number
    for start in range(0, len(vectors), CHUNK):
        sums.index_add_(0, torch.from_numpy(leaf_of[start:start + CHUNK]),
                        torch.from_numpy(float_rows(vectors, slice(start, start + CHUNK))).double())
    return torch.nn.functional.normalize(sums, dim=1).float().numpy()


def probe_lists(vectors: np.ndarray, centroids: np.ndarray, probe: int,
                scratch: Path | None = None) -> np.ndarray:
    """[U, min(probe, lists)] int32: every row's nearest centroids, nearest first, through
    an HNSW graph over the centroids (built on one thread, so it is reproducible); in
    ``scratch`` when given."""
    probe = min(probe, len(centroids))
    graph = faiss.IndexHNSWFlat(centroids.shape[1], 32, faiss.METRIC_INNER_PRODUCT)
    graph.hnsw.efSearch = max(EF_SEARCH, probe)
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        graph.add(centroids)
    finally:
        faiss.omp_set_num_threads(threads)
    probes = scratch_array(scratch, "probes", (len(vectors), probe), np.int32)
    for start in range(0, len(vectors), CHUNK):
        probes[start:start + CHUNK] = graph.search(
            float_rows(vectors, slice(start, start + CHUNK)), probe)[1]
        drop_pages(probes)
    return probes


class RunningTopK:
    """The best ``k`` (score, row) of each of ``n`` queries, merged a candidate set at a time."""

    def __init__(self, n: int, k: int) -> None:
        self.scores = torch.full((n, k), -math.inf)
        self.rows = torch.full((n, k), -1, dtype=torch.int64)

    def merge(self, queries: np.ndarray, scores: np.ndarray, rows: np.ndarray) -> None:
        """Candidates ``scores``/``rows`` [len(queries), c] of the queries ``queries``."""
        who = torch.from_numpy(queries)
        all_scores = torch.cat([self.scores[who], torch.from_numpy(scores)], 1)
        all_rows = torch.cat([self.rows[who], torch.from_numpy(rows)], 1)
        best = all_scores.topk(self.scores.shape[1], dim=1).indices
        self.scores[who] = all_scores.gather(1, best)
        self.rows[who] = all_rows.gather(1, best)


def scan_block(ordered: np.ndarray, queries: slice, probes: np.ndarray, lists: list[slice],
               k: int, device: torch.device | None = None) -> RunningTopK:
    """The top-``k`` of the rows ``queries`` of ``ordered`` (the rows in list order; self
    included) over the lists their ``probes`` [rows, p] name, each list a range of
    ``ordered``: one product per list (``faiss.knn``, or on ``device``). Rows found are
    positions in ``ordered``."""
    block = float_rows(ordered, queries)
    wanted = probes.ravel().astype(np.int64)
    asking = np.repeat(np.arange(len(block)), probes.shape[1])
    order = np.argsort(wanted, kind="stable")
    wanted, asking = wanted[order], asking[order]
    starts = np.flatnonzero(np.r_[True, wanted[1:] != wanted[:-1]])
    best = RunningTopK(len(block), k)
    for first, stop in zip(starts, np.r_[starts[1:], len(wanted)], strict=True):
        members = lists[wanted[first]] if wanted[first] >= 0 else slice(0, 0)
        if members.stop == members.start:
            continue  # -1: the centroid graph found fewer than p lists
        who, kept = asking[first:stop], min(k, members.stop - members.start)
        if device is None:
            scores, found = faiss.knn(block[who], float_rows(ordered, members), kept,
                                      metric=faiss.METRIC_INNER_PRODUCT)
        else:
            scores, found = (t.numpy() for t in nearest(
                torch.from_numpy(block[who]), torch.from_numpy(float_rows(ordered, members)),
                kept, device))
        best.merge(who, scores, found + members.start)
    return best


def list_ordered(vectors: np.ndarray, in_order: np.ndarray,
                 scratch: Path | None) -> np.ndarray | PagedRows:
    """The rows of ``vectors`` in list order (row i is ``vectors[in_order[i]]``): each list
    and each block of queries is then one range of rows, read in one copy instead of a
    gather of rows scattered over the store. In ``scratch`` when given, read through
    :class:`PagedRows`."""
    ordered = scratch_array(scratch, "ordered", vectors.shape, vectors.dtype)
    for start in range(0, len(vectors), CHUNK):
        ordered[start:start + CHUNK] = vectors[in_order[start:start + CHUNK]]
        drop_pages(ordered)
    return ordered if scratch is None else PagedRows(ordered)


class ListSearch(NamedTuple):
    similarities: np.ndarray  # [U, k] float32, best first
    ids: np.ndarray  # [U, k] int64; -1 where fewer than k rows were probed
    lists: int  # lists the rows were cut into


def scan(vectors: np.ndarray, probes: np.ndarray, k: int, device: torch.device | None = None,
         scratch: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` [U, k] of every row over the lists ``probes`` [U, p] names (a row's list
    is its first probe), a block of rows at a time; a row is never its own neighbour. The
    result is in ``scratch`` when given."""
    own, count = np.array(probes[:, 0]), int(probes.max()) + 1
    drop_pages(probes)
    in_order = np.argsort(own, kind="stable")  # rows grouped by their own list
    bounds = np.searchsorted(own[in_order], np.arange(count + 1))
    del own
    lists = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    ordered = list_ordered(vectors, in_order, scratch)
    sims = scratch_array(scratch, "similarities", (len(vectors), k), np.float32)
    ids = scratch_array(scratch, "ids", (len(vectors), k), np.int64)
    for start in range(0, len(vectors), QUERY_BLOCK):
        rows = in_order[start:start + QUERY_BLOCK]
        block_probes = probes[rows]
        drop_pages(probes)
        best = scan_block(ordered, slice(start, start + len(rows)), block_probes, lists, k + 1,
                          device)
        found = best.rows.numpy()
        found = np.where(found >= 0, in_order[found.clip(min=0)], -1)  # positions -> rows
        keep = np.argsort(found == rows[:, None], axis=1, kind="stable")[:, :k]  # drop itself
        sims[rows] = np.take_along_axis(best.scores.numpy(), keep, 1)
        ids[rows] = np.take_along_axis(found, keep, 1)
        drop_pages(sims, ids)
    return sims, ids


def inverted_topk(vectors: np.ndarray, k: int, list_size: int = LIST_SIZE,
                  probe: int = PROBE, device: torch.device | None = None,
                  scratch: Path | None = None) -> ListSearch:
    """Approximate top-``k`` neighbours [U, k] of every row of ``vectors`` [U, d] (unit
    rows, inner product), with the products on ``device`` if one is given; a row is never
    its own neighbour. With a ``scratch`` folder the [U, p] probes and the [U, k] result
    are memory-mapped files there, so what stays resident is about a block's worth."""
    gpu = device is not None and device.type == "cuda" and faiss.get_num_gpus() > 0
    centroids = centroids_of(vectors, split_tree(vectors, list_size, gpu=gpu))
    probes = probe_lists(vectors, centroids, probe, scratch)
    sims, ids = scan(vectors, probes, k, device, scratch)
    return ListSearch(sims, ids, len(centroids))
