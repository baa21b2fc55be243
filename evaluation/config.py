"""Configuration of ``evaluate`` (``eval.*`` in the run config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from core.config import InvalidValue

PROMPT = "a photo of a {}."  # CLIP's default zero-shot prompt


@dataclass
class EvalConfig:
    """What to evaluate, on which shards, and how.

    ``model``: a checkpoint directory or ``shared.pt`` file, ``runs:/<run_id>/encoder``, or a
    registry URI ``models:/<name>/<version>`` / ``models:/<name>@<alias>``; "" takes the
    newest checkpoint of this run's directory. Registry URIs resolve against
    ``tracking.uri`` (default: the run directory's SQLite store).
    """

    model: str = ""  # checkpoint dir, runs:/<id>/encoder or models:/...; "" = newest checkpoint
    train_shards: str = ""  # labelled shards: the kNN bank and the probe's training set
    test_shards: str = ""  # labelled shards: the kNN queries and the probe's test set
    batch_size: int = 256  # images per feature-extraction batch
    ks: list[int] = field(default_factory=lambda: [1, 5, 10, 20, 50, 100, 200])  # kNN k values
    knn_temperature: float = 0.07  # T of the exp(sim / T) neighbour votes
    index: Literal["faiss_flat", "exact", "ivf"] = "faiss_flat"  # see evaluation/knn.py
    ivf_lists: int = 0  # ivf: cells; 0 = about 4 sqrt(bank size)
    ivf_probe: int = 16  # ivf: cells searched per query
    save_index: bool = True  # write the bank's index next to the report (reused if present)
    promote_k: int = 20  # the kNN top-1 that decides --promote (backbone features)
    probe_epochs: int = 100  # linear probe: epochs over the bank
    probe_lr: float = 0.1  # linear probe: AdamW learning rate
    class_groups: list[list[int]] = field(default_factory=list)  # heatmap groups; [] = all (<= 50)
    samples_per_class: int = 100  # learned vs target similarity: samples per class
    # [C, C] class graph the learned similarity is compared with ("": the objective's own)
    class_graph: str = ""  # graph-precompute graph.task=class_graph output (class_graph.npz)
    max_diagnostic_samples: int = 10000  # uniformity and MI estimates subsample to this
    block_mib: int = 256  # bound on each block of pairwise scores (kNN, margin, diagnostics)
    bank_block_mib: int = 64  # bank rows read, normalised and searched at a time (kNN)
    mi_neighbours: int = 3  # k of the nearest-neighbour mutual-information estimate
    compare_untrained: bool = False  # also kNN and probe an untrained copy (the floor)
    # models with CLIP's text tower: retrieval and zero-shot classification
    retrieval_shards: str = ""  # held-out caption shards for retrieval; "" = test_shards
    recall_ks: list[int] = field(default_factory=lambda: [1, 5, 10])  # K of recall@K
    zero_shot_templates: list[str] = field(default_factory=lambda: [PROMPT])  # "{}": class
    text_batch_size: int = 256  # captions per text-tower batch
    output: str = ""  # report directory; "" = <run_dir>/eval

    @property
    def block_bytes(self) -> int:
        """``block_mib`` in bytes."""
        return self.block_mib * 2**20

    @property
    def bank_block_bytes(self) -> int:
        """``bank_block_mib`` in bytes."""
        return self.bank_block_mib * 2**20

    def validate(self) -> None:
        if not self.ks or min(self.ks) < 1:
            raise InvalidValue("ks", f"need positive neighbour counts, got {self.ks}")
        if self.knn_temperature <= 0:
            raise InvalidValue("knn_temperature", "must be > 0")
        if not self.recall_ks or min(self.recall_ks) < 1:
            raise InvalidValue("recall_ks", f"need positive K values, got {self.recall_ks}")
        for template in self.zero_shot_templates:
            if template.count("{}") != 1:
                raise InvalidValue("zero_shot_templates", f"{template!r} needs exactly one "
                                   "'{}' for the class name")
        if not self.zero_shot_templates:
            raise InvalidValue("zero_shot_templates", "need at least one prompt template")
        for key in ("batch_size", "probe_epochs", "samples_per_class", "mi_neighbours",
                    "promote_k", "text_batch_size", "block_mib", "bank_block_mib"):
            if getattr(self, key) < 1:
                raise InvalidValue(key, f"must be >= 1, got {getattr(self, key)}")
        if self.promote_k not in self.ks:
            raise InvalidValue("promote_k", f"{self.promote_k} is not one of ks={self.ks}")
