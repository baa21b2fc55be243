"""CLIP's text tower: each distinct caption runs through the transformer once per batch,
and the result equals encoding every row on its own (float64), gradients included."""

from __future__ import annotations

import torch

from data_pipeline.text import load_tokenizer, tokenize
from pretrain.text_tower import TextTower, TextTowerConfig

CAPTIONS = ["a small red seven on blue", "number 3, large and green", "a photo of a dog"]
ROWS = [0, 1, 2, 1, 0, 2, 0]  # views share their caption; any order


def test_each_distinct_caption_is_encoded_once_and_rows_equal_their_own_encoding():
    torch.manual_seed(0)
    tower = TextTower(TextTowerConfig(trainable=True), 16).double()
    tokens = tokenize(load_tokenizer("bundled"), [CAPTIONS[i] for i in ROWS], 16)
    seen: list[int] = []
    hook = tower.transformer.register_forward_hook(
        lambda module, args, kwargs, out: seen.append(kwargs["input_ids"].shape[0]),
        with_kwargs=True)
    out = tower(tokens["input_ids"], tokens["attention_mask"])
    hook.remove()
    assert seen == [3] and out.shape == (len(ROWS), 16)

    def alone(row: int) -> torch.Tensor:  # the reference: one row, pooled by hand
        ids, mask = tokens["input_ids"][row:row + 1], tokens["attention_mask"][row:row + 1]
        hidden = tower.transformer(input_ids=ids, attention_mask=mask).last_hidden_state[0]
        keep = mask[0].bool()
        return tower.projection(hidden[keep].mean(0))

    reference = torch.stack([alone(r) for r in range(len(ROWS))])
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-12)
    weights = torch.randn(len(ROWS), 16, dtype=torch.float64)
    params = [tower.projection.weight, tower.transformer.embeddings.word_embeddings.weight]
    grads = torch.autograd.grad((out * weights).sum(), params)
    expected = torch.autograd.grad((reference * weights).sum(), params)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
