"""Configuration of the data stages: ``shards.*`` (make-shards) and ``data.*`` (loaders)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from core.config import InvalidValue
from data_pipeline.dali.jpeg import check_decoder
from data_pipeline.images import PILLOW_HARD_LIMIT


@dataclass
class ShardsConfig:
    """Where samples come from and how they are cut into WebDataset shards.

    ``source``: ``digits`` (bundled scikit-learn digits), ``cluttered_digits`` (the same
    digits at random size and position on coloured, cluttered canvases with attribute
    captions: ``data_pipeline/cluttered.py``), ``imagenet`` (``input`` is a tree
    ``<input>/<class_dir>/*.JPEG``), ``captions`` (``input`` is a CSV/TSV table of caption and
    local image path; CC3M and CC12M order the columns differently, so name or number them),
    ``img2dataset`` (``input`` holds img2dataset's tar shards: validated and indexed in place).
    """

    source: str | None = None  # an entry of data_pipeline/sources.py (the list above)
    input: str = ""  # the source's input: image tree, caption table or img2dataset folder
    output: str = ""  # directory for the shards and manifest.json
    class_names: str = ""  # file with one name per line, or "imagenet1k" (torchvision's list)
    caption_column: str = "caption"  # a header name, or a 0-based column number as text
    image_column: str = "image"  # a header name, or a 0-based column number as text
    label_column: str = ""  # captions: integer class labels (kNN, probe); "" = none
    delimiter: str | None = None  # caption table delimiter; null: tab for .tsv, else comma
    has_header: bool = True  # the caption table's first row names the columns
    image_root: str = ""  # relative image paths in a table are resolved against this
    shard_size: int = 1000  # samples per shard
    workers: int = 2  # processes writing shards
    digits_size: int = 64  # digits: pixels of the upsampled 8x8 images
    split: Literal["all", "train", "test"] = "all"  # digits sources: every 5th digit is test
    samples: int = 0  # cluttered_digits: canvases to draw; 0 = one per source digit
    canvas_size: int = 40  # cluttered_digits: side of the canvas, pixels
    clutter: int = 2  # cluttered_digits: fragments of other digits per canvas
    # alt_text: web-like, the digit named among uninformative words or nothing named
    captions: Literal["attributes", "alt_text"] = "attributes"  # cluttered_digits' captions
    seed: int = 0  # the order of samples across shards; cluttered_digits' draws
    shuffle: bool = True  # write samples in a seeded random order (false: source order)
    max_image_pixels: int = 89_478_485  # larger images are skipped (bombs); 0 = Pillow's 2 x this

    def validate(self) -> None:
        if self.shard_size < 1:
            raise InvalidValue("shard_size", f"must be >= 1, got {self.shard_size}")
        if self.workers < 1:
            raise InvalidValue("workers", f"must be >= 1, got {self.workers}")
        if not 0 <= self.max_image_pixels <= PILLOW_HARD_LIMIT:
            raise InvalidValue("max_image_pixels", f"must lie in [0, {PILLOW_HARD_LIMIT}] "
                               f"(Pillow refuses larger images), got {self.max_image_pixels}")
        if self.digits_size < 8:
            raise InvalidValue("digits_size", f"must be >= 8, got {self.digits_size}")
        if self.canvas_size < 16 or self.samples < 0 or self.clutter < 0:
            raise InvalidValue("canvas_size", "canvas_size >= 16, samples >= 0, clutter >= 0")


@dataclass(frozen=True)
class Retry:
    """Remote shard reads: ``attempts`` tries, waiting ``wait`` seconds after the first
    failure and twice as long after each further one (``data.retries``, ``data.retry_wait``)."""

    attempts: int = 5
    wait: float = 1.0


@dataclass
class DataConfig:
    """The training and evaluation loaders (``data.*``)."""

    shards: str = ""  # training shards: make-shards directory or URLs (docs/data_pipeline.md)
    batch_size: int = 64  # images a chunk (a rank's unit of a step); each yields two views
    # kept: the global batch the run began with on any number of ranks (chunks of
    # batch_size dealt whole); per_rank: batch_size a rank, the global batch follows the world
    global_batch: Literal["kept", "per_rank"] = "kept"  # pretrain/run/batch_cut.py
    global_batch_size: int = 0  # kept: instances a step from the start (0: batch_size a rank)
    workers: int = 2  # loader worker processes per rank
    resolution: int = 32  # side of the square views, in pixels
    augment: Literal["simclr", "autoaugment", "none"] = "simclr"  # view augmentation recipe
    pairing: Literal["views", "same_label"] = "views"  # 2 views of an image, or 2 images of a class
    crop_min_scale: float = 0.2  # smallest random-resized-crop area fraction
    color_strength: float = 0.5  # simclr: jitter strength s (SimCLR: 1.0 ImageNet, 0.5 CIFAR)
    hue: float | None = None  # simclr: hue jitter in [0, 0.5]; null: 0.2 x color_strength
    grayscale: float = 0.2  # simclr: probability of a grayscale view
    grayscale_second: float | None = None  # simclr: the second view's (null: grayscale)
    blur: float = 0.5  # simclr: probability of a Gaussian blur
    flip: float = 0.5  # simclr: probability of a horizontal flip
    shuffle_buffer: int = 512  # samples a chunk slot shuffles at a time (its lanes' blocks)
    lanes: int = 4  # places of the data set each chunk slot reads side by side (mixing)
    seed: int = 0  # seed of shard order, shuffling and augmentation
    max_skip_fraction: float = 0.01  # fail when more than this fraction of samples is bad
    max_image_pixels: int = 89_478_485  # larger images are skipped (bombs); 0 = Pillow's 2 x this
    verify_checksums: bool = False  # local: hash every shard at start; remote: each on read
    caption_store: str = ""  # graph-precompute output: joins caption embeddings by key
    backend: str = "cpu"  # training views: CPU workers, or on the device: nvjpeg, dali
    decoder: str = "auto"  # nvjpeg: torchcodec, torchvision or auto (the first installed)
    # a batch's memory follows this, not its largest image (docs/data_pipeline.md)
    device_decode_pixels: int = 100_000_000  # device backends: pixels decoded at a time
    draft_decode: bool = True  # decode JPEGs at the reduced size every view allows (1/2-1/8)
    prefetch: int = 2  # batches each loader worker prepares ahead
    persistent_workers: bool = True  # training: keep the workers from one epoch to the next
    pin_memory: bool = True  # page-locked batches for faster host-to-GPU copies (CUDA only)
    retries: int = 5  # remote shards: read attempts before failing (resumes mid-shard)
    retry_wait: float = 1.0  # remote shards: seconds before the first retry, doubling after
    ledger: bool = False  # training: each rank logs every step's sample keys (loader/ledger.py)

    @property
    def samples_per_batch(self) -> int:
        """Samples of the data set a rank's batch takes: one per instance, two for
        ``pairing=same_label`` (pairs are found among them)."""
        return self.batch_size * (2 if self.pairing == "same_label" else 1)

    @property
    def retry(self) -> Retry:
        return Retry(self.retries, self.retry_wait)

    def validate(self) -> None:
        for key in ("batch_size", "resolution", "shuffle_buffer", "lanes"):
            if getattr(self, key) < 1:
                raise InvalidValue(key, f"must be >= 1, got {getattr(self, key)}")
        check_decoder(self.decoder)
        if self.global_batch_size < 0:
            raise InvalidValue("global_batch_size", f"must be >= 0, got {self.global_batch_size}")
        if self.global_batch_size and self.global_batch == "per_rank":
            raise InvalidValue("global_batch_size", "sets the global batch a run keeps: it "
                               "needs data.global_batch=kept")
        if self.device_decode_pixels < 1:
            raise InvalidValue("device_decode_pixels",
                               f"must be >= 1, got {self.device_decode_pixels}")
        if self.prefetch < 1:
            raise InvalidValue("prefetch", f"must be >= 1, got {self.prefetch}")
        if self.workers < 0:
            raise InvalidValue("workers", f"must be >= 0, got {self.workers}")
        if not 0 <= self.max_image_pixels <= PILLOW_HARD_LIMIT:
            raise InvalidValue("max_image_pixels", f"must lie in [0, {PILLOW_HARD_LIMIT}] "
                               f"(Pillow refuses larger images), got {self.max_image_pixels}")
        if not 0 <= self.max_skip_fraction <= 1:
            raise InvalidValue("max_skip_fraction",
                               f"must lie in [0, 1], got {self.max_skip_fraction}")
        for key in ("grayscale", "grayscale_second", "blur", "flip"):
            if not 0 <= (getattr(self, key) or 0) <= 1:
                raise InvalidValue(key, f"a probability lies in [0, 1], got {getattr(self, key)}")
        if self.color_strength < 0 or not 0 <= (self.hue or 0) <= 0.5:
            raise InvalidValue("color_strength", "need color_strength >= 0 and hue in [0, 0.5]")
        if self.retries < 1 or self.retry_wait < 0:
            raise InvalidValue("retries", "need retries >= 1 and retry_wait >= 0")
        if not 0 < self.crop_min_scale <= 1:
            raise InvalidValue("crop_min_scale", f"must lie in (0, 1], got {self.crop_min_scale}")
