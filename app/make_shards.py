"""``make-shards``: write WebDataset shards and their manifest.

    make-shards --config launch/configs/demo.yaml
    make-shards shards.source=captions shards.input=cc3m.tsv shards.output=data/shards/cc3m \
        shards.caption_column=0 shards.image_column=1 shards.has_header=false
"""

from __future__ import annotations

from collections.abc import Sequence

from app.run_config import parse_run
from core.cli import reported_faults
from data_pipeline.make_shards import make_shards


def main(argv: Sequence[str] | None = None) -> None:
    config, _ = parse_run("make-shards", __doc__, argv)
    with reported_faults("make-shards"):
        manifest = make_shards(config.shards)
    print(f"make-shards: {manifest.total_samples} samples in {len(manifest.shards)} shards "
          f"under {config.shards.output}; skipped {manifest.skipped or 'none'}")


if __name__ == "__main__":
    main()
