"""The router's compiled data path (kaon_operator/router/compiled.py): never a stale build, the choice said at
start, and the router's unit tests run against the build where one of the current sources exists."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kaon_operator.router import compiled

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the operator's packages: sources to edit without touching the repository's."""
    root = tmp_path / "tree"
    for package in compiled.OURS:
        shutil.copytree(compiled.ROOT / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def fake_build(root: Path, cache: Path) -> Path:
    """A build's directory and manifest for `root`'s sources as build() writes them (no compiling: the choice only
    reads the manifest)."""
    build = cache / compiled.key(compiled.digest(compiled.module_files(root), root), compiled.mypyc_version() or "")
    build.mkdir(parents=True)
    (build / compiled.MANIFEST).write_text(json.dumps(compiled.manifest(root)))
    return build


def test_a_build_is_found_for_its_own_sources_only(tree: Path, tmp_path: Path):
    cache = tmp_path / "cache"
    build = fake_build(tree, cache)
    assert compiled.find_build(tree, cache)[0] == build
    proxy = tree / "kaon_operator" / "router" / "proxy.py"
    proxy.write_text(proxy.read_text() + "\n# edited\n")
    found, why = compiled.find_build(tree, cache)
    assert found is None and "no build of these sources" in why


def test_a_build_is_stale_when_a_module_it_compiled_against_changed(tree: Path, tmp_path: Path):
    """config.py is not compiled, but the compiled modules were typed against it (RouterConfig's fields)."""
    cache = tmp_path / "cache"
    fake_build(tree, cache)
    config = tree / "kaon_operator" / "router" / "config.py"
    assert "kaon_operator/router/config.py" in compiled.manifest(tree)["dependencies"]
    config.write_text(config.read_text() + "\n# edited\n")
    found, why = compiled.find_build(tree, cache)
    assert found is None and "kaon_operator/router/config.py changed since the build" in why


def test_the_choice():
    build = Path("/cache/x")
    assert compiled.decide("1", build, "found", []) == compiled.Choice(True, "found")
    assert not compiled.decide("0", build, "found", []).compiled
    assert not compiled.decide("1", None, "no build", []).compiled
    assert not compiled.decide("1", build, "found", ["kaon_operator.router.proxy"]).compiled


def test_the_router_says_at_start_which_data_path_it_runs(tmp_path: Path):
    env = {**os.environ, compiled.ENV: "0", "PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), str(ROOT)])}
    done = subprocess.run([sys.executable, "-m", "kaon_operator.router", "--kubeconfig", str(tmp_path / "none")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert "router data path: source: KAON_ROUTER_COMPILED=0" in done.stderr, done.stderr


def test_the_router_unit_tests_pass_compiled():
    """tests/unit/operator/router in a process whose data path is the build's (KAON_ROUTER_COMPILED=require): a
    mypyc-only failure (an annotation Python leaves unchecked, a method patched on a compiled class) fails here."""
    build, why = compiled.find_build()
    if build is None:
        pytest.skip(f"no compiled build: {why}")
    names = [f"{compiled.PACKAGE}.{m.replace('/', '.')}" for m in compiled.MODULES]
    code = ("import sys, pytest\n"
            "from kaon_operator.router import compiled\n"
            "compiled.activate('require')\n"
            "rc = pytest.main(sys.argv[1:])\n"
            f"names = {names!r}\n"
            "print('compiled modules:', sum(compiled.loaded(sys.modules[n]) for n in names if n in sys.modules))\n"
            "sys.exit(rc)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "runtime"), str(ROOT / "operator"), str(ROOT)])}
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run([sys.executable, "-c", code, "-q", "-p", "no:cacheprovider",
                           str(ROOT / "tests" / "unit" / "operator" / "router")],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert f"compiled modules: {len(names)}" in done.stdout, done.stdout[-2000:]


def test_a_failed_build_is_a_warning_not_a_failed_install(tmp_path: Path, monkeypatch, capsys):
    """`make install` goes on (`|| true`) and the router runs its source: the build says why on stderr, exits 1."""
    monkeypatch.setattr(compiled, "mypyc_version", lambda: None)
    assert compiled.main(["build", "--cache", str(tmp_path)]) == 1
    assert "warning: the router's compiled data path was not built (mypy" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
