"""Cost model of one prefill: compute of the missed suffix and the transfers around it.

Every term is the *exposed* time (the part not hidden behind compute), so a request's TTFT is the
plain sum of its terms. Overlaps modelled (the rest is serial):
- host->device load is layer by layer: layer l+1 is copied while layer l computes, so only the first
  layer's copy and whatever the copies take beyond compute is exposed.
- The CP gather uses two scratch buffers alternating across layers: same pipeline shape.
- The P/D transfer streams layer by layer to the decode worker as layers finish: same shape.
- The storage->host prefetch starts at arrival and overlaps queueing (see simulate.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvstrata.bench.hardware import HardwareProfile, Link, ModelSpec


@dataclass(frozen=True)
class Topology:
    """One serving instance: tensor, context and pipeline parallel sizes, P/D disaggregation."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    pd: bool = False

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp

    @property
    def label(self) -> str:
        parts = [f"tp{self.tp}"] + [
            f"{n}{v}" for n, v in (("cp", self.cp), ("pp", self.pp)) if v > 1
        ]
        return "-".join(parts + (["pd"] if self.pd else []))

    @classmethod
    def parse(cls, text: str) -> Topology:
        """'tp4-cp2-pp1-pd' (any order, '-' or ',' separated; missing sizes are 1)."""
        sizes: dict[str, int] = {}
        pd = False
        for part in text.replace(",", "-").split("-"):
            part = part.strip().lower()
            if part == "pd":
                pd = True
            elif part[:2] in ("tp", "cp", "pp") and part[2:].lstrip("=").isdigit():
                sizes[part[:2]] = int(part[2:].lstrip("="))
            elif part:
                raise ValueError(f"bad topology {text!r}: {part!r} is not tpN, cpN, ppN or pd")
        return cls(sizes.get("tp", 1), sizes.get("cp", 1), sizes.get("pp", 1), pd)

    def check(self, model: ModelSpec) -> None:
        """Clear errors for a layout the model cannot be split into."""
        for name in ("tp", "cp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if model.num_kv_heads % self.tp:
            raise ValueError(
                f"tp={self.tp} does not divide {model.name}'s {model.num_kv_heads} KV heads"
            )
        if model.num_heads % self.tp:
            raise ValueError(
                f"tp={self.tp} does not divide {model.name}'s {model.num_heads} attention heads"
            )
        if self.pp > model.num_layers:
            raise ValueError(f"pp={self.pp} exceeds {model.name}'s {model.num_layers} layers")


@dataclass(frozen=True)
class Costs:
    """Exposed seconds of one prefill, before queueing."""

    compute_s: float
    load_s: float
    prefetch_s: float  # full storage->host time; simulate.py hides the part that overlaps queueing
    gather_s: float
    pd_transfer_s: float
    pd_bytes: float = 0.0
    """KV bytes prefill sends decode (P/D only): the tokens the decode worker lacks."""

    @property
    def busy_s(self) -> float:
        """Time the instance's GPUs are occupied (the P/D send runs on the NIC afterwards)."""
        return self.compute_s + self.load_s + self.gather_s


def pipelined(transfer_s: float, compute_s: float, layers: int) -> float:
    """Exposed part of a per-layer transfer overlapped with per-layer compute.

    The first layer's share cannot overlap; afterwards each layer's copy hides behind the
    previous layer's compute, so only the excess shows.
    """
    if transfer_s <= 0:
        return 0.0
    first = transfer_s / layers
    rest = (transfer_s - compute_s) * (layers - 1) / layers
    return first + max(0.0, rest)


class CostModel:
    """Prefill costs for one model on one hardware profile and topology."""

    def __init__(self, model: ModelSpec, hw: HardwareProfile, topo: Topology) -> None:
        topo.check(model)
        self.model, self.hw, self.topo = model, hw, topo
        self.kv_per_token = model.kv_bytes_per_token()
        self.nodes = math.ceil(topo.gpus / hw.gpus_per_node)
        # A TP x CP group that spans nodes talks over RDMA; inside one node over NVLink / PCIe.
        self.group_link: Link = (
            hw.intra_node if topo.tp * topo.cp <= hw.gpus_per_node else hw.inter_node
        )

    def capacity_tokens(self) -> tuple[int, int]:
        """(device, host) tokens this instance can cache: HBM left after weights, and host DRAM."""
        hw, m, g = self.hw, self.model, self.topo.gpus
        weights = m.params * m.dtype_bytes
        kv_hbm = hw.gpu.hbm_bytes * hw.kv_mem_fraction * g - weights
        if kv_hbm <= 0:
            raise ValueError(f"{m.name} weights do not fit {g} x {hw.gpu.name}; raise tp/pp")
        return int(kv_hbm // self.kv_per_token), int(hw.host_bytes_per_gpu * g // self.kv_per_token)

    def costs(self, prompt: int, device: int, host: int, storage: int) -> Costs:
        """Costs of a prompt of `prompt` tokens whose first device + host + storage come from the
        tiers."""
        hit = device + host + storage
        if not 0 <= hit <= prompt:
            raise ValueError(f"hit tokens {hit} outside [0, {prompt}]")
        m, hw, topo = self.model, self.hw, self.topo
        layers = m.num_layers
        # CP splits the tokens by page and TP splits the heads: tp * cp GPUs share the FLOPs; PP
        # stages run one after another for a single prompt, plus one activation hop per stage.
        flops = m.prefill_flops(hit, prompt)
        compute = flops / (topo.tp * topo.cp * hw.gpu.bf16_flops * hw.mfu)
        if topo.pp > 1 and prompt > hit:
            act = (prompt - hit) * m.hidden * m.dtype_bytes
            compute += (topo.pp - 1) * self.group_link.time(act)
        # Each GPU holds 1/gpus of a page's bytes (heads / tp, layers / pp, pages / cp) and
        # copies them over its own host link, all GPUs in parallel.
        load_bytes = (host + storage) * self.kv_per_token
        load = pipelined(hw.host_link.time(load_bytes, lanes=topo.gpus), compute, layers)
        prefetch = hw.storage.time(storage * self.kv_per_token, lanes=self.nodes)
        gather = 0.0
        if topo.cp > 1:  # each rank receives the pages it does not own, of the whole context
            per_rank = prompt * self.kv_per_token / (topo.tp * topo.pp) * (topo.cp - 1) / topo.cp
            gather = pipelined(self.group_link.time(per_rank), compute, layers)
        pd, sent = 0.0, 0.0
        if topo.pd:
            # Decode matches first (docs/PD.md): it holds the `hit` prefix (its own tiers or the
            # shared storage), so only the missed suffix, computed by prefill, goes over RDMA. Token
            # granularity: the real send rounds up to whole pages (< one page more a request).
            sent = float((prompt - hit) * self.kv_per_token)
            pd = pipelined(hw.inter_node.time(sent, lanes=topo.gpus), compute, layers)
        return Costs(compute, load, prefetch, gather, pd, sent)
