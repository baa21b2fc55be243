"""Training batches from the pieces the loader workers make (``train.py``).

A worker draws and renders the views of its samples of a global batch (:class:`PieceDrawer`:
each instance's views under its own seed, so a view does not depend on which worker drew
it) and tags each with its chunk slot and its place in the chunk. The main process joins
the pieces of a batch (:class:`ChunkJoiner`): the rank's instances in slot order, each
chunk in its own order, then ids, labels, captions and the caption-store rows or caption
tokens the objective needs. ``chunk_sizes`` says how many instances each chunk of the
rank kept, so the trainer encodes chunk by chunk at any world size."""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch
from torch import Tensor

from data_pipeline.config import DataConfig
from data_pipeline.dali.params import SimCLRParams
from data_pipeline.graph.store import CaptionStore
from data_pipeline.loader.backends import backend_spec
from data_pipeline.samples import RawSample, SkipLog, stable_int
from data_pipeline.text import TextConfig, load_tokenizer, tokenize
from data_pipeline.transforms import eval_view
from data_pipeline.views import PerView, batch_views

Item = tuple[int, int, tuple[RawSample, Any]]  # (slot, place in its chunk, (sample, image))


def copy_rows_(out: Tensor, into: list[int], rows: Tensor) -> None:
    """``out[into] = rows`` on the calling thread alone. The main process joins batches
    while the loader workers hold the cores, and torch's parallel copy would spin OpenMP
    threads against them (on 2 cores it took the join two to four times as long); numpy
    copies on this thread."""
    if out.dtype == torch.bfloat16:  # numpy has no bfloat16
        out.index_copy_(0, torch.tensor(into), rows)
    else:
        out.numpy()[into] = rows.numpy()


class PieceDrawer:
    """``(batch, items, skips) -> piece``: a worker's samples of one global batch with
    their views rendered: two views an instance (``views``), or one eval view a sample
    (``same_label``: the joiner pairs them within their chunk)."""

    def __init__(self, cfg: DataConfig, epoch: int) -> None:
        # a backend that renders on the device: the workers draw parameters only
        kind = (SimCLRParams if backend_spec(cfg.backend).device_views
                else functools.partial(batch_views, cfg.augment))
        views = functools.partial(kind, cfg.resolution, cfg.crop_min_scale,
                                  cfg.color_strength, blur=cfg.blur, flip=cfg.flip, hue=cfg.hue)
        self.paired = cfg.pairing == "same_label"
        if self.paired:  # two images of a class, not augmented
            self.first = self.second = PerView(eval_view(cfg.resolution))
        else:
            self.first = views(grayscale=cfg.grayscale)
            self.second = self.first if cfg.grayscale_second is None else views(
                grayscale=cfg.grayscale_second)  # asymmetric views (BYOL)
        self.seed, self.epoch = cfg.seed, epoch

    def __call__(self, batches: list[tuple[int, list[Item], SkipLog]]) -> list[dict[str, Any]]:
        """The pieces of ``(batch, items, skips)`` of several batches (one message): their
        views rendered in one call where views render row by row (as one tensor: a
        message hands over one storage, and small pieces cost what one large one does)."""
        drawn = [self.draw([image for _, _, (_, image) in items],
                           [stable_int(self.seed, self.epoch, sample.key)
                            for _, _, (sample, _) in items]) for _, items, _ in batches]
        return [{"batch": batch, "slots": [slot for slot, _, _ in items],
                 "places": [place for _, place, _ in items],
                 "samples": [RawSample(s.key, s.shard, b"", s.label, s.caption, s.row)
                             for _, _, (s, _) in items],
                 "views": views, "skips": skips}
                for (batch, items, skips), views in zip(batches, self._render(drawn),
                                                        strict=True)]

    def draw(self, images: list[Any], seeds: list[int]) -> list[Any]:
        """The views of ``images`` drawn, each under its seed, not yet rendered: first
        views, then second views (``same_label``: one a sample)."""
        first, second = [], []
        with torch.random.fork_rng(devices=[]):  # the caller's generator is left as it was
            for image, seed in zip(images, seeds, strict=True):
                # the CPU stream the draws consume; torch.manual_seed would also queue a
                # seeding of each accelerator, recording the call stack (0.7 ms a sample)
                torch.random.default_generator.manual_seed(seed)
                first.append(self.first.draw(image))
                if not self.paired:
                    second.append(self.second.draw(image))
        return first + second

    def render(self, images: list[Any], seeds: list[int]) -> Tensor | dict[str, Any]:
        """The views of ``images``, each drawn under its seed: [2m, ...] (first views, then
        second views), or [m, ...] for ``same_label``; a device backend's parameters."""
        return self.first.render(self.draw(images, seeds))

    def _render(self, drawn: list[list[Any]]) -> list[Tensor | dict[str, Any] | None]:
        """Each piece's drawn views rendered (None for a piece without samples)."""
        if not self.first.rowwise:  # a device backend's parameters: piece by piece
            return [self.first.render(views) if views else None for views in drawn]
        if not any(drawn):
            return [None] * len(drawn)
        whole = self.first.render([view for views in drawn for view in views])
        starts = [0, *itertools.accumulate(len(views) for views in drawn)]
        return [whole[a:b] if b > a else None
                for a, b in zip(starts[:-1], starts[1:], strict=True)]


class ChunkJoiner:
    """``pieces -> batch``: the pieces of one global batch from every worker of a rank
    whose chunk slots are ``slots``, joined in slot order and each chunk in its order."""

    def __init__(self, cfg: DataConfig, text: TextConfig | None, slots: range,
                 labelled: bool, pin: bool = False) -> None:
        self.cfg, self.text, self.slots = cfg, text, slots
        self.labelled, self.pin = labelled, pin
        self.paired = cfg.pairing == "same_label"
        self.store = CaptionStore.open(cfg.caption_store) if cfg.caption_store else None
        self.tokenizer = None

    def __call__(self, pieces: list[dict[str, Any]]) -> dict[str, Any]:
        assert len({p["batch"] for p in pieces}) == 1, "pieces of different batches"
        skips = SkipLog()
        for piece in pieces:
            skips.merge(piece["skips"])
        pieces = [p for p in pieces if p["samples"]]
        # (slot, place, piece, row) of every sample, in the order of the rank's batch
        rows = sorted((slot, place, k, i) for k, p in enumerate(pieces)
                      for i, (slot, place) in enumerate(zip(p["slots"], p["places"],
                                                            strict=True)))
        instances = self._instances(rows, [p["samples"] for p in pieces])
        sizes = [sum(1 for first, _ in instances if first[0] == slot) for slot in self.slots]
        if not instances:
            return self.placeholder(skips, sizes)
        heads = [pieces[k]["samples"][i] for (_, _, k, i), _ in instances]
        views = [p["views"] for p in pieces]
        picked = [(k, i) for (_, _, k, i), _ in instances]
        if self.paired:  # one view a sample: a pair's two samples
            picked += [(k, i) for _, (_, _, k, i) in instances]
        else:  # a piece's render is its first views, then its second views
            picked += [(k, i + len(pieces[k]["samples"])) for (_, _, k, i), _ in instances]
        batch = {**(self._rows(views, picked) if isinstance(views[0], Tensor)
                    else device_views(views, picked)),
                 "placeholder": min(sizes) == 0, "chunk_sizes": sizes,
                 "ids": torch.tensor([stable_int(s.key) for s in heads]).repeat(2),
                 "keys": ["+".join(pieces[k]["samples"][i].key for _, _, k, i in pair)
                          if self.paired else pieces[pair[0][2]]["samples"][pair[0][3]].key
                          for pair in instances],
                 "captions": [s.caption for s in heads], **skips.as_batch()}
        if heads[0].label is not None:
            batch["labels"] = torch.tensor([s.label for s in heads]).repeat(2)
        if self.text is not None:  # [2B, L] token ids and mask, the views share the caption
            batch.update({k: v.repeat(2, 1) for k, v in self._tokens(heads).items()})
            batch["text_repeated"] = True  # the second half of token rows repeats the first
        if self.store is not None:  # [2B, E] float16, the views share their caption's row
            batch["caption_embeddings"] = torch.from_numpy(
                self.store.embedding_rows(s.row for s in heads)).repeat(2, 1)
        return batch

    def _instances(self, rows: list[tuple[int, int, int, int]],
                   samples: list[list[RawSample]]) -> list[tuple[tuple, tuple]]:
        """(first, second) sample rows of each instance: a sample twice (``views``), or
        two samples of one class of a chunk (``same_label``: the first two of each class
        among the chunk's samples, then the next two, ...)."""
        if not self.paired:
            return [(row, row) for row in rows]
        pending: dict[tuple[int, int], tuple] = {}
        pairs = []
        for row in rows:
            sample = samples[row[2]][row[3]]
            if sample.label is None:
                raise ValueError(f"data.pairing=same_label needs labels; {sample.key} in "
                                 f"{sample.shard} has none")
            if (row[0], sample.label) in pending:
                pairs.append((pending.pop((row[0], sample.label)), row))
            else:
                pending[row[0], sample.label] = row
        return pairs

    def _rows(self, parts: list[Tensor], picked: list[tuple[int, int]]) -> dict[str, Tensor]:
        """``{"images": rows}``: row ``i`` of part ``k`` for each ``(k, i)`` picked, in
        page-locked memory when the batch goes to a GPU. Each part's rows are copied once,
        straight into the batch (no joined copy of the parts first)."""
        if len(parts) == 1 and not self.pin and picked == [(0, i) for i in range(len(parts[0]))]:
            return {"images": parts[0]}  # one worker's render, in order: as it came
        out = torch.empty((len(picked), *parts[0].shape[1:]), dtype=parts[0].dtype,
                          pin_memory=self.pin)
        by_part: dict[int, tuple[list[int], list[int]]] = {}
        for row, (k, i) in enumerate(picked):
            into, taken = by_part.setdefault(k, ([], []))
            into.append(row)
            taken.append(i)
        for k, (into, taken) in by_part.items():
            whole = taken == list(range(len(parts[k])))
            copy_rows_(out, into, parts[k] if whole else parts[k][taken])
        return {"images": out}

    def placeholder(self, skips: SkipLog, sizes: list[int]) -> dict[str, Any]:
        """A batch in which every sample was skipped: one instance of zero images (two
        views), flagged ``placeholder`` so that every rank runs the step (the collectives
        stay in step) and none updates or logs it; it carries the skips to be counted."""
        resolution = self.cfg.resolution
        batch: dict[str, Any] = {
            "images": torch.zeros(2, 3, resolution, resolution), "placeholder": True,
            "chunk_sizes": sizes,
            "ids": torch.tensor([stable_int("placeholder")]).repeat(2), "keys": [],
            "captions": [""], **skips.as_batch()}
        if self.labelled:
            batch["labels"] = torch.zeros(2, dtype=torch.long)
        if self.text is not None:
            tokens = tokenize(self._tokenizer(), [""], self.text.max_length, to_longest=True)
            batch.update({k: v.repeat(2, 1) for k, v in tokens.items()})
            batch["text_repeated"] = True
        if self.store is not None:
            batch["caption_embeddings"] = torch.zeros(2, self.store.embeddings.shape[1],
                                                      dtype=torch.float16)
        return batch

    def _tokenizer(self):
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.text.model)
        return self.tokenizer

    def _tokens(self, heads: list[RawSample]) -> dict[str, torch.Tensor]:
        for sample in heads:
            if sample.caption is None:
                raise ValueError(f"CLIP needs captions; {sample.key} in {sample.shard} has "
                                 "none")
        return tokenize(self._tokenizer(), [s.caption for s in heads], self.text.max_length,
                        to_longest=True)


def device_views(views: list[dict[str, Any]], order: list[tuple[int, int]]) -> dict[str, Any]:
    """A device backend's pieces (encoded images a sample, view parameters [2m] a piece)
    joined: the images of the first views' samples, the parameters of every view."""
    half = len(order) // 2
    out: dict[str, Any] = {key: [views[k][key][row] for k, row in order[:half]]
                           for key in ("encoded", "encoded_from", "encoded_sizes")}
    out["view_params"] = {key: torch.stack([views[k]["view_params"][key][row]
                                            for k, row in order])
                          for key in views[0]["view_params"]}
    return out
