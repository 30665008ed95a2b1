"""A Kubernetes Secret volume as the kubelet lays it out (..data symlink swapped atomically on rotation)."""
from __future__ import annotations

import os


def secret_volume(root, data: dict[str, str], generation: str) -> None:
    """What the kubelet writes for a Secret volume: a timestamped directory, `..data` linking
    to it, and each key a link through `..data` (swapped atomically on an update)."""
    stamp = root / f"..{generation}"
    stamp.mkdir()
    for key, value in data.items():
        (stamp / key).write_text(value)
    tmp = root / "..data_tmp"
    tmp.symlink_to(stamp.name)
    os.replace(tmp, root / "..data")
    for key in data:
        link = root / key
        if not link.is_symlink():
            link.symlink_to(f"..data/{key}")
    for link in root.iterdir():
        if link.is_symlink() and not link.name.startswith(".") and link.name not in data:
            link.unlink()
