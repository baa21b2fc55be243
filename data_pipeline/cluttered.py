"""Cluttered digits: the bundled real handwritten digits made hard enough to show learning.

Each sample draws one of scikit-learn's 1,797 real 8x8 digits at a random size and position
on a coloured canvas, over clutter cut from other digits (in the spirit of cluttered
MNIST, Jaderberg et al. 2015), with per-pixel noise. The label is the digit. The caption
describes its attributes (digit, stroke and background colour, position, size) in one of
several phrasings, so a caption-similarity graph carries real but partial class structure;
or (``captions="alt_text"``) it is web-like alt-text that names the digit among
uninformative words, or names nothing (``data_pipeline/alt_text.py``). Everything follows
from (seed, split, index): the same configuration gives byte-identical shards. Train and
test samples are drawn from disjoint source digits (every 5th source digit is test).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

from data_pipeline.alt_text import alt_text
from data_pipeline.digits import DIGIT_NAMES
from data_pipeline.formats import Sample, SkipSample
from data_pipeline.samples import stable_int

COLOURS = {  # name -> RGB
    "red": (214, 40, 40), "green": (40, 160, 70), "blue": (40, 80, 215),
    "yellow": (235, 205, 40), "purple": (130, 60, 175), "orange": (240, 135, 30),
    "pink": (240, 125, 185), "cyan": (50, 195, 210), "white": (240, 240, 240),
    "black": (20, 20, 20), "gray": (125, 125, 125), "brown": (125, 80, 40),
}
CAPTION_STYLES = ("attributes", "alt_text")
MIN_CONTRAST = 150.0  # RGB distance between stroke and background colours
TEMPLATES = [
    "a {size} {stroke} {digit} on a {background} background, {position}",
    "the digit {digit} written in {stroke} on {background}, {size}, {position}",
    "{background} background with a {size} {stroke} {numeral} {position}",
    "a handwritten {digit} in {stroke} ink, {position} of a {background} square",
    "{stroke} strokes forming a {digit} {position}; the background is {background}",
    "number {numeral}, {size} and {stroke}, on {background}",
]


@dataclass(frozen=True)
class Layout:
    """One sample's draw: which digit where, in which colours, over which clutter."""

    digit: int  # index into the split's pool of source digits
    size: int  # side of the drawn digit, pixels
    top: int
    left: int
    stroke: str
    background: str
    clutter: list[tuple[int, int, int, int, int, int, str]]  # digit, row, col, h, top, left, colour
    template: int


def _words(layout: Layout, canvas: int, label: int) -> dict[str, str]:
    centre_y = (layout.top + layout.size / 2) / canvas
    centre_x = (layout.left + layout.size / 2) / canvas
    vertical = "top" if centre_y < 0.4 else "bottom" if centre_y > 0.6 else ""
    horizontal = "left" if centre_x < 0.4 else "right" if centre_x > 0.6 else ""
    place = " ".join(w for w in (vertical, horizontal) if w) or "centre"
    position = "in the centre" if place == "centre" else f"in the {place}"
    if layout.template == 3:  # "..., {position} of a square"
        position = "in the middle" if place == "centre" else f"at the {place}"
    fraction = layout.size / canvas
    size = "small" if fraction < 0.6 else "large" if fraction > 0.75 else "medium-sized"
    return {"digit": DIGIT_NAMES[label], "numeral": str(label), "stroke": layout.stroke,
            "background": layout.background, "position": position, "size": size}


class ClutteredDigitsSource:
    """``len(self)`` samples of one split; ``load(i)`` renders sample i as a PNG."""

    def __init__(self, samples: int, canvas: int = 40, clutter: int = 2, split: str = "train",
                 seed: int = 0, captions: str = "attributes") -> None:
        from sklearn.datasets import load_digits

        if split not in ("train", "test"):
            raise ValueError(f"cluttered_digits: split must be train or test, got {split!r}")
        if captions not in CAPTION_STYLES:
            raise ValueError(f"cluttered_digits: captions must be one of {CAPTION_STYLES}, "
                             f"got {captions!r}")
        self.captions = captions
        digits = load_digits()
        index = np.arange(len(digits.target))
        pool = index[(index % 5 == 0) == (split == "test")]
        self.images = digits.images[pool] / 16.0  # [P, 8, 8] stroke intensity in [0, 1]
        self.labels = digits.target[pool].astype(int)
        self.source_index = pool
        self.samples = samples or len(pool)
        self.canvas, self.clutter, self.split, self.seed = canvas, clutter, split, seed
        self.class_names = list(DIGIT_NAMES)

    def __len__(self) -> int:
        return self.samples

    def layout(self, i: int) -> Layout:
        rng = np.random.default_rng(stable_int(self.seed, self.split, i))
        order = np.random.default_rng(stable_int(self.seed, self.split, "order",
                                                 i // len(self.images)))
        digit = int(order.permutation(len(self.images))[i % len(self.images)])
        size = int(rng.integers(int(0.5 * self.canvas), int(0.85 * self.canvas) + 1))
        top, left = (int(rng.integers(0, self.canvas - size + 1)) for _ in range(2))
        names = list(COLOURS)
        background = names[int(rng.integers(len(names)))]
        strokes = [n for n in names
                   if np.linalg.norm(np.subtract(COLOURS[n], COLOURS[background])) > MIN_CONTRAST]
        stroke = strokes[int(rng.integers(len(strokes)))]
        clutter = []
        for _ in range(self.clutter):
            other = int(rng.integers(len(self.images)))
            h = int(rng.integers(2, 5))  # a h x h window of the 8x8 source
            row, col = (int(rng.integers(0, 9 - h)) for _ in range(2))
            side = max(2, round(h * size / 8))
            colour = stroke if rng.random() < 0.5 else strokes[int(rng.integers(len(strokes)))]
            clutter.append((other, row, col, h, int(rng.integers(0, self.canvas - side + 1)),
                            int(rng.integers(0, self.canvas - side + 1)), colour))
        return Layout(digit, size, top, left, stroke, background, clutter,
                      int(rng.integers(len(TEMPLATES))))

    def render(self, layout: Layout, i: int) -> np.ndarray:
        """[canvas, canvas, 3] uint8."""
        rng = np.random.default_rng(stable_int(self.seed, self.split, "noise", i))
        canvas = np.empty((self.canvas, self.canvas, 3), np.float32)
        canvas[:] = COLOURS[layout.background]
        for other, row, col, h, top, left, colour in layout.clutter:
            patch = self.images[other][row:row + h, col:col + h]
            side = max(2, round(h * layout.size / 8))
            _paint(canvas, _scaled(patch, side), top, left, COLOURS[colour])
        _paint(canvas, _scaled(self.images[layout.digit], layout.size), layout.top,
               layout.left, COLOURS[layout.stroke])
        canvas += rng.normal(0.0, 8.0, canvas.shape).astype(np.float32)
        return canvas.clip(0, 255).round().astype(np.uint8)

    def caption(self, layout: Layout, i: int) -> str:
        """Sample ``i``'s caption in this source's style (the canvas is the same in both)."""
        label = int(self.labels[layout.digit])
        if self.captions == "alt_text":
            return alt_text(np.random.default_rng(stable_int(self.seed, self.split,
                                                             "alt_text", i)), label)
        return TEMPLATES[layout.template].format(**_words(layout, self.canvas, label))

    def load(self, i: int) -> Sample:
        """Sample ``i`` as a PNG with its label and caption."""
        if not 0 <= i < self.samples:
            raise SkipSample("missing_image", f"cluttered_digits: no sample {i}")
        layout = self.layout(i)
        buffer = io.BytesIO()
        Image.fromarray(self.render(layout, i)).save(buffer, format="PNG")
        return Sample(key=f"cluttered_{self.split}_{i:07d}", image=buffer.getvalue(),
                      ext="png", label=int(self.labels[layout.digit]),
                      caption=self.caption(layout, i))


def _scaled(patch: np.ndarray, side: int) -> np.ndarray:
    """A stroke-intensity patch resized to side x side (bilinear), in [0, 1]."""
    image = Image.fromarray((patch * 255).astype(np.uint8)).resize((side, side),
                                                                   Image.BILINEAR)
    return np.asarray(image, np.float32) / 255.0


def _paint(canvas: np.ndarray, mask: np.ndarray, top: int, left: int,
           colour: tuple[int, int, int]) -> None:
    """Blend ``colour`` into ``canvas`` through ``mask`` at (top, left), clipped to the
    canvas."""
    h = min(mask.shape[0], canvas.shape[0] - top)
    w = min(mask.shape[1], canvas.shape[1] - left)
    alpha = mask[:h, :w, None]
    region = canvas[top:top + h, left:left + w]
    region *= 1 - alpha
    region += alpha * np.asarray(colour, np.float32)
