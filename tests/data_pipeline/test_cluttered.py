"""The cluttered digits: deterministic draws, disjoint train and test source digits,
captions that state the drawn attributes, and shards that the loaders read."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from data_pipeline.cluttered import COLOURS, DIGIT_NAMES, ClutteredDigitsSource
from data_pipeline.config import ShardsConfig
from data_pipeline.make_shards import make_shards
from tests.data_pipeline.test_make_shards import read_all


def test_same_seed_same_bytes_other_seed_other_draws():
    a, b = ClutteredDigitsSource(20, seed=3), ClutteredDigitsSource(20, seed=3)
    assert [a.load(i) for i in range(20)] == [b.load(i) for i in range(20)]
    c = ClutteredDigitsSource(20, seed=4)
    assert sum(a.load(i).image != c.load(i).image for i in range(20)) == 20


def test_train_and_test_draw_from_disjoint_source_digits():
    train, test = ClutteredDigitsSource(0, split="train"), ClutteredDigitsSource(0, split="test")
    assert len(train) + len(test) == 1797
    assert not set(train.source_index) & set(test.source_index)
    drawn = {int(train.layout(i).digit) for i in range(len(train))}
    assert drawn == set(range(len(train)))  # one pass over the pool uses every digit once


def test_canvas_label_and_caption_agree():
    source = ClutteredDigitsSource(60, canvas=40, seed=1)
    for i in range(60):
        sample, layout = source.load(i), source.layout(i)
        image = np.asarray(Image.open(io.BytesIO(sample.image)))
        assert image.shape == (40, 40, 3)
        assert sample.label == source.labels[layout.digit]
        words = sample.caption.split()
        assert DIGIT_NAMES[sample.label] in words or str(sample.label) in \
            sample.caption.replace(",", " ").split()
        assert layout.stroke in sample.caption and layout.background in sample.caption
        background = np.asarray(COLOURS[layout.background], np.float64)
        corner = image[:3, :3].reshape(-1, 3).mean(0)  # mostly background, plus noise
        assert np.abs(corner - background).max() < 60 or layout.top < 3 or layout.left < 3


def test_shards_of_both_splits(tmp_path):
    for split, samples in (("train", 50), ("test", 20)):
        manifest = make_shards(ShardsConfig(source="cluttered_digits", split=split,
                                            samples=samples, shard_size=30, workers=1,
                                            output=str(tmp_path / split)))
        assert manifest.total_samples == samples and manifest.class_names == DIGIT_NAMES
        keys = [s["__key__"] for s in read_all(tmp_path / split)[1]]
        expected = [f"cluttered_{split}_{i:07d}" for i in range(samples)]
        assert sorted(keys) == expected and keys != expected  # all, in a seeded order


def test_alt_text_captions_name_the_digit_or_nothing_over_the_same_canvases():
    """The alt-text set draws the same canvases with web-like captions: about 80% name the
    digit (a word or a numeral, among uninformative words), the rest name no digit word,
    and none names a colour, so the digit is the captions' only signal about the image."""
    n = 2000
    attributes = ClutteredDigitsSource(n, seed=2)
    alt = ClutteredDigitsSource(n, seed=2, captions="alt_text")
    named = 0
    for i in range(n):
        a, b = attributes.load(i), alt.load(i)
        assert a.image == b.image and a.label == b.label and a.caption != b.caption
        words = b.caption.replace(",", " ").replace(":", " ").split()
        names_it = DIGIT_NAMES[b.label] in words or str(b.label) in words
        other_words = set(DIGIT_NAMES) - {DIGIT_NAMES[b.label]}
        assert not other_words & set(words), b.caption  # never the wrong digit's name
        assert not set(COLOURS) & set(words), b.caption
        named += names_it
    assert abs(named / n - 0.8) < 3 * (0.8 * 0.2 / n) ** 0.5 + 0.01, named / n
    assert [alt.load(i).caption for i in range(50)] == [
        ClutteredDigitsSource(n, seed=2, captions="alt_text").load(i).caption
        for i in range(50)]
