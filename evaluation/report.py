"""The evaluation's outputs: ``results.json`` (every number), PNG plots, ``report.md``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def scalars(tree: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Flatten the numeric leaves: {"knn": {"backbone": {"k20": {"top1": x}}}} ->
    {"knn.backbone.k20.top1": x}."""
    out: dict[str, float] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, f"{name}."))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def plot_knn(results: dict[str, Any], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for space, by_k in results["knn"].items():
        ks = [int(k[1:]) for k in by_k]
        ax.plot(ks, [v["top1"] for v in by_k.values()], marker="o", label=f"{space} top-1")
    ax.set(xscale="log", xlabel="k", ylabel="accuracy", title="weighted kNN")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_margin(same: np.ndarray, other: np.ndarray, margin: float, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(5, 3.5))
    bins = np.linspace(min(same.min(), other.min()), 1, 40)
    ax.hist(same, bins=bins, alpha=0.6, label="nearest same class")
    ax.hist(other, bins=bins, alpha=0.6, label="nearest other class")
    ax.set(xlabel="cosine similarity", ylabel="test samples",
           title=f"target-noise margin {margin:.3f}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_similarity(learned: np.ndarray, target: np.ndarray | None, names: list[str],
                    correlation: float, path: Path) -> None:
    panels = [("learned", learned)] + ([("target", target)] if target is not None else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for ax, (title, matrix) in zip(axes[0], panels, strict=True):
        image = ax.imshow(matrix, cmap="viridis")
        ax.set_xticks(range(len(names)), names, rotation=90, fontsize=7)
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.set_title(title)
        fig.colorbar(image, ax=ax, fraction=0.046)
    fig.suptitle(f"class similarity, rank correlation {correlation:.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_markdown(results: dict[str, Any], path: Path) -> None:
    lines = [f"# Evaluation of {results['model']['source']}", "",
             f"Bank: {results['samples']['train']} samples of {results['train_shards']}; "
             f"queries: {results['samples']['test']} of {results['test_shards']}.", "",
             "| features | " + " | ".join(results["knn"]["backbone"]) + " |",
             "| --- |" + " --- |" * len(results["knn"]["backbone"])]
    floor = results.get("untrained")
    for space, by_k in results["knn"].items():
        lines.append(f"| {space} top-1 | " + " | ".join(f"{v['top1']:.4f}"
                                                        for v in by_k.values()) + " |")
        if floor is not None:
            lines.append(f"| {space} top-1, untrained | " + " | ".join(
                f"{v['top1']:.4f}" for v in floor["knn"][space].values()) + " |")
    lines += ["", f"Linear probe (backbone) top-1: {results['linear_probe']['top1']:.4f}"
              + (f" (untrained: {floor['linear_probe']['top1']:.4f})" if floor else ""), ""]
    if "ivf" in results:
        lines += [f"IVF index top-1 (k={results['ivf']['k']}): {results['ivf']['top1']:.4f} "
                  f"vs exact {results['ivf']['exact_top1']:.4f}", ""]
    lines += ["| diagnostic | backbone | projector |", "| --- | --- | --- |"]
    for key in ("margin", "intra_class_variance", "class_mean_cosine", "etf_cosine",
                "rank_correlation", "alignment", "uniformity", "mutual_information"):
        row = [results["diagnostics"][s].get(key) for s in ("backbone", "projector")]
        lines.append(f"| {key} | " + " | ".join("" if v is None else f"{v:.4f}"
                                                 for v in row) + " |")
    sampled = results["diagnostics"]["backbone"].get("diagnostic_samples")
    if sampled is not None and sampled < results["samples"]["test"]:
        lines += ["", f"Alignment, uniformity and mutual information on a seeded subsample of "
                      f"{sampled} of {results['samples']['test']} queries "
                      "(`eval.max_diagnostic_samples`)."]
    lines += caption_lines(results)
    if "promotion" in results:
        p = results["promotion"]
        lines += ["", f"Promotion to `{p['alias']}`: {'yes' if p['promoted'] else 'no'} "
                      f"({p['reason']})."]
    lines += ["", "Plots: " + ", ".join(f"`{name}`" for name in results["plots"])]
    path.write_text("\n".join(lines) + "\n")


def caption_lines(results: dict[str, Any]) -> list[str]:
    """The retrieval and zero-shot tables of a model with a text tower, and the accuracy
    of a model's learned class embeddings."""
    lines = []
    if "retrieval" in results:
        r = results["retrieval"]
        ks = list(r["image_to_text"])
        lines += ["", f"Retrieval on {r['images']} images and {r['captions']} distinct "
                      f"captions of {r['shards']}:", "",
                  "| direction | " + " | ".join(ks) + " |", "| --- |" + " --- |" * len(ks)]
        for direction in ("image_to_text", "text_to_image"):
            lines.append(f"| {direction.replace('_', ' ')} | " + " | ".join(
                f"{r[direction][k]:.4f}" for k in ks) + " |")
    if "zero_shot" in results:
        z = results["zero_shot"]
        accuracy = ", ".join(f"{k} {v:.4f}" for k, v in z["accuracy"].items())
        lines += ["", f"Zero-shot classification ({z['classes']} classes, "
                      f"{len(z['templates'])} prompt templates): {accuracy}."]
    if "class_embedding_classifier" in results:
        c = results["class_embedding_classifier"]
        accuracy = ", ".join(f"{k} {v:.4f}" for k, v in c["accuracy"].items())
        lines += ["", f"Classifier by cosine to the {c['classes']} learned class embeddings "
                      f"(ProjNCE): {accuracy}."]
    return lines


def write_json(results: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(results, indent=2, default=float))
