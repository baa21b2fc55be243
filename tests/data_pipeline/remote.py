"""A real ``python -m http.server`` on 127.0.0.1 that tests stop and restart, and shards in
img2dataset's layout."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from webdataset import TarWriter

from tests.data_pipeline.helpers import digit_jpeg
from tests.ports import free_port


class ShardServer:
    """Serves ``directory`` at ``url``; ``stop``/``start`` kill and restart it (same port);
    ``requests()`` lists the paths asked for so far (http.server's access log)."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.port = directory, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile(prefix="http-server-", suffix=".log")

    def start(self) -> ShardServer:
        self.process = subprocess.Popen(
            [sys.executable, "-u", "-m", "http.server", str(self.port), "--bind", "127.0.0.1",
             "--directory", str(self.directory)],
            stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(self.url, timeout=1).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"http.server on {self.url} did not start")

    def requests(self) -> list[str]:
        """The path of every GET so far, in order (the probes of ``start`` included)."""
        return re.findall(r'"GET (\S+) HTTP', Path(self.log.name).read_text())

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


def img2dataset_shards(directory: Path, shards: int, per_shard: int, seed: int = 0,
                       failed: int = 2) -> list[str]:
    """Shards as img2dataset writes them: ``{shard:05d}.tar`` with 7-digit keys (shard
    number then index), members ``.jpg``/``.txt``/``.json`` per sample, samples in
    completion order (not key order), ``failed`` samples per shard absent, and
    ``{shard:05d}_stats.json``. Returns the keys written."""
    directory.mkdir(parents=True, exist_ok=True)
    rng, keys = random.Random(seed), []
    for shard in range(shards):
        indices = list(range(per_shard + failed))
        rng.shuffle(indices)
        present = indices[failed:]  # the first `failed` (in completion order) are absent
        with open(directory / f"{shard:05d}.tar", "wb") as handle, TarWriter(
                handle, encoder=False) as writer:
            for index in present:
                key = f"{shard:02d}{index:05d}"
                digit = shard * 100 + index
                writer.write({"__key__": key, "jpg": digit_jpeg(digit),
                              "txt": f"a photo of a handwritten {digit % 10}".encode(),
                              "json": json.dumps({"key": key, "status": "success"}).encode()})
                keys.append(key)
        (directory / f"{shard:05d}_stats.json").write_text(json.dumps({
            "count": per_shard + failed, "successes": per_shard, "failed_to_download": failed,
            "failed_to_resize": 0}))
    return keys
