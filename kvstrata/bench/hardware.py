"""Hardware and model profiles for the what-if simulator, each number with its public source.

Bandwidths are bytes/s in one direction; FLOP rates are dense (no sparsity) bf16 tensor-core
peaks. Achieved fractions (`mfu`, `link_efficiency`) are modelling assumptions, not datasheet
numbers, and are marked as such. Profiles are chosen by name through a registry.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.registry import Registry

GB = 1e9
TB = 1e12


@dataclass(frozen=True)
class Link:
    """A data path: sustained bandwidth (bytes/s, one direction) and per-transfer latency (s)."""

    name: str
    bandwidth: float
    latency_s: float

    def time(self, nbytes: float, lanes: int = 1) -> float:
        """Seconds to move `nbytes` over `lanes` such links in parallel (0 bytes costs nothing)."""
        return 0.0 if nbytes <= 0 else self.latency_s + nbytes / (self.bandwidth * lanes)


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_flops: float
    hbm_bytes: float


@dataclass(frozen=True)
class HardwareProfile:
    """One GPU server type plus the links the cache and the parallel layouts use."""

    name: str
    gpu: GPU
    gpus_per_node: int
    host_link: Link  # host <-> device, one per GPU
    intra_node: Link  # GPU <-> GPU inside a node (CP gather, PP activations)
    inter_node: Link  # RDMA NIC, one per GPU (P/D transfer, CP across nodes)
    storage: Link  # storage -> host per node
    host_bytes_per_gpu: float  # DRAM a node can give the host pool, per GPU
    mfu: float = 0.5  # assumption: prefill reaches ~50% of peak on long prompts
    kv_mem_fraction: float = (
        0.9  # assumption: HBM share usable for weights + KV (SGLang mem_fraction_static ~0.88)
    )


# --- GPUs -----------------------------------------------------------------------------------
# NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 TFLOPS *with sparsity* -> 989.5 dense; 80 GB HBM3.
H100_SXM = GPU("H100-SXM5-80GB", 989.5 * TB, 80 * GB)
# NVIDIA H200 datasheet (SXM): same Hopper tensor cores, BF16 1,979 TFLOPS sparse -> 989.5 dense; 141 GB HBM3e.
H200_SXM = GPU("H200-SXM-141GB", 989.5 * TB, 141 * GB)
# NVIDIA A100 datasheet (SXM4 80GB): BF16 312 TFLOPS dense (624 with sparsity); 80 GB HBM2e.
A100_SXM = GPU("A100-SXM4-80GB", 312 * TB, 80 * GB)
# NVIDIA L40S datasheet: BF16 362.05 TFLOPS dense (733 with sparsity); 48 GB GDDR6.
L40S = GPU("L40S-48GB", 362.05 * TB, 48 * GB)

# --- Links ----------------------------------------------------------------------------------
# PCI-SIG PCIe 5.0: 32 GT/s x16 = 63 GB/s raw per direction; ~80% achieved in DMA copies (assumption).
PCIE5_X16 = Link("PCIe Gen5 x16", 63 * GB * 0.8, 10e-6)
# PCI-SIG PCIe 4.0: 16 GT/s x16 = 31.5 GB/s raw per direction; ~80% achieved (assumption).
PCIE4_X16 = Link("PCIe Gen4 x16", 31.5 * GB * 0.8, 10e-6)
# NVIDIA H100 datasheet: NVLink 4 900 GB/s bidirectional per GPU -> 450 GB/s per direction.
NVLINK4 = Link("NVLink 4", 450 * GB, 5e-6)
# NVIDIA A100 datasheet: NVLink 3 600 GB/s bidirectional per GPU -> 300 GB/s per direction.
NVLINK3 = Link("NVLink 3", 300 * GB, 5e-6)
# NVIDIA ConnectX-7 / Quantum-2 NDR: 400 Gb/s per port = 50 GB/s; ~2 us RDMA latency (NVIDIA docs).
RDMA_400G = Link("400 Gb/s RDMA (ConnectX-7 NDR)", 50 * GB, 2e-6)
# NVIDIA ConnectX-6 HDR: 200 Gb/s per port = 25 GB/s.
RDMA_200G = Link("200 Gb/s RDMA (ConnectX-6 HDR)", 25 * GB, 2e-6)
# Typical data-center PCIe Gen4 NVMe SSD (e.g. Samsung PM9A3 datasheet: 6.9 GB/s sequential read,
# ~90 us 4 KB read latency); a node striping 4 such drives reaches ~27 GB/s.
NVME_4X_GEN4 = Link("4x Gen4 NVMe (local)", 4 * 6.9 * GB, 90e-6)
# Shared network storage reached over one 200 Gb/s NIC per node (e.g. a distributed KV store or
# DeepSeek 3FS client over RDMA); ~1 ms per batched request including the metadata round trip (assumption).
NET_STORAGE_200G = Link("network storage over 200 Gb/s", 25 * GB, 1e-3)

PROFILES: Registry[HardwareProfile] = Registry("hardware profile")


def _add(profile: HardwareProfile) -> None:
    PROFILES.register(profile.name)(lambda: profile)


# DGX H100: 8 GPUs, 2 TB DDR5 per node (NVIDIA DGX H100 datasheet) -> 256 GB per GPU; give the host
# pool half.
_add(
    HardwareProfile("h100-nvme", H100_SXM, 8, PCIE5_X16, NVLINK4, RDMA_400G, NVME_4X_GEN4, 128 * GB)
)
_add(
    HardwareProfile(
        "h100-netstore", H100_SXM, 8, PCIE5_X16, NVLINK4, RDMA_400G, NET_STORAGE_200G, 128 * GB
    )
)
# HGX H200 boards use the same 8-GPU NVLink 4 / PCIe Gen5 platform as H100.
_add(
    HardwareProfile("h200-nvme", H200_SXM, 8, PCIE5_X16, NVLINK4, RDMA_400G, NVME_4X_GEN4, 128 * GB)
)
# DGX A100: 8 GPUs, 1 TB (2 TB option) DDR4 per node (NVIDIA DGX A100 datasheet) -> 64 GB per GPU to
# host memory.
_add(
    HardwareProfile("a100-nvme", A100_SXM, 8, PCIE4_X16, NVLINK3, RDMA_200G, NVME_4X_GEN4, 64 * GB)
)
# L40S servers: PCIe only, no NVLink -> GPU-to-GPU traffic crosses PCIe Gen4.
_add(HardwareProfile("l40s-nvme", L40S, 8, PCIE4_X16, PCIE4_X16, RDMA_200G, NVME_4X_GEN4, 64 * GB))


def get_profile(name: str) -> HardwareProfile:
    """The named profile; an unknown name is a ValueError listing the known ones."""
    return PROFILES.create(name)


@dataclass(frozen=True)
class ModelSpec:
    """The shape numbers the cost model needs (from each model's Hugging Face config.json)."""

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    params: float  # parameter count
    dtype_bytes: int = 2  # bf16 weights and KV

    def kv_bytes_per_token(self) -> int:
        """K and V of every layer: 2 * layers * kv_heads * head_dim * dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def prefill_flops(self, start: int, end: int) -> float:
        """FLOPs to prefill tokens [start, end) with [0, start) cached.

        Dense: 2 * params per token. Attention: QK^T and AV cost 2 * 2 * heads * head_dim per
        (query, key) pair per layer; causal, so query t sees t + 1 keys -> sum over t of (t + 1).
        """
        n = max(0, end - start)
        pairs = (end * (end + 1) - start * (start + 1)) / 2
        return (
            2.0 * self.params * n + 4.0 * self.num_layers * self.num_heads * self.head_dim * pairs
        )


MODELS: Registry[ModelSpec] = Registry("model spec")


def _model(spec: ModelSpec) -> None:
    MODELS.register(spec.name)(lambda: spec)


# meta-llama/Llama-3.1-8B config.json: 32 layers, hidden 4096, 32 heads, 8 KV heads; 8.03B params.
_model(ModelSpec("llama-3.1-8b", 32, 4096, 32, 8, 128, 8.03e9))
# meta-llama/Llama-3.1-70B config.json: 80 layers, hidden 8192, 64 heads, 8 KV heads; 70.6B params.
_model(ModelSpec("llama-3.1-70b", 80, 8192, 64, 8, 128, 70.6e9))
# Qwen/Qwen2.5-7B config.json: 28 layers, hidden 3584, 28 heads, 4 KV heads; 7.62B params.
_model(ModelSpec("qwen2.5-7b", 28, 3584, 28, 4, 128, 7.62e9))
# HuggingFaceTB/SmolLM2-135M config.json: 30 layers, hidden 576, 9 heads, 3 KV heads; 135M params.
_model(ModelSpec("smollm2-135m", 30, 576, 9, 3, 64, 0.135e9))


def get_model(name: str) -> ModelSpec:
    return MODELS.create(name)
