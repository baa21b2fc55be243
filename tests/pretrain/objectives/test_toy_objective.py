"""A new objective is three pieces: its loss file, its table entry, its docs row. A toy
(DCL: ``toy_decoupled.py``, ``toy_entry.py``, ``toy_docs.md``) in those three pieces,
added to the table, runs through every test matrix with no test edited; with its
production path broken, the matrices fail it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from pretrain.objectives import OBJECTIVES
from tests.objective_cases import EXTRA_ENTRIES

TOY_DOCS = Path(__file__).parent / "toy_docs.md"
# every matrix an objective goes through: file -> the tests of it the toy must appear in
MATRICES = {
    "tests/pretrain/objectives/test_plain_forms.py": "plain against fused, dense and tiled",
    "tests/pretrain/objectives/test_tiles.py": "tiled against dense, no [n, N] tensor",
    "tests/pretrain/objectives/test_partition.py": "rank slices against the whole batch",
    "tests/pretrain/objectives/test_precision.py": "bf16 autocast at tau 0.01",
    "tests/pretrain/distributed/test_global_batch.py": "two gloo ranks against one",
    "tests/pretrain/distributed/test_engine.py": "every engine, two ranks against one",
    "tests/pretrain/loop/test_chunked.py": "chunks against the whole batch",
    "tests/pretrain/loop/test_host_reads.py": "no host reads, DDP and FSDP2",
    "tests/pretrain/loop/test_cuda_dry_run.py": "every tensor on the CUDA device",
}


def run_matrices(tmp_path: Path, files: list[str], **env: str) -> dict[str, list[str]]:
    """The matrices' tests of the toy objective, run in a fresh pytest with the toy's entry
    added to the table: {file: outcomes}."""
    report = tmp_path / "report.xml"
    environment = {**os.environ, EXTRA_ENTRIES: "tests.pretrain.objectives.toy_entry", **env}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly",
                    "-p", "no:cacheprovider", "-k", "decoupled", f"--junitxml={report}",
                    *files], env=environment, capture_output=True, check=False)
    outcomes: dict[str, list[str]] = {file: [] for file in files}
    for case in ET.parse(report).getroot().iter("testcase"):
        file = case.get("classname").replace(".", "/") + ".py"
        failed = case.find("failure") is not None or case.find("error") is not None
        outcomes[file].append("failed" if failed else "passed")
    return outcomes


def test_a_toy_objective_in_three_pieces_runs_through_every_matrix(tmp_path):
    assert "decoupled" not in OBJECTIVES  # the suite's own table is untouched
    outcomes = run_matrices(tmp_path, list(MATRICES))
    for file, what in MATRICES.items():
        assert outcomes[file], f"{file} ({what}) never ran the toy objective"
        assert set(outcomes[file]) == {"passed"}, f"{file} ({what}): {outcomes[file]}"


def test_the_matrices_fail_the_toy_when_its_production_path_is_off(tmp_path):
    files = ["tests/pretrain/objectives/test_plain_forms.py",
             "tests/pretrain/objectives/test_partition.py"]
    outcomes = run_matrices(tmp_path, files, TOY_BROKEN="1")
    assert set(outcomes[files[0]]) == {"failed"}  # 1 % off its plain form
    assert outcomes[files[1]] and set(outcomes[files[1]]) == {"passed"}  # consistent across ranks


def test_the_toy_docs_section_is_a_row_of_the_objectives_table():
    row = TOY_DOCS.read_text().strip()
    assert re.fullmatch(r"\| `decoupled` \| [^|]+ \| [^|]+ \|", row)


def test_every_objective_has_its_row_in_the_docs():
    text = Path("docs/objectives.md").read_text()
    missing = [name for name in OBJECTIVES if f"| `{name}` |" not in text]
    assert not missing, f"docs/objectives.md has no row for {missing}"
