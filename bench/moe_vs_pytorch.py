"""Loom's MoE block vs a PyTorch MoE block on the same shapes: forward + backward of one block.

The peer is transformers' Qwen3MoeSparseMoeBlock (softmax router, top-k with renormalisation, experts
as stacked gate_up / down weights, index_add combination) — what a Qwen3-MoE model runs in PyTorch.
Both get random N(0, 0.02) weights, the same token count, dims and threads, on the CPU; each reports
the median seconds of forward + backward over the timed steps and its peak RSS growth over them
(VmHWM reset before the timed steps). Prints tokens/s of both and the ratios.

Two tables:
  1 process   --threads threads: Loom's block vs PyTorch's.
  2 ranks     one thread each, every rank its own tokens: PyTorch's block on each (data parallel),
              Loom's at EP 1 (each rank all experts, no exchange) and at EP 2 (each rank half the
              experts, tokens dispatched and combined by all-to-all): aggregate tokens/s, the
              largest per-rank RSS growth, and Loom EP 2's all-to-all bytes per rank and step,
              measured and by the formula of docs/moe.md (they must be equal).

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


def pytorch_rank(args_json):
    """One rank of the 2-rank PyTorch table (a child process, one thread)."""
    a = argparse.Namespace(**json.loads(args_json))
    torch.set_num_threads(1)
    print(json.dumps(pytorch_block(a)))


def loom_ranks(a, ep):
    loom = os.path.join(os.path.dirname(a.loom_bench), "loom")
    cmd = [loom, "launch", "--nproc", "2", "--exec", "--", a.loom_bench, "--tokens", str(a.tokens), "--dim", str(a.dim),
           "--ffn", str(a.ffn), "--experts", str(a.experts), "--top-k", str(a.top_k), "--steps", str(a.steps),
           "--warmup", str(a.warmup), "--threads", "1", "--ep", str(ep)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return [json.loads(line[line.index("{"):]) for line in out.splitlines() if "{" in line]


def pytorch_ranks(a):
    import sys
    child = json.dumps(vars(a))
    procs = [subprocess.Popen([sys.executable, __file__, "--pytorch-rank", child], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = []
    for proc in procs:
        out, _ = proc.communicate()
        assert proc.returncode == 0, out
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def summarize(name, ranks, tokens):
    total = sum(tokens / r["seconds"] for r in ranks)
    rss = max(r["peak_rss_growth_mib"] for r in ranks)
    print(f"  {name}: {total:.0f} tokens/s over 2 ranks, max per-rank peak RSS growth {rss:.1f} MiB")
    return total, rss


def main():
    import sys
    if len(sys.argv) == 3 and sys.argv[1] == "--pytorch-rank":
        pytorch_rank(sys.argv[2])
        return
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
    print(f"2 ranks, 1 thread each, {a.tokens} tokens per rank:")
    peer, peer_rss = summarize("PyTorch (transformers, data parallel)", pytorch_ranks(a), a.tokens)
    ep1, ep1_rss = summarize("Loom EP 1", loom_ranks(a, 1), a.tokens)
    ep2_ranks = loom_ranks(a, 2)
    ep2, ep2_rss = summarize("Loom EP 2", ep2_ranks, a.tokens)
    print(f"  Loom / PyTorch tokens/s: EP 1 {ep1 / peer:.2f}x, EP 2 {ep2 / peer:.2f}x; "
          f"peak RSS growth ratio: EP 1 {ep1_rss / max(peer_rss, 1e-9):.2f}, EP 2 {ep2_rss / max(peer_rss, 1e-9):.2f}")
    for r in sorted(ep2_ranks, key=lambda r: r["rank"]):
        measured, formula = r["all_to_all_bytes_per_step"], r["formula_bytes_per_step"]
        uniform = 8 * (a.experts - a.experts // 2) + 4 * a.tokens * a.top_k * a.dim * 4 * (2 - 1) / 2
        print(f"  EP 2 rank {r['rank']}: all-to-all {measured / 2**20:.3f} MiB/step sent, formula {formula / 2**20:.3f} MiB "
              f"({'equal' if measured == formula else 'DIFFERENT'}); uniform-routing estimate {uniform / 2**20:.3f} MiB")


if __name__ == "__main__":
    main()
