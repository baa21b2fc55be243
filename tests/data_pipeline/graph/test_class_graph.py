"""Class-template graphs from the bundled model on real text: the ImageNet class names."""

from __future__ import annotations

import numpy as np

from data_pipeline.graph.class_graph import build_class_graph, class_embeddings, load_class_graph
from data_pipeline.graph.config import GraphConfig
from data_pipeline.image_tree import read_class_names

GROUPS = {
    "cats": ["tabby", "tiger cat", "Persian cat", "Siamese cat", "Egyptian cat"],
    "dogs": ["golden retriever", "Labrador retriever", "German shepherd", "beagle", "pug"],
    "balls": ["soccer ball", "basketball", "tennis ball", "golf ball", "volleyball"],
    "instruments": ["acoustic guitar", "violin", "cello", "banjo", "grand piano"],
}


def test_semantic_groups_are_closer_within_than_across():
    imagenet = set(read_class_names("imagenet1k"))
    names = [n for group in GROUPS.values() for n in group]
    assert set(names) <= imagenet, set(names) - imagenet
    vectors = class_embeddings(names, ["a photo of a {name}.", "a {name}."], "bundled")
    graph = vectors @ vectors.T
    group_of = np.repeat(np.arange(len(GROUPS)), 5)
    same = group_of[:, None] == group_of[None, :]
    off_diagonal = ~np.eye(len(names), dtype=bool)
    for g, group in enumerate(GROUPS):
        rows = group_of == g
        within = graph[rows][:, rows][off_diagonal[rows][:, rows]].mean()
        across = graph[rows][:, ~rows].mean()
        assert within > across + 0.1, (group, within, across)
    assert graph[same & off_diagonal].mean() > graph[~same].mean() + 0.2


def test_class_graph_file(tmp_path):
    names = tmp_path / "names.txt"
    names.write_text("tabby cat\ngolden retriever\nviolin\n")
    cfg = GraphConfig(task="class_graph", class_names=str(names), output=str(tmp_path),
                      templates=["a photo of a {name}."])
    graph, loaded = load_class_graph(build_class_graph(cfg))
    assert loaded == ["tabby cat", "golden retriever", "violin"]
    assert graph.shape == (3, 3) and np.allclose(np.diag(graph), 1, atol=1e-3)
    assert np.allclose(graph, graph.T)
