"""Class-template graphs (X-CLR's ImageNet recipe; docs/graph.md): captions such as
"a photo of a {name}." per class, averaged over templates, giving a C x C cosine matrix."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from data_pipeline.graph.config import GraphConfig
from data_pipeline.graph.encoder import encode, load_encoder
from data_pipeline.image_tree import read_class_names
from data_pipeline.shards import ShardSet


def class_embeddings(names: list[str], templates: list[str], model_name: str,
                     device: str = "auto", batch_size: int = 256) -> np.ndarray:
    """[C, E] float32: the normalised mean over templates of each class's caption embedding."""
    model = load_encoder(model_name, device)
    dimension = getattr(model, "get_embedding_dimension", None) or \
        model.get_sentence_embedding_dimension  # renamed in sentence-transformers 6
    total = np.zeros((len(names), dimension()), np.float32)
    for template in templates:
        vectors, _ = encode(model, [template.format(name=n) for n in names], batch_size)
        total += vectors.astype(np.float32)
    return total / np.linalg.norm(total, axis=1, keepdims=True)


def build_class_graph(cfg: GraphConfig) -> Path:
    """Write ``class_graph.npz``: ``graph`` [C, C] float32 cosines, ``class_names``,
    ``templates``, ``model``. Class names: ``graph.class_names``, else the manifest's."""
    if cfg.class_names:
        names = read_class_names(cfg.class_names)
    else:
        names = ShardSet.class_names_of(cfg.shards)
        if not names:
            raise ValueError(f"{cfg.shards}: its manifest lists no class names; "
                             "set graph.class_names")
    vectors = class_embeddings(names, cfg.templates, cfg.model, cfg.device, cfg.batch_size)
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "class_graph.npz"
    np.savez(path, graph=vectors @ vectors.T, class_names=np.array(names),
             templates=np.array(cfg.templates), model=np.array(cfg.model))
    return path


def load_class_graph(path: str | Path) -> tuple[np.ndarray, list[str]]:
    """([C, C] float32 graph, class names) from ``class_graph.npz``."""
    with np.load(path) as data:
        return data["graph"], [str(n) for n in data["class_names"]]
