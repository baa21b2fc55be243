"""The caption-embedding store: float16 rows of the distinct captions, a sorted key index
and the row of each key, all memory-mapped, so a loader worker joins a sample to its row by
``__key__`` without holding the store in memory (docs/graph.md). The pages its lookups and
row reads map are let go after every ``DROP_BYTES`` (``data_pipeline/graph/pages.py``): an
epoch's pass over the store leaves no more of it resident than a pass over a few batches.

Files: ``keys.npy`` [N] sorted fixed-width bytes, ``rows.npy`` [N] int32, ``embeddings.npy``
[U, E] float16, ``captions.jsonl`` (the U distinct captions, for inspection), ``meta.json``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from core.errors import RunError
from data_pipeline.graph import pages

FILES = ("keys.npy", "rows.npy", "embeddings.npy")
META_LIMIT = 1 << 20  # meta.json is a few hundred bytes: read no more


class StoreError(RunError, ValueError):
    """A store whose files are missing or disagree with each other."""


@dataclass
class CaptionStore:
    directory: Path
    keys: np.ndarray
    rows: np.ndarray
    embeddings: np.ndarray
    meta: dict
    looked_up: int = field(default=0, repr=False)  # bytes of key pages mapped since a drop
    paged: pages.PagedRows | None = field(default=None, repr=False)

    @classmethod
    def open(cls, directory: str | Path) -> CaptionStore:
        directory = Path(directory)
        meta_path = directory / "meta.json"
        if not meta_path.is_file():
            raise StoreError(f"{meta_path}: missing (run graph-precompute)")
        with open(meta_path, "rb") as handle:
            text = handle.read(META_LIMIT + 1)
        if len(text) > META_LIMIT:
            raise StoreError(f"{meta_path}: larger than {META_LIMIT} bytes, not a store's")
        try:
            meta = json.loads(text)
        except (ValueError, RecursionError):
            raise StoreError(f"{meta_path}: not JSON (run graph-precompute)") from None
        try:
            keys, rows, embeddings = (np.load(directory / f, mmap_mode="r") for f in FILES)
        except (OSError, ValueError) as err:
            raise StoreError(f"{directory}: unreadable store file: {err}") from None
        if len(keys) != len(rows) or len(keys) != meta["num_keys"]:
            raise StoreError(f"{directory / 'rows.npy'}: {len(rows)} rows for {len(keys)} keys "
                             f"(meta.json says {meta['num_keys']})")
        if embeddings.shape != (meta["num_unique"], meta["dim"]):
            raise StoreError(f"{directory / 'embeddings.npy'}: shape {embeddings.shape}, "
                             f"meta.json says ({meta['num_unique']}, {meta['dim']})")
        if len(rows) and int(rows.max()) >= len(embeddings):
            raise StoreError(f"{directory / 'rows.npy'}: a row beyond the "
                             f"{len(embeddings)} embeddings")
        pages.drop_pages(rows)  # the check's pass touched every row
        return cls(directory, keys, rows, embeddings, meta)

    def find(self, keys: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """([n] embedding row of each key, [n] bool found)."""
        if not len(self.keys):
            return np.full(len(keys), -1), np.zeros(len(keys), bool)
        wanted = np.array([k.encode() for k in keys], dtype=self.keys.dtype)
        pos = np.searchsorted(self.keys, wanted).clip(max=len(self.keys) - 1)
        found = self.keys[pos] == wanted
        rows = np.where(found, self.rows[pos], -1)
        # a key's binary search maps a page-fault window at each of its ~log2(N) steps
        steps = math.ceil(math.log2(len(self.keys) + 1)) + 1
        self.looked_up += len(keys) * steps * pages.FAULT_AROUND_BYTES
        if self.looked_up >= pages.DROP_BYTES:
            pages.drop_pages(self.keys, self.rows)
            self.looked_up = 0
        return rows, found

    def embedding_rows(self, rows: Iterable[int]) -> np.ndarray:
        """[n, E] float16 copy of the embedding ``rows``, read through
        :class:`~data_pipeline.graph.pages.PagedRows`."""
        if self.paged is None:
            self.paged = pages.PagedRows(self.embeddings, pages.DROP_BYTES)
        return self.paged[np.asarray(list(rows), dtype=np.int64)]

    def captions(self, rows: Iterable[int] | None = None) -> list[str]:
        """The distinct captions (all, or those of ``rows`` in that order), read line by
        line from ``captions.jsonl``: only the wanted ones are kept."""
        wanted = None if rows is None else list(rows)
        keep = None if wanted is None else set(wanted)
        found: dict[int, str] = {}
        with open(self.directory / "captions.jsonl", encoding="utf-8") as handle:
            for row, line in enumerate(handle):
                if keep is None or row in keep:
                    found[row] = json.loads(line)
        return list(found.values()) if wanted is None else [found[r] for r in wanted]
