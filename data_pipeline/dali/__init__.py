"""The DALI backend of the training views (``data.backend=dali``): loader workers draw each
view's parameters without decoding (:mod:`.params`); the main process decodes and crops
with NVIDIA DALI on the run's device and applies the colour steps there (:mod:`.device`,
:mod:`.colour`)."""

from __future__ import annotations

import importlib.util

INSTALL_HINT = "dali needs NVIDIA DALI: pip install '.[dali]'"


def dali_available() -> bool:
    """Whether NVIDIA DALI is installed (found without importing it)."""
    return importlib.util.find_spec("nvidia.dali") is not None
