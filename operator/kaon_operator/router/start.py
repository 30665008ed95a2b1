"""`kaon-router`'s entry point: chooses the compiled data path or the source (compiled.py), then runs main.py.

Its own module because the choice must come before anything imports the data path, and main.py imports it (its
flags' defaults are RouterConfig's)."""
from __future__ import annotations

from kaon_operator.router import compiled


def main(argv: list[str] | None = None) -> int:
    compiled.activate()
    from kaon_operator.router.main import main as run

    return run(argv)
