"""KV cache events for routers, in vLLM's wire format over ZMQ.

PUB socket, one multipart message per event batch: (topic, sequence number as 8 bytes big-endian,
msgpack payload). The payload's schema is kv_events_format's (kvstrata/cache/event_wire.py: "vllm",
vLLM 0.32's tagged maps with each block's cache_salt in extra_keys, or "array", the older tagged
arrays); events are BlockStored, BlockRemoved and AllBlocksCleared.
After a prefix-cache reset the batch starts with AllBlocksCleared (a subscriber forgets every
medium), followed by BlockStored for what the reset kept (host copies; storage where the tree still
knows it), so the sets a subscriber rebuilds always equal the cache's own.
Block hashes are the low 64 bits of our 128-bit page keys (msgpack integers are 64-bit).
A ROUTER socket (optional) answers a request [start_seq (8 bytes)] with every buffered batch from
that sequence number on, each as (seq, payload), then (-1 as 8 signed bytes, empty); it is served
by a thread of its own, within a total budget and a rate per subscriber
(kvstrata/serve/event_replay.py).

With kv_events_curve_secret_file / kv_events_curve_clients_dir both sockets are CURVE servers:
every subscriber must present a key pair whose public half is in the clients directory (pyzmq's
ThreadAuthenticator checks it), and all traffic is encrypted; anyone else's connection fails its
handshake and receives nothing. Event payloads carry every tenant's prompt token ids, so a
socket reachable by other users or hosts should not run without it.

The publisher runs on the engine thread (rank 0's, under ranks): the PUB socket is used by that
thread only; the replay socket by the replay thread only (the authenticator runs its own thread
on the same context).
"""

from __future__ import annotations

import time

import zmq
from prometheus_client import CollectorRegistry

from kvstrata.cache.event_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    encode_batch,
)
from kvstrata.cache.events import MEDIA, BlockChange, BlockTracker, block_hash
from kvstrata.cache.hicache import HiCache
from kvstrata.engine.engine import Engine
from kvstrata.engine.step_result import PagesCached, StepResult
from kvstrata.listeners import Listeners, exit_process
from kvstrata.serve.config import ServeConfig
from kvstrata.serve.event_replay import ReplayBuffer, ReplayLimits, ReplayMetrics, ReplayServer
from kvstrata.zmq_curve import CurveKeys, authenticator


def encode_change(
    change: BlockChange, tokens: list[int], page_size: int, salts: list[str]
) -> KVEvent:
    """One tree change as a typed event (salts: each page's cache_salt, stored changes only)."""
    hashes = [block_hash(k) for k in change.keys]
    if not change.stored:
        return BlockRemoved(hashes, change.medium)
    parent = None if change.parent is None else block_hash(change.parent)
    return BlockStored(hashes, parent, tokens, page_size, change.medium, salts)


class KVEventPublisher:
    """Publishes the tree's per-medium changes after every step."""

    def __init__(
        self,
        cfg: ServeConfig,
        page_size: int,
        listeners: Listeners | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.page = page_size
        self.format = cfg.kv_events_format
        self.topic = cfg.kv_events_topic.encode()
        self.ctx = zmq.Context()
        keys = curve_keys(cfg)
        self.auth = authenticator(self.ctx, keys) if keys is not None else None
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 1000)  # at close: at most 1 s to flush queued batches
        if keys is not None:
            keys.server(self.pub)
        self.pub.bind(cfg.kv_events_endpoint)
        self.buffer = ReplayBuffer(cfg.kv_events_buffer)
        self.replay: ReplayServer | None = None
        self.registry = registry
        self.metrics: ReplayMetrics | None = None  # registered in `registry` while open
        if cfg.kv_events_replay_endpoint:
            self.replay = ReplayServer(
                self.ctx,
                cfg.kv_events_replay_endpoint,
                self.buffer,
                ReplayLimits(cfg.kv_events_replay_rate, cfg.kv_events_replay_budget),
                keys,
                listeners,
                topic=self.topic,
            )
            if registry is not None:  # /metrics: answered, dropped, deferred
                self.metrics = ReplayMetrics(self.replay)
                registry.register(self.metrics)
        self.seq = 0
        self.tracker = BlockTracker()
        self.tokens: dict[int, list[int]] = {}  # page key -> its tokens (for BlockStored)
        self.salts: dict[int, str] = {}  # page key -> its request's cache_salt (salted only)
        self.resets = 0  # the cache's reset count last announced

    # ---- called by the step loop (kvstrata/serve/step_loop.py) ----------------------------------
    def after_step(self, cache: HiCache | None, result: StepResult) -> None:
        """Publish what changed in `cache`'s tree since the last call; `result` (the engine's
        step, or what happened between steps) says what the pages under new keys hold."""
        assert cache is not None, "KV events are published over a cache only"
        for pages in result.cached:
            self._learn(pages)
        head: list[KVEvent] = []
        if cache.resets != self.resets:  # the cache was reset: say so, then what is left
            self.resets = cache.resets
            self.tracker = BlockTracker()
            head = [AllBlocksCleared()]
        changes = self.tracker.diff(cache.tree)
        if changes or head:
            self._publish(head + [self._encode(c) for c in changes])
            held = set().union(*self.tracker.held.values())
            for key in [k for k in self.tokens if k not in held]:
                del self.tokens[key]
                self.salts.pop(key, None)

    def close(self) -> None:
        if self.replay is not None:
            self.replay.close()  # its thread first: the context's term waits for its socket
        if self.metrics is not None and self.registry is not None:
            self.registry.unregister(self.metrics)
        self.pub.close()
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()

    # ---- internals --------------------------------------------------------------------------------
    def _learn(self, pages: PagesCached) -> None:
        for i, key in enumerate(pages.keys):
            self.tokens.setdefault(key, pages.tokens[i * self.page : (i + 1) * self.page])
            if pages.salt:  # a salted key is the salt's alone (the salt is in its chain)
                self.salts[key] = pages.salt

    def _encode(self, change: BlockChange) -> KVEvent:
        if not change.stored:
            return encode_change(change, [], self.page, [])
        toks = [t for k in change.keys for t in self.tokens.get(k, [])]
        salts = [self.salts.get(k, "") for k in change.keys]
        return encode_change(change, toks, self.page, salts)

    def _publish(self, events: list[KVEvent]) -> None:
        payload = encode_batch(events, self.format, time.time())
        seq = self.seq
        self.seq += 1
        self.buffer.append(seq, payload)
        try:
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.Again:  # a slow subscriber: it can replay from the buffer
            pass


def curve_keys(cfg: ServeConfig) -> CurveKeys | None:
    """The event sockets' CURVE keys (None: no CURVE)."""
    if not cfg.kv_events_curve_secret_file:
        return None
    secret, peers = cfg.kv_events_curve_secret_file, cfg.kv_events_curve_clients_dir
    return CurveKeys.load(secret, peers, "--kv-events-curve-*")


__all__ = ["MEDIA", "KVEventPublisher", "block_hash", "encode_change"]


def rank0_events(
    serve_cfg: ServeConfig | None, page_size: int, eng: Engine
) -> KVEventPublisher | None:
    """Rank 0's KV event stream under several ranks (one per server: the tree is the same on
    every rank); None when the server publishes none."""
    if serve_cfg is None or not serve_cfg.kv_events_endpoint or eng.cache is None:
        return None
    listeners = Listeners()
    listeners.on_death.append(exit_process)  # its server sees rank 0 go, and stops
    return KVEventPublisher(serve_cfg, page_size, listeners)
