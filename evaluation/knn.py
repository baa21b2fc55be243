"""Weighted kNN classification (Wu et al. 2018; docs/evaluation.md) over a bank of features.

Cosine similarity on L2-normalised features; each of the k nearest bank entries votes
exp(sim / T) for its class (T = 0.07); top-1 and top-5 for every k from one search at the
largest k. A class counts towards top-5 only if it received a vote (with k < 5 the
zero-vote classes would otherwise fill the list in arbitrary order).

Indexes (``eval.index``):
- ``faiss_flat`` (default): faiss ``IndexFlatIP``, exact; on the GPU with faiss-gpu. Searching
  all queries in one call it ran at 1.07x this machine's torch.mm rate on the benchmark
  shape (``bench/knn.py``; one query at a time it would not use BLAS and be far slower).
- ``exact``: blockwise ``queries @ bank.T`` with ``torch.topk`` per block, on the GPU when
  there is one without faiss-gpu (0.81x torch.mm on 2 CPU cores: top-k costs the rest;
  both figures from docs/benchmarks.md, "kNN", a median of 3 rounds on a drifting machine).
- ``ivf``: faiss ``IndexIVFFlat`` (inner product) for banks too large for exact search;
  ``ivf_lists`` cells, ``ivf_probe`` probed; the report gives its accuracy next to exact.
Indexes are saved (``.pt`` for exact, ``.faiss`` otherwise) under a name keyed by the model's
weights, the bank's shards and the index settings (:mod:`evaluation.identity`), and reused
only under that name.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

BLOCK_BYTES = 256 * 2**20  # default score block [queries, bank] (eval.block_mib)


class ExactIndex:
    def __init__(self, bank: Tensor, block_bytes: int = BLOCK_BYTES,
                 loaded: bool = False) -> None:
        self.bank = F.normalize(bank, dim=1)
        self.block_bytes = block_bytes
        self.loaded = loaded  # read from a saved file

    def search(self, queries: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """queries [q, d] -> (similarities [q, k], bank indices [q, k]), best first."""
        queries = F.normalize(queries.to(self.bank.device, self.bank.dtype), dim=1)
        k = min(k, self.bank.shape[0])
        rows = max(1, self.block_bytes // (self.bank.shape[0] * self.bank.element_size()))
        # one reused output block: fresh 256 MiB buffers page-fault on every block (~30%)
        out = queries.new_empty(min(rows, queries.shape[0]), self.bank.shape[0])
        sims, index = [], []
        for start in range(0, queries.shape[0], rows):
            chunk = queries[start:start + rows]
            block = torch.mm(chunk, self.bank.T, out=out[: len(chunk)])
            top = torch.topk(block, k, dim=1)
            sims.append(top.values)
            index.append(top.indices)
        return torch.cat(sims), torch.cat(index)

    def save(self, path: Path) -> None:
        torch.save(self.bank.cpu(), path.with_suffix(".pt"))


class FaissIndex:
    def __init__(self, bank: Tensor, kind: str, lists: int = 0, probe: int = 16,
                 index=None, block_bytes: int = BLOCK_BYTES) -> None:
        import faiss

        self.loaded = index is not None  # read from a saved file
        if index is None:
            index = self._build(bank, kind, lists, block_bytes)
        if kind == "ivf":
            faiss.extract_index_ivf(index).nprobe = probe
        self.index = _to_gpu(index)
        self.cpu_index = index

    @staticmethod
    def _build(bank: Tensor, kind: str, lists: int, block_bytes: int):
        """The index of the L2-normalised bank, added in row blocks of ``block_bytes`` (the
        index holds its own copy; no normalised copy of the whole bank is made)."""
        import faiss

        dim = bank.shape[1]
        if kind == "ivf":
            lists = lists or max(1, int(4 * np.sqrt(len(bank))))
            index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, lists,
                                       faiss.METRIC_INNER_PRODUCT)
            # k-means reads at most 256 rows per list (faiss's own cap): a seeded sample
            sample = torch.randperm(len(bank), generator=torch.Generator().manual_seed(0))
            index.train(_unit_rows(bank[sample[: 256 * lists].sort().values]))
        else:
            index = faiss.IndexFlatIP(dim)
            # reserve the whole bank up front: grown block by block, the vector doubles
            # and copies (peak 2x the bank measured at 400k rows; reserved: 1x + a block)
            index.codes.resize(len(bank) * dim * 4)
            index.codes.resize(0)
        rows = max(1, block_bytes // (4 * dim))
        for start in range(0, len(bank), rows):
            index.add(_unit_rows(bank[start:start + rows]))
        return index

    def search(self, queries: Tensor, k: int) -> tuple[Tensor, Tensor]:
        sims, index = self.index.search(_unit_rows(queries), min(k, self.cpu_index.ntotal))
        return torch.from_numpy(sims), torch.from_numpy(index)

    def save(self, path: Path) -> None:
        import faiss

        faiss.write_index(self.cpu_index, str(path.with_suffix(".faiss")))


def _unit_rows(rows: Tensor) -> np.ndarray:
    """[n, d] rows L2-normalised, as the contiguous float32 array faiss takes."""
    return np.ascontiguousarray(F.normalize(rows.float(), dim=1).cpu().numpy())


def _to_gpu(index):
    import faiss

    if torch.cuda.is_available() and hasattr(faiss, "StandardGpuResources"):
        # this rank's device (runtime sets it from LOCAL_RANK), not always GPU 0
        return faiss.index_cpu_to_gpu(faiss.StandardGpuResources(),
                                      torch.cuda.current_device(), index)
    return index


def build_index(bank: Tensor, kind: str, lists: int = 0, probe: int = 16,
                path: Path | None = None,
                block_bytes: int = BLOCK_BYTES) -> ExactIndex | FaissIndex:
    """The bank's index, loaded from ``path`` (without suffix) when saved there before;
    ``path`` must name what the index was built from (:func:`evaluation.identity.index_key`)."""
    if kind == "exact":
        if path is not None and path.with_suffix(".pt").is_file():
            saved = torch.load(path.with_suffix(".pt"), weights_only=True)
            if saved.shape == bank.shape:
                return ExactIndex(saved.to(bank.device), block_bytes, loaded=True)
        return ExactIndex(bank, block_bytes)
    if path is not None and path.with_suffix(".faiss").is_file():
        import faiss

        index = faiss.read_index(str(path.with_suffix(".faiss")))
        if index.ntotal == bank.shape[0]:
            return FaissIndex(bank, kind, lists, probe, index=index)
    return FaissIndex(bank, kind, lists, probe, block_bytes=block_bytes)


def weighted_votes(sims: Tensor, neighbour_labels: Tensor, num_classes: int,
                   temperature: float) -> Tensor:
    """[q, k] similarities and labels -> [q, C] summed exp(sim / T) per class."""
    weights = (sims.double() / temperature).exp()
    votes = torch.zeros(sims.shape[0], num_classes, dtype=torch.float64)
    return votes.scatter_add_(1, neighbour_labels.long(), weights)


def knn_accuracy(index, bank_labels: Tensor, queries: Tensor, labels: Tensor, ks: list[int],
                 temperature: float, num_classes: int,
                 block_bytes: int = BLOCK_BYTES) -> tuple[dict, dict[int, Tensor]]:
    """({"k20": {"top1": .., "top5": ..}, ...}, {k: predicted class [q]}); the [q, C] votes
    are counted for blocks of queries within ``block_bytes``."""
    sims, index_ = index.search(queries, max(ks))
    sims, index_ = sims.cpu(), index_.cpu()
    neighbour_labels = bank_labels.cpu()[index_]
    labels = labels.cpu()
    rows = max(1, block_bytes // (num_classes * 16))  # votes (float64) and their top-k
    top1 = dict.fromkeys(ks, 0)
    top5 = dict.fromkeys(ks, 0)
    predictions: dict[int, list[Tensor]] = {k: [] for k in ks}
    for start in range(0, len(labels), rows):
        truth = labels[start:start + rows]
        for k in ks:
            votes = weighted_votes(sims[start:start + rows, :k],
                                   neighbour_labels[start:start + rows, :k], num_classes,
                                   temperature)
            top = votes.topk(min(5, num_classes), dim=1).indices
            predictions[k].append(top[:, 0])
            voted = votes.gather(1, truth[:, None].clamp(min=0)).squeeze(1) > 0  # no vote: miss
            top1[k] += int((top[:, 0] == truth).sum())
            top5[k] += int(((top == truth[:, None]).any(1) & voted).sum())
    results = {f"k{k}": {"top1": top1[k] / len(labels), "top5": top5[k] / len(labels)}
               for k in ks}
    return results, {k: torch.cat(predictions[k]) for k in ks}
