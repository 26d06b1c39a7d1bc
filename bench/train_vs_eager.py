"""Loom vs PyTorch eager, single process, same Llama config, same threads, fp32.

Runs `loom train` on a ~124M-parameter Llama 3 config (dim 768, 12 layers, 12 heads, 4 kv heads,
vocab 32000, seq 256, batch 4) and bench/llama_eager.py on the same shapes, then prints the
tokens/s ratio and Loom's MFU against the fp32 GEMM peak measured in the same run.

Usage: .venv/bin/python bench/train_vs_eager.py [--steps 8] [--threads 2] [--loom build/bin/loom]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure_gemm_peak(threads):
    import torch
    torch.set_num_threads(threads)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    for _ in range(3):
        a @ b
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(10):
            a @ b
        best = max(best, 10 * 2 * 1024**3 / (time.perf_counter() - t))
    return best


def run_loom(args, dump):
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), LOOM_NUM_THREADS=str(args.threads))
    cmd = [args.loom, "train", "--config", os.path.join(ROOT, "bench/llama3_124m.toml"),
           f"--job.dump_folder={dump}", f"--training.steps={args.warmup + args.steps}",
           f"--metrics.log_freq=1", f"--metrics.peak_flops={args.peak}"]
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    rows = [json.loads(l) for l in open(os.path.join(dump, "metrics.jsonl"))]
    timed = rows[args.warmup:]
    tokens = 4 * 256
    # tps per logged step; average step time over the timed steps
    step_s = sum(tokens / r["tps"] for r in timed) / len(timed)
    return {"tps": tokens / step_s, "step_s": step_s, "mfu": sum(r["mfu"] for r in timed) / len(timed),
            "loss": timed[-1]["loss"]}


def run_eager(args):
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench/llama_eager.py"),
                          "--steps", str(args.steps), "--warmup", str(args.warmup),
                          "--threads", str(args.threads)],
                         check=True, env=env, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--loom", default=os.path.join(ROOT, "build/bin/loom"))
    args = p.parse_args()
    args.peak = measure_gemm_peak(args.threads)
    # FLOPs/token as TorchTitan counts them: 6N + 12 L H d_head T (N = non-embedding params).
    with tempfile.TemporaryDirectory() as dump:
        loom = run_loom(args, dump)
    eager = run_eager(args)
    print(f"fp32 GEMM peak ({args.threads} threads): {args.peak / 1e9:.1f} GFLOP/s")
    print(f"PyTorch eager: {eager['tps']:.1f} tokens/s ({eager['step_s']:.3f} s/step)")
    print(f"Loom:          {loom['tps']:.1f} tokens/s ({loom['step_s']:.3f} s/step), MFU {loom['mfu']:.1f}%")
    print(f"ratio Loom / PyTorch eager: {loom['tps'] / eager['tps']:.3f}x")
    print(json.dumps({"bench": "train_vs_eager", "peak_gflops": args.peak / 1e9, "loom_tps": loom["tps"],
                      "eager_tps": eager["tps"], "ratio": loom["tps"] / eager["tps"], "loom_mfu": loom["mfu"]}))


if __name__ == "__main__":
    main()
