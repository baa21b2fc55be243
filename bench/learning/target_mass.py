"""Where X-CLR's target mass goes on a caption set: to the anchor's other view, to other
images of its class, to other classes, under each of X-CLR's levers.

    python -m bench.learning.target_mass bench/results/learning/data/shards/alt_text-train \\
        bench/results/learning/data/captions/alt_text-train

Draws batches of B images as training does (two views sharing a caption, global batch)
and computes t_ij = softmax_{j != i}(c_i . c_j / tau_s) in float64 from the store's
caption embeddings, centred on the samples' mean and renormalised as ``graph.center``
stores them, and over each anchor's ``top_k`` most similar candidates (ties kept, as
``objective.xclr.top_k``). Prints mean mass per row: own view, same class, other class, and
the class precision same / (same + other). With ``--record``, also writes
``bench/records/learning/xclr_target_mass.json``, whose ``levers`` view is the table of
``docs/learning.md``, "X-CLR on web captions".
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import print_table
from bench.learning.data import caption_vectors
from bench.records import invocation, provenance, write_record
from pretrain.objectives.xclr import TIE  # objective.xclr's ties at the k-th


def target_mass(vectors: np.ndarray, labels: np.ndarray, tau_s: float, top_k: int,
                batch: int, trials: int, seed: int = 0) -> dict[str, float]:
    """Mean target mass per anchor row over ``trials`` batches of ``batch`` images, each
    image twice (its two views)."""
    gen = np.random.default_rng(seed)
    sums = np.zeros(3)
    for _ in range(trials):
        images = gen.choice(len(vectors), batch, replace=False)
        captions = np.repeat(vectors[images], 2, axis=0)  # [2B, E]
        classes, image = np.repeat(labels[images], 2), np.repeat(np.arange(batch), 2)
        cosine = captions @ captions.T
        np.fill_diagonal(cosine, -np.inf)
        if top_k and top_k < len(cosine) - 1:
            kth = -np.sort(-cosine, axis=1)[:, top_k - 1:top_k]
            cosine = np.where(cosine >= kth - TIE, cosine, -np.inf)
        logits = cosine / tau_s
        targets = np.exp(logits - logits.max(1, keepdims=True))
        targets /= targets.sum(1, keepdims=True)
        own = image[:, None] == image[None, :]
        np.fill_diagonal(own, False)
        same = (classes[:, None] == classes[None, :]) & ~own
        np.fill_diagonal(same, False)
        sums += [(targets * own).sum(1).mean(), (targets * same).sum(1).mean(),
                 (targets * ~(own | same)).sum(1).mean()]
    own_mass, same_mass, other_mass = sums / trials
    return {"own_view": own_mass, "same_class": same_mass, "other_class": other_mass,
            "class_precision": same_mass / max(same_mass + other_mass, 1e-12)}


NAME = "learning/xclr_target_mass"
RENDERER = "bench.learning.target_mass"  # this module, by the name a record imports it
# the docs' rows: words -> (center, tau_s, top_k, images a step), one lever at a time from
# the previous recipe, then the recipe and the levers beside it
SETTINGS = {
    "previous recipe (tau_s 0.1)": (False, 0.1, 0, 128),
    "tau_s 0.05 (the recipe)": (False, 0.05, 0, 128),
    "tau_s 0.2": (False, 0.2, 0, 128),
    "centred store": (True, 0.1, 0, 128),
    "`top_k=16`": (False, 0.1, 16, 128),
    "256 images a step": (False, 0.1, 0, 256),
    "tau_s 0.05, `top_k=16`": (False, 0.05, 16, 128),
    "tau_s 0.05, centred": (True, 0.05, 0, 128),
    "tau_s 0.05, centred, 256 images a step": (True, 0.05, 0, 256),
}


def render_levers(record: dict[str, Any]) -> list[str]:
    """``levers``: the mass on the other view, the class and other classes, and the class's
    share of the mass off the view, for each of :data:`SETTINGS`."""
    rows = {(r["center"], r["tau_s"], r["top_k"], r["batch"]): r
            for r in record["figures"]["rows"]}
    lines = ["| setting | other view | same class | other classes | class share |",
             "| --- | --- | --- | --- | --- |"]
    for words, key in SETTINGS.items():
        row = rows[key]
        lines.append(f"| {words} | {row['own_view']:.3f} | {row['same_class']:.3f} | "
                     f"{row['other_class']:.3f} | {row['class_precision']:.3f} |")
    return lines


def centred(vectors: np.ndarray) -> np.ndarray:
    """unit(v - mean over the samples), as ``graph.center`` stores the captions."""
    shifted = vectors - vectors.mean(0)
    return shifted / np.maximum(np.linalg.norm(shifted, axis=1, keepdims=True), 1e-12)


VIEWS = {"levers": render_levers}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.learning.target_mass",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shards", type=Path)
    parser.add_argument("store", type=Path, help="the caption store (graph.center=false)")
    parser.add_argument("--tau-s", type=float, nargs="+", default=[0.05, 0.1, 0.2])
    parser.add_argument("--top-k", type=int, nargs="+", default=[0, 16])
    parser.add_argument("--batch", type=int, nargs="+", default=[128, 256],
                        help="images in a global batch")
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--record", action="store_true",
                        help=f"also write bench/records/{NAME}.json (the docs' table)")
    args = parser.parse_args()
    seen = provenance(invocation())  # the tree the run starts from
    vectors, labels = caption_vectors(args.shards, args.store)
    vectors = vectors.astype(np.float64)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    rows = []
    for center, tau_s, top_k, batch in itertools.product((False, True), args.tau_s,
                                                          args.top_k, args.batch):
        mass = target_mass(centred(vectors) if center else vectors, labels, tau_s, top_k,
                           batch, args.trials)
        rows.append({"center": center, "tau_s": tau_s, "top_k": top_k, "batch": batch,
                     **{k: round(v, 3) for k, v in mass.items()}})
    print_table(rows, list(rows[0]))
    if args.record:
        path = write_record(NAME, seen, RENDERER, {"trials": args.trials, "rows": rows})
        print(f"record: {path}")


if __name__ == "__main__":
    main()
