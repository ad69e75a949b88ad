"""The decode worker's side of a hand-off (the decode role's KV connector).

Decode's own Lease matched and admitted the request over its tiers (device, host, storage prefetch
into host), locked the held prefix and allocated every other page; a request that names a prefill
worker then waits for remote KV (the scheduler plans none of its prompt). Once admitted, a
thread per hand-off sends prefill the keys of the pages decode holds and waits (bounded by
pd_timeout_s of silence) for exactly the missing pages and the first-token logits row. The
engine thread (the connector's get_finished) writes them into the request's own pages and the
engine emits the first token; or, on any failure, the request ends with 502/504 naming the
prefill endpoint and its pages go back (or, with pd_on_failure=local, it is prefilled here).
Meanwhile prefill may `pull` held pages it lacks: the engine thread copies them out of the
request's own (locked) pages and the hand-off thread sends them on the same channel.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any

import httpx2 as httpx
import torch
import zmq

from kvstrata.engine.engine import Engine
from kvstrata.engine.kv_connector import (
    EngineView,
    Finished,
    KVConnector,
    Landed,
    RemoteDone,
    RemoteFailed,
)
from kvstrata.engine.request import Request
from kvstrata.keyfile import read_key_file
from kvstrata.pd.config import PDConfig
from kvstrata.pd.cp_pages import mine, owners_of, received_pages
from kvstrata.pd.metrics import RankCounts
from kvstrata.pd.pages import host_pages, write_pages
from kvstrata.pd.transport import Transport
from kvstrata.pd.wire import (
    Layout,
    Received,
    WireError,
    assemble,
    header,
    pack_keys,
    pulled_message,
    read_header,
    read_layer,
    read_pages,
    typed,
)

POLL_S = 0.05  # how often a waiting hand-off checks for a cancel
WIRE_RETRIES = 1  # a reply that fails its checks (a checksum) is asked for again this often


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a hand-off thread hands the engine thread: pages, or (status, message)."""

    rid: str
    endpoint: str
    received: Received | None = None
    failure: tuple[int, str] | None = None
    pulled: int = 0  # held pages prefill pulled from here (every try)


class Resolver:
    """HTTP base URL of a prefill worker -> its transfer endpoint (from GET /v1/pd/info)."""

    def __init__(self, timeout_s: float, headers: dict[str, str] | None = None) -> None:
        self.timeout_s = timeout_s
        self.headers = headers or {}  # prefill's API key, when it has one
        self._known: dict[str, list[str]] = {}
        self._keys: dict[str, bytes] = {}  # target -> its CURVE public key (from its info)
        self._lock = threading.Lock()

    def endpoint(self, target: str, rank: int = 0) -> str:
        """The transfer endpoint of `target`'s rank `rank` (a multi-rank prefill worker has one
        per rank; a tcp:// target lists them comma-separated, rank order)."""
        eps = self._endpoints(target)
        if rank >= len(eps):
            raise OSError(
                f"{target} has {len(eps)} rank(s): none pairs with rank {rank} of this decode worker"
            )
        return eps[rank]

    def server_key(self, target: str) -> bytes:
        """`target`'s CURVE public key as its /v1/pd/info gave it (b"": none, or a tcp://
        target); read after `endpoint`."""
        with self._lock:
            return self._keys.get(target, b"")

    def endpoints_of(self, target: str) -> list[str]:
        """Every rank's transfer endpoint of `target`, rank order (cached until `forget`)."""
        return self._endpoints(target)

    def _endpoints(self, target: str) -> list[str]:
        if target.startswith("tcp://"):
            return target.split(",")
        with self._lock:
            if target in self._known:
                return self._known[target]
        url = f"{target.rstrip('/')}/v1/pd/info"
        info = httpx.get(url, timeout=self.timeout_s, headers=self.headers)
        if info.status_code != 200:
            hint = " (its API key: --pd-prefill-api-key-file)" if info.status_code == 401 else ""
            raise OSError(f"GET {target}/v1/pd/info answered {info.status_code}{hint}")
        body = info.json()
        if body.get("role") != "prefill" or not body.get("transfer_endpoint"):
            raise OSError(f"{target} is not a prefill worker (role {body.get('role')!r})")
        eps = list(body.get("transfer_endpoints") or [body["transfer_endpoint"]])
        with self._lock:
            self._known[target] = eps
            self._keys[target] = str(body.get("curve_public_key") or "").encode()
        return eps

    def expect(self, target: str, endpoints: list[str] | None) -> None:
        """The HTTP side checked that `target` now listens on `endpoints` (a prefill worker
        restarted on a new port, which the router already knows): a cache that differs is
        forgotten, so the hand-off reads the worker's info anew instead of dialling its old
        endpoint (this cache is the rank's own, apart from the HTTP side's)."""
        with self._lock:
            stale = endpoints is not None and self._known.get(target, endpoints) != endpoints
        if stale:
            self.forget(target)

    def forget(self, target: str) -> None:
        """After a failure: the worker may come back on another port."""
        with self._lock:
            self._known.pop(target, None)
            self._keys.pop(target, None)


class Handoff(threading.Thread):
    """One request's exchange with prefill on a fresh channel; ends by putting one Outcome."""

    def __init__(
        self, side: DecodeSide, req: Request, target: str, held: list[int], pages: list[int]
    ) -> None:
        """target: the prefill worker; held: keys of the pages decode holds; pages: the
        request's device pages (logical page -> device page)."""
        super().__init__(name=f"pd-handoff-{req.rid}", daemon=True)
        self.side, self.req, self.rid, self.target = side, req, req.rid, target
        # the endpoints the HTTP side checked `target` listens on (None: it named none)
        checked = (req.kv_params or {}).get("prefill_endpoints")
        self.checked_endpoints = [str(e) for e in checked] if isinstance(checked, list) else None
        self.hid = req.rid  # the hand-off id on the wire: a new one per attempt
        self.tokens, self.salt, self.held = req.tokens, req.cache_salt, held
        self.pages = pages
        self.n_pages = -(-len(req.tokens) // side.view.page_size)
        self.hits = dict(req.hits)  # what decode's own tiers served (usage.pd)
        self.cancelled = threading.Event()
        # named in a failure before the endpoint is resolved: the one the HTTP side checked
        rank = side.layout.rank
        eps = self.checked_endpoints or []
        self.endpoint = eps[rank] if rank < len(eps) else target
        self.layers: dict[int, list[memoryview]] = {}  # a layered hand-off's slices so far
        self.ch: Any = None  # this try's channel (the thread's own)
        self.pulled = 0  # held pages sent to prefill on its `pull`, every try
        # under cp (kvstrata/pd/cp_pages.py): decode's owner of each page it lacks, and the
        # prompt pages this rank owns (all it receives); None: every page of [held, n)
        self.owners: list[int] | None = None
        self.expect: list[int] | None = None

    def run(self) -> None:
        side = self.side
        for attempt in range(1 + WIRE_RETRIES):
            # a retry is a new hand-off: prefill may still be working on the first one
            self.layers, self.hid = {}, self.rid if not attempt else f"{self.rid}~{attempt}"
            try:
                side.resolver.expect(self.target, self.checked_endpoints)
                self.endpoint = side.resolver.endpoint(self.target, side.layout.rank)
                key = side.resolver.server_key(self.target)
                if not (key or side.cfg.pd_insecure or self.target.startswith("tcp://")):
                    raise ValueError(
                        f"{self.target} runs --pd-insecure (its /v1/pd/info names no CURVE key) "
                        "and this decode worker authenticates: start both alike"
                    )
                outcome = self._exchange(side.transport.connect(self.endpoint, self.hid, key))
            except WireError as exc:  # corrupted or inconsistent: nothing of it was used
                outcome = self._fail(502, f"bad hand-off reply: {exc}")
                if attempt < WIRE_RETRIES and not self.cancelled.is_set():
                    side.metrics.retried()
                    continue  # the same hand-off again, on a fresh channel
            except (OSError, httpx.HTTPError, zmq.ZMQError, ValueError) as exc:
                outcome = self._fail(502, f"unreachable: {type(exc).__name__}: {exc}")
            except Exception as exc:  # noqa: BLE001 - whatever prefill sent, the request ends
                outcome = self._fail(502, f"bad hand-off reply: {type(exc).__name__}: {exc}")
            break
        if outcome.failure is not None:
            side.resolver.forget(self.target)
        side.outcomes.put(outcome)

    def _fail(self, status: int, why: str) -> Outcome:
        msg = f"P/D hand-off of {self.rid} with prefill {self.endpoint} failed: {why}"
        return Outcome(self.rid, self.endpoint, failure=(status, msg))

    def _exchange(self, ch: Any) -> Outcome:
        cfg, self.ch = self.side.cfg, ch
        try:
            ask = dict(tokens=self.tokens, salt=self.salt, keys=pack_keys(self.held))
            if self.owners is not None:
                ask["owners"] = self.owners
            ch.send([header("handoff", self.hid, layout=self.side.layout.as_dict(), **ask)])
            heard = time.monotonic()
            while not self.cancelled.is_set():
                frames = ch.recv(min(POLL_S, cfg.pd_timeout_s))
                if frames is None:
                    dead = ch.unreachable(cfg.pd_heartbeat_s)  # refused or lost: a heartbeat
                    if dead is not None:
                        return self._fail(502, dead)
                    if time.monotonic() - heard > cfg.pd_timeout_s:
                        return self._fail(504, f"no answer within pd_timeout_s={cfg.pd_timeout_s}")
                    continue
                heard = time.monotonic()
                try:
                    done = self._on_message(frames)
                except WireError:
                    ch.send([header("cancel", self.hid)])  # prefill may stop what is left
                    raise
                if done is not None:
                    return done
            ch.send([header("cancel", self.hid)])  # prefill may stop computing for us
            return self._fail(499, "cancelled")
        finally:
            ch.close()

    def _on_message(self, frames: list[Any]) -> Outcome | None:
        head = read_header(frames)
        if head["id"] != self.hid or head["type"] == "heartbeat":
            return None
        if head["type"] == "refused":
            return self._fail(502, f"refused: {head.get('message', '?')}")
        if head["type"] == "pull":
            return self._answer_pull(typed(head, "first_page", int), typed(head, "end_page", int))
        layers, page_bytes = self.side.part  # this rank's part of a page
        if head["type"] == "layer":
            layer = typed(head, "layer", int, 0, layers - 1)
            self.layers[layer] = read_layer(head, frames, page_bytes // layers)
            return None
        if head["type"] != "pages":
            raise WireError(f"unexpected message type {head['type']!r}")
        got = read_pages(head, frames, page_bytes, want_state=self.side.wants_state)
        want = self.n_pages - len(self.held) if self.expect is None else len(self.expect)
        if head.get("layers"):  # the pages came layer by layer before this message
            got = dataclasses.replace(got, pages=assemble(self.layers, layers, want))
        if got.first_page != len(self.held) or len(got.pages) != want:
            raise WireError(
                f"sent pages [{got.first_page}, {got.first_page + len(got.pages)}), "
                f"expected [{len(self.held)}, {self.n_pages})"
            )
        received_pages(got, self.expect)  # under cp: exactly the pages this rank owns
        return Outcome(self.rid, self.endpoint, received=got, pulled=self.pulled)

    def _answer_pull(self, first: int, end: int) -> Outcome | None:
        """Send prefill held pages [first, end), copied by the engine thread (bounded wait)."""
        if self.owners is not None:  # a cp rank holds other pages than its peer would need
            raise WireError("prefill pulls held pages; not under cp > 1")
        if not 0 <= first < end <= len(self.held):
            raise WireError(f"prefill pulls pages [{first}, {end}); decode holds {len(self.held)}")
        reply: queue.SimpleQueue[list[Any] | None] = queue.SimpleQueue()
        self.side.pulls.put((self.rid, first, end, reply))
        limit = self.side.cfg.pd_timeout_s
        try:
            pages = reply.get(timeout=limit)
        except queue.Empty:
            self.ch.send([header("cancel", self.hid)])
            why = f"the engine thread did not copy held pages [{first}, {end}) within {limit} s"
            return self._fail(504, why)
        if pages is None:
            return None  # the request ended meanwhile: the hook cancels this hand-off
        self.ch.send(pulled_message(self.hid, first, pages))
        self.pulled += len(pages)
        self.side.metrics.pulled("pull_sent", len(pages), sum(p.nbytes for p in pages))
        return None


class DecodeSide(KVConnector):
    """The decode role's connector: starts a hand-off for each request that names a prefill
    worker and lands its pages (or fails it) between steps, on the engine thread.

    One rank lands an outcome as soon as it arrives. Under several ranks (`gate`, see
    kvstrata/pd/ranks.py) each rank only records what arrived; the step's consensus says which
    hand-offs every rank has (land them) or any rank failed (fail them), so every rank lands the
    same hand-offs at the same step, whatever the arrival times."""

    def __init__(
        self, cfg: PDConfig, transport: Transport, metrics: RankCounts, rank: int = 0
    ) -> None:
        self.cfg, self.transport, self.metrics, self.rank = cfg, transport, metrics, rank
        self.resolver = Resolver(cfg.pd_timeout_s, prefill_auth(cfg))
        self.layout: Layout = None  # type: ignore[assignment]  # set by attach()
        self.view: EngineView = None  # type: ignore[assignment]  # set by register_kv_caches
        self.wants_state = False  # an MTP head: replies must carry prefill's hidden state
        self.part = (0, 0)  # (layers, page bytes) of this rank's part of a page
        self.cp_rank = 0  # this rank's place in its cp group (set by RankPD)
        self.gate: Any = None  # kvstrata.pd.ranks.HandoffGate under several ranks
        self.outcomes: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        # prefill's pulls: (rid, first page, end page, reply queue) for the engine thread
        self.pulls: queue.SimpleQueue[tuple[str, int, int, Any]] = queue.SimpleQueue()
        self.active: dict[str, Handoff] = {}  # in admission order (the same on every rank)
        self.ready: dict[str, Outcome] = {}  # arrived here, not landed yet

    def attach(self, engine: Engine, layout: Layout, gate: Any = None) -> None:
        self.layout, self.gate = layout, gate
        engine.use_connector(self)

    def register_kv_caches(self, view: EngineView) -> None:
        self.view = view
        self.part = (view.pool.shape.num_layers, view.pool.shape.page_nbytes)
        self.wants_state = view.spec is not None and view.spec.wants_hidden

    # ---- the connector (engine thread) -----------------------------------------------------------
    def get_num_new_matched_tokens(self, req: Request, local_tokens: int) -> int:
        """A request naming a prefill worker gets every prompt token decode lacks from it."""
        if not (req.kv_params and req.kv_params.get("prefill")):
            return 0
        return len(req.tokens) - local_tokens

    def update_state_after_alloc(self, req: Request, pages: list[int], remote_tokens: int) -> None:
        if not remote_tokens:
            return
        assert req.kv_params is not None
        held = self.view.kv.held_keys(req)  # every tier: device, host (and what storage brought)
        h = Handoff(self, req, str(req.kv_params["prefill"]), held, pages)
        if self.layout.cp > 1:  # the same page tables on every cp rank: the same owners
            h.owners = owners_of(pages, len(held), h.n_pages, self.layout.cp)
            h.expect = mine(h.owners, len(held), self.cp_rank)
        self.active[req.rid] = h
        h.start()

    def request_finished(self, req: Request) -> bool:
        """Ended before its pages came (aborted: client gone): stop waiting for prefill. Decode
        reads no page of an ended request: they go back at once."""
        h = self.active.pop(req.rid, None)
        if h is not None:
            h.cancelled.set()
            self.ready.pop(req.rid, None)
        return False

    def get_finished(self, idle_wait_s: float) -> Finished:
        return Finished(remote=self._landings(idle_wait_s))

    def _landings(self, idle_wait_s: float) -> list[RemoteDone]:
        """The hand-offs that land (or fail) this step, in admission order."""
        self._collect(idle_wait_s)
        self._serve_pulls()
        gate = self.gate
        landing = gate.landable(self.ready) if gate else [(r, None) for r in self.ready]
        done: list[RemoteDone] = []
        for rid, failure in landing:
            h = self.active.pop(rid, None)
            if h is None:
                continue  # ended meanwhile; its pages are already back
            out = self.ready.pop(rid, None)
            if failure is not None and (out is None or out.failure is None):  # another rank's
                h.cancelled.set()
                out = Outcome(rid, h.endpoint, failure=failure)
            assert out is not None
            try:
                done.append(self._land(h, out))
            except Exception as exc:  # noqa: BLE001 - this hand-off fails alone
                why = f"P/D hand-off of {rid} failed landing: {type(exc).__name__}: {exc}"
                done.append(RemoteFailed(h.req, 500, why))
        return done

    def window(self) -> list[str]:
        """The hand-offs in flight, in admission order (the same list on every rank: it changes
        only by agreed steps)."""
        return list(self.active)

    def _collect(self, wait: float) -> None:
        """Outcomes that arrived (blocks up to `wait` for the first: only remote KV to wait on)."""
        while True:
            try:
                out = self.outcomes.get(timeout=wait) if wait else self.outcomes.get_nowait()
            except queue.Empty:
                return
            wait = 0.0
            if out.rid in self.active:
                self.ready[out.rid] = out

    def _serve_pulls(self) -> None:
        """Engine thread: copy out the held pages prefill pulls (locked by the request's lease,
        so nothing writes them; a host -> device load of some is waited for first)."""
        while True:
            try:
                rid, first, end, reply = self.pulls.get_nowait()
            except queue.Empty:
                return
            h = self.active.get(rid)
            if h is None:
                reply.put(None)
                continue
            self.view.kv.wait_loaded(h.req, self.cfg.pd_timeout_s)
            reply.put(host_pages(self.view.pool, h.pages[first:end]))

    def _land(self, h: Handoff, out: Outcome) -> RemoteDone:
        """Write the pages (the engine emits the first token), or fail the request."""
        if out.failure is not None:
            self.metrics.failed()
            if self.cfg.pd_on_failure == "local":
                return Landed(h.req, None)  # the engine prefills it from its held prefix on
            return RemoteFailed(h.req, *out.failure)
        got = out.received
        assert got is not None
        at, n = got.first_page, h.n_pages
        ids = [h.pages[i] for i in received_pages(got, None)]  # this rank's pages
        write_pages(self.view.pool, ids, got.pages)
        h.req.transfer = {
            "pages_received": n - at,  # every page decode lacked, over all its ranks
            # whole pages: every rank landed its verified part (equal to got.nbytes on one rank)
            "bytes_received": (n - at) * self.layout.page_bytes,
            "pages_skipped": sum(h.hits.values()),
            "pages_from_storage": h.hits["storage"],
            "prefill_computed_tokens": int(got.stats.get("computed_tokens", 0)),
            "pages_pulled": out.pulled,  # held pages prefill pulled from here
            "bytes_pulled": out.pulled * self.layout.page_bytes,
            # of those, the pages that passed prefill's checks (a failed one is computed)
            "pages_pulled_kept": int(got.stats.get("pulled_kept", 0)),
            "prefill": out.endpoint,
        }
        self.metrics.received(h.req.transfer, got.nbytes)
        state = None if got.state is None else torch.from_numpy(got.state)
        if state is not None:  # float32 on the wire; exact back in the model's dtype
            state = state.to(self.view.pool.device, self.view.pool.shape.torch_dtype)
        return Landed(h.req, len(h.req.tokens), torch.from_numpy(got.logits), state)


def prefill_auth(cfg: PDConfig) -> dict[str, str] | None:
    """The header decode sends its prefill workers' /v1/pd/info (None: they have no key)."""
    if not cfg.pd_prefill_api_key_file:
        return None
    key = read_key_file(cfg.pd_prefill_api_key_file, "--pd-prefill-api-key-file")
    return {"Authorization": f"Bearer {key}"}
