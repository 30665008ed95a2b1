"""kaon's release, as installed (`kaon --version`, the server's /version)."""
from __future__ import annotations

import importlib.metadata


def package_version() -> str:
    try:
        return importlib.metadata.version("kaon")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"
