"""Loom's MoE block vs a PyTorch MoE block on the same shapes: forward + backward of one block.

The peer is transformers' Qwen3MoeSparseMoeBlock (softmax router, top-k with renormalisation, experts
as stacked gate_up / down weights, index_add combination) — what a Qwen3-MoE model runs in PyTorch.
Both get random N(0, 0.02) weights, the same token count, dims and threads, on the CPU; each reports
the median seconds of forward + backward over the timed steps and its peak RSS growth over them
(VmHWM reset before the timed steps). Prints tokens/s of both and the ratios.

Only expert parallelism 1 exists so far (issue 25's EP 2 column waits for the `ep` dimension).

Usage: .venv/bin/python bench/moe_vs_pytorch.py [--tokens 2048] [--dim 512] [--ffn 256]
       [--experts 16] [--top-k 4] [--steps 5] [--warmup 2] [--threads 2] [--loom-bench build/bin/loom_bench_moe]
"""

import argparse
import json
import os
import statistics
import subprocess
import time

import torch


def rss_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def pytorch_block(a):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    config = Qwen3MoeConfig(hidden_size=a.dim, moe_intermediate_size=a.ffn, num_experts=a.experts,
                            num_experts_per_tok=a.top_k, norm_topk_prob=True)
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config).to(torch.float32)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    x = torch.randn(1, a.tokens, a.dim)
    times = []
    baseline = rss_bytes("VmRSS")
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            reset_peak_rss()
        block.zero_grad(set_to_none=True)
        inp = x.detach().requires_grad_(True)
        start = time.perf_counter()
        out = block(inp)
        out = out[0] if isinstance(out, tuple) else out
        out.sum().backward()
        if i >= a.warmup:
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {"seconds": median, "tokens_per_s": a.tokens / median,
            "peak_rss_growth_mib": max(0, rss_bytes("VmHWM") - baseline) / 2**20}


def main():
    p = argparse.ArgumentParser()
    for name, default in [("tokens", 2048), ("dim", 512), ("ffn", 256), ("experts", 16), ("top-k", 4),
                          ("steps", 5), ("warmup", 2), ("threads", 2)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--loom-bench", default=os.path.join(os.path.dirname(__file__), "..", "build", "bin", "loom_bench_moe"))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    cmd = [a.loom_bench, "--tokens", str(a.tokens), "--dim", str(a.dim), "--ffn", str(a.ffn), "--experts",
           str(a.experts), "--top-k", str(a.top_k), "--steps", str(a.steps), "--warmup", str(a.warmup),
           "--threads", str(a.threads)]
    loom = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
    torch_fig = pytorch_block(a)
    print(f"MoE block forward+backward: {a.tokens} tokens, dim {a.dim}, {a.experts} experts of ffn {a.ffn}, "
          f"top {a.top_k}, {a.threads} threads")
    for name, f in (("Loom", loom), ("PyTorch (transformers Qwen3MoeSparseMoeBlock)", torch_fig)):
        print(f"  {name}: {f['seconds'] * 1e3:.1f} ms, {f['tokens_per_s']:.0f} tokens/s, "
              f"peak RSS growth {f['peak_rss_growth_mib']:.1f} MiB")
    print(f"  Loom / PyTorch tokens/s: {loom['tokens_per_s'] / torch_fig['tokens_per_s']:.2f}x; "
          f"peak RSS growth ratio: {loom['peak_rss_growth_mib'] / max(torch_fig['peak_rss_growth_mib'], 1e-9):.2f}")


if __name__ == "__main__":
    main()
