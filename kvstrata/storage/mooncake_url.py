"""The `mooncake://` storage URL: which Mooncake Store master to join and how.

    mooncake://HOST:RPC_PORT?metadata=URL&segment=BYTES&buffer=BYTES&protocol=tcp&device=NAMES
                            &local=HOST&prefix=TEXT

HOST:RPC_PORT is the master's RPC address. `metadata` is the transfer engine's metadata server
(default `http://HOST:8080/metadata`, the master's own HTTP metadata server); `segment` is the
memory this client contributes to the shared store (default 0: a fleet's memory comes from
standalone holders, `mooncake_client --global_segment_size=...`, so objects outlive the serving
processes that wrote them; a segment given here leaves with its process) and `buffer` its local
transfer buffer (bytes, with an optional k/m/g binary suffix); `protocol` is `tcp` (default) or `rdma` (then `device`
names the RDMA devices); `local` is the address other clients reach this one on (default
127.0.0.1); `prefix` starts every object key (default `kvstrata:`; 32 hex digits follow).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
_KNOWN = ("metadata", "segment", "buffer", "protocol", "device", "local", "prefix")
PROTOCOLS = ("tcp", "rdma")


@dataclass(frozen=True)
class MooncakeTarget:
    """One Mooncake Store client's settings, parsed from a `mooncake://` URL."""

    master: str  # "host:rpc_port" of mooncake_master
    metadata: str  # the transfer engine's metadata server URL
    segment_bytes: int  # memory this client contributes to the store (0 = none, a pure reader)
    buffer_bytes: int  # the client's local transfer buffer
    protocol: str  # "tcp" or "rdma"
    device: str  # RDMA device names ("" for tcp)
    local_host: str  # the address other clients reach this client's segment on
    prefix: str  # every object key starts with this

    @property
    def client_id(self) -> tuple[str, str, int, int, str, str, str]:
        """What one shared client is keyed on (everything but the key prefix)."""
        return (
            self.master, self.metadata, self.segment_bytes, self.buffer_bytes,
            self.protocol, self.device, self.local_host,
        )  # fmt: skip


def parse_size(text: str, name: str) -> int:
    """'268435456' or '256m' -> bytes; ValueError naming `name` otherwise."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1:] if t[-1:] in _SUFFIX and not t[-1:].isdigit() else ""
    digits = t[: len(t) - len(unit)]
    if not digits.isdigit():
        raise ValueError(f"mooncake URL: {name}={text!r} is not a byte count (e.g. 256m)")
    return int(digits) * _SUFFIX[unit]


def parse_mooncake_url(url: str) -> MooncakeTarget:
    """The target named by `url`; ValueError naming the bad part."""
    parts = urlsplit(url)
    if parts.scheme != "mooncake":
        raise ValueError(f"not a mooncake:// URL: {url!r}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError as e:
        raise ValueError(f"mooncake URL {url!r}: bad port ({e})") from None
    if not host or not port:
        raise ValueError(f"mooncake URL {url!r} needs the master as HOST:RPC_PORT")
    query = parse_qs(parts.query, keep_blank_values=True)
    unknown = sorted(set(query) - set(_KNOWN))
    if unknown:
        raise ValueError(f"mooncake URL {url!r}: unknown option(s) {unknown}; known: {_KNOWN}")

    def opt(name: str, default: str) -> str:
        return query.get(name, [default])[-1]

    protocol = opt("protocol", "tcp")
    if protocol not in PROTOCOLS:
        raise ValueError(f"mooncake URL {url!r}: protocol must be one of {PROTOCOLS}")
    buffer_bytes = parse_size(opt("buffer", "64m"), "buffer")
    if buffer_bytes <= 0:
        raise ValueError(f"mooncake URL {url!r}: buffer must be > 0")
    return MooncakeTarget(
        master=f"{host}:{port}",
        metadata=opt("metadata", f"http://{host}:8080/metadata"),
        segment_bytes=parse_size(opt("segment", "0"), "segment"),
        buffer_bytes=buffer_bytes,
        protocol=protocol,
        device=opt("device", ""),
        local_host=opt("local", "127.0.0.1"),
        prefix=opt("prefix", "kvstrata:"),
    )


def mooncake_sibling_url(url: str, suffix: str) -> str:
    """`url` with its key prefix extended by `suffix` (a separate namespace, same client)."""
    target = parse_mooncake_url(url)
    parts = urlsplit(url)
    query = [(k, v) for k, vs in parse_qs(parts.query, keep_blank_values=True).items() for v in vs]
    query = [(k, v) for k, v in query if k != "prefix"] + [("prefix", target.prefix + suffix)]
    return urlunsplit(parts._replace(query=urlencode(query, safe=":/")))
