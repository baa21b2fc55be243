"""CLIP's text tower: each row's result equals encoding it on its own (float64), gradients
included; a training batch, padded only to its longest caption, embeds each caption as a
fixed context does; and a training step hands the tower each caption once when the loader
says the views share their captions (``text_repeated``), with the same result per view."""

from __future__ import annotations

import pytest
import torch

from data_pipeline.config import DataConfig
from data_pipeline.loader.collate import ChunkJoiner, PieceDrawer
from data_pipeline.samples import RawSample, SkipLog
from data_pipeline.text import TextConfig, load_tokenizer, tokenize
from pretrain.loop.step import model_inputs
from pretrain.model.encoder import ContrastiveModel, ModelConfig
from pretrain.model.text_tower import TextTower, TextTowerConfig
from tests.app.helpers import run_pretrain, train_overrides
from tests.pretrain.run.test_checkpoint import final_model

CAPTIONS = ["a small red seven on blue", "number 3, large and green", "a photo of a dog"]
ROWS = [0, 1, 2, 1, 0, 2, 0]  # any order, repeats included


SCRATCH = TextTowerConfig(trainable=True, scratch_layers=2, scratch_width=64)


@pytest.mark.parametrize("cfg", [TextTowerConfig(trainable=True), SCRATCH],
                         ids=["pretrained", "scratch"])
def test_every_row_equals_its_own_encoding(cfg):
    torch.manual_seed(0)
    tower = TextTower(cfg, 16).double()
    tokens = tokenize(load_tokenizer("bundled"), [CAPTIONS[i] for i in ROWS], 16)
    out = tower(tokens["input_ids"], tokens["attention_mask"])
    assert out.shape == (len(ROWS), 16)

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


def test_a_tower_from_scratch_is_a_small_random_bert_over_the_bundled_tokenizer():
    """scratch_layers: the shape asked for, the tokenizer's whole vocabulary, weights from
    the caller's seed (none of all-MiniLM-L6-v2's), refused unless trainable."""
    from pretrain.model.text_tower import scratch_transformer

    pretrained = TextTower(TextTowerConfig(), 16).transformer
    torch.manual_seed(0)
    tower = TextTower(SCRATCH, 16)
    config = tower.transformer.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == \
        (2, 64, 2)
    assert config.vocab_size == len(load_tokenizer("bundled")) == pretrained.config.vocab_size
    assert config.max_position_embeddings == SCRATCH.max_length
    torch.manual_seed(0)
    again = scratch_transformer(SCRATCH).state_dict()
    torch.manual_seed(1)
    other = scratch_transformer(SCRATCH).state_dict()
    for key, value in tower.transformer.state_dict().items():
        assert torch.equal(value, again[key]), key
    word = "embeddings.word_embeddings.weight"
    assert not torch.equal(tower.transformer.state_dict()[word], other[word])
    assert pretrained.state_dict()[word].shape[1] != tower.transformer.state_dict()[word].shape[1]
    with pytest.raises(ValueError, match="trainable"):
        TextTowerConfig(scratch_layers=2).validate()


def test_a_training_batch_is_padded_to_its_longest_caption_and_embeds_as_a_fixed_context():
    """The loader's token rows are as wide as the batch's longest caption (counted by the
    tokenizer alone, one caption at a time), at most ``max_length``; the tower gives each
    caption what the fixed 32-token context gives it (float64: padding is masked out of
    attention and pooling, so it changes nothing but the work)."""
    tokenizer = load_tokenizer("bundled")
    lengths = [len(tokenizer(caption)["input_ids"]) for caption in CAPTIONS]
    items = [(0, i, (RawSample(f"k{i}", "s", b"", None, caption),
                     torch.zeros(3, 8, 8, dtype=torch.uint8)))
             for i, caption in enumerate(CAPTIONS)]
    cfg = DataConfig(resolution=8)

    def collated(max_length: int) -> dict:
        piece = PieceDrawer(cfg, epoch=0)([(0, items, SkipLog())])[0]
        return ChunkJoiner(cfg, TextConfig(max_length=max_length), range(1),
                           labelled=False)([piece])

    batch = collated(32)
    assert batch["input_ids"].shape == (6, max(lengths)) and max(lengths) < 32
    assert batch["attention_mask"][:3].sum(1).tolist() == lengths
    assert collated(4)["input_ids"].shape == (6, 4)

    torch.manual_seed(0)
    tower = TextTower(TextTowerConfig(), 16).double()
    fixed = tokenize(tokenizer, CAPTIONS, 32)
    torch.testing.assert_close(tower(batch["input_ids"][:3], batch["attention_mask"][:3]),
                               tower(fixed["input_ids"], fixed["attention_mask"]),
                               rtol=0, atol=1e-12)


def test_a_tokenizer_saved_padding_on_the_left_pads_on_the_right(tmp_path):
    """A caption keeps its tokens' positions however wide its batch: a model directory
    whose tokenizer pads on the left is loaded padding on the right."""
    saved = load_tokenizer("bundled")
    saved.padding_side = "left"
    saved.save_pretrained(tmp_path)
    tokens = tokenize(load_tokenizer(str(tmp_path)), CAPTIONS, 32, to_longest=True)
    assert tokens["attention_mask"][:, 0].tolist() == [1, 1, 1]
    assert tokens["attention_mask"][:, -1].tolist() != [1, 1, 1]


def test_a_step_encodes_each_caption_once_when_the_views_share_them():
    torch.manual_seed(0)
    model = ContrastiveModel(ModelConfig(width=8, projector_hidden=16, projector_dim=16),
                             with_text=True).double()
    tokens = tokenize(load_tokenizer("bundled"), CAPTIONS * 2, 16)  # 2 views of 3 images
    batch = {"images": torch.randn(6, 3, 16, 16, dtype=torch.float64), **tokens}
    seen: list[int] = []
    model.text.transformer.register_forward_hook(
        lambda module, args, kwargs, out: seen.append(kwargs["input_ids"].shape[0]),
        with_kwargs=True)
    shared = model(*model_inputs({**batch, "text_repeated": True})).text
    every_row = model(*model_inputs(batch)).text
    assert seen == [3, 6]  # once per caption, then once per view
    torch.testing.assert_close(shared, every_row, rtol=0, atol=1e-12)
    assert model_inputs({**batch, "text_repeated": True}, slice(0, 4))[3] == 1  # chunks


@pytest.mark.parametrize("scratch", [0, 1], ids=["pretrained", "scratch"])
def test_a_trainable_tower_trains_on_two_ddp_ranks(digits_shards, random_text, tmp_path,
                                                   scratch):
    """The shipped CC3M/CC12M image-text recipes fine-tune the tower under DDP, which stops a
    run at its second step if any trainable parameter gets no gradient: the transformer's
    pooler (the [CLS] head, unused by mean pooling) must not train. Through the real
    command, 2 ranks, the tower's weights moved; a tower from scratch trains there too and
    is restored from its checkpoint with the same shapes."""
    overrides = train_overrides(digits_shards, tmp_path, **{
        "objective.name": "clip", "model.text.trainable": True,
        "model.text.model": random_text.model, "train.max_steps": 3,
        "model.text.scratch_layers": scratch, "model.text.scratch_width": 32})
    result = run_pretrain(overrides, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    state = final_model(tmp_path / "run")["model"]
    start = TextTower(TextTowerConfig(model=random_text.model, trainable=True,
                                      scratch_layers=scratch, scratch_width=32),
                      16).transformer.state_dict()
    assert {k: v.shape for k, v in start.items()} == {
        k.removeprefix("text.transformer."): v.shape for k, v in state.items()
        if k.startswith("text.transformer.")}
    if scratch:  # its start is the run's seed, drawn after the image side's: not redrawn here
        return
    moved = [k for k, v in start.items() if not torch.equal(state[f"text.transformer.{k}"], v)]
    assert any(k.startswith("encoder.layer.") for k in moved), moved
    assert not any(k.startswith("pooler.") for k in moved), moved
