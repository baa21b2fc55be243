"""make-shards: round trip of every ingestion format, stable keys, resumable runs."""

from __future__ import annotations

import csv
import dataclasses
import json
import tarfile

import numpy as np
import pytest
from sklearn.datasets import load_digits

from data_pipeline.config import ShardsConfig
from data_pipeline.make_shards import make_shards
from data_pipeline.manifest import Manifest, ManifestError, file_sha256
from data_pipeline.tario import iter_shard
from tests.data_pipeline.helpers import digit_jpeg, save_image
from tests.data_pipeline.remote import img2dataset_shards


def read_all(directory):
    manifest = Manifest.read(directory)
    manifest.verify(directory, checksums=True)
    return manifest, [s for info in manifest.shards for s in iter_shard(directory / info.name)]


def test_digits_round_trip_and_resume(tmp_path):
    cfg = ShardsConfig(source="digits", output=str(tmp_path / "d"), shard_size=500, workers=2,
                       digits_size=32)
    manifest = make_shards(cfg)
    again, samples = read_all(tmp_path / "d")
    assert manifest.total_samples == 1797 == len(samples)
    assert [s.samples for s in manifest.shards] == [500, 500, 500, 297]
    keys = [s["__key__"] for s in samples]
    assert len(set(keys)) == 1797
    targets = load_digits().target
    labels = np.array([int(s["cls"]) for s in samples])
    order = [int(k.split("_")[1]) for k in keys]
    assert (labels == targets[order]).all()
    assert samples[0]["txt"].decode().startswith("a photo of the digit ")
    assert manifest.class_names[7] == "seven"
    # Interrupted run: one shard and its sidecar lost; the re-run redoes only that one, in
    # this process (one shard to write): its checksum in the manifest is the pool's.
    first = tmp_path / "d" / "shard-000001.tar"
    untouched = (tmp_path / "d" / "shard-000000.tar").stat().st_mtime_ns
    first.unlink()
    (tmp_path / "d" / "shard-000001.json").unlink()
    resumed = make_shards(cfg)
    assert resumed == manifest
    assert (tmp_path / "d" / "shard-000000.tar").stat().st_mtime_ns == untouched


def test_digit_splits_are_disjoint(tmp_path):
    train = make_shards(ShardsConfig(source="digits", output=str(tmp_path / "tr"), split="train",
                                     workers=1))
    test = make_shards(ShardsConfig(source="digits", output=str(tmp_path / "te"), split="test",
                                    workers=1))
    assert train.total_samples + test.total_samples == 1797
    train_keys = {s["__key__"] for s in read_all(tmp_path / "tr")[1]}
    test_keys = {s["__key__"] for s in read_all(tmp_path / "te")[1]}
    assert not train_keys & test_keys


def test_imagenet_tree_with_names_file_and_a_corrupt_image(tmp_path):
    root = tmp_path / "train"
    for c, wnid in enumerate(["n02", "n01", "n03"]):
        for j in range(4):
            save_image(root / wnid / f"{wnid}_{j}.JPEG", c * 4 + j)
    (root / "n01" / "broken.JPEG").write_bytes(b"\xff\xd8 not really a jpeg")
    (tmp_path / "names.txt").write_text("goldfish\ntabby cat\nbasketball\n")
    cfg = ShardsConfig(source="imagenet", input=str(root), class_names=str(tmp_path / "names.txt"),
                       output=str(tmp_path / "s"), shard_size=5, workers=2)
    manifest = make_shards(cfg)
    _, samples = read_all(tmp_path / "s")
    assert manifest.total_samples == 12 and manifest.skipped == {"corrupt_image": 1}
    by_key = {s["__key__"]: s for s in samples}
    assert int(by_key["n01_n01_0"]["cls"]) == 0  # sorted folders: n01, n02, n03
    assert int(by_key["n03_n03_2"]["cls"]) == 2
    assert by_key["n02_n02_1"]["txt"] == b"a photo of a tabby cat"
    assert manifest.class_names == ["goldfish", "tabby cat", "basketball"]


def test_imagenet_names_must_match_the_folders(tmp_path):
    save_image(tmp_path / "train" / "n01" / "a.JPEG", 0)
    (tmp_path / "names.txt").write_text("one\ntwo\n")
    cfg = ShardsConfig(source="imagenet", input=str(tmp_path / "train"),
                       class_names=str(tmp_path / "names.txt"), output=str(tmp_path / "s"))
    with pytest.raises(ValueError, match="names.txt: 2 names for 1 class folders"):
        make_shards(cfg)


@pytest.mark.parametrize("layout", ["csv_header", "tsv_cc3m"])
def test_caption_tables(tmp_path, layout):
    images = tmp_path / "images"
    rows = []
    for i in range(7):
        save_image(images / f"{i}.jpg", i)
        rows.append((f"caption number {i}", f"images/{i}.jpg"))
    rows.append(("", "images/0.jpg"))  # empty caption
    rows.append(("a caption without its image", "images/missing.jpg"))
    if layout == "csv_header":
        table = tmp_path / "cc12m.csv"
        with open(table, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["url", "image", "caption"])
            writer.writerows([("http://x", path, cap) for cap, path in rows])
        cfg = ShardsConfig(source="captions", input=str(table), output=str(tmp_path / "s"),
                           caption_column="caption", image_column="image", shard_size=3)
    else:  # CC3M order: caption, then path; no header
        table = tmp_path / "cc3m.tsv"
        table.write_text("".join(f"{cap}\t{path}\n" for cap, path in rows))
        cfg = ShardsConfig(source="captions", input=str(table), output=str(tmp_path / "s"),
                           caption_column="0", image_column="1", has_header=False, shard_size=3)
    manifest = make_shards(cfg)
    _, samples = read_all(tmp_path / "s")
    assert manifest.total_samples == 7
    assert manifest.skipped == {"bad_caption": 1, "missing_image": 1}
    rows_of = [int(s["__key__"].split("_")[1]) for s in samples]  # key row_<index>
    assert sorted(rows_of) == list(range(7)) and rows_of != sorted(rows_of)  # shuffled
    for row, sample in zip(rows_of, samples, strict=True):
        assert sample["txt"].decode() == f"caption number {row}"
        assert sample["jpg"] == (images / f"{row}.jpg").read_bytes()


def test_a_caption_table_with_a_label_column_writes_labels(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    lines = []
    for i in range(5):
        save_image(images / f"{i}.jpg", i)
        lines.append(f"caption {i}\timages/{i}.jpg\t{i % 3}\n")
    lines.append("a caption\timages/0.jpg\tcat\n")  # a label that is not a class index
    lines.append("a caption\timages/0.jpg\t3\n")  # a class index past the names
    lines.append("a short row\timages/0.jpg\n")  # no label column
    table = tmp_path / "labelled.tsv"
    table.write_text("".join(lines))
    (tmp_path / "names.txt").write_text("zero\none\ntwo\n")
    cfg = ShardsConfig(source="captions", input=str(table), output=str(tmp_path / "s"),
                       caption_column="0", image_column="1", label_column="2",
                       has_header=False, shard_size=2)
    with pytest.raises(ValueError, match="label_column needs shards.class_names"):
        make_shards(cfg)
    manifest = make_shards(dataclasses.replace(cfg, class_names=str(tmp_path / "names.txt")))
    _, samples = read_all(tmp_path / "s")
    assert manifest.total_samples == 5 and manifest.skipped == {"bad_label": 2, "bad_row": 1}
    assert manifest.class_names == ["zero", "one", "two"]
    for sample in samples:
        row = int(sample["__key__"].split("_")[1])
        assert int(sample["cls"]) == row % 3 and sample["txt"].decode() == f"caption {row}"


def test_a_caption_table_of_image_urls_is_refused_with_what_to_do(tmp_path, capsys):
    from app.make_shards import main

    table = tmp_path / "cc3m.tsv"
    table.write_text("a dog\thttps://example.com/dog.jpg\na cat\thttps://example.com/c.jpg\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["shards.source=captions", f"shards.input={table}",
              f"shards.output={tmp_path / 's'}", "shards.caption_column=0",
              "shards.image_column=1", "shards.has_header=false"])
    assert exit_info.value.code == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"make-shards: error: caption table {table}: column '1' holds URLs "
        "(https://example.com/dog.jpg); make-shards reads local images: download them with "
        "img2dataset and index its output (shards.source=img2dataset)")
    assert not (tmp_path / "s").exists()


def test_img2dataset_output_is_indexed_in_place(tmp_path):
    raw = tmp_path / "img2dataset"
    raw.mkdir()
    for shard in range(2):
        with tarfile.open(raw / f"{shard:05d}.tar", "w") as tar:
            for j in range(3):
                key = f"{shard:05d}{j:04d}"
                for ext, data in (("jpg", digit_jpeg(j)), ("txt", b"a caption"),
                                  ("json", b"{}")):
                    if shard == 1 and j == 2 and ext == "jpg":
                        continue  # a sample without its image
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    import io
                    tar.addfile(info, io.BytesIO(data))
    for shard, (download, resize) in enumerate([(2, 0), (1, 1)]):  # img2dataset's failures
        (raw / f"{shard:05d}_stats.json").write_text(json.dumps({
            "count": 3 + download + resize, "successes": 3, "failed_to_download": download,
            "failed_to_resize": resize, "status_dict": {"success": 3}}))
    before = {p.name: p.read_bytes() for p in raw.iterdir()}
    manifest = make_shards(ShardsConfig(source="img2dataset", input=str(raw),
                                        output=str(tmp_path / "index")))
    assert [s.samples for s in manifest.shards] == [3, 2]
    assert manifest.skipped == {"missing_image": 1, "failed_download": 3, "failed_resize": 1}
    assert {p.name: p.read_bytes() for p in raw.iterdir()} == before  # never rewritten
    links = sorted((tmp_path / "index").glob("*.tar"))  # the tars, linked: never copied
    assert [p.name for p in links] == ["00000.tar", "00001.tar"]
    assert all(p.is_symlink() and p.resolve().parent == raw.resolve() for p in links)
    assert [s.name for s in manifest.shards] == ["00000.tar", "00001.tar"]  # plain names
    Manifest.read(tmp_path / "index").verify(tmp_path / "index", checksums=True)


def test_manifest_mismatch_names_the_shard(tmp_path):
    make_shards(ShardsConfig(source="digits", output=str(tmp_path / "d"), shard_size=1000,
                             workers=1))
    manifest = Manifest.read(tmp_path / "d")
    shard = tmp_path / "d" / manifest.shards[1].name
    shard.write_bytes(shard.read_bytes()[:-512])
    with pytest.raises(ManifestError, match="shard-000001.tar: .* bytes, the manifest says"):
        manifest.verify(tmp_path / "d")
    shard.unlink()
    with pytest.raises(ManifestError, match="shard-000001.tar: listed in .* but missing"):
        manifest.verify(tmp_path / "d")


def test_img2dataset_indexing_in_parallel_equals_one_process_and_hashes_every_byte(tmp_path):
    """Indexing counts and checksums each tar in one read, ``shards.workers`` tars at a
    time; a tar cut mid-member is counted up to the cut and its checksum is the file's."""
    raw = tmp_path / "img2dataset"
    img2dataset_shards(raw, shards=5, per_shard=6)
    cut = raw / "00003.tar"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    manifests = [make_shards(ShardsConfig(source="img2dataset", input=str(raw), workers=w,
                                          output=str(tmp_path / f"index{w}")))
                 for w in (1, 2)]
    assert manifests[0].shards == manifests[1].shards
    assert manifests[0].skipped == manifests[1].skipped
    assert manifests[0].skipped["truncated_shard"] == 1
    for shard in manifests[1].shards:
        assert shard.sha256 == file_sha256(raw / shard.name)
    counts = [s.samples for s in manifests[1].shards]
    assert counts[:3] + counts[4:] == [6] * 4 and 0 < counts[3] < 6
