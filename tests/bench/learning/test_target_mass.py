"""The target-mass diagnostic of X-CLR's levers: the cases whose answer is known."""

from __future__ import annotations

import numpy as np

from bench.learning.target_mass import centred, target_mass


def test_unique_captions_put_the_mass_on_the_other_view_and_class_captions_on_the_class():
    gen = np.random.default_rng(0)
    labels = np.arange(40) % 4
    unique = np.linalg.qr(gen.normal(size=(64, 40)))[0].T  # 40 orthonormal captions
    mass = target_mass(unique, labels, 0.01, 0, batch=20, trials=3)
    assert abs(mass["own_view"] - 1) < 1e-9
    by_class = np.eye(4)[labels]  # one caption per class: duplicates within the class
    mass = target_mass(by_class, labels, 0.01, 0, batch=20, trials=3)
    assert mass["class_precision"] > 1 - 1e-9 and abs(sum(list(mass.values())[:3]) - 1) < 1e-9
    # top_k = 1 keeps the other view and its ties (the class's duplicates) alone
    assert target_mass(by_class, labels, 1.0, 1, batch=20, trials=3)["class_precision"] > \
        1 - 1e-9
    assert target_mass(by_class, labels, 1.0, 0, batch=20, trials=3)["class_precision"] < 0.9


def test_centring_removes_the_direction_every_caption_shares():
    gen = np.random.default_rng(1)
    shared = np.ones(16) / 4
    vectors = shared + 0.1 * gen.normal(size=(200, 16))
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    moved = centred(vectors)
    np.testing.assert_allclose(np.linalg.norm(moved, axis=1), 1)
    assert (vectors @ vectors.T).mean() > 0.8 and abs((moved @ moved.T).mean()) < 0.05
