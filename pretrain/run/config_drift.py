"""Configuration drift on resume: what changed between the configuration a checkpoint
recorded and this run's, and whether the run may go on.

Keys that alter what is trained (``objective.*``, ``model.*``, ``seed``, ``data.*`` but
its operational keys, and ``optim.layer_decay``, which shapes the optimizer's groups)
refuse a resume unless ``checkpoint.allow_changes`` names them (a key, a prefix ending in
".", or "*"); every other change (learning rate, epochs, logging, workers, ...) is listed
in one warning, and MLflow records each changed param as a ``changed.<key>`` tag
(:mod:`pretrain.run.tracking`). A key one side lacks (added or removed by another version of
this code, whose default kept the old behaviour) is listed, never refused.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import yaml

from core.config import flatten
from core.errors import RunError

log = logging.getLogger(__name__)

# optim.layer_decay: the optimizer's groups, which its saved state must match
TRAINED = ("objective.", "model.", "data.", "seed", "optim.layer_decay")
# data keys that change how samples are read, not which samples or views are trained on
DATA_OPERATIONAL = {"workers", "prefetch", "persistent_workers", "pin_memory", "retries",
                    "retry_wait", "verify_checksums", "max_skip_fraction", "max_image_pixels",
                    "batch_size", "global_batch", "global_batch_size", "ledger"}
# batch_size, global_batch: a resume keeps its position in samples; global_batch_size:
# the global batch the checkpoints record is kept


class _Absent:
    def __repr__(self) -> str:
        return "(absent)"

    __str__ = __repr__


ABSENT = _Absent()  # the value of a key one configuration does not have


def config_changes(recorded_yaml: str, current_yaml: str) -> dict[str, tuple[Any, Any]]:
    """``{key: (recorded, current)}`` for every key whose value differs between the
    configuration a checkpoint recorded and this run's (both resolved YAML); a key one of
    them lacks has :data:`ABSENT` there."""
    recorded = flatten(yaml.safe_load(recorded_yaml) or {})
    current = flatten(yaml.safe_load(current_yaml) or {})
    return {key: (recorded.get(key, ABSENT), current.get(key, ABSENT))
            for key in sorted(recorded.keys() | current.keys())
            if recorded.get(key, ABSENT) != current.get(key, ABSENT)}


def unfit_checkpoint(path: Path, recorded_yaml: str, current_yaml: str,
                     err: Exception) -> RunError:
    """The one-line fault of a checkpoint whose tensors do not fit the configured model:
    the model and objective keys that differ (what shapes the tensors), else every key."""
    changes = config_changes(recorded_yaml, current_yaml) if recorded_yaml else {}
    shaping = {k: v for k, v in changes.items() if k.startswith(("model.", "objective."))}
    named = ", ".join(f"{k}={old} in the checkpoint, {new} here"
                      for k, (old, new) in (shaping or changes).items())
    first = next((line.strip() for line in str(err).splitlines() if "size mismatch" in line
                  or "Missing key" in line or "Unexpected key" in line), str(err)[:200])
    return RunError(f"{path}: its tensors do not fit the configured model ({first}); "
                    f"{named or 'it records no configuration to compare with'}: resume with "
                    "the checkpoint's values, or choose another name or output_dir (the "
                    "checkpoint is kept)")


def alters_training(key: str) -> bool:
    if key.startswith("data."):
        return key.split(".", 1)[1] not in DATA_OPERATIONAL
    return key.startswith(TRAINED)


def allowed(key: str, allow: list[str]) -> bool:
    return any(a == "*" or a == key or (a.endswith(".") and key.startswith(a)) for a in allow)


def check_drift(path: Path, recorded_yaml: str, current_yaml: str, allow: list[str]) -> None:
    """Refuse (:class:`RunError`) a resume that changes a trained key not in ``allow``;
    log the other changes in one warning."""
    if not recorded_yaml:
        return
    changes = config_changes(recorded_yaml, current_yaml)
    refused = {k: v for k, v in changes.items()
               if alters_training(k) and not allowed(k, allow) and ABSENT not in v}
    if refused:
        named = ", ".join(f"{k}={old} in the checkpoint, {new} here"
                          for k, (old, new) in refused.items())
        raise RunError(f"{path}: resuming would change what is trained ({named}): resume "
                       "with the checkpoint's values, allow the change with "
                       f"checkpoint.allow_changes=[{','.join(refused)}], or choose another "
                       "name or output_dir (the checkpoint is kept)")
    if changes:
        log.warning("resuming %s with %d changed keys: %s", path, len(changes),
                    ", ".join(f"{k}: {old} -> {new}" for k, (old, new) in changes.items()))
