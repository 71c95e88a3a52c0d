"""API keys under `pagedkv serve`: whose prefix cache a request reads, and its fair share.

    keys = parse_keys(["sk-alice", "sk-bob", "sk-ci-1 ci", "sk-ci-2 ci"])
    engines = KeyEngines(keys, connect, max_running_per_key=16, max_waiting_per_key=64)
    caller = await engines.caller(keys[0])        # 429 naming the setting when over its cap
    caller.engine.stream(prompt_ids, params, key=caller.name)

Cache groups. The daemon shares prefix blocks only between sessions with the same cache salt,
and a request's `cached_tokens` (and the time to its first token) says how much of its prompt
was cached: a key reading another key's cache learns that key's prompts, a block at a time. So
every key gets a cache group of its own, with its own engine: a daemon session with a private
salt (nothing shared, and what it leaves cached is dropped when it ends). The operator names
keys that may share (one team's keys): a key line `KEY GROUP` puts the key in the group GROUP,
whose engine's session opens with the salt "pagedkv-serve:GROUP". Engines are opened at a
group's first request and kept (one session, one runner stream each; at most one per group); an
engine that stopped (its daemon restarted) is opened again at the group's next request.

Fair share. All engines' waiting requests are in one `FairQueue`: the next request admitted,
in whichever engine, is the oldest of the key served longest ago, among keys with fewer than
`max_running_per_key` running. A key with `max_waiting_per_key` requests waiting is refused
(429, OpenAI's error body naming --max-waiting-per-key) before its request is queued.
"""

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from pagedkv.client.engine.engine import Engine
from pagedkv.client.engine.fair_queue import FairQueue, Line
from pagedkv.server.errors import ApiError

# Where app.py leaves the API key a request was authenticated with (an `ApiKey`).
API_KEY = "pagedkv.api_key"
# The prefix of a named group's cache salt (a salt only this server's sessions use).
GROUP_SALT_PREFIX = b"pagedkv-serve:"
# Seconds a key over its cap is told to wait (Retry-After).
KEY_RETRY_AFTER_S = 1
# Opens an engine whose session has the given cache salt, waiting in the given line.
Connect = Callable[[bytes, Line], Awaitable[Engine]]


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A key clients send as `Authorization: Bearer KEY`."""

    # The secret itself (compared in constant time by app.py; never logged).
    secret: str
    # Its name in the fair queue and in errors: "key-N", N its place among the keys.
    name: str
    # Its cache group: the operator's GROUP, else its own name (nothing shared).
    group: str
    # The salt of its group's session: GROUP_SALT_PREFIX + GROUP, or b"" (private).
    salt: bytes


@dataclass(frozen=True, slots=True)
class Caller:
    """Whose request it is, and the engine that computes it."""

    # The key's name ("" on a server without keys: one queue, first in first out).
    name: str
    engine: Engine


def parse_keys(lines: Sequence[str]) -> tuple[ApiKey, ...]:
    """Keys from lines `KEY` or `KEY GROUP` (ValueError naming the line that is neither, or a
    key given twice)."""
    keys: list[ApiKey] = []
    for line in lines:
        fields = line.split()
        if len(fields) not in (1, 2):
            raise ValueError(f"an API key line must be `KEY` or `KEY GROUP`, got {len(fields)} "
                             "fields")
        name = f"key-{len(keys)}"
        group = fields[1] if len(fields) == 2 else name
        salt = GROUP_SALT_PREFIX + group.encode() if len(fields) == 2 else b""
        keys.append(ApiKey(fields[0], name, group, salt))
    if len({key.secret for key in keys}) < len(keys):
        raise ValueError("an API key is given twice")
    return tuple(keys)


class KeyEngines:
    """The engine of each cache group, and the queue their requests share."""

    def __init__(self, connect: Connect, max_running_per_key: int,
                 max_waiting_per_key: int) -> None:
        if max_waiting_per_key < 0:
            raise ValueError(f"--max-waiting-per-key must be >= 0, got {max_waiting_per_key}")
        self._connect = connect
        # The turns of every group's waiting requests (ValueError for a negative cap).
        self.queue = FairQueue(max_running_per_key)
        # Most requests of one key waiting (0: no cap).
        self.max_waiting_per_key = max_waiting_per_key
        # Each group's engine, once opened.
        self.engines: dict[str, Engine] = {}
        # Opened one at a time: two first requests of a group open one engine.
        self._opening = asyncio.Lock()

    async def caller(self, key: ApiKey) -> Caller:
        """`key`'s caller (its group's engine opened if need be); 429 when `key` already has
        max_waiting_per_key requests waiting."""
        waiting = self.queue.waiting_of(key.name)
        if self.max_waiting_per_key and waiting >= self.max_waiting_per_key:
            raise ApiError(429, f"{waiting} requests of this API key are waiting (the server's "
                                f"bound per key, --max-waiting-per-key, is "
                                f"{self.max_waiting_per_key}): retry later",
                           headers={"Retry-After": str(KEY_RETRY_AFTER_S)})
        return Caller(key.name, await self._engine(key))

    async def _engine(self, key: ApiKey) -> Engine:
        async with self._opening:
            engine = self.engines.get(key.group)
            if engine is None or engine.failure() is not None:
                if engine is not None:
                    await engine.close()  # its line was cleared when it stopped
                engine = self.engines[key.group] = await self._connect(key.salt,
                                                                       self.queue.line())
            return engine

    def running(self) -> int:
        """Requests running in every group's engine."""
        return sum(len(engine.scheduler.running) for engine in self.engines.values())

    async def close(self) -> None:
        for engine in self.engines.values():
            await engine.close()
        self.engines.clear()
