"""Evaluation of caption-trained (CLIP) models: image-text retrieval and zero-shot
classification, on L2-normalised embeddings of the image projector and the text tower.

Retrieval follows CLIP (Radford et al. 2021, section 3.1.4 and Table 13): each image is
paired with its caption; recall@K is the fraction of queries whose paired item is among
the K most similar. Identical caption strings are one text (a caption shared by several
images is correct for each of them), so a duplicate cannot count as a miss.
Zero-shot classification (section 3.1.4): each class is the mean embedding of its name in
every prompt template, and an image takes the class of highest cosine similarity.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from core.errors import RunError
from data_pipeline.text import load_tokenizer, tokenize
from evaluation.config import EvalConfig
from evaluation.features import Features
from registry.package import EmbeddingModel

QUERY_CHUNK = 1024  # queries scored at once: memory O(chunk * candidates)


def _hits(queries: Tensor, candidates: Tensor, correct: Tensor, ks: list[int],
          candidate_group: Tensor | None = None) -> dict[str, float]:
    """Recall@K of ``queries`` [q, D] against ``candidates`` [c, D]. Query i is right when a
    retrieved candidate j has ``candidate_group[j] == correct[i]`` (without groups:
    ``j == correct[i]``)."""
    top = max(ks)
    found = {k: 0 for k in ks}
    for start in range(0, queries.shape[0], QUERY_CHUNK):
        chunk = queries[start:start + QUERY_CHUNK]
        ranked = (chunk @ candidates.T).topk(min(top, candidates.shape[0]), dim=1).indices
        labels = ranked if candidate_group is None else candidate_group[ranked]
        match = labels == correct[start:start + QUERY_CHUNK, None]  # [chunk, top]
        for k in ks:
            found[k] += int(match[:, :k].any(dim=1).sum())
    return {f"R@{k}": found[k] / queries.shape[0] for k in ks}


def retrieval_recall(images: Tensor, texts: Tensor, caption_of_image: Tensor,
                     ks: list[int]) -> dict[str, dict[str, float]]:
    """Image-to-text and text-to-image recall@K.

    Args:
        images: [n, D] L2-normalised image embeddings.
        texts: [m, D] L2-normalised embeddings of the m distinct captions.
        caption_of_image: [n] long, the row of ``texts`` that is image i's caption.
        ks: the K of recall@K.
    Returns:
        {"image_to_text": {"R@K": r}, "text_to_image": {"R@K": r}}; text queries are the
        distinct captions, right when any image of that caption is retrieved.
    """
    return {"image_to_text": _hits(images, texts, caption_of_image, ks),
            "text_to_image": _hits(texts, images, torch.arange(texts.shape[0]), ks,
                                   candidate_group=caption_of_image)}


def zero_shot_accuracy(images: Tensor, class_texts: Tensor, labels: Tensor,
                       ks: list[int]) -> dict[str, float]:
    """Top-K accuracy of classifying ``images`` [n, D] by cosine similarity to
    ``class_texts`` [C, D] (L2-normalised class embeddings); ``labels`` [n] long."""
    return _hits(images, class_texts, labels, [k for k in ks if k <= class_texts.shape[0]])


def class_embedding_classifier(class_embeddings: Tensor,
                               labelled: Features) -> dict[str, Any]:
    """ProjNCE's classifier (Jeong & Hero, Sec. 5): each of ``labelled``'s projections goes
    to the class whose learned embedding (a row of ``class_embeddings`` [C, P]) is nearest
    in cosine; top-1 and top-5 accuracy."""
    classes = F.normalize(class_embeddings.detach().float().cpu(), dim=1)
    accuracy = zero_shot_accuracy(F.normalize(labelled.projector, dim=1), classes,
                                  labelled.labels, [1, 5])
    return {"classes": classes.shape[0],
            "accuracy": {k.replace("R@", "top"): v for k, v in accuracy.items()}}


@torch.no_grad()
def embed_texts(model: EmbeddingModel, texts: list[str], device: torch.device,
                batch_size: int) -> Tensor:
    """[m, P] L2-normalised float32 embeddings of ``texts`` by the model's text tower."""
    tower = model.text.to(device).eval()
    tokenizer = load_tokenizer(tower.config.model)
    rows = []
    for start in range(0, len(texts), batch_size):
        tokens = tokenize(tokenizer, texts[start:start + batch_size], tower.config.max_length)
        rows.append(tower(tokens["input_ids"].to(device),
                          tokens["attention_mask"].to(device)).float().cpu())
    return F.normalize(torch.cat(rows), dim=1)


def class_embeddings(model: EmbeddingModel, class_names: list[str], templates: list[str],
                     device: torch.device, batch_size: int) -> Tensor:
    """[C, P]: each class's prompts ``template.format(name)`` embedded, averaged and
    re-normalised (CLIP's prompt ensembling)."""
    prompts = [template.format(name) for name in class_names for template in templates]
    embedded = embed_texts(model, prompts, device, batch_size)
    return F.normalize(embedded.view(len(class_names), len(templates), -1).mean(1), dim=1)


def no_captions(shards: str) -> RunError:
    return RunError(f"eval.retrieval_shards={shards}: no sample has a caption (txt); "
                    "retrieval needs held-out caption shards")


def caption_recall(model: EmbeddingModel, images: Tensor, captions: list[str],
                   device: torch.device, batch_size: int,
                   ks: list[int]) -> tuple[dict[str, dict[str, float]], int]:
    """Recall@k both ways between ``images`` [n, D] (normalised projections) and their
    ``captions`` [n], each distinct caption embedded once by the model's text tower; and
    how many distinct captions there are."""
    distinct = sorted(set(captions))
    row = {caption: index for index, caption in enumerate(distinct)}
    caption_of_image = torch.tensor([row[caption] for caption in captions])
    texts = embed_texts(model, distinct, device, batch_size)
    return retrieval_recall(images, texts, caption_of_image, ks), len(distinct)


def caption_evaluation(model: EmbeddingModel, retrieval: Features, labelled: Features,
                       cfg: EvalConfig, shards: str, device: torch.device) -> dict[str, Any]:
    """Retrieval on the captioned samples of ``retrieval`` and zero-shot classification of
    ``labelled`` (its class names in ``cfg.zero_shot_templates``), projector space."""
    captioned = [i for i, caption in enumerate(retrieval.captions) if caption]
    if not captioned:
        raise no_captions(shards)
    images = F.normalize(retrieval.projector[captioned], dim=1)
    recall, distinct = caption_recall(model, images, [retrieval.captions[i] for i in captioned],
                                      device, cfg.text_batch_size, cfg.recall_ks)
    results: dict[str, Any] = {"retrieval": {
        "shards": shards, "images": len(captioned), "captions": distinct, **recall}}
    if labelled.class_names:
        classes = class_embeddings(model, labelled.class_names, cfg.zero_shot_templates,
                                   device, cfg.text_batch_size)
        accuracy = zero_shot_accuracy(F.normalize(labelled.projector, dim=1), classes,
                                      labelled.labels, [1, 5])
        results["zero_shot"] = {"classes": len(labelled.class_names),
                                "templates": cfg.zero_shot_templates,
                                "accuracy": {k.replace("R@", "top"): v
                                             for k, v in accuracy.items()}}
    return results
