"""The prefix cache's block hashes, by `--prefix-caching-hash-algo` (vLLM's flag).

- `builtin` (kaon's default, as vLLM's was once): Python's hash of (parent, token ids), a signed 64-bit int.
  Fast; the same in every process (ints and tuples of ints do not depend on PYTHONHASHSEED), but no one
  outside kaon computes it.
- `sha256_cbor`: vLLM's: SHA-256 of the canonical CBOR of [parent's 32-byte digest, token ids, extra keys],
  the first block's parent being NONE_HASH, SHA-256 of the CBOR of PYTHONHASHSEED (random when unset, as in
  vLLM). A router that recomputes vLLM's hashes from a request's tokens (llm-d-kv-cache-manager's token
  processor) finds kaon's blocks. Kept as the digest's int (256 bits); the KV events carry its last 8 bytes
  as an unsigned int, as vLLM sends them (`event_hash`).

Pure functions; the engine builds one `BlockHasher` at start.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import cbor2

from kaon_runtime.config import PREFIX_CACHING_HASH_ALGOS
from kaon_runtime.errors import InvalidRequestError

_U64 = (1 << 64) - 1

# Roots of the builtin chain hashes. Ints and tuples of ints hash alike in every Python process, None and
# strings do not (PYTHONHASHSEED, addresses): a block's hash names it across restarts and engines
# (the disk tier, KV events: engine/kv_tiers.py, engine/kv_events.py), so no chain starts from those.
_NO_PARENT, _LORA_ROOT, _SALT_ROOT = 0x6B616F6E, 0x6C6F7261, 0x73616C74


def sha256_cbor(obj: object) -> bytes:
    """vLLM's sha256_cbor: canonical CBOR, so the bytes hashed are the same in every language."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def none_hash(seed: str | None) -> int:
    """vLLM's NONE_HASH, the parent of every chain's first block: the seed's sha256_cbor (vLLM passes
    PYTHONHASHSEED); no seed: 32 random bytes, so no other process computes this engine's hashes."""
    digest = os.urandom(32) if seed is None else sha256_cbor(seed)
    return int.from_bytes(digest, "big")


def event_hash(block_hash: int) -> int:
    """A block hash as the KV events carry it: builtin's (a signed 64-bit int) as is, a sha256 digest's last
    8 bytes as an unsigned int (vLLM's int block hashes, the default of VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)."""
    return block_hash if block_hash < 0 else block_hash & _U64


@dataclass(frozen=True, slots=True)
class BlockHasher:
    algo: str = "builtin"
    root: int | None = None  # sha256_cbor: NONE_HASH (int of its 32 bytes)

    def chain(self, parent: int | None, token_ids: tuple[int, ...]) -> int:
        if self.algo == "builtin":
            return hash((_NO_PARENT if parent is None else parent, token_ids))
        assert self.root is not None
        prev = (self.root if parent is None else parent).to_bytes(32, "big")
        return int.from_bytes(sha256_cbor([prev, list(token_ids), None]), "big")

    def first_parent(self, lora_id: int, salt_key: int | None) -> int | None:
        """The parent of a sequence's first block: its LoRA adapter and cache salt folded in, so two adapters
        (or an adapter and the base) never share K/V computed by different weights, and requests of different
        salts (tenants) never share cached blocks. vLLM folds them into every block's extra keys instead; kaon
        keeps them in the root, so with sha256_cbor only the base model's unsalted hashes are vLLM's."""
        if self.algo == "builtin":
            if salt_key is None:
                return None if lora_id == 0 else hash((_LORA_ROOT, lora_id))
            return hash((_SALT_ROOT, lora_id, salt_key))
        if salt_key is None and lora_id == 0:
            return None
        assert self.root is not None
        keys = ["kaon-root", self.root.to_bytes(32, "big"), lora_id, salt_key]
        return int.from_bytes(sha256_cbor(keys), "big")

    def tier_id(self) -> str:
        """What the disk tier's manifest records of the hashes ("" for builtin, so older tiers stay valid): a
        tier written with another algorithm or seed names its blocks by other hashes."""
        if self.algo == "builtin":
            return ""
        assert self.root is not None
        return f"{self.algo}:{hashlib.sha256(self.root.to_bytes(32, 'big')).hexdigest()[:16]}"


BUILTIN = BlockHasher()


def make_hasher(algo: str, seed: str | None) -> BlockHasher:
    if algo not in PREFIX_CACHING_HASH_ALGOS:
        raise InvalidRequestError(f"--prefix-caching-hash-algo must be one of "
                                  f"{', '.join(PREFIX_CACHING_HASH_ALGOS)}, not {algo!r}")
    return BlockHasher(algo, None if algo == "builtin" else none_hash(seed))


def hasher_from_env(algo: str) -> BlockHasher:
    """The hasher the engine uses: the seed from PYTHONHASHSEED, as vLLM reads it (I/O at the edge)."""
    return make_hasher(algo, os.environ.get("PYTHONHASHSEED"))
