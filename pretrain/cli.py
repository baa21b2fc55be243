"""The command line shared by every pipeline stage: ``--config FILE`` plus ``key=value``.

    pretrain --config launch/configs/demo.yaml objective.temperature=0.2
    pretrain --config launch/configs/demo.yaml --print-config
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pretrain.config import ConfigError, load_config, to_yaml
from pretrain.run_config import RunConfig


def parse_run_config(prog: str, description: str,
                     argv: Sequence[str] | None = None) -> RunConfig:
    """Parse the stage's arguments into a validated :class:`RunConfig` or exit with 2."""
    return parse_run_args(prog, description, argv)[0]


def parse_run_args(prog: str, description: str, argv: Sequence[str] | None = None,
                   add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
                   ) -> tuple[RunConfig, argparse.Namespace]:
    """Like :func:`parse_run_config`, with the stage's own options (``add_arguments``)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    if add_arguments is not None:
        add_arguments(parser)
    parser.add_argument("--config", type=Path, help="YAML file, e.g. launch/configs/demo.yaml")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved configuration as YAML and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="overrides, nested keys with dots (objective.temperature=0.2)")
    args = parser.parse_intermixed_args(argv)
    try:
        config = load_config(RunConfig, args.config, args.overrides)
    except ConfigError as err:
        parser.exit(2, f"{prog}: configuration error: {err}\n")
    if args.print_config:
        sys.stdout.write(to_yaml(config))
        parser.exit(0)
    return config, args


def stage_main(prog: str, description: str, run: Callable[[RunConfig], None] | None,
               lands_with: str = "") -> Callable[[Sequence[str] | None], None]:
    """A console entry point: parse and validate the config, then run the stage.

    A stage whose implementation has not landed yet (``run=None``) still validates and
    prints configurations, and says which issue brings it.
    """

    def main(argv: Sequence[str] | None = None) -> None:
        config = parse_run_config(prog, description, argv)
        if run is None:
            sys.exit(f"{prog}: configuration is valid; the {prog} stage itself arrives "
                     f"with {lands_with} (use --print-config to see the resolved config)")
        run(config)

    return main
