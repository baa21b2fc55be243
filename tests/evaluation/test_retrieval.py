"""Retrieval recall, zero-shot accuracy and the class-embedding classifier against naive
loops and known answers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from evaluation import retrieval
from evaluation.features import Features
from evaluation.retrieval import class_embedding_classifier, retrieval_recall, zero_shot_accuracy


def naive_recall(images, texts, caption_of_image, ks):
    """Per query: sort every candidate by similarity, look for a right one in the top K."""
    i2t, t2i = {k: 0 for k in ks}, {k: 0 for k in ks}
    for i in range(images.shape[0]):
        order = sorted(range(texts.shape[0]), key=lambda j: -float(images[i] @ texts[j]))
        for k in ks:
            i2t[k] += int(caption_of_image[i].item() in order[:k])
    for t in range(texts.shape[0]):
        order = sorted(range(images.shape[0]), key=lambda j: -float(texts[t] @ images[j]))
        for k in ks:
            t2i[k] += int(any(caption_of_image[j].item() == t for j in order[:k]))
    return ({f"R@{k}": v / images.shape[0] for k, v in i2t.items()},
            {f"R@{k}": v / texts.shape[0] for k, v in t2i.items()})


@pytest.mark.parametrize("chunk", [1024, 7])
def test_recall_equals_a_naive_loop_with_shared_captions(monkeypatch, chunk):
    monkeypatch.setattr(retrieval, "QUERY_CHUNK", chunk)  # several query chunks
    generator = torch.Generator().manual_seed(0)
    texts = F.normalize(torch.randn(15, 8, generator=generator, dtype=torch.float64), dim=1)
    caption_of_image = torch.randint(0, 15, (40,), generator=generator)  # captions shared
    images = F.normalize(texts[caption_of_image] + 0.8 * torch.randn(
        40, 8, generator=generator, dtype=torch.float64), dim=1)
    ks = [1, 3, 5]
    got = retrieval_recall(images, texts, caption_of_image, ks)
    i2t, t2i = naive_recall(images, texts, caption_of_image, ks)
    assert got["image_to_text"] == pytest.approx(i2t)
    assert got["text_to_image"] == pytest.approx(t2i)
    assert 0 < got["image_to_text"]["R@1"] < 1  # neither trivial nor hopeless


def test_identical_embeddings_retrieve_perfectly():
    generator = torch.Generator().manual_seed(1)
    embeddings = F.normalize(torch.randn(500, 32, generator=generator), dim=1)
    got = retrieval_recall(embeddings, embeddings.clone(), torch.arange(500), [1, 5, 10])
    assert got == {"image_to_text": {"R@1": 1.0, "R@5": 1.0, "R@10": 1.0},
                   "text_to_image": {"R@1": 1.0, "R@5": 1.0, "R@10": 1.0}}


def test_shuffled_pairs_retrieve_at_chance():
    n, generator = 2000, torch.Generator().manual_seed(2)
    embeddings = F.normalize(torch.randn(n, 32, generator=generator), dim=1)
    texts = embeddings[torch.randperm(n, generator=generator)]  # pairs broken at random
    got = retrieval_recall(embeddings, texts, torch.arange(n), [1, 5, 10])
    for direction in got.values():
        for key, recall in direction.items():
            k = int(key[2:])  # hits ~ Binomial(n, k/n): within 5 standard deviations
            assert abs(recall - k / n) <= 5 * (k / n / n) ** 0.5 + 1 / n, (key, recall)


def test_zero_shot_known_answers():
    generator = torch.Generator().manual_seed(3)
    classes = F.normalize(torch.randn(10, 16, generator=generator), dim=1)
    labels = torch.randint(0, 10, (3000,), generator=generator)
    images = F.normalize(classes[labels] + 0.05 * torch.randn(3000, 16, generator=generator),
                         dim=1)
    assert zero_shot_accuracy(images, classes, labels, [1, 5]) == {"R@1": 1.0, "R@5": 1.0}
    wrong = labels[torch.randperm(3000, generator=generator)]  # labels unrelated to images
    chance = zero_shot_accuracy(images, classes, wrong, [1, 5])
    assert chance["R@1"] == pytest.approx(0.1, abs=0.03)
    assert chance["R@5"] == pytest.approx(0.5, abs=0.05)
    assert list(zero_shot_accuracy(images, classes[:3], labels.clamp(max=2), [1, 5])) == ["R@1"]


def test_the_class_embedding_classifier_equals_a_naive_loop():
    """ProjNCE's classifier: each projection to the class of the nearest learned embedding
    in cosine, whatever the scale of either."""
    generator = torch.Generator().manual_seed(5)
    table = torch.randn(7, 12, generator=generator) * torch.rand(7, 1, generator=generator)
    projections = torch.randn(300, 12, generator=generator) * 3
    labels = torch.randint(0, 7, (300,), generator=generator)
    features = Features([str(i) for i in range(300)], labels, torch.zeros(300, 1),
                        projections, [str(c) for c in range(7)], [None] * 300)
    found = class_embedding_classifier(table, features)
    top1 = top5 = 0
    for z, label in zip(projections, labels, strict=True):
        cosines = [float(z @ w / (z.norm() * w.norm())) for w in table]
        ranked = sorted(range(7), key=lambda c: -cosines[c])
        top1 += int(ranked[0] == label)
        top5 += int(int(label) in ranked[:5])
    assert found["classes"] == 7
    assert found["accuracy"] == pytest.approx({"top1": top1 / 300, "top5": top5 / 300})
    assigned = Features(features.keys, projections.matmul(F.normalize(table, dim=1).T)
                        .argmax(1), features.backbone, projections, features.class_names,
                        features.captions)
    assert class_embedding_classifier(table, assigned)["accuracy"]["top1"] == 1.0
