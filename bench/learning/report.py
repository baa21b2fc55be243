"""The learning benchmark's outputs: a Markdown report and plots beside the JSON."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bench.learning.claims import (  # noqa: E402
    NEGATIVES,
    Results,
    diagnostic,
    fmt,
    knn,
    probe,
    stat,
    verdict,
)
from bench.learning.runs import KS  # noqa: E402

TABLE_METRICS = [("kNN top-1 (backbone)", knn),
                 ("kNN top-1 (projector)", lambda r: knn(r, "projector")),
                 ("linear probe", probe),
                 ("margin (projector)", diagnostic("margin", "projector")),
                 ("class-mean cosine (projector)", diagnostic("class_mean_cosine", "projector")),
                 ("intra-class variance (projector)",
                  diagnostic("intra_class_variance", "projector"))]


def results_table(results: Results, names: list[str]) -> list[str]:
    lines = ["| configuration | seeds | " + " | ".join(t for t, _ in TABLE_METRICS) + " |",
             "| --- | --- |" + " --- |" * len(TABLE_METRICS)]
    for name in names:
        cells = []
        seeds = 0
        for _, metric in TABLE_METRICS:
            mean, std, seeds = stat(results, name, metric)
            cells.append("—" if seeds == 0 else fmt(mean, std))
        stopped = [r["training"]["stopped"] for r in results.get(name, [])
                   if r.get("training", {}).get("stopped")]
        note = f" (stopped: {len(stopped)})" if stopped else ""
        lines.append(f"| {name}{note} | {seeds} | " + " | ".join(cells) + " |")
    return lines


CAPTION_METRICS = [("image-to-text R@1", ("retrieval", "image_to_text", "R@1")),
                   ("image-to-text R@10", ("retrieval", "image_to_text", "R@10")),
                   ("text-to-image R@1", ("retrieval", "text_to_image", "R@1")),
                   ("text-to-image R@10", ("retrieval", "text_to_image", "R@10")),
                   ("zero-shot top-1", ("zero_shot", "accuracy", "top1")),
                   ("zero-shot top-5", ("zero_shot", "accuracy", "top5"))]


def caption_table(results: Results) -> list[str]:
    """Retrieval and zero-shot numbers of the configurations with a text tower (clip)."""
    def lookup(path: tuple[str, ...]):
        def metric(result: dict[str, Any]) -> float:
            value: Any = result["evaluation"]
            for key in path:
                value = value[key]
            return value
        return metric

    names = [n for n, runs in results.items()
             if any("retrieval" in r.get("evaluation", {}) for r in runs)]
    if not names:
        return []
    lines = ["| configuration | seeds | " + " | ".join(t for t, _ in CAPTION_METRICS) + " |",
             "| --- | --- |" + " --- |" * len(CAPTION_METRICS)]
    for name in names:
        runs = {name: [r for r in results[name] if "retrieval" in r.get("evaluation", {})]}
        cells = [stat(runs, name, lookup(path)) for _, path in CAPTION_METRICS]
        lines.append(f"| {name} | {cells[0][2]} | " + " | ".join(
            fmt(mean, std) for mean, std, _ in cells) + " |")
    return lines


def caption_signal_table(datasets: Mapping[str, Any]) -> list[str]:
    from bench.learning.caption_classes import caption_figures, table

    return table({name: caption_figures(data) for name, data in datasets.items()
                  if data.caption_graph is not None})


def claims_section(claims: list[dict[str, Any]]) -> list[str]:
    lines = []
    for claim in claims:
        lines += [f"### ({claim['claim']}) {claim['title']}: **{verdict(claim)}**", ""]
        extra = {k: v for k, v in claim.items()
                 if k not in ("claim", "title", "reproduced", "rows")}
        if extra:
            lines += [", ".join(f"{k}: {v}" for k, v in extra.items()), ""]
        rows = claim["rows"]
        if rows:
            keys = list(dict.fromkeys(k for row in rows for k in row))  # every column, in order
            lines += ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
            lines += ["| " + " | ".join(str(row.get(k, "")) for k in keys) + " |"
                      for row in rows]
            lines.append("")
    return lines


def plot_knn_curves(results: Results, names: list[str], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in names:
        means = [stat(results, name, lambda r, k=k: knn(r, "backbone", k))[0] for k in KS]
        stds = [stat(results, name, lambda r, k=k: knn(r, "backbone", k))[1] for k in KS]
        if not np.isnan(means).all():
            ax.errorbar(KS, means, yerr=np.nan_to_num(stds), marker="o", ms=3, capsize=2,
                        label=name)
    ax.set(xscale="log", xlabel="k", ylabel="kNN top-1 (backbone)",
           title="weighted kNN on the cluttered digits (mean ± std over seeds)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_negatives(results: Results, path: Path) -> None:
    names = [f"supcon_k{k}" if k != "all" else "supcon" for k in NEGATIVES]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    panels = [("kNN top-1", knn),
              ("class-mean cosine", diagnostic("class_mean_cosine", "projector")),
              ("intra-class variance", diagnostic("intra_class_variance", "projector"))]
    for ax, (title, metric) in zip(axes, panels, strict=True):
        stats = [stat(results, n, metric) for n in names]
        ax.errorbar(range(len(names)), [s[0] for s in stats],
                    yerr=np.nan_to_num([s[1] for s in stats]), marker="o", capsize=3)
        if title == "class-mean cosine":
            ax.axhline(-1 / 9, ls="--", c="gray", label="simplex ETF -1/(C-1)")
            ax.legend(fontsize=7)
        ax.set(xticks=range(len(names)), xticklabels=[str(k) for k in NEGATIVES],
               xlabel="num_negatives", title=title)
    fig.suptitle("SupCon with k negatives per anchor (kNN: backbone; geometry: projector)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_similarity(results: Results, pairs: list[tuple[str, str, np.ndarray]],
                    path: Path) -> None:
    """Learned class similarity (first seed, backbone) beside the target graph."""
    fig, axes = plt.subplots(len(pairs), 2, figsize=(8, 3.6 * len(pairs)), squeeze=False)
    for row, (name, graph_name, target) in zip(axes, pairs, strict=True):
        runs = [r for r in results.get(name, []) if "evaluation" in r]
        if not runs:
            continue
        similarity = runs[0]["evaluation"]["similarity"]["backbone"]
        learned = np.asarray(similarity["learned"])
        corr = similarity[f"rank_correlation_{graph_name}"]
        for ax, matrix, title in ((row[0], learned, f"{name}: learned"),
                                  (row[1], target, f"target: {graph_name}")):
            image = ax.imshow(matrix, cmap="viridis")
            ax.set_title(title if ax is row[1] else f"{title} (rank corr. {corr:.2f})",
                         fontsize=9)
            ax.set_xticks(range(10))
            ax.set_yticks(range(10))
            fig.colorbar(image, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
