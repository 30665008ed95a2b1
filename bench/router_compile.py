"""The router's hot modules compiled with mypyc, in a copy of a tree, to measure what compiling them would give.

    python bench/router_compile.py OUT [--tree .]
    python bench/router_path.py --tree OUT            # the router's Python alone, compiled (A/B: --tree .)
    python bench/router.py --loops uvloop --compiled OUT   # beside nginx and the uncompiled router, in one run

The same source, compiled by mypyc (the mypy project's compiler: typed Python to C extensions, as black ships):
OUT/operator is a copy of the tree's operator/ in which MODULES are extension modules (Python imports a module's
.so before its .py). This measures; it changes nothing of what kaon ships. Not compiled: proxy.py (an async generator,
which mypyc does not implement, serves aiohttp's cleanup context) and the modules off the common request's path.
Compiling takes minutes (gcc at -O3, one module at a time). mypyc comes with the mypy wheel of the dev
environment; the compiled copy runs only on the Python that built it.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODULES = ("json_cost", "request", "upstream", "front", "relay", "admission", "backoff", "retry", "auth",
           "strategies/least_connections")
"""Under operator/kaon_operator/router/: those a whole answer's request runs through (bench/router_path.py's
profile), each compiled as mypyc can take it."""


def build(tree: Path, out: Path) -> list[str]:
    """Copy `tree`'s operator/ to `out`/operator and compile MODULES there; the modules that import compiled."""
    target = out / "operator"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(tree / "operator", target, ignore=shutil.ignore_patterns("__pycache__", "build", "*.so"))
    files = [f"kaon_operator/router/{m}.py" for m in MODULES]
    subprocess.run([sys.executable, "-m", "mypyc", *files], cwd=target, check=True, stdout=subprocess.DEVNULL)
    check = ("import importlib, sys; sys.path.insert(0, sys.argv[1]); "
             "print(' '.join(m for m in sys.argv[2:] if importlib.import_module("
             "'kaon_operator.router.' + m.replace('/', '.')).__file__.endswith('.so')))")
    found = subprocess.run([sys.executable, "-c", check, str(target), *MODULES], capture_output=True, text=True,
                           check=True).stdout.split()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="where the compiled copy goes (its operator/ is replaced)")
    parser.add_argument("--tree", type=Path, default=HERE.parent, help="the tree whose operator/ is compiled")
    args = parser.parse_args()
    compiled = build(args.tree.resolve(), args.out.resolve())
    missing = sorted(set(MODULES) - set(compiled))
    print(f"{args.out}: compiled {len(compiled)} of {len(MODULES)} modules" +
          (f"; NOT compiled: {' '.join(missing)}" if missing else ""))
    if missing:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
