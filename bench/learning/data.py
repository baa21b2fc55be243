"""The benchmark's data, made with the project's own stages: the cluttered digits (train
and test canvases from disjoint source digits, their caption store and class-template
graph, and the class-level similarity of their captions), in two caption styles
(attributes and alt-text, over the same canvases), and the plain digits for reference."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import write_json
from data_pipeline.config import ShardsConfig
from data_pipeline.graph.class_graph import build_class_graph, load_class_graph
from data_pipeline.graph.config import GraphConfig
from data_pipeline.graph.job import run_captions
from data_pipeline.graph.store import CaptionStore
from data_pipeline.make_shards import make_shards
from data_pipeline.manifest import Manifest
from data_pipeline.tario import iter_shard

TEMPLATES = ["a photo of the digit {name}.", "a handwritten {name}.", "the number {name}."]


@dataclass(frozen=True)
class DataSet:
    """Shards and targets of one data set, as paths the recipes' keys take."""

    name: str
    train: Path
    test: Path
    class_graph: Path  # class-template graph (X-CLR's ImageNet recipe)
    caption_store: Path | None = None  # per-sample caption embeddings (X-CLR from captions)
    caption_graph: Path | None = None  # [C, C] mean caption similarity between classes
    center: bool = False  # the caption store made with graph.center


def _shards(cfg: ShardsConfig) -> Path:
    out = Path(cfg.output)
    if not (out / "manifest.json").is_file():
        make_shards(cfg)
    return out


def _class_graph(shards: Path, output: Path) -> Path:
    path = output / "class_graph.npz"
    if not path.is_file():
        build_class_graph(GraphConfig(task="class_graph", shards=str(shards),
                                      output=str(output), templates=TEMPLATES))
    return path


def caption_vectors(shards: Path, store_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """([n, E] unit caption embeddings, [n] labels) of the shards' samples, in shard order."""
    store = CaptionStore.open(store_dir)
    keys, labels = [], []
    for shard in Manifest.read(shards).shards:
        for raw in iter_shard(shards / shard.name):
            keys.append(raw["__key__"])
            labels.append(int(raw["cls"]))
    rows, found = store.find(keys)
    return np.asarray(store.embeddings[rows[found]], np.float32), np.asarray(labels)[found]


def caption_class_graph(vectors: np.ndarray, labels: np.ndarray, classes: int) -> np.ndarray:
    """[C, C]: mean cosine between the caption embeddings of class a and class b."""
    means = np.stack([vectors[labels == c].mean(0) for c in range(classes)])
    sums = np.stack([vectors[labels == c].sum(0) for c in range(classes)])
    counts = np.bincount(labels, minlength=classes)
    graph = means @ means.T
    # the diagonal without self pairs: (|sum|^2 - n) / (n (n - 1)), embeddings are unit
    own = (np.einsum("cd,cd->c", sums, sums) - counts) / (counts * (counts - 1))
    graph[np.diag_indices(classes)] = own
    return graph


def caption_class_accuracy(vectors: np.ndarray, labels: np.ndarray, k: int = 20
                           ) -> dict[str, float]:
    """How well a caption's embedding names its image's class: the majority of its ``k``
    nearest other captions (cosine), and a logistic regression fitted on the first 5/6 and
    scored on the rest."""
    from sklearn.linear_model import LogisticRegression

    similarity = vectors @ vectors.T
    np.fill_diagonal(similarity, -np.inf)
    nearest = np.argpartition(-similarity, k, axis=1)[:, :k]
    votes = np.array([np.bincount(labels[row], minlength=labels.max() + 1).argmax()
                      for row in nearest])
    cut = len(labels) * 5 // 6
    linear = LogisticRegression(max_iter=2000).fit(vectors[:cut], labels[:cut])
    return {"knn": float((votes == labels).mean()),
            "linear": float(linear.score(vectors[cut:], labels[cut:]))}


def caption_signal(caption_graph: np.ndarray) -> dict[str, float]:
    """How much class signal a caption set carries by cosine: the mean cosine of two
    captions of one class (``within``), of two classes (``between``), and their difference."""
    classes = len(caption_graph)
    within = float(np.trace(caption_graph) / classes)
    between = float((caption_graph.sum() - np.trace(caption_graph)) / (classes * (classes - 1)))
    return {"within": within, "between": between, "gap": within - between}


def cluttered(root: Path, train_samples: int, test_samples: int,
              captions_style: str = "attributes", center: bool = False) -> DataSet:
    """The cluttered digits with ``captions_style`` captions (``shards.captions``): the
    canvases are the same in both styles. ``center``: the caption store made with
    ``graph.center`` (the same shards)."""
    common = {"source": "cluttered_digits", "shard_size": 1000, "workers": 2,
              "captions": captions_style}
    name = "cluttered" if captions_style == "attributes" else "alt_text"
    train = _shards(ShardsConfig(**common, split="train", samples=train_samples,
                                 output=str(root / "shards" / f"{name}-train")))
    test = _shards(ShardsConfig(**common, split="test", samples=test_samples,
                                output=str(root / "shards" / f"{name}-test")))
    captions = root / "captions" / f"{name}{'-centred' * center}-train"
    if not (captions / "meta.json").is_file():
        run_captions(GraphConfig(shards=str(train), output=str(captions), center=center))
    graph = _class_graph(train, captions)
    caption_graph = captions / "caption_class_graph.npz"
    accuracy = captions / "caption_class_accuracy.json"
    if not (caption_graph.is_file() and accuracy.is_file()):
        names = load_class_graph(graph)[1]
        vectors, labels = caption_vectors(train, captions)
        np.savez(caption_graph, graph=caption_class_graph(vectors, labels, len(names)),
                 class_names=np.array(names))
        write_json(accuracy, caption_class_accuracy(vectors, labels))
    return DataSet(f"{name}{'_centred' * center}", train, test, graph, captions, caption_graph,
                   center)


def digits(root: Path) -> DataSet:
    train = _shards(ShardsConfig(source="digits", split="train", digits_size=32, workers=2,
                                 shard_size=500, output=str(root / "shards" / "digits-train")))
    test = _shards(ShardsConfig(source="digits", split="test", digits_size=32, workers=1,
                                shard_size=500, output=str(root / "shards" / "digits-test")))
    return DataSet("digits", train, test, _class_graph(train, root / "captions" / "digits"))
