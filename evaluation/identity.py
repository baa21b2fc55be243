"""What an evaluation artifact was computed from, as digests: a saved index is reused only
when the model (its weights), the bank (its shards' manifest checksums and the view
resolution), the feature space and the index settings are all the same."""

from __future__ import annotations

import hashlib
import json

import torch
from torch import nn

from data_pipeline.manifest import Manifest
from data_pipeline.shards import ShardSet, is_folder


def model_digest(model: nn.Module) -> str:
    """SHA-256 of every parameter and buffer (names, dtypes, shapes and bytes)."""
    sha = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        value = tensor.detach().cpu().contiguous()
        sha.update(f"{name}|{value.dtype}|{tuple(value.shape)}|".encode())
        sha.update(value.flatten().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def bank_digest(shards: str, resolution: int) -> str:
    """SHA-256 of the shards' manifest entries (name, samples, sha256), class names and
    the evaluation view's resolution; a shard list without a manifest beside it counts
    by its URLs and sample counts."""
    if is_folder(shards):
        manifest = Manifest.read(shards)
        entries = [(s.name, s.samples, s.sha256) for s in manifest.shards]
        classes = manifest.class_names
    else:
        listed = ShardSet.open(shards)
        entries = [[url, count] for url, count in zip(listed.urls, listed.counts, strict=True)]
        classes = listed.class_names
    record = {"shards": entries, "classes": classes, "resolution": resolution}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def index_key(model: str, bank: str, space: str, settings: dict) -> str:
    """The name suffix of a saved index: 16 hex digits over everything it depends on."""
    record = json.dumps({"model": model, "bank": bank, "space": space, **settings},
                        sort_keys=True)
    return hashlib.sha256(record.encode()).hexdigest()[:16]
