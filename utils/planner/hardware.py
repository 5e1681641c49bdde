"""The GPUs and their links: presets (HARDWARE), a cluster of nodes (Cluster), the memory a layout may fill, and
which groups of ranks stay inside a node."""

from dataclasses import dataclass

# Memory the planner never fills: the CUDA context, NCCL's buffers and cuBLAS/attention workspaces (a fixed amount),
# and the caching allocator's fragmentation (a share of the GPU). PyTorch's allocator commonly loses 5-10 % to it.
RESERVE_FIXED = 3e9
RESERVE_FRACTION = 0.05


# GPU presets: dense bf16 peak, HBM bandwidth, NVLink bandwidth per GPU each way, NIC bandwidth per GPU each way,
# from NVIDIA's A100 datasheet (2021), H100 datasheet (2023) and H200 product brief (2024); the H800 is the H100 with
# NVLink cut to 400 GB/s in all (Zhao et al., "Insights into DeepSeek-V3", ISCA 2025, arXiv:2505.09343, section 4.1).
# Latencies: the order NCCL shows
# per ring step.
# MATMUL_EFFICIENCY, the share of peak the matmuls reach inside a real training loop, is the planner's one fitted
# number: fitted once, to Narayanan et al. 2021's Table 1 (ten GPT runs of Megatron-LM from 1.7B to 1T parameters on
# A100s, the widest range of sizes one software ran: the geometric mean of predicted over published TFLOP/s is 1), and
# used for every GPU and every other published run, which it then predicts (utils/published_runs.py). cuBLAS alone
# reaches more on large shapes (about 80 % of an A100's peak); the difference is what the planner does not model:
# the optimizer step, data loading, launch gaps, clocks under power limits.
MATMUL_EFFICIENCY = 0.6
# A fused attention kernel runs its FLOPs at its own rate, and which kernel runs is a choice (Layout.attention_kernel).
# ATTENTION_SPEED is each kernel's FLOP rate, forward and backward, as a share of cuBLAS's large matmuls on the same
# GPU (about 80 % of an A100's peak, 75 % of an H100's, 742 TFLOP/s), so that the planner's in-loop matmul efficiency
# scales both alike. Each kernel's rates count the FLOPs as the FlashAttention papers do (backward 2.5 x forward).
# - fa2, FlashAttention-2 on an A100: 50-73 % of its peak (Dao 2023, arXiv:2307.08691), about 60 % / 80 % = 0.75
#   both ways. On an H100 (Shah et al. 2024, FlashAttention-3, arXiv:2407.08608, its speed figures for head
#   dimension 128, bf16/fp16, 16K tokens): 370 TFLOP/s forward, 322 backward: 0.50 and 0.43. The planner's default,
#   and what utils/published_runs.py assumes for Llama 3.
# - fa3, FlashAttention-3 (the same figures): 648 TFLOP/s forward, 561 backward: 0.87 and 0.76. Hopper only (it uses
#   the H100's asynchronous copies and warpgroup matmuls). Its headline 740 TFLOP/s is the forward at head size 256.
# - cudnn, cuDNN's fused attention as that paper measured it beside FlashAttention-3 (same figures): 595 forward, 516
#   backward: 0.80 and 0.70. Listed for Hopper, where it was measured.
ATTENTION_SPEED = {
    "fa2": {"A100": (0.75, 0.75), "H100": (0.50, 0.43), "H200": (0.50, 0.43), "H800": (0.50, 0.43)},
    "fa3": {"H100": (0.87, 0.76), "H200": (0.87, 0.76), "H800": (0.87, 0.76)},
    "cudnn": {"H100": (0.80, 0.70), "H200": (0.80, 0.70), "H800": (0.80, 0.70)},
}


def kernel_speeds(gpu: str) -> tuple[tuple[str, float], ...]:
    """(kernel, speed) for every kernel that runs on this GPU preset."""
    return tuple((kernel, speeds[gpu]) for kernel, speeds in ATTENTION_SPEED.items() if gpu in speeds)


HARDWARE = {
    "A100": dict(
        name="A100 SXM 80GB", memory=80e9, peak_flops=312e12, hbm_bandwidth=2.0e12, intra_bandwidth=300e9,
        inter_bandwidth=25e9, matmul_efficiency=MATMUL_EFFICIENCY, attention_speeds=kernel_speeds("A100"),
    ),  # NVLink 3: 600 GB/s in all; one 200 Gb/s HDR InfiniBand NIC per GPU (DGX A100, Selene)
    "H100": dict(
        name="H100 SXM 80GB", memory=80e9, peak_flops=989e12, hbm_bandwidth=3.35e12, intra_bandwidth=450e9,
        inter_bandwidth=50e9, matmul_efficiency=MATMUL_EFFICIENCY, attention_speeds=kernel_speeds("H100"),
    ),  # NVLink 4: 900 GB/s in all; one 400 Gb/s NDR InfiniBand (or RoCE) NIC per GPU
    "H200": dict(
        name="H200 SXM 141GB", memory=141e9, peak_flops=989e12, hbm_bandwidth=4.8e12, intra_bandwidth=450e9,
        inter_bandwidth=50e9, matmul_efficiency=MATMUL_EFFICIENCY, attention_speeds=kernel_speeds("H200"),
    ),  # the H100's compute and links, more and faster memory
    "H800": dict(
        name="H800 SXM 80GB", memory=80e9, peak_flops=989e12, hbm_bandwidth=3.35e12, intra_bandwidth=200e9,
        inter_bandwidth=50e9, matmul_efficiency=MATMUL_EFFICIENCY, attention_speeds=kernel_speeds("H800"),
    ),  # NVLink 400 GB/s in all; 400 Gb/s InfiniBand per GPU
}  # fmt: skip


@dataclass(frozen=True)
class Cluster:
    """GPUs, nodes and links. The defaults describe H100 SXM nodes (HARDWARE["H100"]); Cluster.of("A100", gpus) takes
    another preset."""

    gpus: int
    gpus_per_node: int = 8
    memory: float = 80e9  # bytes per GPU
    peak_flops: float = 989e12  # dense bf16 FLOP/s per GPU
    intra_bandwidth: float = 450e9  # bytes/s per GPU inside a node, each way
    inter_bandwidth: float = 50e9  # bytes/s per GPU between nodes, each way
    intra_latency: float = 5e-6  # seconds per message inside a node
    inter_latency: float = 10e-6  # seconds per message between nodes
    matmul_efficiency: float = MATMUL_EFFICIENCY  # share of peak the matmuls reach in a training loop
    hbm_bandwidth: float = 3.35e12  # bytes/s of the GPU's own memory
    attention_speeds: tuple = kernel_speeds("H100")  # (kernel, (forward, backward) FLOP rate as shares of matmuls')
    name: str = "H100 SXM 80GB"

    @classmethod
    def of(cls, gpu: str, gpus: int, gpus_per_node: int = 8, **overrides) -> "Cluster":
        if gpu not in HARDWARE:
            raise ValueError(f"unknown GPU {gpu!r}: one of {', '.join(HARDWARE)}")
        return cls(gpus, gpus_per_node, **{**HARDWARE[gpu], **overrides})

    @property
    def usable_memory(self) -> float:
        """What a layout may fill: the memory less the reserve (RESERVE_FIXED, RESERVE_FRACTION)."""
        return self.memory * (1 - RESERVE_FRACTION) - RESERVE_FIXED

    @property
    def matmul_flops(self) -> float:
        return self.peak_flops * self.matmul_efficiency

    def gemm_seconds(self, m: float, k: float, n: float) -> float:
        """One (m x k) @ (k x n) matrix product in 16-bit values on the roofline (NVIDIA's Matrix Multiplication
        Background User's Guide, "Understanding Performance"): its 2mkn FLOPs at the matmul rate, or the 2(mk + kn + mn)
        bytes it reads and writes at the HBM bandwidth when those take longer. The second wins when the arithmetic
        intensity, mkn / (mk + kn + mn) FLOPs a byte, falls below the rate over the bandwidth: about the smallest
        dimension once the other two are large, so a product of few tokens (an expert's share of a micro-batch)
        streams its weights instead of computing. The backward's two products have the same three dimensions."""
        return max(2 * m * k * n / self.matmul_flops, 2 * (m * k + k * n + m * n) / self.hbm_bandwidth)

    def attention_flops(self, kernel: str | None, backward: bool = False) -> float:
        """FLOP/s of the attention's scores and their product with V, forward or backward: the fused kernel's
        (ATTENTION_SPEED; one number stands for both directions), or batched matmuls' (kernel None: unfused)."""
        if kernel is None:
            return self.matmul_flops
        speeds = dict(self.attention_speeds)
        if kernel not in speeds:
            raise ValueError(f"attention kernel {kernel!r} does not run on {self.name}: one of {', '.join(speeds)}")
        speed = speeds[kernel]
        return self.matmul_flops * (speed[backward] if isinstance(speed, tuple) else speed)

    def link(self, inside_node: bool) -> tuple[float, float]:
        """(bandwidth, latency) of the link a group uses: the slow one as soon as it leaves a node."""
        if inside_node:
            return self.intra_bandwidth, self.intra_latency
        return self.inter_bandwidth, self.inter_latency


def inside_one_node(stride: int, size: int, gpus_per_node: int) -> bool:
    """Whether every group of `size` ranks spaced `stride` apart stays inside a node (ranks fill nodes in order).
    The rank grid puts TP innermost (stride 1), then CP, DP, then PP."""
    span = stride * size
    return span <= gpus_per_node and gpus_per_node % span == 0
