"""Power-law fits of a cost against a size, and their extrapolation to a target size."""

from __future__ import annotations

import numpy as np


def exponent(sizes: list[float], costs: list[float]) -> float:
    """The slope of log(cost) against log(size): 1 is linear, 0 constant."""
    return float(np.polyfit(np.log(sizes), np.log(costs), 1)[0])


def extrapolate(size: float, cost: float, slope: float, target: float, time: bool) -> float:
    """``cost`` at ``size`` carried to ``target`` along the fitted power law; a time is
    carried at least linearly (a fit below 1 reflects start-up costs being amortised, not
    per-item work getting cheaper)."""
    return cost * (target / size) ** (max(slope, 1.0) if time else slope)
