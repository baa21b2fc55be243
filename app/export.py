"""``export``: an encoder in a format other libraries load (``docs/export.md``).

    export export.model=runs/demo/checkpoints/step_00000100 export.format=onnx \
        export.output=exported/demo-onnx
    export --config launch/configs/demo.yaml export.model=models:/cluttered-encoder/1 \
        export.format=onnx export.output=exported/demo-onnx --log-artifact
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from app.run_config import parse_run
from core.cli import reported_faults
from core.config import from_dict
from evaluation.load import load_encoder
from pretrain.model.encoder import ModelConfig
from pretrain.run.tracking import tracking_uri
from registry.evaluation_record import read_evaluation
from serving.export import Exported, chosen_space, export, log_export


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-artifact", action="store_true",
                        help="attach the exported folder to the encoder's MLflow run and "
                             "link it from the registered version's model card")


def main(argv: Sequence[str] | None = None) -> None:
    config, args = parse_run("export", __doc__, argv, add_arguments)
    cfg = config.export
    with reported_faults("export"):
        run_dir = Path(config.output_dir) / config.name
        uri = tracking_uri(config.tracking, run_dir)
        loaded = load_encoder(cfg.model, run_dir, uri, key="export.model")
        model_cfg = from_dict(ModelConfig, loaded.tree.get("model", {}), prefix="model.")
        evaluation = read_evaluation(loaded.ref, uri)
        out = export(Exported(loaded.model.eval(), model_cfg, loaded.tree, cfg.model,
                              evaluation), cfg)
        logged = log_export(out, loaded.ref, uri, cfg.format) if args.log_artifact else None
    files = ", ".join(sorted(p.name for p in out.iterdir()))
    print(f"export: {cfg.model} as {cfg.format} ({chosen_space(cfg)}) in {out}: {files}"
          + (f"; attached as {logged}" if logged else ""))


if __name__ == "__main__":
    main()
