"""Weighted kNN classification (Wu et al. 2018; docs/evaluation.md) over a bank of features.

Cosine similarity on L2-normalised features; each of the k nearest bank entries votes
exp(sim / T) for its class (T = 0.07); top-1 and top-5 for every k from one search at the
largest k. A class counts towards top-5 only if it received a vote (with k < 5 the
zero-vote classes would otherwise fill the list in arbitrary order).

Indexes (``eval.index``):
- ``faiss_flat`` (default) and ``exact``: exact search, the bank read a block of rows at a
  time and never held whole (:class:`ExactIndex`); each block searched for all queries at
  once by faiss's brute-force ``knn`` or by ``torch.mm`` and ``torch.topk``, on the CPU.
- ``ivf``: faiss ``IndexIVFFlat`` (inner product) for banks too large for exact search;
  ``ivf_lists`` cells, ``ivf_probe`` probed; the report gives its accuracy next to exact.
  It holds the bank. It is saved (``.faiss``) under a name keyed by the model's weights,
  the bank's shards and the index settings (:mod:`evaluation.identity`), and reused only
  under that name.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

BLOCK_BYTES = 256 * 2**20  # default score block [queries, bank rows] (eval.block_mib)
BANK_BLOCK_BYTES = 64 * 2**20  # default bank block [rows, d] float32 (eval.bank_block_mib)


class ExactIndex:
    """Exact inner-product search of the L2-normalised bank, read in blocks of rows: the
    bank is neither copied nor held whole (a :class:`~evaluation.bank.RowFiles` bank stays
    on disk). Each block of at most ``bank_block_bytes`` is normalised as it is read,
    searched for every query and its best k merged with the best so far. ``faiss_flat``
    searches a block with faiss's brute-force ``knn``, which bounds its own scores;
    ``exact`` with ``torch.mm`` and ``torch.topk`` over chunks of queries whose
    [queries, rows] scores fit ``block_bytes``. Fewer, larger bank blocks are faster (each
    block's top-k starts from nothing); the bank block is what the search adds to the
    process. Nothing to build, so nothing is saved."""

    loaded = False

    def __init__(self, bank: Tensor, block_bytes: int = BLOCK_BYTES,
                 with_faiss: bool = False,
                 bank_block_bytes: int = BANK_BLOCK_BYTES) -> None:
        self.bank = bank  # [n, d]: a tensor or anything that reads row blocks as one
        self.block_bytes = block_bytes
        self.bank_block_bytes = bank_block_bytes
        self.with_faiss = with_faiss  # faiss searches float32 only
        wide = bank.dtype == torch.float64 and not with_faiss
        self.dtype = torch.float64 if wide else torch.float32

    def search(self, queries: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """queries [q, d] -> (similarities [q, k], bank indices [q, k]), best first."""
        queries = F.normalize(queries.cpu().to(self.dtype), dim=1)
        n, dim = self.bank.shape
        k = min(k, n)
        item = queries.element_size()
        rows = even_blocks(n, max(k, self.bank_block_bytes // (item * dim)))
        best = (torch.empty(len(queries), 0, dtype=self.dtype),
                torch.empty(len(queries), 0, dtype=torch.long))
        unit = queries.new_empty(min(rows, n), dim)  # the normalised block, reused
        # one reused score buffer: fresh 256 MiB ones page-fault on every block (~30%)
        chunk = max(1, self.block_bytes // (item * rows))  # queries per [chunk, rows] block
        scores = None if self.with_faiss else queries.new_empty(
            min(chunk, len(queries)) * min(rows, n))
        for start in range(0, n, rows):
            raw = self.bank[start:start + rows].cpu().to(self.dtype)
            block = unit[:len(raw)]
            torch.div(raw, torch.linalg.vector_norm(raw, dim=1, keepdim=True).clamp_(min=1e-12),
                      out=block)
            del raw
            if scores is None:
                sims, found = faiss_block(queries, block, k)
            else:
                sims, found = torch_block(queries, block, k, scores, chunk)
            best = merge_best(best, (sims, found + start), k)
        return best


def even_blocks(n: int, most: int) -> int:
    """Rows per block when ``n`` rows go in the fewest blocks of at most ``most`` rows, all
    but the last of one size (no small remainder block)."""
    count = -(-n // max(1, most))
    return max(1, -(-n // max(1, count)))


def faiss_block(queries: Tensor, block: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The best ``k`` of ``block`` [rows, d] for every query, by faiss's brute force."""
    import faiss

    sims, rows = faiss.knn(queries.numpy(), block.numpy(), min(k, len(block)),
                           metric=faiss.METRIC_INNER_PRODUCT)
    return torch.from_numpy(sims), torch.from_numpy(rows)


def torch_block(queries: Tensor, block: Tensor, k: int, scores: Tensor,
                chunk: int) -> tuple[Tensor, Tensor]:
    """The best ``k`` of ``block`` [rows, d] for every query, by matmul and top-k over
    ``chunk`` queries at a time, their scores in ``scores``."""
    k = min(k, len(block))
    values, indices = [], []
    for start in range(0, len(queries), chunk):
        part = queries[start:start + chunk]
        out = scores[:len(part) * len(block)].view(len(part), len(block))
        top = torch.topk(torch.mm(part, block.T, out=out), k, dim=1)
        values.append(top.values)
        indices.append(top.indices)
    return torch.cat(values), torch.cat(indices)


def merge_best(best: tuple[Tensor, Tensor], found: tuple[Tensor, Tensor],
               k: int) -> tuple[Tensor, Tensor]:
    """The best ``k`` of two ([q, a], [q, a]) and ([q, b], [q, b]) (similarities, indices),
    best first."""
    sims = torch.cat([best[0], found[0]], dim=1)
    rows = torch.cat([best[1], found[1]], dim=1)
    top = torch.topk(sims, min(k, sims.shape[1]), dim=1)
    return top.values, rows.gather(1, top.indices)


class IvfIndex:
    """faiss ``IndexIVFFlat`` (inner product) of the L2-normalised bank: ``lists`` cells
    (0: about 4 sqrt(n)), ``probe`` of them searched per query; on the GPU with faiss-gpu.
    The index holds the bank (4 bytes a value)."""

    def __init__(self, bank: Tensor, lists: int = 0, probe: int = 16, index=None,
                 bank_block_bytes: int = BANK_BLOCK_BYTES) -> None:
        import faiss

        self.loaded = index is not None  # read from a saved file
        if index is None:
            index = self._build(bank, lists, bank_block_bytes)
        faiss.extract_index_ivf(index).nprobe = probe
        self.index = _to_gpu(index)
        self.cpu_index = index

    @staticmethod
    def _build(bank: Tensor, lists: int, bank_block_bytes: int):
        """The index, trained on a seeded sample of the bank and added in row blocks of
        ``bank_block_bytes`` (no normalised copy of the whole bank is made)."""
        import faiss

        dim = bank.shape[1]
        lists = lists or max(1, int(4 * np.sqrt(len(bank))))
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, lists,
                                   faiss.METRIC_INNER_PRODUCT)
        # k-means reads at most 256 rows per list (faiss's own cap): a seeded sample
        sample = torch.randperm(len(bank), generator=torch.Generator().manual_seed(0))
        index.train(_unit_rows(bank[sample[: 256 * lists].sort().values]))
        rows = max(1, bank_block_bytes // (4 * dim))
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
                block_bytes: int = BLOCK_BYTES,
                bank_block_bytes: int = BANK_BLOCK_BYTES) -> ExactIndex | IvfIndex:
    """The bank's index: for ``exact`` and ``faiss_flat`` the bank itself, searched in
    blocks; for ``ivf`` built (or loaded from ``path``, without suffix, when saved there
    before; ``path`` must name what the index was built from:
    :func:`evaluation.identity.index_key`)."""
    if kind != "ivf":
        return ExactIndex(bank, block_bytes, kind == "faiss_flat", bank_block_bytes)
    if path is not None and path.with_suffix(".faiss").is_file():
        import faiss

        index = faiss.read_index(str(path.with_suffix(".faiss")))
        if index.ntotal == bank.shape[0]:
            return IvfIndex(bank, lists, probe, index=index)
    return IvfIndex(bank, lists, probe, bank_block_bytes=bank_block_bytes)


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
