"""An ImageNet-style tree (``<root>/<class_dir>/<image>``) as a make-shards source that no
process holds whole.

The constructor lists one class folder at a time and appends each image's path (relative
to the root, as bytes) to a temporary file, with its end offset (int64) and label (int32)
in two more: ~40 bytes an image (~50 MB for ImageNet's 1.28M), where a list of ``Path``
objects costs ~400 bytes an image in the parent and again, unpickled, in every spawned
worker. Workers map the files and ``load(i)`` reads path ``i`` from them; what travels to
a worker is the files' names.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import weakref
from array import array
from pathlib import Path

import numpy as np

from data_pipeline.formats import IMAGE_SUFFIXES, Sample
from data_pipeline.images import PILLOW_MAX_PIXELS, check_image

FLUSH = 1 << 16  # images listed between writes to the temporary files


def safe_key(text: str) -> str:
    """A WebDataset key: ASCII letters, digits, ``_`` and ``-`` (a dot would split it)."""
    return re.sub(r"[^A-Za-z0-9_\-]", "_", text)


def read_class_names(spec: str, expected: int | None = None) -> list[str]:
    """``imagenet1k`` (torchvision's 1,000 names in class-index order) or a file, one per line."""
    if spec == "imagenet1k":
        from torchvision.models import ResNet50_Weights

        names = list(ResNet50_Weights.IMAGENET1K_V1.meta["categories"])
    else:
        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(f"class-names file {path}: not found")
        names = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()
                 if line.strip()]
    if expected is not None and len(names) != expected:
        raise ValueError(f"class names {spec}: {len(names)} names for {expected} class folders")
    return names


class _Listing:
    """Append-only (path bytes, label) records in three temporary files."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="image-tree-")
        weakref.finalize(self, shutil.rmtree, self.directory, True)  # in this process only
        self.count, self.size = 0, 0
        self._files = {name: open(os.path.join(self.directory, name), "wb")
                       for name in ("paths.bin", "ends.i64", "labels.i32")}
        self._ends, self._labels, self._paths = array("q"), array("i"), bytearray()

    def add(self, path: bytes, label: int) -> None:
        self.size += len(path)
        self.count += 1
        self._paths += path
        self._ends.append(self.size)
        self._labels.append(label)
        if len(self._ends) == FLUSH:
            self._flush()

    def _flush(self) -> None:
        self._files["paths.bin"].write(self._paths)
        self._ends.tofile(self._files["ends.i64"])
        self._labels.tofile(self._files["labels.i32"])
        self._ends, self._labels, self._paths = array("q"), array("i"), bytearray()

    def close(self) -> None:
        self._flush()
        for handle in self._files.values():
            handle.close()
        self._files = {}


class ImageFolderSource:
    """``<root>/<class_dir>/*.JPEG``; label = index of the sorted class folder; images in
    name order within a class."""

    def __init__(self, root: str, class_names: str,
                 max_pixels: int = PILLOW_MAX_PIXELS) -> None:
        self.root, self.max_pixels = Path(root), max_pixels
        if not self.root.is_dir():
            raise FileNotFoundError(f"image tree {self.root}: not a directory")
        class_dirs = sorted(p.name for p in self.root.iterdir() if p.is_dir())
        self.class_names = (read_class_names(class_names, len(class_dirs)) if class_names
                            else class_dirs)
        listing = _Listing()
        for label, name in enumerate(class_dirs):
            with os.scandir(self.root / name) as entries:
                files = sorted(e.name for e in entries
                               if os.path.splitext(e.name)[1].lower() in IMAGE_SUFFIXES)
            for file in files:
                listing.add(os.fsencode(os.path.join(name, file)), label)
        listing.close()
        self._listing = listing  # owns the temporary files for this object's lifetime
        self.directory, self.count = listing.directory, listing.count
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def __getstate__(self) -> dict:
        # workers map the files themselves; the parent's listing removes them when done
        return {**self.__dict__, "_arrays": None, "_listing": None}

    def __len__(self) -> int:
        return self.count

    def _item(self, i: int) -> tuple[Path, int]:
        if self._arrays is None:
            self._arrays = tuple(
                np.memmap(os.path.join(self.directory, name), dtype, "r") if self.count
                else np.zeros(0, dtype)
                for name, dtype in (("paths.bin", np.uint8), ("ends.i64", np.int64),
                                    ("labels.i32", np.int32)))
        paths, ends, labels = self._arrays
        start = int(ends[i - 1]) if i else 0
        relative = os.fsdecode(paths[start:int(ends[i])].tobytes())
        return self.root / relative, int(labels[i])

    def load(self, i: int) -> Sample:
        path, label = self._item(i)
        data = path.read_bytes()
        check_image(data, str(path), self.max_pixels)
        return Sample(key=safe_key(f"{path.parent.name}_{path.stem}"), image=data,
                      ext=IMAGE_SUFFIXES[path.suffix.lower()], label=label,
                      caption=f"a photo of a {self.class_names[label]}")
