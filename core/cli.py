"""The command line every stage shares: ``--config FILE`` plus ``key=value`` overrides.

    pretrain --config launch/configs/demo.yaml objective.temperature=0.2
    pretrain --config launch/configs/demo.yaml --print-config     # the resolved values
    pretrain --help-config                                        # every key, described
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TypeVar

from core.config import ConfigError, describe, load_config, to_yaml
from core.errors import RunError, disk_full

T = TypeVar("T")

EPILOG = ("Every key, with its type, default and description: --help-config. "
          "The resolved configuration of a file plus overrides: --print-config.")


def help_config(root: type) -> str:
    """The listing ``--help-config`` prints: one line per key."""
    rows = describe(root)
    width = max(len(key) for key, *_ in rows)
    lines = []
    for key, type_name, default, text in rows:
        lines.append(f"{key:<{width}}  {text}  [{type_name}, default: {default}]")
    return "\n".join(lines) + "\n"


def parse_stage_args(root: type[T], prog: str, description: str,
                     argv: Sequence[str] | None = None,
                     add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
                     check: Callable[[T], None] | None = None) -> tuple[T, argparse.Namespace]:
    """Parse a stage's arguments into a validated ``root`` config, or exit with status 2.

    ``add_arguments`` adds the stage's own options; ``check`` raises :class:`ConfigError`
    when the stage lacks a value it needs, so that fails before any work too.
    """
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    if add_arguments is not None:
        add_arguments(parser)
    parser.add_argument("--config", type=Path, help="YAML file, e.g. launch/configs/demo.yaml")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved configuration as YAML and exit")
    parser.add_argument("--help-config", action="store_true",
                        help="list every key with its type, default and description, and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="overrides, nested keys with dots (objective.temperature=0.2)")
    args = parser.parse_intermixed_args(argv)
    if args.help_config:
        sys.stdout.write(help_config(root))
        parser.exit(0)
    try:
        config = load_config(root, args.config, args.overrides)
        if args.print_config:
            sys.stdout.write(to_yaml(config))
            parser.exit(0)
        if check is not None:
            check(config)
    except ConfigError as err:
        parser.exit(2, f"{prog}: configuration error: {err}\n")
    return config, args


def one_line(err: BaseException) -> str:
    """The message of ``err``; for an error re-raised from a DataLoader worker (whose
    message is "Caught X in DataLoader worker process N." and the worker's traceback),
    the original message from the traceback's last line."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Caught "):
        name = f"{type(err).__name__}: "
        last = lines[-1]
        return last[last.index(name) + len(name):] if name in last else last
    return " ".join(lines)


@contextmanager
def reported_faults(prog: str) -> Iterator[None]:
    """A :class:`RunError` inside becomes one line on stderr and exit status 1; so does a
    full disk wherever a write met it (the places that know their file raise a
    :class:`RunError` naming it and its key, :func:`core.errors.no_space`). A crash in
    native code (a segfault in a collective or a kernel) prints every thread's Python
    stack on stderr before the process dies, where torchrun would report only its signal."""
    with suppress(OSError, ValueError, AttributeError):  # stderr without a file: no stacks
        faulthandler.enable(sys.stderr)
    try:
        yield
    except RunError as err:
        sys.stderr.write(f"{prog}: error: {one_line(err)}\n")
        raise SystemExit(1) from None
    except Exception as err:
        if not disk_full(err):
            raise
        where = f" writing {err.filename}" if isinstance(err, OSError) and err.filename else ""
        sys.stderr.write(f"{prog}: error: no space left on device{where} "
                         f"({type(err).__name__}: {one_line(err)[:200]}): free space on that "
                         "disk and run the same command again; every checkpoint written so "
                         "far is kept\n")
        raise SystemExit(1) from None
