"""`kaon fetch` and `kaon serve --model hf://...`: the pure rules, then the real clients against the
stand-in hub (unmodified huggingface_hub over HTTP, e2e/fake_hub.py) and a real MinIO server."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from kaon_runtime.fetch import FetchError, fetch, parse_uri, source as src, store
from support.sources import BUCKET, HF_TOKEN, PREFIX, PRIVATE_REPO, PUBLIC_REPO

NEEDED = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


# Pure rules --------------------------------------------------------------------------------------------------------


def test_uris_parse_and_name_their_cache_directory():
    hf = parse_uri("hf://meta-llama/Llama-3.1-8B@refs/pr/3")
    assert (hf.scheme, hf.location, hf.revision) == ("hf", "meta-llama/Llama-3.1-8B", "refs/pr/3")
    assert src.cache_dir_name(hf) == "hf/meta-llama/Llama-3.1-8B/refs--pr--3"
    assert parse_uri("hf://org/name", revision="v2").revision == "v2"
    assert parse_uri("hf://org/name").revision == "main"
    s3 = parse_uri("s3://models/llama/8b/")
    assert (s3.location, s3.path) == ("models", "llama/8b") and src.cache_dir_name(s3) == "s3/models/llama/8b"
    assert parse_uri("/models/x").scheme == "local"
    for bad in ("hf://just-a-name", "s3://A_B/x", "gs://bucket/x", "pvc://claim/x"):
        with pytest.raises(FetchError) as err:
            parse_uri(bad)
        assert err.value.kind == src.INVALID
    with pytest.raises(FetchError, match="names revision"):
        parse_uri("hf://org/name@v1", revision="v2")


def test_only_the_files_the_engine_reads_are_selected():
    repo = ["README.md", ".gitattributes", "config.json", "generation_config.json", "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json", "original/consolidated.00.pth", "pytorch_model.bin",
            "onnx/model.onnx", "q4/model-q4.gguf"]
    assert src.select_files(repo, None, "r") == [
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
        "model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert src.select_files(repo, "q4/model-q4.gguf", "r") == ["q4/model-q4.gguf"]
    assert src.select_files(["README.md", "m.Q4_K_M.gguf"], None, "r") == ["m.Q4_K_M.gguf"]
    cases = [(["a.Q4.gguf", "a.Q8.gguf"], None, src.INVALID, "choose one with ggufFile"),
             (["README.md"], None, src.INVALID, "neither config.json"),
             ([], None, src.NOT_FOUND, "is empty"),
             (repo, "nope.gguf", src.NOT_FOUND, "its GGUF files: q4/model-q4.gguf"),
             (["model.safetensors", "config.json"], None, src.INVALID, "no tokenizer.json")]
    for names, gguf, kind, words in cases:
        with pytest.raises(FetchError, match=words) as err:
            src.select_files(names, gguf, "r")
        assert err.value.kind == kind


def test_tensor_parallel_fit_follows_the_engines_rule():
    llama_8b = {"num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336}
    for tp in (1, 2, 4, 8, 16, 32):
        src.check_fit(llama_8b, tp)
    for tp, words in ((3, "32 attention heads"), (6, "32 attention heads"), (64, "32 attention heads")):
        with pytest.raises(FetchError, match=words) as err:
            src.check_fit(llama_8b, tp)
        assert err.value.kind == src.DOES_NOT_FIT and err.value.exit_code == 6
    src.check_fit({"num_attention_heads": 24, "num_key_value_heads": 2, "intermediate_size": 6144}, 6)  # 6 % 2 == 0
    src.check_fit({"text_config": {"num_attention_heads": 12}}, 3)


def test_every_failure_kind_has_its_own_exit_code():
    assert len(set(src.EXIT_CODES.values())) == len(src.EXIT_CODES) and 0 not in src.EXIT_CODES.values()
    assert FetchError(src.NO_SPACE, "the disk\n  is full").line() == "no space: the disk is full"


# hf:// with the unmodified huggingface_hub client ------------------------------------------------------------------


@pytest.fixture
def hub_env(hf_hub, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hf_hub.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return hf_hub


def downloads(hub, repo: str) -> Counter:
    return Counter({k.removeprefix(repo + "/"): v for k, v in hub.downloads.items() if k.startswith(repo + "/")})


def test_hf_fetch_downloads_the_needed_files_once_and_verifies_them(hub_env, tmp_path, tiny_llama_dir):
    before = downloads(hub_env, PUBLIC_REPO)
    path = fetch(f"hf://{PUBLIC_REPO}", tmp_path)
    assert path == tmp_path / "hf" / PUBLIC_REPO / "main"
    assert sorted(p.name for p in path.iterdir() if p.is_file() and not p.name.startswith(".")) == NEEDED
    for name in NEEDED:
        assert (path / name).read_bytes() == (tiny_llama_dir / name).read_bytes()
    assert downloads(hub_env, PUBLIC_REPO) - before == Counter(NEEDED)  # README, original/ stay on the hub
    marker = json.loads((path / ".kaon-complete.json").read_text())
    assert marker["revision"] == hub_env.commit(PUBLIC_REPO) and marker["model"] == "."
    assert {f["name"] for f in marker["files"]} == set(NEEDED)

    again = downloads(hub_env, PUBLIC_REPO)
    assert fetch(f"hf://{PUBLIC_REPO}", tmp_path) == path  # a restarted init container: nothing downloaded
    assert downloads(hub_env, PUBLIC_REPO) == again


def test_hf_without_a_marker_the_files_are_checked_and_a_corrupt_one_fetched_again(hub_env, tmp_path):
    path = fetch(f"hf://{PUBLIC_REPO}", tmp_path)
    (path / ".kaon-complete.json").unlink()  # as if the fetch was killed right before the marker
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[1000] ^= 0xFF  # same size, one bit flipped
    weights.write_bytes(bytes(data))
    before = downloads(hub_env, PUBLIC_REPO)
    fetch(f"hf://{PUBLIC_REPO}", tmp_path)
    fetched = downloads(hub_env, PUBLIC_REPO) - before
    assert fetched == Counter(["model.safetensors"])  # the intact files were verified and kept
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == \
        hub_env.sibling(PUBLIC_REPO, hub_env.root / PUBLIC_REPO / "model.safetensors")["lfs"]["sha256"]


def test_hf_resumes_an_interrupted_download(hub_env, tmp_path, tiny_llama_dir):
    directory = tmp_path / "hf" / PUBLIC_REPO / "main"
    directory.mkdir(parents=True)
    whole = (tiny_llama_dir / "model.safetensors").read_bytes()
    version = hashlib.sha256(whole).hexdigest()  # an LFS file's part is kept under its content's id
    part = store.part_path(directory / "model.safetensors", version)
    part.write_bytes(whole[:len(whole) // 3])  # killed a third of the way
    logged = []
    fetch(f"hf://{PUBLIC_REPO}", tmp_path, log=logged.append)
    assert (directory / "model.safetensors").read_bytes() == whole  # and its sha256 was verified
    assert (f"{PUBLIC_REPO}/model.safetensors", len(whole) // 3) in hub_env.resumed  # a ranged GET
    assert f"model.safetensors: resuming at {len(whole) // 3} of {len(whole)} bytes" in logged


def kaon_fetch(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kaon_runtime.cli", "fetch", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120, cwd=cwd)


def test_private_repo_needs_the_right_token_and_each_failure_says_why(hub_env, tmp_path):
    log = tmp_path / "termination-log"
    log.touch()  # the kubelet creates it; kaon fetch only writes into an existing one
    cases = [
        ({}, f"hf://{PRIVATE_REPO}", 4, "not found: hf://kaon-test/private-llama@main: repository not found, or "
                                        "private and the token cannot read it (no HF_TOKEN)"),
        ({"HF_TOKEN": "hf_wrong"}, f"hf://{PRIVATE_REPO}", 3,
         "unauthorized: hf://kaon-test/private-llama@main: the hub refused the credentials (401) (HF_TOKEN is set)"),
        ({"HF_TOKEN": HF_TOKEN}, "hf://kaon-test/missing", 4, "not found: hf://kaon-test/missing@main: repository"),
        ({}, f"hf://{PUBLIC_REPO}@v9", 4, "not found: hf://kaon-test/tiny-llama@v9: revision 'v9' not found"),
        ({}, f"hf://{PUBLIC_REPO}", 6, "model does not fit: tensorParallelSize 3 does not divide its 4 attention "
                                       "heads"),
    ]
    for env, uri, code, line in cases:
        extra = ["--tensor-parallel-size", "3"] if code == 6 else []
        res = kaon_fetch("--model", uri, "--model-cache", str(tmp_path / "c"), "--termination-log", str(log), *extra,
                         env={"HF_ENDPOINT": hub_env.url, **env})
        assert res.returncode == code, (uri, res.stderr)
        last = res.stderr.strip().splitlines()[-1]
        assert last.startswith(f"kaon fetch: {line}"), last
        assert "Traceback" not in res.stderr
        assert log.read_text().startswith(line)
    # The fit is checked from config.json before any weight is downloaded.
    assert not (tmp_path / "c" / "hf" / PUBLIC_REPO / "main" / "model.safetensors").exists()

    res = kaon_fetch("--model", f"hf://{PRIVATE_REPO}", "--model-cache", str(tmp_path / "c"),
                     env={"HF_ENDPOINT": hub_env.url, "HF_TOKEN": HF_TOKEN})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(tmp_path / "c" / "hf" / PRIVATE_REPO / "main")
    assert "size and checksum verified" in res.stderr and "complete in" in res.stderr  # progress is logged


def test_two_fetches_of_one_cache_at_once_download_each_file_once(hub_env, tmp_path):
    before = downloads(hub_env, PUBLIC_REPO)
    procs = [subprocess.Popen([sys.executable, "-m", "kaon_runtime.cli", "fetch", "--model", f"hf://{PUBLIC_REPO}",
                               "--model-cache", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "HF_ENDPOINT": hub_env.url}) for _ in range(2)]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    assert results[0][0] == results[1][0]
    assert downloads(hub_env, PUBLIC_REPO) - before == Counter(NEEDED)  # the second waited on the lock, then reused


def test_no_space_is_refused_before_downloading(hub_env, tmp_path, monkeypatch):
    real = store.shutil.disk_usage
    monkeypatch.setattr(store.shutil, "disk_usage", lambda p: real(p)._replace(free=100_000))  # a nearly full disk
    before = downloads(hub_env, PUBLIC_REPO)
    with pytest.raises(FetchError, match=r"the model needs .* MB more but .* has 0.1 MB free") as err:
        fetch(f"hf://{PUBLIC_REPO}", tmp_path)
    assert err.value.kind == src.NO_SPACE and err.value.exit_code == 5
    assert downloads(hub_env, PUBLIC_REPO) == before
    assert not list((tmp_path / "hf" / PUBLIC_REPO / "main").glob(".kaon-complete*"))


def test_kaon_generate_with_an_hf_uri_fetches_into_the_cache_first(hub_env, tmp_path):
    res = subprocess.run([sys.executable, "-m", "kaon_runtime.cli", "generate", "--model", f"hf://{PUBLIC_REPO}",
                          "--model-cache", str(tmp_path), "--raw", "--prompt", "Hello", "--max-tokens", "3",
                          "--device", "cpu", "--dtype", "float32"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_ENDPOINT": hub_env.url})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "3 tokens" in res.stdout and (tmp_path / "hf" / PUBLIC_REPO / "main" / ".kaon-complete.json").is_file()
    res = subprocess.run([sys.executable, "-m", "kaon_runtime.cli", "serve", "--model", "pvc://models/x"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 7 and "pvc:// is for InferenceServices" in res.stderr and "Traceback" not in res.stderr


def test_the_fetch_command_does_not_import_torch():
    code = ("import sys; from kaon_runtime.cli import main; import kaon_runtime.fetch.hf, kaon_runtime.fetch.s3; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')]; print(bad); "
            "sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


# s3:// against a real MinIO ----------------------------------------------------------------------------------------


def test_s3_fetch_with_the_real_client_and_store(minio, tmp_path, monkeypatch, tiny_llama_dir):
    for key, value in minio.env().items():
        monkeypatch.setenv(key, value)
    path = fetch(f"s3://{BUCKET}/{PREFIX}", tmp_path)
    assert path == tmp_path / "s3" / BUCKET / PREFIX
    assert sorted(p.name for p in path.iterdir() if p.is_file() and not p.name.startswith(".")) == NEEDED
    assert (path / "model.safetensors").read_bytes() == (tiny_llama_dir / "model.safetensors").read_bytes()
    assert not (path / "original").exists() and not (path / "README.md").exists()
    stamp = (path / ".kaon-complete.json").stat().st_mtime_ns
    assert fetch(f"s3://{BUCKET}/{PREFIX}", tmp_path) == path
    assert (path / ".kaon-complete.json").stat().st_mtime_ns == stamp


def test_s3_resumes_an_interrupted_download(minio, tmp_path, monkeypatch, tiny_llama_dir):
    for key, value in minio.env().items():
        monkeypatch.setenv(key, value)
    directory = tmp_path / "s3" / BUCKET / PREFIX
    directory.mkdir(parents=True)
    whole = (tiny_llama_dir / "model.safetensors").read_bytes()
    from kaon_runtime.fetch.s3 import S3Store
    (listed,) = [f for f in S3Store(parse_uri(f"s3://{BUCKET}/{PREFIX}")).list() if f.name == "model.safetensors"]
    part = store.part_path(directory / "model.safetensors", listed.version)  # kept under the object's ETag
    part.write_bytes(whole[:len(whole) // 3])  # killed a third of the way
    logged = []
    path = fetch(f"s3://{BUCKET}/{PREFIX}", tmp_path, log=logged.append)
    assert (path / "model.safetensors").read_bytes() == whole  # and its MD5 (the ETag) was verified
    assert f"model.safetensors: resuming at {len(whole) // 3} of {len(whole)} bytes" in logged


def test_s3_failures_say_why(minio, tmp_path):
    cases = [(minio.env(secret_key="wrong"), f"s3://{BUCKET}/{PREFIX}", 3,
              "unauthorized: s3://models/tiny-llama: the store refused the credentials: SignatureDoesNotMatch"),
             (minio.env(access_key="nobody"), f"s3://{BUCKET}/{PREFIX}", 3, "unauthorized: "),
             (minio.env(), "s3://no-such-bucket/x", 4, "not found: s3://no-such-bucket/x: NoSuchBucket"),
             (minio.env(), f"s3://{BUCKET}/nothing-here", 4, "not found: s3://models/nothing-here: no objects"),
             ({**minio.env(), "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, f"s3://{BUCKET}/{PREFIX}", 8,
              "unreachable: s3://models/tiny-llama: cannot reach http://127.0.0.1:9")]
    for env, uri, code, line in cases:
        res = kaon_fetch("--model", uri, "--model-cache", str(tmp_path), env=env)
        assert res.returncode == code, (uri, res.stderr)
        assert res.stderr.strip().splitlines()[-1].startswith(f"kaon fetch: {line}"), res.stderr
        assert "Traceback" not in res.stderr


def test_local_paths_are_checked_like_a_pvc(tiny_llama_dir, tmp_path):
    assert kaon_fetch("--model", str(tiny_llama_dir)).returncode == 0
    res = kaon_fetch("--model", str(tmp_path / "missing"))
    assert res.returncode == 4 and "not found: " in res.stderr
    res = kaon_fetch("--model", str(tiny_llama_dir), "--tensor-parallel-size", "3")
    assert res.returncode == 6 and "model does not fit: tensorParallelSize 3" in res.stderr
