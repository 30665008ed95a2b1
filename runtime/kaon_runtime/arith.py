"""Integer arithmetic the engine writes in many places: how many blocks, shards or words a length needs."""
from __future__ import annotations


def ceil_div(n, d):
    """The smallest q with q * d >= n, for non-negative n and positive d (ints, or torch/numpy integer arrays)."""
    return -(-n // d)


def round_up(n, multiple):
    """n rounded up to a multiple of `multiple`."""
    return ceil_div(n, multiple) * multiple
