"""The response cache in Valkey or Redis (an InferenceRoute's spec.cache.valkey), shared by every router
replica: what one stored, the next finds.

Keys (prefix: `kaon:route:<namespace>:<route>`):
- `<prefix>:a:<key>`: the Answer's JSON, with the TTL as its expiry (SET ... EX);
- `<prefix>:lru`: a sorted set of the keys by last use, trimmed to spec.cache.maxEntries (the oldest
  entries deleted with it), so the size bound holds across replicas;
- `<prefix>:v:<semantic scope>`: a hash of key -> the prompt's unit embedding (float32 bytes); an entry
  whose answer is gone is dropped when a search meets it.
The client is redis-py's asyncio client (Valkey speaks the same protocol). A server that cannot be
reached makes the route answer without its cache (a miss, logged), never an error.
"""
from __future__ import annotations

import array
import logging
import time
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kaon_operator.routes.answers import Answer
from kaon_operator.routes.memory_store import cosine_of_units, unit

logger = logging.getLogger("kaon.routes.valkey")
TIMEOUT_S = 1.0


class ValkeyStore:
    def __init__(self, url: str, prefix: str, max_entries: int):
        # Any: redis-py types every reply as bytes | str (decode_responses is off here: always bytes).
        self.client: Any = aioredis.from_url(url.replace("valkey://", "redis://", 1), socket_timeout=TIMEOUT_S,
                                        socket_connect_timeout=TIMEOUT_S)
        self.prefix, self.max_entries = prefix, max_entries
        self._warned = 0.0

    def _failed(self, exc: Exception) -> None:
        now = time.monotonic()
        if now - self._warned > 10:
            self._warned = now
            logger.warning("%s: the shared cache failed (%s); answering without it", self.prefix, exc)

    async def get(self, key: str) -> Answer | None:
        try:
            data = await self.client.get(f"{self.prefix}:a:{key}")
            if data is None:
                return None
            await self.client.zadd(f"{self.prefix}:lru", {key: time.time()})
            return Answer.loads(data)
        except (RedisError, OSError, ValueError, KeyError) as exc:
            self._failed(exc)
            return None

    async def put(self, key: str, answer: Answer, ttl: float) -> None:
        lru = f"{self.prefix}:lru"
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.set(f"{self.prefix}:a:{key}", answer.dumps(), ex=max(1, int(ttl)))
                pipe.zadd(lru, {key: time.time()})
                pipe.zcard(lru)
                *_, size = await pipe.execute()
            if size > self.max_entries:
                old = await self.client.zrange(lru, 0, size - self.max_entries - 1)
                if old:
                    await self.client.delete(*(f"{self.prefix}:a:{k.decode()}" for k in old))
                    await self.client.zrem(lru, *old)
        except (RedisError, OSError) as exc:
            self._failed(exc)

    async def nearest(self, scope: str, vector: Sequence[float]) -> tuple[float, str] | None:
        index = f"{self.prefix}:v:{scope}"
        try:
            found = await self.client.hgetall(index)
            if not found:
                return None
            keys = [k.decode() for k in found]
            alive = await self.client.exists(*(f"{self.prefix}:a:{k}" for k in keys)) if keys else 0
            query, best, dead = unit(vector), None, []
            for key, raw in found.items():
                values = array.array("f")
                values.frombytes(raw)
                similarity = cosine_of_units(query, values)
                if best is None or similarity > best[0]:
                    best = (similarity, key.decode())
            if alive < len(keys):  # some answers expired: drop their vectors
                for key in keys:
                    if not await self.client.exists(f"{self.prefix}:a:{key}"):
                        dead.append(key)
                if dead:
                    await self.client.hdel(index, *dead)
                if best is not None and best[1] in dead:
                    return None
            return best
        except (RedisError, OSError, ValueError) as exc:
            self._failed(exc)
            return None

    async def add_vector(self, scope: str, vector: Sequence[float], key: str, ttl: float) -> None:
        index = f"{self.prefix}:v:{scope}"
        try:
            await self.client.hset(index, key, array.array("f", unit(vector)).tobytes())
            await self.client.expire(index, max(1, int(ttl)))
        except (RedisError, OSError) as exc:
            self._failed(exc)

    async def close(self) -> None:
        await self.client.aclose()
