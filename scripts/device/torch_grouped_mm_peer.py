# PyTorch peer for issue 36's expert products alone: torch's grouped_mm (CUTLASS's grouped GEMM on Hopper) at the
# shapes of CudaGroupedGemmBench.CublasAndCudnnSameRun: one MoE layer's gate|up and down products for a 4096-token
# chunk routed uniformly at random (Qwen3-30B-A3B: 128 experts top 8, 2048 -> 2 x 768; DeepSeek-V2-Lite: 64 top 6,
# 2048 -> 2 x 1408), bf16, CUDA events, 20 timed reps after warm-ups. Prints one line per shape:
#   TORCH-GROUPED-MM <shape> ms=<per layer> tflops=<x>
# Usage (device): python3 .dev/torch_grouped_mm_peer.py [tokens per chunk, comma separated; default 4096]
import sys

import torch

print("torch", torch.__version__, torch.cuda.get_device_name(0), flush=True)
gmm = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm")
for T, (name, E, k, H, F) in [(int(t), s) for t in (sys.argv[1] if len(sys.argv) > 1 else "4096").split(",")
                               for s in [("qwen3-30b-a3b", 128, 8, 2048, 768), ("deepseek-v2-lite", 64, 6, 2048, 1408)]]:
    g = T * k
    picks = torch.rand(T, E, device="cuda").topk(k, dim=1).indices.flatten()
    counts = torch.bincount(picks, minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)  # cumulative ends
    xg = torch.randn(g, H, device="cuda", dtype=torch.bfloat16)
    act = torch.randn(g, F, device="cuda", dtype=torch.bfloat16)
    w_gu = torch.randn(E, 2 * F, H, device="cuda", dtype=torch.bfloat16) * 0.02
    w_down = torch.randn(E, H, F, device="cuda", dtype=torch.bfloat16) * 0.02
    def layer():
        a = gmm(xg, w_gu.transpose(-2, -1), offs=offs)
        b = gmm(act, w_down.transpose(-2, -1), offs=offs)
        return a, b
    for _ in range(3):
        layer()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        layer()
    e.record()
    torch.cuda.synchronize()
    ms = s.elapsed_time(e) / 20
    flops = 2.0 * g * H * 2 * F + 2.0 * g * F * H
    print(f"TORCH-GROUPED-MM T={T} {name} ms={ms:.3f} tflops={flops / (ms * 1e-3) / 1e12:.0f}", flush=True)
