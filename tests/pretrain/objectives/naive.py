"""Per-anchor loops for what the plain forms of the table do not express: a loss over a
chosen subset of each anchor's negatives (``negatives_kept(i, j)``; the plain forms take
every negative), the identities FlatNCE and Hoelder-FlatNCE are defined by (InfoNCE
without the positive, the paper's m_gamma / detach(m_gamma)), and ProjNCE's adjustment R,
a metric. Deliberately slow and literal: Python loops, plain exp/log, float64.
"""

from __future__ import annotations

import torch
from torch import Tensor


def unit(z: Tensor) -> Tensor:
    return z / z.norm(dim=1, keepdim=True)


def _mean(values: list[Tensor]) -> Tensor:
    return torch.stack(values).mean()


def _keep_all(i: int, j: int) -> bool:
    return True


def supcon(z: Tensor, keys: Tensor, tau: float, negatives_kept=_keep_all) -> Tensor:
    """Khosla L_out; with keys = ids this is InfoNCE."""
    z, n = unit(z), len(z)
    losses = []
    for i in range(n):
        positives = [p for p in range(n) if p != i and keys[p] == keys[i]]
        if not positives:
            continue
        cols = [a for a in range(n) if a != i and (a in positives or negatives_kept(i, a))]
        denom = sum(torch.exp(z[i] @ z[a] / tau) for a in cols)
        terms = [-torch.log(torch.exp(z[i] @ z[p] / tau) / denom) for p in positives]
        losses.append(sum(terms) / len(positives))
    return _mean(losses)


def sincere(z: Tensor, labels: Tensor, tau: float, eps: float = 0.0,
            negatives_kept=_keep_all) -> Tensor:
    z, n = unit(z), len(z)
    losses = []
    for i in range(n):
        positives = [p for p in range(n) if p != i and labels[p] == labels[i]]
        if not positives:
            continue
        negatives = [j for j in range(n) if labels[j] != labels[i] and negatives_kept(i, j)]
        neg = sum((torch.exp(z[i] @ z[j] / tau) for j in negatives), torch.zeros((), dtype=z.dtype))
        terms = []
        for p in positives:
            num = torch.exp(z[i] @ z[p] / tau)
            terms.append(-torch.log(num / (torch.exp(z[i] @ z[p] / tau - eps) + neg)))
        losses.append(sum(terms) / len(positives))
    return _mean(losses)


def infonce_without_positive(z: Tensor, ids: Tensor, tau: float) -> Tensor:
    """-log(exp(s_ip/tau) / sum_{n in Neg(i)} exp(s_in/tau)): FlatNCE's gradient twin."""
    z, n = unit(z), len(z)
    losses = []
    for i in range(n):
        positives = [p for p in range(n) if p != i and ids[p] == ids[i]]
        negatives = [j for j in range(n) if ids[j] != ids[i]]
        if not positives or not negatives:
            continue
        neg = sum(torch.exp(z[i] @ z[j] / tau) for j in negatives)
        losses.append(sum(-torch.log(torch.exp(z[i] @ z[p] / tau) / neg)
                          for p in positives) / len(positives))
    return _mean(losses)


def holder_mean_flatnce(z: Tensor, ids: Tensor, tau: float, gamma: float) -> Tensor:
    """The paper's Hoelder-FlatNCE, sum_i m_gamma / detach(m_gamma) (Def. 3.6), averaged."""
    z, n = unit(z), len(z)
    terms = []
    for i in range(n):
        positives = [p for p in range(n) if p != i and ids[p] == ids[i]]
        negatives = [j for j in range(n) if ids[j] != ids[i]]
        for p in positives:
            f = torch.stack([torch.exp((z[i] @ z[j] - z[i] @ z[p]) / tau) for j in negatives])
            m = (f**gamma).mean() ** (1 / gamma)
            terms.append(m / m.detach() / len(positives))
    return torch.stack(terms).sum() / sum(
        1 for i in range(n) if any(ids[p] == ids[i] for p in range(n) if p != i))


def xclr(z: Tensor, similarity: Tensor, tau: float, tau_s: float,
         columns_kept=_keep_all) -> Tensor:
    """``similarity`` [N, N]: c_i . c_j (captions, or the class graph at the label pair)."""
    z, n = unit(z), len(z)
    losses = []
    for i in range(n):
        others = [j for j in range(n) if j != i and columns_kept(i, j)]
        t_den = sum(torch.exp(similarity[i, k] / tau_s) for k in others)
        q_den = sum(torch.exp(z[i] @ z[k] / tau) for k in others)
        losses.append(-sum(torch.exp(similarity[i, j] / tau_s) / t_den
                           * torch.log(torch.exp(z[i] @ z[j] / tau) / q_den) for j in others))
    return _mean(losses)


def projnce(z: Tensor, labels: Tensor, tau: float, g_plus: list[Tensor],
            g_minus: list[Tensor]) -> tuple[Tensor, Tensor]:
    """(loss, mean R) for per-sample projections g+(y_k), g-(y_k) given as lists of [D]."""
    z, n = unit(z), len(z)
    losses, adjustments = [], []
    for i in range(n):
        if not any(labels[p] == labels[i] for p in range(n) if p != i):
            continue
        others = [k for k in range(n) if k != i]
        minus = sum(torch.exp(z[i] @ g_minus[k] / tau) for k in others)
        plus = sum(torch.exp(z[i] @ g_plus[k] / tau) for k in others)
        i_proj = -torch.log(torch.exp(z[i] @ g_plus[i] / tau) / minus)
        losses.append(i_proj + plus / minus)
        adjustments.append(plus / minus)
    return _mean(losses), _mean(adjustments)


def centroid_projections(z: Tensor, labels: Tensor) -> tuple[list[Tensor], list[Tensor]]:
    z, n = unit(z), len(z)
    plus = []
    for k in range(n):
        mates = [z[m] for m in range(n) if m != k and labels[m] == labels[k]]
        plus.append(sum(mates) / len(mates) if mates else z[k])
    return plus, [z[k] for k in range(n)]
