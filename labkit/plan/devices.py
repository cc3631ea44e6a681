"""Device presets for the planner: memory, peak FLOP/s and the bandwidths a step's time depends on.

A preset's memory is the vendor's "GB" read as GiB (2**30 bytes), because the DRAM of these boards comes in
power-of-two GiB stacks and chips (an A100 80GB has five 16 GiB HBM2e stacks); a size the user types is read as
written ("24GB" is 24 x 10**9 bytes, labkit.memory.units.parse_bytes). What a program can allocate is a little
less (ECC, the driver's reserve, the CUDA context), so a plan within a few per cent of the limit is tight.
FLOP/s are dense (no 2:4 sparsity). Bandwidths are bytes per second in ONE direction: a datasheet's
bidirectional figure is halved. Every figure names the datasheet it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.memory.units import GiB


@dataclass(frozen=True)
class Device:
    """One accelerator as the cost model sees it."""

    name: str  # preset key, e.g. "h100"
    title: str  # what it is, e.g. "NVIDIA H100 SXM5 80GB"
    memory: int  # bytes: the vendor's GB read as GiB (see the module docstring)
    tensor_flops: float  # dense bf16/fp16 tensor-core peak, FLOP/s (matmuls under bf16, fp16 and autocast)
    fp32_flops: float  # fp32 peak without tensor cores, FLOP/s (matmuls of a pure fp32 step)
    hbm_bw: float  # device memory bandwidth, bytes/s (memory-bound ops: optimizer steps, pointwise recompute)
    host_link: str  # how the device reaches host memory
    host_bw: float  # bytes/s one way over the host link (optimizer and activation offload)
    interconnect: str  # how devices reach each other
    link_bw: float  # bytes/s one way per device to its peers (collectives)
    bf16: bool = True  # bf16 tensor cores (a T4 has fp16 only: its 16-bit plans use fp16)

    @property
    def half(self) -> str:
        """The 16-bit format the device computes in: "bf16" or "fp16"."""
        return "bf16" if self.bf16 else "fp16"


# PCIe per direction, x16 link: gen3 ~16 GB/s, gen4 ~32 GB/s, gen5 ~64 GB/s (PCI-SIG base specifications 3.0,
# 4.0 and 5.0: 8, 16 and 32 GT/s per lane, 128b/130b encoding); the datasheets quote the bidirectional sum.
PCIE3, PCIE4, PCIE5 = 16e9, 32e9, 64e9

PRESETS: dict[str, Device] = {
    # NVIDIA T4 Tensor Core GPU datasheet: 16 GB GDDR6, 320 GB/s, 65 TFLOPS mixed-precision (FP16/FP32),
    # 8.1 TFLOPS FP32, PCIe Gen3 x16 (32 GB/s bidirectional); no NVLink: peers over PCIe; no bf16 (Turing)
    "t4": Device("t4", "NVIDIA T4 16GB", 16 * GiB, 65e12, 8.1e12, 320e9, "PCIe gen3 x16", PCIE3,
                 "PCIe gen3 x16", PCIE3, bf16=False),
    # NVIDIA A10 Tensor Core GPU datasheet: 24 GB GDDR6, 600 GB/s, BF16 tensor 125 TFLOPS (250 with sparsity),
    # FP32 31.2 TFLOPS, PCIe Gen4 64 GB/s (bidirectional); no NVLink
    "a10": Device("a10", "NVIDIA A10 24GB", 24 * GiB, 125e12, 31.2e12, 600e9, "PCIe gen4 x16", PCIE4,
                  "PCIe gen4 x16", PCIE4),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM): BF16 tensor 312 TFLOPS dense, FP32 19.5 TFLOPS,
    # 40GB HBM2 1,555 GB/s; 80GB HBM2e 2,039 GB/s; NVLink 600 GB/s (bidirectional); PCIe Gen4 64 GB/s
    "a100-40gb": Device("a100-40gb", "NVIDIA A100 SXM4 40GB", 40 * GiB, 312e12, 19.5e12, 1555e9, "PCIe gen4 x16",
                        PCIE4, "NVLink 3 (600 GB/s bidirectional)", 300e9),
    "a100-80gb": Device("a100-80gb", "NVIDIA A100 SXM4 80GB", 80 * GiB, 312e12, 19.5e12, 2039e9, "PCIe gen4 x16",
                        PCIE4, "NVLink 3 (600 GB/s bidirectional)", 300e9),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM): BF16 tensor 1,979 TFLOPS with sparsity = 989 dense,
    # FP32 67 TFLOPS, 80 GB HBM3 3.35 TB/s, NVLink 900 GB/s (bidirectional), PCIe Gen5 128 GB/s
    "h100": Device("h100", "NVIDIA H100 SXM5 80GB", 80 * GiB, 989e12, 67e12, 3.35e12, "PCIe gen5 x16", PCIE5,
                   "NVLink 4 (900 GB/s bidirectional)", 450e9),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): 141 GB HBM3e 4.8 TB/s; compute as the H100 SXM (BF16 989 dense,
    # FP32 67 TFLOPS); NVLink 900 GB/s, PCIe Gen5 128 GB/s
    "h200": Device("h200", "NVIDIA H200 SXM 141GB", 141 * GiB, 989e12, 67e12, 4.8e12, "PCIe gen5 x16", PCIE5,
                   "NVLink 4 (900 GB/s bidirectional)", 450e9),
}
ALIASES = {"a100": "a100-80gb", "a100-80": "a100-80gb", "a100-40": "a100-40gb"}

# This machine's CPU as a "device": no datasheet, so its figures are stated assumptions, good for relative times
# only: per core 2.5 GHz x 32 fp32 FLOP/cycle (one AVX-512 FMA unit: 16 lanes x 2), bf16 twice that (AVX512-BF16
# dot products); DRAM 51.2 GB/s, dual-channel DDR4-3200 (JEDEC JESD79-4: 25.6 GB/s per channel); "host" and
# "interconnect" are that same memory (an offload or a collective is a copy at DRAM bandwidth).
CPU_HZ, CPU_FP32_PER_CYCLE, CPU_DRAM_BW = 2.5e9, 32, 51.2e9


def cpu_device() -> Device:
    """This machine's CPU, its memory from labkit.device.describe (system RAM)."""
    from labkit.device import describe

    info = describe("cpu")
    cores = info.cores or 1
    fp32 = cores * CPU_HZ * CPU_FP32_PER_CYCLE
    memory = info.total_memory or 8 * GiB
    return Device("cpu", f"CPU: {info.name}, {cores} cores", memory, 2 * fp32, fp32, CPU_DRAM_BW,
                  "same memory", CPU_DRAM_BW, "shared memory", CPU_DRAM_BW)


def names() -> list[str]:
    """Every preset name, "cpu" last."""
    return [*PRESETS, "cpu"]


def get_device(name) -> Device:
    """A Device from a preset name (case-insensitive; "cpu" is this machine) or a Device itself."""
    if isinstance(name, Device):
        return name
    if not isinstance(name, str):
        raise ValueError(f"device preset must be a name, got {name!r}")
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key == "cpu":
        return cpu_device()
    if key not in PRESETS:
        raise ValueError(f"unknown device preset {name!r}; choose one of {', '.join(names())}")
    return PRESETS[key]


def closest(memory: int) -> Device:
    """The GPU preset whose memory is closest to `memory` bytes (ties: the larger): the speeds a plan assumes
    when only a memory size is given."""
    return min(PRESETS.values(), key=lambda d: (abs(d.memory - memory), -d.memory))
