"""The image-tree source: its file-backed listing equals a plain walk of the tree, a worker
(an unpickled copy) reads the same samples, and what is pickled does not grow with the tree."""

from __future__ import annotations

import os
import pickle

from data_pipeline.formats import IMAGE_SUFFIXES
from data_pipeline.image_tree import ImageFolderSource
from tests.data_pipeline.helpers import digit_jpeg


def reference(root) -> list[tuple[str, int]]:
    """(path, label) of every image: class folders sorted, image files sorted by name."""
    classes = sorted(d for d in os.listdir(root) if (root / d).is_dir())
    return [(str(root / c / f), label) for label, c in enumerate(classes)
            for f in sorted(os.listdir(root / c))
            if os.path.splitext(f)[1].lower() in IMAGE_SUFFIXES]


def test_listing_equals_a_walk_and_a_worker_reads_the_same_samples(tmp_path):
    root = tmp_path / "train"
    names = {"n02": ["b.JPEG", "a.jpg", "notes.txt", "ü ber.png", "c.jpeg"],
             "n01": ["z.webp", "y.JPG"], "n03": [], "n00 cls": ["only.jpg"]}
    for i, (folder, files) in enumerate(names.items()):
        (root / folder).mkdir(parents=True)
        for j, file in enumerate(files):
            (root / folder / file).write_bytes(digit_jpeg(10 * i + j))
    (root / "stray.jpg").write_bytes(digit_jpeg(0))  # not in a class folder
    source = ImageFolderSource(str(root), "")
    want = reference(root)
    assert len(source) == len(want) == 7
    worker = pickle.loads(pickle.dumps(source))
    for i, (path, label) in enumerate(want):
        sample = worker.load(i)
        assert (sample.image, sample.label) == (open(path, "rb").read(), label)
        assert source._item(i) == (root / os.path.relpath(path, root), label)
    assert source.class_names == ["n00 cls", "n01", "n02", "n03"]
    assert worker.load(0).key == "n00_cls_only"


def test_what_travels_to_a_worker_does_not_grow_with_the_tree(tmp_path):
    sizes = {}
    for count in (100, 5_000):
        root = tmp_path / f"tree-{count}"
        for c in range(10):
            (root / f"n{c:02d}").mkdir(parents=True)
        (tmp_path / "one.jpg").write_bytes(digit_jpeg(0))
        for i in range(count):
            os.link(tmp_path / "one.jpg", root / f"n{i % 10:02d}" / f"img_{i:06d}.jpg")
        source = ImageFolderSource(str(root), "")
        assert len(source) == count
        assert source._item(count - 1)[0].name == f"img_{count - 1:06d}.jpg"
        sizes[count] = len(pickle.dumps(source))
    assert sizes[5_000] - sizes[100] < 10, sizes  # the class names and file names only
