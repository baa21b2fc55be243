"""Full-disk faults recognised through the wrappers libraries put around them, and turned
into one line by the entry points."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from core.cli import reported_faults
from core.errors import RunError, disk_full, error_chain, free_space, full_disk_stops


def wrapped(inner: BaseException) -> RuntimeError:
    """``inner`` raised inside another error, as torch.save and SQLAlchemy do."""
    try:
        try:
            raise inner
        except BaseException:
            raise RuntimeError("[enforce fail at inline_container.cc:671] . unexpected pos")  # noqa: B904 (an implicit context, as torch raises it)
    except RuntimeError as outer:
        return outer


def test_a_full_disk_is_recognised_through_wrappers():
    assert disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert disk_full(wrapped(OSError(errno.ENOSPC, "No space left on device")))
    assert disk_full(Exception("(sqlite3.OperationalError) database or disk is full"))
    assert not disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not disk_full(wrapped(ValueError("bad value")))


def test_free_space_reads_local_paths_and_local_uris(tmp_path):
    assert free_space(tmp_path).endswith(" MiB free")
    assert free_space(f"sqlite:///{tmp_path / 'missing' / 'mlflow.db'}").endswith(" MiB free")
    assert free_space("http://127.0.0.1:5000") == ""


def test_full_disk_stops_names_the_key_and_passes_other_errors(tmp_path):
    with pytest.raises(RunError) as raised, \
            full_disk_stops("the report", tmp_path / "r.md", "eval.output", "nothing lost"):
        raise wrapped(OSError(errno.ENOSPC, "No space left on device"))
    assert str(raised.value).startswith(f"no space left on device writing the report "
                                        f"{tmp_path / 'r.md'} (")
    assert str(raised.value).endswith(": free space there or set eval.output to another "
                                      "disk; nothing lost")
    with pytest.raises(ValueError), full_disk_stops("x", tmp_path, "k", ""):
        raise ValueError("not a disk")


def test_an_unplaced_full_disk_is_one_line_and_status_1(tmp_path, capsys):
    path = tmp_path / "plot.png"
    with pytest.raises(SystemExit) as exit_info, reported_faults("evaluate"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"evaluate: error: no space left on device writing {path} "
                          "(OSError: [Errno 28] No space left on device: "), err
    with pytest.raises(KeyError), reported_faults("evaluate"):  # other bugs keep tracebacks
        raise KeyError("x")


def test_first_line_is_a_short_cause_even_of_an_empty_message():
    from core.errors import first_line

    assert first_line(ValueError("bad value\ntraceback text")) == "bad value"
    assert first_line(RuntimeError("x" * 500), 160) == "x" * 160
    assert first_line(OSError()) == "OSError"  # str() is empty: splitlines()[0] would raise
    assert first_line("from a message\nmore") == "from a message"


def test_the_error_chain_follows_causes_and_contexts_once_each():
    inner, outer = KeyboardInterrupt(), RuntimeError("unexpected pos")
    outer.__context__ = inner
    inner.__context__ = outer  # a cycle ends the walk instead of looping
    assert list(error_chain(outer)) == [outer, inner]


def test_free_space_of_a_path_removed_while_asked_reads_its_parent(tmp_path, monkeypatch):
    """Another rank may remove a partial checkpoint between a check and the question: the
    figure comes from the nearest parent still there (it was lost, and the checkpoint
    fault's message with it, on a 2-rank full-disk test)."""
    import shutil

    from core import errors

    partial, real = tmp_path / "partial", shutil.disk_usage
    partial.mkdir()

    def removed_meanwhile(path):
        if str(path) == str(partial):
            raise FileNotFoundError(path)
        return real(path)

    monkeypatch.setattr(errors.shutil, "disk_usage", removed_meanwhile)
    assert free_space(partial).endswith(" MiB free")


def test_a_crash_in_native_code_prints_the_python_stack():
    """A segfault inside an entry point's ``reported_faults`` (a fresh interpreter, no
    PYTHONFAULTHANDLER) leaves the Python stack on stderr, where torchrun would report
    only signal 11."""
    code = ("import ctypes\nfrom core.cli import reported_faults\n"
            "with reported_faults('pretrain'):\n    ctypes.string_at(0)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    result = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGSEGV
    assert "Segmentation fault" in result.stderr and 'File "<string>", line 4' in result.stderr
