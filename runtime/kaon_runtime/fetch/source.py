"""Pure decisions of `kaon fetch`: no I/O, so every rule is a unit test."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import PurePosixPath

FETCHED_SCHEMES = ("hf://", "s3://")

# Why a fetch failed: the word the operator shows, and the exit code a script can test.
UNAUTHORIZED, NOT_FOUND, NO_SPACE, DOES_NOT_FIT, INVALID, UNREACHABLE = (
    "unauthorized", "not found", "no space", "model does not fit", "invalid model", "unreachable")
EXIT_CODES = {UNAUTHORIZED: 3, NOT_FOUND: 4, NO_SPACE: 5, DOES_NOT_FIT: 6, INVALID: 7, UNREACHABLE: 8}


class FetchError(Exception):
    """A failure with a reason a person can act on: kind is one of EXIT_CODES' keys."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind, self.message = kind, message

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.kind]

    def line(self) -> str:
        """The one line written to the termination log and last to stderr: `<kind>: <message>`."""
        return f"{self.kind}: {' '.join(self.message.split())}"


@dataclass(frozen=True, slots=True)
class Source:
    scheme: str  # "hf", "s3" or "local"
    location: str  # org/name, bucket, or a local path
    path: str = ""  # s3: the key prefix (no trailing slash)
    revision: str | None = None  # hf only

    @property
    def uri(self) -> str:
        if self.scheme == "hf":
            return f"hf://{self.location}" + (f"@{self.revision}" if self.revision else "")
        if self.scheme == "s3":
            return f"s3://{self.location}/{self.path}".rstrip("/")
        return self.location


_HF = re.compile(r"^hf://(?P<repo>[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*)(@(?P<rev>[^@ ]+))?$")
_S3 = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(/(?P<prefix>[^ ]*))?$")


def parse_uri(uri: str, revision: str | None = None) -> Source:
    """hf://org/name[@rev], s3://bucket/prefix, or a local path (file or directory)."""
    if uri.startswith("hf://"):
        m = _HF.match(uri)
        if not m:
            raise FetchError(INVALID, f"{uri!r}: an hf:// URI is hf://<org>/<name> or hf://<org>/<name>@<revision>")
        if m["rev"] and revision and m["rev"] != revision:
            raise FetchError(INVALID, f"{uri!r} names revision {m['rev']!r} but --revision says {revision!r}")
        source = Source("hf", m["repo"], revision=m["rev"] or revision or "main")
    elif uri.startswith("s3://"):
        m = _S3.match(uri)
        if not m:
            raise FetchError(INVALID, f"{uri!r}: an s3:// URI is s3://<bucket>/<prefix> with a valid bucket name")
        source = Source("s3", m["bucket"], path=(m["prefix"] or "").strip("/"))
    else:
        return _local(uri)
    cache_dir_name(source)  # refused here, before anything is listed or written, if it names no directory
    return source


def _local(uri: str) -> Source:
    if "://" in uri:
        raise FetchError(INVALID, f"{uri!r}: kaon fetch takes hf://, s3:// or a local path "
                                  "(pvc:// is mounted by the operator; builtin:// needs no fetch)")
    return Source("local", uri)


def cache_dir_name(source: Source) -> str:
    """The model's directory under the cache root, a function of the URI only (so the init container
    and the engine, or two replicas, agree on it without talking)."""
    def safe(part: str) -> str:
        # '.' and '..' are the only parts the substitution leaves able to climb out of the cache root
        # (an s3 prefix s3://b/../../x, a revision '..'): never a directory name, whatever the URI.
        if part in (".", ".."):
            raise FetchError(INVALID, f"{source.uri!r}: a '.' or '..' part would leave the model cache")
        return re.sub(r"[^A-Za-z0-9._-]", "--", part)
    if source.scheme == "hf":
        return str(PurePosixPath("hf", *map(safe, source.location.split("/")), safe(source.revision or "main")))
    if source.scheme == "s3":
        return str(PurePosixPath("s3", safe(source.location), *map(safe, filter(None, source.path.split("/")))))
    raise ValueError(f"{source.uri} is not fetched")


# The files of a repository the engine reads; everything else (other formats, README, images) stays out.
ADAPTER_CONFIG = "adapter_config.json"
HF_DIR_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja", "model.safetensors.index.json",
                "quantize_config.json")  # older GPTQ checkpoints keep their quantization there


def check_file_name(name: str, where: str) -> str:
    """A file name from a store's listing (an S3 key less its prefix, a hub file name) as a path
    under the model directory, or INVALID: a name that is absolute, climbs out (`..`), has an empty
    or `.` part (`a//b`), a backslash or a control character could write outside the directory
    or be read differently by another tool, so no such name is ever joined to a local path."""
    parts = name.split("/")
    bad = (not name or name.startswith("/") or "\\" in name or any(ord(c) < 32 or c == "\x7f" for c in name)
           or any(part in ("", ".", "..") for part in parts))
    if bad:
        raise FetchError(INVALID, f"{where} lists a file named {name!r}, which is not a plain relative path "
                                  "(no leading /, no `..` or empty parts, no backslash); refusing the model")
    return name


def select_files(names: list[str], gguf_file: str | None, where: str) -> list[str]:
    """Which of a repository's (or prefix's) files to download: config, safetensors and tokenizer
    files at the top level, a LoRA adapter's config and safetensors, or one GGUF file."""
    if gguf_file:
        if gguf_file not in names:
            ggufs = sorted(n for n in names if n.endswith(".gguf"))
            raise FetchError(NOT_FOUND, f"{where} has no {gguf_file}" + (f"; its GGUF files: {', '.join(ggufs)}"
                                                                         if ggufs else ""))
        return [gguf_file]
    top = [n for n in names if "/" not in n]
    safetensors = sorted(n for n in top if n.endswith(".safetensors"))
    if safetensors and ADAPTER_CONFIG in top:  # a LoRA adapter (PEFT's layout): no config.json, no tokenizer
        return [ADAPTER_CONFIG] + safetensors
    if safetensors:
        if "config.json" not in top:
            raise FetchError(INVALID, f"{where} has *.safetensors but no config.json")
        if "tokenizer.json" not in top:
            raise FetchError(INVALID, f"{where} has no tokenizer.json (kaon needs the fast tokenizer file)")
        return [n for n in HF_DIR_FILES if n in top] + safetensors
    ggufs = sorted(n for n in names if n.endswith(".gguf"))
    if len(ggufs) == 1:
        return ggufs
    if ggufs:
        raise FetchError(INVALID, f"{where} has {len(ggufs)} GGUF files ({', '.join(ggufs[:6])}"
                                  f"{', ...' if len(ggufs) > 6 else ''}): choose one with ggufFile (--gguf-file)")
    if not names:
        raise FetchError(NOT_FOUND, f"{where} is empty")
    raise FetchError(INVALID, f"{where} has neither config.json + *.safetensors nor a .gguf file")


def check_fit(config: dict, tensor_parallel_size: int) -> None:
    """The engine's rule (kaon_runtime.distributed.sharding), read from config.json before any
    weight is downloaded: the heads and the MLP width split evenly across the ranks."""
    tp = tensor_parallel_size
    if tp <= 1:
        return
    text = config.get("text_config") or config  # multimodal wrappers keep the LM's shape inside
    heads = text.get("num_attention_heads")
    if not isinstance(heads, int):
        return  # not a shape we know: the engine decides
    kv = text.get("num_key_value_heads") or heads
    problems = []
    if heads % tp:
        problems.append(f"its {heads} attention heads")
    if kv % tp and tp % kv:
        problems.append(f"its {kv} KV heads (nor is it a multiple of them)")
    width = text.get("intermediate_size")
    if isinstance(width, int) and width % tp:
        problems.append(f"its MLP width {width}")
    group = quantization_group(config)
    head_dim = text.get("head_dim") or (text.get("hidden_size") or 0) // heads
    row_parallel = [heads * head_dim, width if isinstance(width, int) else 0]
    if not problems and group and any(size // tp % group for size in row_parallel):
        problems.append(f"the row-parallel layers' inputs ({' and '.join(map(str, row_parallel))}) into whole "
                        f"quantization groups of {group}")
    if problems:
        raise FetchError(DOES_NOT_FIT, f"tensorParallelSize {tp} does not divide {' or '.join(problems)}; "
                                       f"use a tensorParallelSize that does")


def quantization_group(config: dict) -> int | None:
    """The input columns per scale of a quantized checkpoint (GPTQ, AWQ, compressed-tensors), if grouped."""
    quant = config.get("quantization_config")
    if not isinstance(quant, dict):
        return None
    sizes = [quant.get("group_size")]
    for group in (quant.get("config_groups") or {}).values():
        weights = group.get("weights") or {} if isinstance(group, dict) else {}
        sizes += [weights.get("group_size"), (weights.get("block_structure") or [None, None])[-1]]
    found = [size for size in sizes if isinstance(size, int) and size > 0]
    return max(found) if found else None


def parse_config(text: str, where: str) -> dict:
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FetchError(INVALID, f"{where}/config.json is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise FetchError(INVALID, f"{where}/config.json is not a JSON object")
    return config


def git_blob_sha1_header(size: int) -> bytes:
    """A git blob id is sha1(b"blob <size>\\0" + content): the hub's id of a small (non-LFS) file."""
    return f"blob {size}\0".encode()
