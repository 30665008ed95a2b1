"""The router's data path compiled with mypyc, run when a build of the current sources exists.

mypyc (the mypy project's compiler: typed Python to C extension modules, as mypy and black ship themselves)
compiles MODULES, the modules a request runs through, unchanged: the same source, about 10% less CPU per request
with sockets (bench/history/router.md). Nothing in the repository is compiled in place: a build lives in a cache
outside it,

    ${KAON_CACHE:-~/.cache/kaon}/router-mypyc/<key>/     key: a hash of MODULES' sources, mypyc's version, the ABI

with a manifest of every other module of kaon_operator/kaon_wire those import (their hashes: mypyc compiles
against their types) and the third-party versions. The router's start (main.py) calls `activate()` before it
imports the data path: a build whose key and manifest match the sources it would import is loaded through an
import hook (the extension modules by file, from the cache); anything else (no build, a .py edited since, another
mypyc) runs the plain source, and one log line says which and why. KAON_ROUTER_COMPILED=0 forces the source;
=require makes a missing build an error (the CI's compiled run of the router's tests).

Build (what `make install` and operator/Dockerfile run; minutes, gcc at -O3; a failure is a warning, never a
broken install: the router runs the source):

    python -m kaon_operator.router.compiled build [--cache DIR]
    python -m kaon_operator.router.compiled status

Over 300 lines for a stated reason: the build and the choice read and write the same key and manifest, so they
stay in one file, where a change to one is seen beside the other (the decisions, key() and decide(), are pure).
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

MODULES = ("json_cost", "request", "upstream", "front", "relay", "admission", "backoff", "retry", "auth",
           "strategies/least_connections", "proxy", "endpoints", "metrics", "fast")
"""Under kaon_operator/router/: what a request's common path runs through (bench/router_path.py's profile)."""

PACKAGE = "kaon_operator.router"
ROOT = Path(__file__).resolve().parents[2]
"""The directory holding kaon_operator/ and kaon_wire/: the repository's operator/, or site-packages."""
OURS = ("kaon_operator", "kaon_wire")
THIRD_PARTY = ("aiohttp", "multidict", "yarl", "httptools", "uvloop", "prometheus_client")
"""Libraries the compiled modules call into: a new version rebuilds (mypyc checks values against their types)."""
RECIPE = 1
"""Bumped when how a build is made changes (flags, layout): every older build is then stale."""
ENV = "KAON_ROUTER_COMPILED"
MANIFEST = "manifest.json"
MYPY_CONFIG = ("[mypy]\nplugins = pydantic.mypy\nignore_missing_imports = True\n"
               "disable_error_code = annotation-unchecked\n")
"""The repository's mypy settings that type the compiled modules' imports (pyproject.toml's [tool.mypy]); mypyc
fails, without an error of its own, on any note in a module it compiles: annotation-unchecked's is only a note."""
KEEP = 6
"""Builds kept per cache (one per recent source state: switching branches finds its own)."""


class BuildFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class Choice:
    compiled: bool
    reason: str

    def line(self) -> str:
        return f"router data path: {'compiled (mypyc)' if self.compiled else 'source'}: {self.reason}"


def cache_root() -> Path:
    return Path(os.environ.get("KAON_CACHE") or Path.home() / ".cache" / "kaon") / "router-mypyc"


def module_files(root: Path = ROOT) -> list[Path]:
    return [root / "kaon_operator" / "router" / f"{m}.py" for m in MODULES]


def digest(files: list[Path], root: Path) -> dict[str, str]:
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def mypyc_version() -> str | None:
    try:
        return importlib.metadata.version("mypy")
    except importlib.metadata.PackageNotFoundError:
        return None


def key(sources: dict[str, str], mypyc: str) -> str:
    """The build's name: the compiled modules' sources, the compiler, the recipe and the interpreter's ABI."""
    text = json.dumps([RECIPE, mypyc, sorted(sources.items())])
    return f"{hashlib.sha256(text.encode()).hexdigest()[:20]}-mypyc{mypyc}-{sys.implementation.cache_tag}"


def _imported(file: Path, root: Path) -> set[str]:
    """Modules of OURS that `file` imports (what it names; the caller resolves them to files)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(file.read_bytes())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)  # `from pkg import module`
    return {n for n in names if n.split(".")[0] in OURS}


def _file_of(module: str, root: Path) -> Path | None:
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def dependencies(files: list[Path], root: Path = ROOT) -> list[Path]:
    """Every module of OURS the compiled modules import, directly or not, with their packages' __init__: the types
    mypyc compiled against (the compiled modules themselves left out)."""
    seen: set[Path] = set()
    todo = list(files)
    while todo:
        file = todo.pop()
        if file in seen:
            continue
        seen.add(file)
        for module in _imported(file, root):
            parts = module.split(".")
            for i in range(1, len(parts) + 1):  # the packages' __init__ run too
                found = _file_of(".".join(parts[:i]), root)
                if found is not None and found not in seen:
                    todo.append(found)
    return sorted(seen - set(files))


def third_party() -> dict[str, str]:
    versions = {}
    for name in THIRD_PARTY:
        try:
            versions[name] = importlib.metadata.version(name.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def stale(manifest: dict, root: Path) -> str | None:
    """Why a build's manifest does not match what this process would import (None: it matches)."""
    for rel, sha in manifest["dependencies"].items():
        file = root / rel
        if not file.is_file():
            return f"{rel} is gone since the build"
        if hashlib.sha256(file.read_bytes()).hexdigest() != sha:
            return f"{rel} changed since the build"
    if manifest["third_party"] != third_party():
        return "a library changed since the build"
    if manifest["ext_suffix"] != sysconfig.get_config_var("EXT_SUFFIX"):
        return "built for another interpreter"
    return None


def find_build(root: Path = ROOT, cache: Path | None = None) -> tuple[Path | None, str]:
    """The build of the current sources, or None and why not."""
    cache = cache or cache_root()
    sources = digest(module_files(root), root)
    mypyc = mypyc_version()
    if mypyc is not None:
        candidates = [cache / key(sources, mypyc)]
    else:  # an image that built it in a stage with mypy and ships none: any compiler's build of these sources
        prefix = key(sources, "").split("-")[0]
        candidates = sorted(cache.glob(f"{prefix}-mypyc*-{sys.implementation.cache_tag}"))
    for build in candidates:
        if (build / MANIFEST).is_file():
            why = stale(json.loads((build / MANIFEST).read_text()), root)
            if why is None:
                return build, str(build)
            return None, f"the build at {build} is stale: {why}"
    return None, f"no build of these sources in {cache} (python -m {PACKAGE}.compiled build)"


class _Finder(importlib.abc.MetaPathFinder):
    """Imports the named modules from the build's extension files (ahead of the source on sys.path)."""

    def __init__(self, files: dict[str, Path]):
        self.files = files

    def find_spec(self, fullname, path=None, target=None):
        file = self.files.get(fullname)
        if file is None:
            return None
        return importlib.util.spec_from_file_location(fullname, file)


def extension_modules(build: Path) -> dict[str, Path]:
    """Module name -> file for every extension in a build (the modules and mypyc's shared library)."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    files = (f for f in build.rglob(f"*{suffix}") if f.relative_to(build).parts[0] != "build")  # not setuptools'
    return {str(f.relative_to(build))[:-len(suffix)].replace("/", "."): f for f in files}


def decide(setting: str, build: Path | None, why: str, imported: list[str]) -> Choice:
    """Pure: what the router runs, given KAON_ROUTER_COMPILED, the build found (or why none) and the data path's
    modules already imported as source in this process."""
    if setting == "0":
        return Choice(False, f"{ENV}=0")
    if build is None:
        return Choice(False, why)
    if imported:
        return Choice(False, f"already imported from source: {', '.join(imported)}")
    return Choice(True, why)


_chosen: list[Choice] = []


def chosen() -> Choice:
    """What this process's activate() chose (the line main.py logs at the router's start)."""
    if _chosen:
        return _chosen[-1]
    return Choice(False, "not chosen at start (the router started without kaon_operator.router.start)")


def activate(setting: str | None = None) -> Choice:
    """Before the data path is imported: load it from the build of the current sources when there is one."""
    setting = os.environ.get(ENV, "1") if setting is None else setting
    names = [f"{PACKAGE}.{m.replace('/', '.')}" for m in MODULES]
    build, why = find_build() if setting != "0" else (None, "")
    choice = decide(setting, build, why, [n for n in names if n in sys.modules])
    if choice.compiled and build is not None:
        sys.meta_path.insert(0, _Finder(extension_modules(build)))
    if setting == "require" and not choice.compiled:
        raise RuntimeError(f"{ENV}=require: {choice.reason}")
    _chosen.append(choice)
    return choice


def loaded(module: ModuleType) -> bool:
    """Whether a module runs compiled (an extension module, not its .py)."""
    return isinstance(getattr(module, "__loader__", None), importlib.machinery.ExtensionFileLoader)


def manifest(root: Path = ROOT) -> dict:
    """What a build of `root`'s sources was made from: checked at every start (stale())."""
    return {"mypyc": mypyc_version(), "recipe": RECIPE, "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
            "sources": digest(module_files(root), root),
            "dependencies": digest(dependencies(module_files(root), root), root),
            "third_party": third_party(), "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def build(cache: Path | None = None, root: Path = ROOT) -> Path:
    """Compile MODULES of `root` into the cache (at once if there already); the build's directory."""
    cache = cache or cache_root()
    mypyc = mypyc_version()
    if mypyc is None:
        raise RuntimeError("mypy (which brings mypyc) is not installed")
    found, _ = find_build(root, cache)
    if found is not None:
        return found
    target = cache / key(digest(module_files(root), root), mypyc)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kaon-router-mypyc-") as tmp:
        work = Path(tmp) / "src"
        for package in OURS:  # mypyc compiles in place: a copy, so no .so ever lands beside the sources
            shutil.copytree(root / package, work / package,
                            ignore=shutil.ignore_patterns("__pycache__", "build", "*.so"))
        files = [str(f.relative_to(root)) for f in module_files(root)]
        (work / "mypy.ini").write_text(MYPY_CONFIG)
        # Without PYTHONPATH: mypy would find the packages there too, beside the copy, and fail without a word.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        done = subprocess.run([sys.executable, "-m", "mypyc", *files], cwd=work, env=env, capture_output=True,
                              text=True)
        if done.returncode != 0:
            lines = (done.stdout + done.stderr).splitlines()
            said = [line for line in lines if "error" in line.lower()] or lines[-20:] or ["(no message)"]
            raise BuildFailed("mypyc failed: " + "\n".join(said[-20:]))
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=cache))
        staging.chmod(0o755)  # mkdtemp's 0700 would hide it from a router running as another user (the image's)
        for file in extension_modules(work).values():
            dest = staging / file.relative_to(work)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(file, dest)
    (staging / MANIFEST).write_text(json.dumps(manifest(root), indent=1))
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)  # whole or not at all: a reader never finds half a build
    _prune(cache)
    return target


def _prune(cache: Path) -> None:
    builds = sorted((p for p in cache.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in builds[KEEP:]:
        shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {PACKAGE}.compiled", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("build", "status"))
    parser.add_argument("--cache", type=Path, help="default: ${KAON_CACHE:-~/.cache/kaon}/router-mypyc")
    args = parser.parse_args(argv)
    if args.action == "status":
        found, why = find_build(cache=args.cache)
        print(f"compiled: {why}" if found else f"source: {why}")
        return 0 if found else 1
    started = time.monotonic()
    try:
        built = build(args.cache)
    except (RuntimeError, OSError) as exc:
        # Never a broken install: the router runs its source without the build.
        print(f"warning: the router's compiled data path was not built ({exc}); it will run from source",
              file=sys.stderr)
        return 1
    print(f"the router's compiled data path: {built} ({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
