"""The cache store shared by every replica: entries in Redis, vectors mirrored locally.

Works on plain Redis 7.0 (no vector search) and on Redis Cluster: every key of one scope
carries the hash tag `{scope}`, so a scope lives in one slot and every multi-key command
and script stays inside it.  Nothing ever touches two scopes at once.

Keys (prefix `sluice`, configurable):
  sluice:{<scope>}:e:<exact_key>  hash   p prompt, a answer (bytes), t stored_at (epoch s),
                                         x expires_at (epoch ms), v vector (float32 bytes,
                                         absent for an exact-only entry), s the prompt's
                                         token states (sidecar/cache/token_states.py's
                                         format; only on a route whose verifier reads
                                         them); PEXPIRE = TTL
  sluice:{<scope>}:ids            zset   exact keys of the scope, scored by last use (ms);
                                         the per-scope LRU bound; expires with its newest
                                         entry
  sluice:events                   stream put / del / purge events, MAXLEN ~ bound

Exact lookups go straight to Redis (HMGET of every field but the states, and a ZADD XX that
marks the use).  The states travel only when a replica's verifier needs a candidate's that it
does not hold (get_states: one script call for a request's candidates, each value read only
if within the size asked for); being fields of the entry, they are written, expired, evicted
and purged with it, and are never in the stream.  Semantic
lookups search this replica's mirror of the shared vectors and then fetch the entry, which
both gets the answer and proves the entry has not expired or been evicted in Redis
meanwhile; a vanished hit is dropped and the search repeats.  The mirror follows the
stream; it is rebuilt from a SCAN of the scope sets at start and after a reconnect (in the
background: lookups keep using the old one meanwhile), unless the outage was short enough
to catch up from the stream: same Redis process, and the stream still holds the last event
applied.

The local tier: the mirror is a MemoryStore that also keeps, beside the shared vectors, the
answers this replica stored or fetched (until their TTL; within the one byte budget,
least recently used first).  While Redis is up it is never read for an answer (Redis is the
truth: a purge there is seen at once).  While Redis is down, exact and semantic lookups are
answered from it, and answers that arrive are kept in it, so an outage costs sharing, not
caching.  It honours what the stream says: a purge or purge_all empties it as the shared
tier (and drops a later put asked for before it), a del or another replica's put of the same
key drops its copy.  A rebuild after a reconnect starts it empty: purges made while this
replica could not hear them cannot be ruled out.

Bounds: a put runs one script that writes the entry and evicts the scope's least recently
used entries beyond max_entries_per_scope.  Redis has no cross-slot count, so the overall
bound in Redis is its own maxmemory with an eviction policy (volatile-lru: every key here
has a TTL); the mirror and local tier are bounded like any MemoryStore (max_bytes, max_entries).

Failure: every command runs under a short deadline.  A connection error or timeout marks
the backend down (logged once, sluice_cache_backend_up 0, counted in
sluice_cache_backend_errors_total): from then on lookups are answered by the local tier
alone and puts kept there, at once, without touching the network, while a background task
reconnects with backoff, then rebuilds the mirror (or catches up from the stream).  Only purge_scope, an admin call, raises (StoreUnavailable).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge
from redis.asyncio.cluster import RedisCluster
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from sidecar.observability import metrics
from sidecar.config import redacted_url
from sidecar.cache.inflight_redis import PURGE_MARKER_MS, purge_marker
from sidecar.cache.memory_store import MemoryStore
from sidecar.cache.store import Entry, Neighbour, StoreLimits, StoreUnavailable
from sidecar.redis_retry import once_more_on_a_closed_connection
from sidecar.cache.vector_index import DEFAULT_EXACT_MAX, as_unit
from sidecar.observability.logs import Throttle

__all__ = ["RedisSettings", "RedisStore", "BACKEND_UP", "BACKEND_ERRORS", "LOCAL_HITS"]

log = logging.getLogger("sluice.cache")

BACKEND_UP = Gauge("sluice_cache_backend_up",
                   "1 while the shared cache backend (Redis) answers, else 0.")
BACKEND_ERRORS = Counter("sluice_cache_backend_errors_total",
                         "Shared cache backend calls that failed, by operation.", ["op"])
LOCAL_HITS = Counter("sluice_cache_local_tier_hits_total",
                     "Entries found in this replica's local tier while the shared backend was down: "
                     "exact hits, and nearest neighbours the same-question checks then judge.",
                     ["tier"])

# Errors that mean "the backend is not there": they mark it down.  Any other RedisError
# (a bad reply, a script error) is counted and logged but leaves it up.
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, TimeoutError, OSError)
_FAILED: Any = object()
_NEAREST_TRIES = 3
_OTHER_ERROR_LOG_EVERY_S = 60.0
UNPUBLISHED_MAX = 1024          # stream events kept for a retry while Redis does not take them
REPUBLISH_BATCH = 64            # of which one put, or one round trip after a reconnect, sends

# Write one entry and keep its scope within bounds, atomically.  Every key it touches is
# of one scope, so one slot: KEYS[1] the entry hash, KEYS[2] the scope's id set, KEYS[3] its
# purge marker.  ARGV: ttl ms, now ms, per-scope max, entry-key prefix of the scope, exact
# key, asked-at ms ('' for none), then the hash's field/value pairs.  Returns the evicted
# exact keys, or nil when the scope was purged after the answer was asked for.
_PUT = """
local purged = redis.call('GET', KEYS[3])
if ARGV[6] ~= '' and purged and tonumber(purged) and tonumber(purged) >= tonumber(ARGV[6]) then
  return false
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 7))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[5])
redis.call('PEXPIRE', KEYS[2], ARGV[1], 'NX')
redis.call('PEXPIRE', KEYS[2], ARGV[1], 'GT')
local over = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[3])
local evicted = {}
if over > 0 then
  for _, id in ipairs(redis.call('ZRANGE', KEYS[2], 0, over)) do
    if #evicted < over and id ~= ARGV[5] then
      redis.call('ZREM', KEYS[2], id)
      redis.call('DEL', ARGV[4] .. id)
      evicted[#evicted + 1] = id
    end
  end
end
return evicted
"""
# Delete the next ARGV[2] entries of a scope (KEYS[1] its id set, ARGV[1] the entry-key
# prefix): a batch at a time, so that no call holds Redis longer than a lookup's timeout.
# Returns {entries deleted, ids left}; the set vanishes with its last id.
_PURGE_BATCH = """
local ids = redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[2]) - 1)
local n = 0
for _, id in ipairs(ids) do
  n = n + redis.call('DEL', ARGV[1] .. id)
end
if #ids > 0 then
  redis.call('ZREM', KEYS[1], unpack(ids))
end
return {n, redis.call('ZCARD', KEYS[1])}
"""
_PURGE_BATCH_SIZE = 500
# What a lookup reads of an entry: all but its token states (read only when needed).
_ENTRY_FIELDS = ("p", "a", "t", "x", "v")
# The `s` field of each entry in KEYS (all of one scope) when it is at most ARGV[1] bytes,
# else its length (0: none), so that no reply is larger than asked for.
_STATES = """
local out = {}
for i, key in ipairs(KEYS) do
  local n = redis.call('HSTRLEN', key, 's')
  if n > 0 and n <= tonumber(ARGV[1]) then
    out[i] = redis.call('HGET', key, 's')
  else
    out[i] = n
  end
end
return out
"""


@dataclass(frozen=True)
class RedisSettings:
    url: str = "redis://127.0.0.1:6379/0"
    cluster: bool = False            # url names one node of a Redis Cluster
    key_prefix: str = "sluice"
    timeout_s: float = 0.05          # socket timeout and deadline of one round trip
    connect_timeout_s: float = 0.05
    stream_maxlen: int = 10_000      # events kept for replicas (~1.7 KB each)
    stream_block_ms: int = 1_000     # longest wait of the event reader per XREAD
    reconnect_min_s: float = 0.1     # backoff between reconnect tries: doubles up to max
    reconnect_max_s: float = 2.0
    start_timeout_s: float = 5.0     # start() waits this long for the first mirror load
    load_batch: int = 256            # entries fetched per round trip when loading

    def __post_init__(self) -> None:
        for name in ("timeout_s", "connect_timeout_s", "reconnect_min_s", "start_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)!r}")
        if self.reconnect_max_s < self.reconnect_min_s:
            raise ValueError("reconnect_max_s: must be >= reconnect_min_s")
        for name in ("stream_maxlen", "stream_block_ms", "load_batch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)!r}")
        if not self.key_prefix or "{" in self.key_prefix or "}" in self.key_prefix:
            raise ValueError(f"key_prefix: must be non-empty, without braces, got {self.key_prefix!r}")


class _Keys:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.events = f"{prefix}:events"
        self.ids_pattern = f"{_glob_escape(prefix)}:{{*}}:ids"
        self.entries_pattern = f"{_glob_escape(prefix)}:{{*}}:e:*"
        self.purged_all = f"{prefix}:purged-all"      # when the last purge_all ran (seconds)

    def entry_prefix(self, scope: str) -> str:
        return f"{self.prefix}:{{{scope}}}:e:"

    def entry(self, scope: str, exact_key: str) -> str:
        return f"{self.prefix}:{{{scope}}}:e:{exact_key}"

    def ids(self, scope: str) -> str:
        return f"{self.prefix}:{{{scope}}}:ids"

    def scope_of_ids(self, key: bytes) -> str:
        return key.decode()[len(self.prefix) + 2:-len("}:ids")]


def _stream_id(event_id: bytes) -> tuple[int, int]:
    ms, _, seq = event_id.partition(b"-")
    return int(ms), int(seq or 0)


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class RedisStore:
    """CacheStore in Redis, shared by replicas; see the module docstring."""

    def __init__(self, settings: RedisSettings | None = None, limits: StoreLimits | None = None,
                 *, dim: int = 384, exact_max: int = DEFAULT_EXACT_MAX,
                 clock: Callable[[], float] = time.time) -> None:
        self.settings = settings or RedisSettings()
        self.limits = limits or StoreLimits()
        self.dim = dim
        self._exact_max = exact_max
        self._clock = clock
        self._keys = _Keys(self.settings.key_prefix)
        self._local = self._new_local_tier()
        self._up: bool | None = None  # None until the first answer or failure
        self._client: Any = None
        self._reader: Any = None
        self._put_script: Any = None
        self._purge_script: Any = None
        self._states_script: Any = None
        self._loop_task: asyncio.Task | None = None
        self._loaded = asyncio.Event()
        self._went_down = asyncio.Event()      # wakes the sync loop out of its blocking XREAD
        self._said_misfit = False              # checked that the server suits (not a cluster node, 7.0+)
        self._purged_all_at = -math.inf        # the last purge_all, for puts asked for before it
        self._closed = False
        self._last_id: bytes | None = None      # the last stream event the mirror has
        self._unpublished: deque[dict[str, Any]] = deque(maxlen=UNPUBLISHED_MAX)   # events to retry
        self._loaded_from: str | None = None    # run_id of the Redis the mirror came from
        self._other_error_warning = Throttle(_OTHER_ERROR_LOG_EVERY_S)
        self._malformed_warning = Throttle(_OTHER_ERROR_LOG_EVERY_S)

    def _new_local_tier(self) -> MemoryStore:
        return MemoryStore(self.limits, dim=self.dim, exact_max=self._exact_max, clock=self._clock)

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return bool(self._up)

    @property
    def nbytes(self) -> int:
        """Bytes held in this process (the local tier and mirror), against limits.max_bytes."""
        return self._local.nbytes

    async def start(self) -> None:
        self._install(*self._connect())
        try:
            async with asyncio.timeout(self.settings.timeout_s + self.settings.connect_timeout_s):
                await self._client.ping()
            self._mark_up()
        except (*_UNREACHABLE, RedisError) as exc:
            self._mark_down("connect", exc)
        self._loop_task = asyncio.create_task(self._sync_loop(), name="sluice-cache-sync")
        if self._up:
            try:
                async with asyncio.timeout(self.settings.start_timeout_s):
                    await self._loaded.wait()
            except TimeoutError:
                log.warning("cache index still loading after %.1fs; semantic lookups miss "
                            "what it has not reached yet", self.settings.start_timeout_s)

    async def close(self) -> None:
        self._closed = True
        task, self._loop_task = self._loop_task, None
        if task is not None:
            task.cancel()  # a client may swallow one cancel mid-read: the flag ends the loop
            await asyncio.wait({task}, timeout=self.settings.stream_block_ms / 1000 + 1)
        await self._aclose(self._client, self._reader)
        self._client = self._reader = None

    def _connect(self) -> tuple[Any, Any]:
        s = self.settings
        common = dict(socket_connect_timeout=s.connect_timeout_s, retry=Retry(NoBackoff(), 0),
                      health_check_interval=0)
        reader_timeout = s.stream_block_ms / 1000 + max(1.0, s.timeout_s)
        if s.cluster:
            make = lambda timeout: RedisCluster.from_url(  # noqa: E731
                s.url, socket_timeout=timeout, **common)
        else:
            make = lambda timeout: aioredis.Redis.from_url(  # noqa: E731
                s.url, socket_timeout=timeout, **common)
        return make(s.timeout_s), make(reader_timeout)

    def _install(self, client: Any, reader: Any) -> None:
        self._client, self._reader = client, reader
        self._put_script = client.register_script(_PUT)
        self._purge_script = client.register_script(_PURGE_BATCH)
        self._states_script = client.register_script(_STATES)

    @staticmethod
    async def _aclose(*clients: Any) -> None:
        for client in clients:
            if client is not None:
                try:
                    await client.aclose()
                except (*_UNREACHABLE, RedisError, RuntimeError):
                    pass

    # -- health ---------------------------------------------------------------------------

    def _mark_up(self) -> None:
        if self._up is not True:
            log.info("cache backend %s reachable%s", self._where(),
                     "" if self._up is None else " again: shared cache resumes")
        self._up = True
        self._went_down.clear()
        BACKEND_UP.set(1)

    def _mark_down(self, op: str, exc: BaseException) -> None:
        BACKEND_ERRORS.labels(op).inc()
        if self._up is not False:
            log.warning("cache backend %s unreachable (%s: %s); only this replica's local tier answers "
                        "until it is back", self._where(), type(exc).__name__, exc)
        self._up = False
        self._went_down.set()
        BACKEND_UP.set(0)

    def _other_error(self, op: str, exc: BaseException) -> None:
        BACKEND_ERRORS.labels(op).inc()
        if self._other_error_warning.due():
            log.warning("cache backend %s: %s failed: %s: %s (logged once a minute)",
                        self._where(), op, type(exc).__name__, exc)

    def _where(self) -> str:
        return redacted_url(self.settings.url)          # never log a password

    async def _run(self, op: str, call: Callable[[Any], Awaitable[Any]],
                   round_trips: int | None = 1) -> Any:
        """`call(client)` within `round_trips` timeouts (None: each command's own socket
        timeout only); _FAILED, never an exception, if it fails."""
        if not self._up:
            return _FAILED
        deadline = None if round_trips is None else self.settings.timeout_s * round_trips
        try:
            async with asyncio.timeout(deadline):
                return await once_more_on_a_closed_connection(lambda: call(self._client))
        except _UNREACHABLE as exc:
            self._mark_down(op, exc)
        except RedisError as exc:
            self._other_error(op, exc)
        return _FAILED

    # -- CacheStore ----------------------------------------------------------------------

    async def get_exact(self, scope: str, exact_key: str) -> Entry | None:
        found = await self._run("get", lambda c: self._fetch(c, scope, exact_key))
        if found is _FAILED:
            return self._local_answer(scope, exact_key, "exact")
        if found is None:
            self._local.discard(scope, exact_key)      # gone from the shared tier: gone here
            return None
        return self._keep(*found)

    async def nearest(self, scope: str, vector: np.ndarray,
                      min_similarity: float) -> Neighbour | None:
        for _ in range(_NEAREST_TRIES):
            local = self._local.nearest_now(scope, vector, min_similarity)
            if local is None:
                return None
            key = local.entry.entry_id
            found = await self._run("nearest", lambda c, key=key: self._fetch(c, scope, key))
            if found is _FAILED:
                entry = self._local_answer(scope, key, "nearest")
                return None if entry is None else Neighbour(entry, local.similarity)
            if found is not None:
                return Neighbour(self._keep(*found), local.similarity)
            self._local.discard(scope, key)  # expired or evicted in Redis: not servable
        return None

    def _local_answer(self, scope: str, exact_key: str, tier: str) -> Entry | None:
        """The local tier's answer, while Redis cannot give one."""
        entry = self._local.get_exact_now(scope, exact_key)
        if entry is None or not entry.answer:            # a shared vector alone: no answer here
            return None
        LOCAL_HITS.labels(tier).inc()
        return entry

    def _keep(self, entry: Entry, expires_at: float | None, vector: np.ndarray | None) -> Entry:
        """A fetched entry, kept in the local tier for an outage (already there: marked used)."""
        held = self._local.get_exact_now(entry.scope, entry.entry_id)
        if expires_at is not None and (held is None or not held.answer or held.stored_at != entry.stored_at):
            try:
                self._local.put_now(entry, vector, expires_at)
            except ValueError:                           # a malformed vector: kept exact-only
                self._local.put_now(entry, None, expires_at)
        return entry

    async def put(self, scope: str, exact_key: str, prompt: str, vector: np.ndarray | None,
                  answer: bytes, ttl_s: float, asked_at: float | None = None,
                  states: bytes | None = None) -> bool:
        now = self._clock()
        ttl_s = min(ttl_s, self.limits.max_ttl_s)
        unit = None if vector is None else as_unit(vector, self.dim)  # a bad vector raises
        if ttl_s <= 0 or (asked_at is not None and (asked_at <= self._purged_all_at
                                                    or self._local.purged_since(scope, asked_at))):
            return False
        stored = self._local.put_now(Entry(exact_key, scope, prompt, answer, now), unit, now + ttl_s)
        if not self._up:
            return stored
        expires_ms = int((now + ttl_s) * 1000)
        fields: dict[str, Any] = {"p": prompt, "a": answer, "t": repr(now), "x": expires_ms}
        if unit is not None:
            fields["v"] = unit.tobytes()
        if states:      # in the entry's hash: written by the same script, gone with the entry
            fields["s"] = states

        async def write(client: Any) -> list[bytes]:
            args: list[Any] = [max(1, int(ttl_s * 1000)), int(now * 1000),
                               self.limits.max_entries_per_scope,
                               self._keys.entry_prefix(scope), exact_key,
                               "" if asked_at is None else int(asked_at * 1000)]
            for name, value in fields.items():
                args += [name, value]
            return await self._put_script(
                keys=[self._keys.entry(scope, exact_key), self._keys.ids(scope), purge_marker(scope)],
                args=args)

        event = {"op": "put", "s": scope, "k": exact_key, "t": fields["t"], "x": expires_ms}
        if unit is not None:
            event["v"] = fields["v"]
        evicted = await self._run("put", write)
        if evicted is None:             # the scope was purged after the answer was asked for
            self._local.discard(scope, exact_key)
            return False
        if evicted is _FAILED:
            # The script may have run before the failure: replicas hear of the entry once Redis
            # answers again (an event for an entry that is not there costs a lookup one fetch).
            self._unpublished.append(event)
            return stored
        # The stream is another slot than the scope's keys (Redis Cluster): a second round trip.
        # Events it could not take wait for the next put or reconnect; lost, the entry would
        # stay out of every replica's semantic index for its whole TTL.
        backlog = self._take_unpublished()          # a few at a time: no put carries them all
        events = [*backlog, event, *({"op": "del", "s": scope, "k": key.decode()} for key in evicted)]
        if await self._run("put", lambda client: self._publish_all(client, events)) is _FAILED:
            self._unpublished.extendleft(reversed(backlog))
            self._unpublished.extend(events[len(backlog):])
        for key in evicted:
            self._local.discard(scope, key.decode())
        return stored

    async def get_states(self, scope: str, exact_keys: list[str], max_bytes: int) -> list[bytes | None]:
        if not exact_keys:
            return []
        keys = [self._keys.entry(scope, key) for key in exact_keys]     # one scope: one slot
        found = await self._run("states", lambda c: self._states_script(keys=keys, args=[max_bytes]))
        if found is _FAILED or not isinstance(found, list) or len(found) != len(keys):
            return [None] * len(exact_keys)
        return [value if isinstance(value, bytes) and len(value) <= max_bytes else None for value in found]

    async def purge_scope(self, scope: str) -> int:
        self._local.purge_scope_now(scope)
        deleted = await self._run("purge", lambda c: self._purge(c, scope), round_trips=None)
        if deleted is _FAILED:
            raise StoreUnavailable(f"cache backend {self._where()} unreachable: scope "
                                   f"{scope!r} was purged from this replica only")
        return deleted

    async def purge_all(self) -> int:
        """purge_scope for every scope there is (admin); raises StoreUnavailable."""
        self._local.purge_all_now()
        now = self._clock()
        self._purged_all_at = now

        async def purge_all(client: Any) -> int:
            # First the time, for puts asked for before it in scopes with nothing stored yet
            # (each replica hears it from the stream; one that starts later reads the key).
            await client.set(self._keys.purged_all, repr(now), px=PURGE_MARKER_MS)
            await client.xadd(self._keys.events, {"op": "purge_all", "t": repr(now)},
                              maxlen=self.settings.stream_maxlen, approximate=True)
            deleted = 0
            async for ids_key in client.scan_iter(match=self._keys.ids_pattern, count=1000,
                                                  _type="zset"):
                deleted += await self._purge(client, self._keys.scope_of_ids(ids_key), find_strays=False)
            return deleted + await self._unlink_matching(client, self._keys.entries_pattern)

        deleted = await self._run("purge", purge_all, round_trips=None)
        if deleted is _FAILED:
            raise StoreUnavailable(f"cache backend {self._where()} unreachable: "
                                   "the cache was purged on this replica only")
        return deleted

    async def _purge(self, client: Any, scope: str, find_strays: bool = True) -> int:
        """Delete a scope in batches (puts that land meanwhile go too), then tell replicas.
        find_strays: also SCAN for its entries that its id set no longer lists (purge_all
        scans for every scope's at once instead)."""
        deleted, batches = 0, self.limits.max_entries_per_scope // _PURGE_BATCH_SIZE + 10
        for _ in range(batches):
            n, left = await self._purge_script(keys=[self._keys.ids(scope)],
                                               args=[self._keys.entry_prefix(scope), _PURGE_BATCH_SIZE])
            deleted += int(n)
            if not left:
                break
        if find_strays:
            deleted += await self._unlink_matching(client, _glob_escape(self._keys.entry_prefix(scope)) + "*")
        # Late twins' answers void, and puts asked for before now dropped (the value: when).
        await client.set(purge_marker(scope), int(self._clock() * 1000), px=PURGE_MARKER_MS)
        await client.xadd(self._keys.events, {"op": "purge", "s": scope},
                          maxlen=self.settings.stream_maxlen, approximate=True)
        return deleted

    @staticmethod
    async def _unlink_matching(client: Any, pattern: str) -> int:
        """Delete the keys matching `pattern`, found by SCAN: entries that their scope's id set
        no longer lists, since Redis evicted or expired the set (under allkeys-lru or
        volatile-lru a full Redis evicts any key). An admin path: a keyspace scan is affordable."""
        deleted, batch = 0, []
        async for key in client.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) >= _PURGE_BATCH_SIZE:
                deleted += await client.unlink(*batch)
                batch.clear()
        if batch:
            deleted += await client.unlink(*batch)
        return deleted

    # -- Redis commands -------------------------------------------------------------------

    async def _fetch(self, client: Any, scope: str, exact_key: str
                     ) -> tuple[Entry, float | None, np.ndarray | None] | None:
        """The entry, when it expires (None if unreadable) and its vector (None: none or bad)."""
        pipe = client.pipeline(transaction=False)
        pipe.hmget(self._keys.entry(scope, exact_key), *_ENTRY_FIELDS)      # not the states
        pipe.zadd(self._keys.ids(scope), {exact_key: int(self._clock() * 1000)}, xx=True)
        # The LRU mark is a write: Redis full under noeviction refuses it, yet the read stands.
        values, _ = await pipe.execute(raise_on_error=False)
        if isinstance(values, Exception):
            raise values
        fields = {name.encode(): value for name, value in zip(_ENTRY_FIELDS, values) if value is not None}
        if b"a" not in fields:
            return None
        try:
            stored_at = float(fields.get(b"t", b"0"))
        except ValueError:              # not written by this code: a miss, not a failed request
            return None
        entry = Entry(exact_key, scope, fields.get(b"p", b"").decode("utf-8", "replace"),
                      fields[b"a"], stored_at)
        try:
            expires_at: float | None = int(fields.get(b"x", b"")) / 1000
        except ValueError:
            expires_at = None           # served, but not kept locally: its TTL is unknown
        vector = fields.get(b"v")
        if vector is not None and len(vector) == 4 * self.dim:
            return entry, expires_at, np.frombuffer(vector, np.float32)
        return entry, expires_at, None

    async def _republish(self) -> None:
        """Stream events puts could not publish, now that Redis answers again."""
        while events := self._take_unpublished():
            try:
                async with asyncio.timeout(self.settings.timeout_s * 4):
                    await self._publish_all(self._client, events)
            except BaseException:
                self._unpublished.extendleft(reversed(events))
                raise

    def _take_unpublished(self) -> list[dict[str, Any]]:
        return [self._unpublished.popleft() for _ in range(min(len(self._unpublished), REPUBLISH_BATCH))]

    async def _publish_all(self, client: Any, events: list[dict[str, Any]]) -> None:
        pipe = client.pipeline(transaction=False)
        for event in events:
            pipe.xadd(self._keys.events, event, maxlen=self.settings.stream_maxlen, approximate=True)
        await pipe.execute()

    # -- the mirror: load, then follow the stream; reconnect when down --------------------

    async def _sync_loop(self) -> None:
        s = self.settings
        backoff = s.reconnect_min_s
        while not self._closed:
            op = "sync" if self._up else "reconnect"
            try:
                if not self._up:
                    await self._reconnect()
                    backoff = s.reconnect_min_s
                    await self._republish()
                if not await self._can_resume():
                    self._last_id = await self._load()
                self._loaded.set()
                while self._up and not self._closed:
                    reply = await self._read_events_unless_down()
                    for _stream, events in reply or ():
                        for event_id, fields in events:
                            self._apply(fields)
                            self._last_id = event_id
            except asyncio.CancelledError:
                raise
            except _UNREACHABLE as exc:
                self._mark_down(op, exc)
            except RedisError as exc:
                self._other_error(op, exc)
            except Exception:  # a bug here must not end the task: the mirror would freeze
                log.exception("cache sync failed; retrying")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, s.reconnect_max_s)

    async def _read_events_unless_down(self) -> Any:
        """The next stream events, or None as soon as a request marks Redis down: reconnecting
        must not wait out the XREAD's block (each lookup misses until it is done)."""
        read = asyncio.ensure_future(self._reader.xread({self._keys.events: self._last_id},
                                                        count=500, block=self.settings.stream_block_ms))
        # A read given up on may still end in an error (its connection closed): it is moot.
        read.add_done_callback(lambda done: done.cancelled() or done.exception())
        down = asyncio.ensure_future(self._went_down.wait())
        try:
            await asyncio.wait({read, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            down.cancel()
            if not read.done():
                read.cancel()        # the reader is replaced on reconnect: its state is moot
        return read.result() if read.done() and not read.cancelled() else None

    async def _reconnect(self) -> None:
        """Fresh clients (no stale pooled connections); raises while Redis is away."""
        client, reader = self._connect()
        try:
            async with asyncio.timeout(self.settings.timeout_s + self.settings.connect_timeout_s):
                await client.ping()
        except BaseException:
            await self._aclose(client, reader)
            raise
        old = (self._client, self._reader)
        self._install(client, reader)
        await self._aclose(*old)
        self._mark_up()

    async def _can_resume(self) -> bool:
        """After a short outage of the same Redis process, whose stream still holds every
        event since the last one applied, the mirror can catch up from the stream instead
        of being reloaded whole.  (Cluster: always reload; there is no one process.)"""
        if self._last_id is None or self.settings.cluster:
            return False
        if await self._server_id() != self._loaded_from:
            return False
        oldest = await self._client.xrange(self._keys.events, count=1)
        return bool(oldest) and _stream_id(oldest[0][0]) <= _stream_id(self._last_id)

    async def _server_id(self) -> str | None:
        if self.settings.cluster:
            return None
        info = await self._client.info("default")          # the server's and the cluster's
        if not self._said_misfit:
            self._said_misfit = True
            self._say_misfit(info)
        return info.get("run_id")

    def _say_misfit(self, info: dict) -> None:
        """Log a server this store cannot work with as configured (once, at the first load)."""
        if info.get("cluster_enabled"):
            log.error("cache backend %s is a Redis Cluster node but SLUICE_REDIS_CLUSTER is off: "
                      "every scope on another node fails (MOVED) and misses", self._where())
        major = str(info.get("redis_version", "")).partition(".")[0]
        if major.isdigit() and int(major) < 7:
            log.error("cache backend %s runs Redis %s: storing answers needs 7.0 or later "
                      "(PEXPIRE NX/GT); every put fails", self._where(), info.get("redis_version"))

    async def _load(self) -> bytes:
        """Rebuild the mirror from Redis; the stream position to follow it from."""
        client, batch = self._client, self.settings.load_batch
        self._loaded_from = await self._server_id()
        self._note_purge_all(await client.get(self._keys.purged_all))
        newest = await client.xrevrange(self._keys.events, count=1)
        last_id = newest[0][0] if newest else b"0-0"
        mirror = self._new_local_tier()
        per_scope = self.limits.max_entries_per_scope
        started = time.monotonic()
        async for ids_key in client.scan_iter(match=self._keys.ids_pattern, count=1000,
                                              _type="zset"):
            scope = self._keys.scope_of_ids(ids_key)
            members = await client.zrange(ids_key, -per_scope, -1)  # least recent first
            for i in range(0, len(members), batch):
                chunk = members[i:i + batch]
                pipe = client.pipeline(transaction=False)
                for member in chunk:
                    pipe.hmget(self._keys.entry(scope, member.decode()), "v", "x", "t")
                for member, (vector, expires_ms, stored_at) in zip(chunk, await pipe.execute()):
                    if vector and expires_ms:
                        self._add_to(mirror, scope, member.decode(), vector, expires_ms, stored_at)
        mirror.adopt_purges(self._local)
        self._local = mirror
        log.info("cache index loaded: %d vectors in %.2fs", len(mirror), time.monotonic() - started)
        return last_id

    def _add_to(self, mirror: MemoryStore, scope: str, key: str, vector: bytes,
                expires_ms: bytes | int | None, stored_at: bytes | None) -> None:
        """One stored vector into a mirror. A malformed one (corrupt, or not written by this
        code) is skipped: raising would stop the load or the stream at it on every replica."""
        try:
            if expires_ms is None or len(vector) % 4:
                raise ValueError("no expiry, or vector bytes not float32")
            v = np.frombuffer(vector, np.float32)
            if v.shape[0] != self.dim:
                return  # written by a replica with another embedding size: not ours to serve
            mirror.put_now(Entry(key, scope, "", b"", float(stored_at or 0)), v, int(expires_ms) / 1000)
        except (ValueError, TypeError) as exc:      # zero or non-finite vector, junk numbers
            metrics.CACHE_UNREADABLE.inc()
            if self._malformed_warning.due():
                log.warning("cache index: malformed entry skipped (scope %s): %s", scope[:16], exc)

    def _note_purge_all(self, when: bytes | None) -> None:
        """A purge_all ran at `when` (seconds, as text): puts asked for before it are dropped."""
        try:
            at = float(when)
        except (TypeError, ValueError):
            return
        if math.isfinite(at):
            self._purged_all_at = max(self._purged_all_at, at)

    def _holds_answer(self, scope: str, key: str, stored_at: bytes | None) -> bool:
        """The local tier has the answer stored at `stored_at` under the key."""
        held = self._local.peek(scope, key)
        try:
            return held is not None and bool(held.answer) and held.stored_at == float(stored_at or b"nan")
        except ValueError:
            return False

    def _apply(self, fields: dict[bytes, bytes]) -> None:
        op, scope = fields.get(b"op"), fields.get(b"s", b"").decode()
        key = fields.get(b"k", b"").decode()
        if op == b"put":
            if self._holds_answer(scope, key, fields.get(b"t")):
                return      # this replica's own put (or a fetch of it) coming back
            if b"v" in fields:
                self._add_to(self._local, scope, key, fields[b"v"], fields.get(b"x"), fields.get(b"t"))
            else:
                self._local.discard(scope, key)
        elif op == b"del":
            self._local.discard(scope, key)
        elif op == b"purge":
            self._local.purge_scope_now(scope)
        elif op == b"purge_all":
            self._local.purge_all_now()
            self._note_purge_all(fields.get(b"t"))
