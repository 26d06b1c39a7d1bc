"""Long context with context parallelism: the debug model at one long sequence, CP 1 vs CP 2 vs CP 4.

Trains Llama 3's debugmodel (6 layers, dim 256, 16 heads) on one sequence of --seq-len tokens per
step (default 16,384; causal attention, fp32, Gloo) at context-parallel degree 1, 2 and 4 (one rank
per degree: `loom launch --nproc c -- train ... --parallelism.context_parallel_degree=c`), each for
--steps steps, and prints per degree:

- the peak RSS of every rank, measured from outside (VmHWM of each rank process sampled every 5 ms,
  as bench/fsdp_vs_fsdp2.py does), and its ratio to CP 1: the attention activations of a rank hold
  1/c of the tokens, so the activation part of memory falls as 1/c (parameters, gradients and
  AdamW state are FSDP-sharded over the cp ranks too, dp_shard_cp);
- the loss of every step (the runs see the same tokens; they must agree to float32 rounding and
  fall) and the median step time.

Usage: .venv/bin/python bench/cp_long_context.py [--seq-len 16384] [--steps 20] [--degrees 1,2,4]
                                                  [--threads 1] [--loom build/bin/loom]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp_vs_fsdp2 import gib, run_sampled, thread_env  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs/llama3_debug.toml")


def run(args, degree):
    with tempfile.TemporaryDirectory() as dump:
        cmd = [args.loom, "launch", "--nproc", str(degree), "--", "train", "--config", CONFIG,
               f"--job.dump_folder={dump}", f"--training.steps={args.steps}", "--metrics.log_freq=1",
               f"--training.seq_len={args.seq_len}", "--training.local_batch_size=1",
               f"--parallelism.context_parallel_degree={degree}", "--parallelism.data_parallel_shard_degree=1",
               "--lr_scheduler.warmup_steps=2", "--metrics.peak_flops=1e11"]
        peak_kib = run_sampled(cmd, thread_env(args.threads), subprocess.DEVNULL)
        rows = [json.loads(l) for l in open(os.path.join(dump, "metrics.jsonl"))]
    assert len(rows) == args.steps, f"expected {args.steps} metric rows, got {len(rows)}"
    local_tokens = args.seq_len / degree
    return {"peak_kib": peak_kib, "losses": [r["loss"] for r in rows],
            "step_s": statistics.median(local_tokens / r["tps"] for r in rows[1:] or rows)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--degrees", default="1,2,4")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--loom", default=os.path.join(ROOT, "build/bin/loom"))
    args = p.parse_args()
    degrees = [int(d) for d in args.degrees.split(",")]
    if any(d < 1 or args.seq_len % (2 * d) for d in degrees) or args.steps < 2:
        sys.exit("error: need --steps >= 2 and every degree d >= 1 with --seq-len divisible by 2d")
    if not os.access(args.loom, os.X_OK):
        sys.exit(f"error: {args.loom} is not an executable; build it or pass --loom")
    res = {}
    for d in degrees:
        res[d] = run(args, d)
        print(f"  CP {d}: done, peak RSS {gib(max(res[d]['peak_kib'].values())):.3f} GiB", file=sys.stderr)
    base = max(res[degrees[0]]["peak_kib"].values())
    print(f"debugmodel, one sequence of {args.seq_len} tokens per step, {args.steps} steps, "
          f"{args.threads} thread(s) per rank, fp32, causal")
    for d in degrees:
        r = res[d]
        peaks = r["peak_kib"]
        per_rank = ", ".join(f"rank {k} {gib(v):.3f}" for k, v in sorted(peaks.items()))
        print(f"CP {d}: peak RSS per rank {per_rank} GiB; max {gib(max(peaks.values())):.3f} GiB = "
              f"{max(peaks.values()) / base:.3f}x CP {degrees[0]}; median step {r['step_s']:.1f} s")
        print(f"  loss {' '.join(f'{l:.4f}' for l in r['losses'])}")
    falls = all(r["losses"][-1] < r["losses"][0] for r in res.values())
    agree = max(abs(a - b) for r in res.values() for a, b in zip(r["losses"], res[degrees[0]]["losses"]))
    print(f"loss falls in every run: {falls}; max |loss - loss at CP {degrees[0]}|: {agree:.2e}")
    print(json.dumps({"bench": "cp_long_context", "seq_len": args.seq_len, "steps": args.steps,
                      **{f"cp{d}_peak_rss_gib": {k: gib(v) for k, v in res[d]["peak_kib"].items()} for d in degrees},
                      **{f"cp{d}_losses": res[d]["losses"] for d in degrees},
                      **{f"cp{d}_step_s": res[d]["step_s"] for d in degrees}}))
    if not falls or agree > 1e-3:
        sys.exit("error: the runs do not train alike")


if __name__ == "__main__":
    main()
