"""scikit-learn's bundled real handwritten digits as a make-shards source, and their class
names (shared with the cluttered digits)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from data_pipeline.formats import Sample

DIGIT_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


class DigitsSource:
    """scikit-learn's 1,797 real 8x8 handwritten digits, upsampled, as JPEG, with
    captions such as "a photo of the digit seven"."""

    def __init__(self, size: int, split: str = "all") -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        index = np.arange(len(digits.target))
        if split != "all":
            index = index[(index % 5 == 0) == (split == "test")]
        self.index, self.size = index, size
        self.images = (digits.images[index] * (255 / 16)).astype(np.uint8)
        self.labels = digits.target[index].astype(int)
        self.class_names = list(DIGIT_NAMES)

    def __len__(self) -> int:
        return len(self.index)

    def load(self, i: int) -> Sample:
        image = Image.fromarray(self.images[i]).resize((self.size, self.size), Image.BILINEAR)
        buffer = io.BytesIO()
        image.convert("RGB").save(buffer, format="JPEG", quality=95)
        label = int(self.labels[i])
        return Sample(key=f"digits_{int(self.index[i]):05d}", image=buffer.getvalue(), ext="jpg",
                      label=label, caption=f"a photo of the digit {DIGIT_NAMES[label]}")
