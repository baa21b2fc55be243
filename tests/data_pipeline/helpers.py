"""Real JPEGs of the bundled digits and small shard sets with planted bad samples."""

from __future__ import annotations

import io
from pathlib import Path

import psutil
from PIL import Image

from data_pipeline.digits import DigitsSource
from data_pipeline.formats import Sample
from data_pipeline.manifest import Manifest, ShardInfo, file_sha256
from data_pipeline.tario import write_shard

_DIGITS = DigitsSource(size=24)


def digit_sample(i: int, key: str | None = None, label: int | None = None,
                 caption: str | None = "auto") -> Sample:
    base = _DIGITS.load(i % len(_DIGITS))
    return Sample(key=key or f"s{i:05d}", image=base.image, ext="jpg",
                  label=base.label if label is None else label,
                  caption=base.caption if caption == "auto" else caption)


def digit_jpeg(i: int) -> bytes:
    return _DIGITS.load(i % len(_DIGITS)).image


def write_set(directory: Path, shards: list[list[Sample]], class_names: list[str] | None = None,
              ) -> Manifest:
    """Write ``shards`` as tar files plus a manifest under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    infos = []
    for index, samples in enumerate(shards):
        path = directory / f"shard-{index:06d}.tar"
        count = write_shard(path, samples)
        infos.append(ShardInfo(path.name, count, path.stat().st_size, file_sha256(path)))
    manifest = Manifest("test", infos, class_names or [str(c) for c in range(10)])
    manifest.write(directory)
    return manifest


def uneven_set(directory: Path, sizes: list[int]) -> Manifest:
    start, shards = 0, []
    for size in sizes:
        shards.append([digit_sample(i) for i in range(start, start + size)])
        start += size
    return write_set(directory, shards)


def save_image(path: Path, i: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.open(io.BytesIO(digit_jpeg(i))).save(path)


def refresh_manifest(directory: Path) -> None:
    """Make the manifest agree with shard files changed on disk (sizes and checksums), as
    a manifest written after the damage would."""
    manifest = Manifest.read(directory)
    for info in manifest.shards:
        info.bytes = (directory / info.name).stat().st_size
        info.sha256 = file_sha256(directory / info.name)
    manifest.write(directory)


def cut_inside_header(path: Path, member: str) -> None:
    """Truncate the tar at ``path`` 100 bytes into ``member``'s header."""
    import tarfile

    with tarfile.open(path) as tar:
        header = next(m.offset for m in tar.getmembers() if m.name == member)
    path.write_bytes(path.read_bytes()[: header + 100])


def live_loader_workers() -> list[psutil.Process]:
    """This process's DataLoader workers still running (a forkserver's children included)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.name() == "pt_data_worker" and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def webdataset_keys(shards: Path) -> list[str]:
    """The keys of a shard folder as webdataset itself reads them (independent of the
    project's readers)."""
    import webdataset as wds

    return [sample["__key__"] for tar in sorted(shards.glob("*.tar"))
            for sample in wds.WebDataset(str(tar), shardshuffle=False, empty_check=False)]


def ledger_keys_by_epoch(run_dir: Path) -> dict[int, set[str]]:
    """Every key any step line of the run's ledger names (trained or dropped, committed or
    superseded), per epoch, read from the JSON lines directly."""
    import json

    named: dict[int, set[str]] = {}
    for path in (run_dir / "ledger").glob("*.jsonl"):
        for text in path.read_text().splitlines():
            try:
                line = json.loads(text)
            except ValueError:
                continue  # a torn last line
            if "step" in line:
                named.setdefault(int(line["epoch"]), set()).update(
                    key.split("+")[0] for key in [*line["keys"], *line.get("dropped", [])])
    return named


def assert_ledger_by_keys(epochs: dict[str, dict], run_dir: Path, shards: Path,
                          full: int) -> None:
    """The ledger command's ``--json --keys`` answer ``epochs`` checked against the shards'
    own keys: no epoch reads a key the shards do not hold, every key any ledger line names
    is the shards', and in each of the first ``full`` epochs nothing is read twice and the
    keys trained on once are exactly the shards' keys less the unread ones listed."""
    keys = set(webdataset_keys(shards))
    named = ledger_keys_by_epoch(run_dir)
    for epoch, count in epochs.items():
        assert count["unknown"] == 0 and count["total"] == len(keys), (epoch, count)
        assert named[int(epoch)] <= keys, (epoch, sorted(named[int(epoch)] - keys)[:5])
    for epoch in list(epochs)[:full]:
        count, unread = epochs[epoch], set(epochs[epoch]["unread_keys"])
        assert count["more_than_once"] == 0 and not count["more_keys"], (epoch, count)
        assert unread <= keys and count["once"] == len(keys - unread), (epoch, count["once"])
        assert keys - unread <= named[int(epoch)], epoch
