"""Training batches from decoded instances: two views each, ids, labels, captions, and
the caption-store rows or caption tokens the objective needs."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from data_pipeline.config import DataConfig
from data_pipeline.dali.params import SimCLRParams
from data_pipeline.graph.store import CaptionStore
from data_pipeline.loader.backends import backend_spec
from data_pipeline.samples import RawSample, SkipLog, stable_int
from data_pipeline.text import TextConfig, load_tokenizer, tokenize
from data_pipeline.transforms import eval_view
from data_pipeline.views import PerView, batch_views

Instance = list[tuple[RawSample, Any]]  # one image (views) or two of one class (same_label)


class TrainCollator:
    """``(instances, seeds, skips) -> batch``. Each instance's views are drawn under its
    own seed, so a batch does not depend on which worker built it; the drawn views are
    then rendered as one batch (``data_pipeline/views.py``)."""

    def __init__(self, cfg: DataConfig, text: TextConfig | None,
                 store: CaptionStore | None) -> None:
        # a backend that renders on the device: the workers draw parameters only
        kind = (SimCLRParams if backend_spec(cfg.backend).device_views
                else functools.partial(batch_views, cfg.augment))
        views = functools.partial(kind, cfg.resolution, cfg.crop_min_scale,
                                  cfg.color_strength, blur=cfg.blur, flip=cfg.flip, hue=cfg.hue)
        if cfg.pairing == "same_label":  # two images of a class, not augmented
            self.first = self.second = PerView(eval_view(cfg.resolution))
        else:
            self.first = views(grayscale=cfg.grayscale)
            self.second = self.first if cfg.grayscale_second is None else views(
                grayscale=cfg.grayscale_second)  # asymmetric views (BYOL)
        self.text, self.store, self.tokenizer = text, store, None
        self.resolution = cfg.resolution

    def __call__(self, group: list[Instance], seeds: list[int], skips: SkipLog,
                 ) -> dict[str, Any]:
        first, second = [], []
        with torch.random.fork_rng(devices=[]):  # the caller's generator is left as it was
            for instance, seed in zip(group, seeds, strict=True):
                # the CPU stream the draws consume; torch.manual_seed would also queue a
                # seeding of each accelerator, recording the call stack (0.7 ms a sample)
                torch.random.default_generator.manual_seed(seed)
                # one image drawn twice (views), or the two images of a class (same_label)
                first.append(self.first.draw(instance[0][1]))
                second.append(self.second.draw(instance[-1][1]))
        heads = [instance[0][0] for instance in group]
        views = self.first.render(first + second)  # [2B, 3, R, R]: view 1s, view 2s
        batch = {
            **(views if isinstance(views, dict) else {"images": views}),
            "placeholder": False,
            "ids": torch.tensor([stable_int(s.key) for s in heads]).repeat(2),
            "keys": ["+".join(s.key for s, _ in instance) for instance in group],
            "captions": [s.caption for s in heads],
            **skips.as_batch(),
        }
        if heads[0].label is not None:
            batch["labels"] = torch.tensor([s.label for s in heads]).repeat(2)
        if self.text is not None:  # [2B, L] token ids and mask, the views share the caption
            batch.update({k: v.repeat(2, 1) for k, v in self._tokens(heads).items()})
            batch["text_repeated"] = True  # the second half of token rows repeats the first
        if self.store is not None:  # [2B, E] float16, the views share their caption's row
            rows = [s.row for s in heads]
            batch["caption_embeddings"] = torch.from_numpy(
                np.asarray(self.store.embeddings[rows])).repeat(2, 1)
        return batch

    def placeholder(self, skips: SkipLog, labelled: bool) -> dict[str, Any]:
        """A batch in which every sample was skipped: one instance of zero images (two
        views), flagged ``placeholder`` so that every rank runs the step (the collectives
        stay in step) and none updates or logs it; it carries the skips to be counted."""
        resolution = self.resolution
        batch: dict[str, Any] = {
            "images": torch.zeros(2, 3, resolution, resolution), "placeholder": True,
            "ids": torch.tensor([stable_int("placeholder")]).repeat(2), "keys": [],
            "captions": [""], **skips.as_batch()}
        if labelled:
            batch["labels"] = torch.zeros(2, dtype=torch.long)
        if self.text is not None:
            if self.tokenizer is None:
                self.tokenizer = load_tokenizer(self.text.model)
            tokens = tokenize(self.tokenizer, [""], self.text.max_length, to_longest=True)
            batch.update({k: v.repeat(2, 1) for k, v in tokens.items()})
            batch["text_repeated"] = True
        if self.store is not None:
            batch["caption_embeddings"] = torch.zeros(2, self.store.embeddings.shape[1],
                                                      dtype=torch.float16)
        return batch

    def _tokens(self, heads: list[RawSample]) -> dict[str, torch.Tensor]:
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.text.model)
        for sample in heads:
            if sample.caption is None:
                raise ValueError(f"CLIP needs captions; {sample.key} in {sample.shard} has "
                                 "none")
        return tokenize(self.tokenizer, [s.caption for s in heads], self.text.max_length,
                        to_longest=True)
