"""The epoch ledger (``data.ledger=true``): the samples every step of a run trained on, so
that "each sample once per epoch" can be audited on a real job, not only argued from the
loader's plan.

Each rank of each attempt (a launch, or a restart by torchrun) appends JSON lines to
``<run_dir>/ledger/<attempt>-rank<r>.jsonl``; ``attempt`` is the attempt's start time in
milliseconds and torchrun's restart count, both rank 0's and shared by every rank, so the
file names sort in the order the attempts ran:

    {"resumed_from": s, "world": w, "rank": r}        first: the step it starts from (0: new)
    {"epoch": e, "step": s, "world": w, "rank": r, "keys": [...], "skipped": [...]}
    {"checkpoint": s}                                   a checkpoint of step s is complete

One step line per step (``step`` counts from 1): ``keys`` are the ``__key__`` of every
sample this rank's batch trained on (a ``pairing=same_label`` instance as ``head+partner``),
``skipped`` the samples the loader skipped while making it (``reason``, ``shard``,
``detail``, ``count``). A step whose update was dropped (a non-finite loss, or a rank with
nothing but skipped samples) lists its keys under ``dropped`` instead. Lines are buffered
and appended at every report and before every checkpoint (the update flags stay on the
device until then: no host read per step), never fsynced: a killed process loses only
lines after its last checkpoint, which the next attempt trains again.

Reading (:func:`epoch_counts`, ``python -m data_pipeline.loader.ledger RUN_DIR [--json
[--keys]]``): the attempts in order, each one's ``resumed_from`` superseding the earlier
attempts' lines of later steps; the steps after the last attempt's newest checkpoint are
not committed and not counted. Every key read is judged against the keys the shards hold,
read from the shards themselves. Per epoch: ``total`` keys in the shards, ``once``,
``more_than_once`` and ``unread`` (never trained on) by key, ``skipped`` (the loader's
count), and ``unknown``: reads of keys the shards do not hold, each named with its ledger
file and line (the command then exits 2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import zlib
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
import yaml
from tqdm import tqdm

from data_pipeline.loader.ledger_buckets import SHARD_KEY, EpochCount, bucket_line, tally_bucket

LEDGER_DIR = "ledger"
KEYS_IN_MEMORY = 1 << 20  # the reader tallies at most about this many keys at a time


def attempt_name(start_ms: int, restart: int) -> str:
    """``<start ms>-r<torchrun's restart count>``, both rank 0's (an agent that joins a
    running job counts its restarts from 0): sorts in the order attempts ran."""
    return f"{start_ms:014d}-r{restart:03d}"


def restart_count() -> int:
    """This agent's torchrun restart count (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


@dataclass
class PendingStep:
    """A step line waiting for its update flag (on the device until the next flush)."""

    line: dict[str, Any]
    applied: torch.Tensor


class LedgerWriter:
    """This rank's ledger of one attempt (see the module's docstring)."""

    def __init__(self, run_dir: Path, attempt: str, rank: int, world: int) -> None:
        self.path = run_dir / LEDGER_DIR / f"{attempt}-rank{rank}.jsonl"
        self.rank, self.world = rank, world
        self.file: TextIO | None = None
        self.pending: list[PendingStep] = []
        self.committed = -1  # the newest checkpoint step written

    def start(self, resumed_from: int) -> None:
        """Open the file and write the attempt's first line."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (kept open)
        self.committed = resumed_from
        self._append([{"resumed_from": resumed_from, "world": self.world, "rank": self.rank}])

    def record(self, epoch: int, step: int, batch: dict[str, Any],
               applied: torch.Tensor) -> None:
        """Step ``step`` (counted from 1) of ``epoch`` trained on ``batch`` if ``applied``
        ([] bool, on the device) is true."""
        skipped = [{"reason": reason, "shard": shard, "detail": detail, "count": count}
                   for (reason, shard, detail), count in batch.get("skipped_samples", [])]
        line = {"epoch": epoch, "step": step, "world": self.world, "rank": self.rank,
                "keys": list(batch["keys"]), "skipped": skipped}
        self.pending.append(PendingStep(line, applied.detach().reshape(())))

    def flush(self) -> None:
        """Append the buffered step lines (one host read of their update flags)."""
        if not self.pending:
            return
        flags = torch.stack([p.applied for p in self.pending]).cpu().tolist()
        lines = []
        for pending, applied in zip(self.pending, flags, strict=True):
            line = pending.line
            if not applied:
                line["dropped"] = line.pop("keys")
                line["keys"] = []
            lines.append(line)
        self.pending = []
        self._append(lines)

    def commit(self, step: int) -> None:
        """The checkpoint of ``step`` is complete: the steps up to it are committed."""
        if step <= self.committed:
            return
        self.flush()
        self._append([{"checkpoint": step}])
        self.committed = step

    def close(self) -> None:
        """Append what is buffered and close. After a failed step the device may not
        answer: those lines are dropped (they follow the last checkpoint, so they are not
        committed in any case)."""
        if self.file is None:
            return
        try:
            self.flush()
        except RuntimeError:
            self.pending = []
        self.file.close()
        self.file = None

    def _append(self, lines: list[dict[str, Any]]) -> None:
        assert self.file is not None, "LedgerWriter.start first"
        self.file.write("".join(json.dumps(line, separators=(",", ":")) + "\n"
                                for line in lines))
        self.file.flush()


# -- reading ------------------------------------------------------------------------------

@dataclass
class Attempt:
    """One attempt's files (all its ranks) and what bounds its steps: the step it resumed
    from, the checkpoints it completed, and how many keys its step lines hold."""

    files: list[Path] = field(default_factory=list)
    resumed_from: int = 0
    checkpoints: list[int] = field(default_factory=list)
    keys: int = 0

    def step_lines(self) -> Iterator[dict[str, Any]]:
        """The step lines of every rank, one at a time (a line cut short by a killed
        process, the last of its file, is left out)."""
        for path in self.files:
            with path.open(encoding="utf-8") as lines:
                for number, text in enumerate(lines, start=1):
                    try:
                        line = json.loads(text)
                    except json.JSONDecodeError:
                        continue  # the torn last line of a killed process
                    if "step" in line:
                        yield {**line, "where": f"{path.name} line {number}"}


def read_attempts(run_dir: Path) -> list[Attempt]:
    """Every attempt, in the order the attempts ran, without its keys."""
    files = sorted((run_dir / LEDGER_DIR).glob("*-rank*.jsonl"))
    if not files:
        raise FileNotFoundError(f"{run_dir / LEDGER_DIR}: no ledger (train with data.ledger=true)")
    attempts: dict[str, Attempt] = defaultdict(Attempt)
    for path in files:
        attempt = attempts[path.name.rsplit("-rank", 1)[0]]
        attempt.files.append(path)
        with path.open(encoding="utf-8") as lines:
            for number, text in enumerate(lines):
                try:
                    line = json.loads(text)
                except json.JSONDecodeError:
                    continue
                if "resumed_from" in line:
                    if number == 0:
                        attempt.resumed_from = int(line["resumed_from"])
                elif "checkpoint" in line:
                    attempt.checkpoints.append(int(line["checkpoint"]))
                else:
                    attempt.keys += len(line.get("keys", []))
    return [attempts[name] for name in sorted(attempts)]


def committed_steps(attempts: list[Attempt]) -> Iterator[dict[str, Any]]:
    """The step lines that stand: each attempt supersedes the earlier ones' steps after the
    one it resumed from; the last attempt's steps after its newest checkpoint (or the step
    it resumed from) are not committed."""
    if not attempts:
        return
    limit = max([attempts[-1].resumed_from, *attempts[-1].checkpoints])
    for i, attempt in enumerate(attempts):
        last = min([later.resumed_from for later in attempts[i + 1:]] + [limit])
        yield from (line for line in attempt.step_lines() if line["step"] <= last)


def epoch_counts(run_dir: Path, shard_keys: Sequence[str],
                 keep_keys: bool = False) -> dict[int, EpochCount]:
    """Per epoch, how the samples ``shard_keys`` names were trained on."""
    return counts_of(read_attempts(run_dir), iter(shard_keys), len(shard_keys), keep_keys)


def counts_of(attempts: list[Attempt], shard_keys: Iterator[str], total: int,
              keep_keys: bool = False) -> dict[int, EpochCount]:
    """Each (epoch, key) read, and each key the shards hold (``total`` of them, streamed
    from ``shard_keys``), is spilled to one of enough bucket files (by the key's hash)
    that a bucket holds at most about :data:`KEYS_IN_MEMORY` keys; the buckets are then
    tallied one at a time, each read judged against the shard keys of its bucket. Memory
    stays flat in samples x epochs (but for the key lists ``keep_keys`` asks for)."""
    reads = sum(a.keys for a in attempts)
    buckets = max(1, -(-(reads + total) // KEYS_IN_MEMORY))
    counts: dict[int, EpochCount] = {}
    with tempfile.TemporaryDirectory(prefix="ledger-") as spill:
        paths = [Path(spill) / f"{b}.txt" for b in range(buckets)]
        files = [path.open("w", encoding="utf-8", newline="\n") for path in paths]

        def write(epoch: str, key: str, where: str) -> None:
            files[zlib.crc32(key.encode()) % buckets].write(bucket_line(epoch, key, where))

        for key in shard_keys:
            write(SHARD_KEY, key, "")
        for line in committed_steps(attempts):
            epoch = int(line["epoch"])
            count = counts.setdefault(epoch, EpochCount(0))
            count.skipped += sum(int(s["count"]) for s in line.get("skipped", []))
            for key in line["keys"]:
                write(str(epoch), key.split("+")[0], line["where"])
        for file in files:
            file.close()
        for path in paths:
            tally_bucket(path, counts, keep_keys)
    return dict(sorted(counts.items()))


def shard_set_keys(run_dir: Path, shards: str | None) -> tuple[Iterator[str], int]:
    """The keys of ``shards`` (or of the shards the run's resolved ``config.yaml`` names),
    read from the shards themselves (a local tar's headers, a remote one's stream), and
    how many samples the shards hold."""
    from data_pipeline.shards import ShardSet
    from data_pipeline.tario import sample_keys

    if shards is None:
        config = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
        shards = str(config["data"]["shards"])
    shard_set = ShardSet.open(shards)
    keys = (key for url in tqdm(shard_set.urls, desc="shard keys", unit="shard",
                                disable=len(shard_set.urls) < 8)
            for key in sample_keys(url))
    return keys, shard_set.total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m data_pipeline.loader.ledger",
        description="How often each sample was trained on, per epoch, from a run's ledger.")
    parser.add_argument("run_dir", type=Path, help="the run's directory (output_dir/name)")
    parser.add_argument("--shards", help="the training shards (default: the run's config)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--keys", action="store_true",
                        help="with --json: list each epoch's unread and repeated keys")
    args = parser.parse_args(argv)
    try:
        attempts = read_attempts(args.run_dir)
        keys, total = shard_set_keys(args.run_dir, args.shards)
        counts = counts_of(attempts, keys, total, args.keys)
    except (OSError, KeyError, ValueError) as err:
        print(f"ledger: {err}", file=sys.stderr)
        return 1
    for epoch, c in counts.items():
        if c.unknown:
            print(f"ledger: epoch {epoch}: {c.unknown} reads of keys the shards do not hold, "
                  f"e.g. {', '.join(c.unknown_examples)}", file=sys.stderr)
    if args.json:
        print(json.dumps({"epochs": {str(e): {k: v for k, v in asdict(c).items()
                                               if v is not None}
                                     for e, c in counts.items()}}))
        return 2 if any(c.unknown for c in counts.values()) else 0
    print(f"{'epoch':>5} {'total':>9} {'once':>9} {'more':>6} {'unread':>9} {'skipped':>8} "
          f"{'unknown':>8}")
    for epoch, c in counts.items():
        print(f"{epoch:>5} {c.total:>9} {c.once:>9} {c.more_than_once:>6} {c.unread:>9} "
              f"{c.skipped:>8} {c.unknown:>8}")
    return 2 if any(c.unknown for c in counts.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
