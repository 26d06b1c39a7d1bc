"""Activation checkpointing: peak memory and step time of none / selective / full (issue 13).

Runs `loom train` on the 124M benchmark config (bench/llama3_124m.toml: dim 768, 12 layers, 12
heads / 4 kv, vocab 32000, fp32, single process) at seq 1024 with
`--activation_checkpoint.mode` none, selective (`selective_ac_option` op, and every 2nd block) and
full, one after another, `--repeat` times each, and prints for each mode the peak RSS of the
process (the largest per-step `mem_peak_gib` of metrics.jsonl, i.e. VmHWM, reset every step) and
the median step time (tokens per step / `tps`), with both as ratios against none, plus the final
loss (the same in every mode: AC does not change the numerics). Warm-up steps are not timed.

The batch (default 2 x 1024 tokens) keeps the run within ~24 GiB even without AC; the model's
sharded state is not involved (single process): parameters, gradients and the two AdamW moments
are ~2 GiB of every figure, the rest is activations, the chunked output head's buffers and the
process.

Usage: .venv/bin/python bench/ac_memory.py [--steps 3] [--warmup 1] [--batch 2] [--seq 1024]
       [--threads 2] [--repeat 1] [--loom build/bin/loom]
"""
import argparse
import json
import os
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODES = [
    ("none", ["--activation_checkpoint.mode=none"]),
    ("selective op", ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=op"]),
    ("selective 2", ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=2"]),
    ("full", ["--activation_checkpoint.mode=full"]),
]


def run(args, dump, extra):
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), LOOM_NUM_THREADS=str(args.threads))
    total = args.warmup + args.steps
    cmd = [args.loom, "train", "--config", os.path.join(ROOT, "bench/llama3_124m.toml"),
           f"--job.dump_folder={dump}", f"--training.steps={total}", f"--training.seq_len={args.seq}",
           f"--training.local_batch_size={args.batch}", "--training.deterministic=true",
           "--metrics.log_freq=1", "--metrics.peak_flops=1e11"] + extra
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rows = [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl")) if '"loss"' in line]
    assert [r["step"] for r in rows] == list(range(1, total + 1)), "expected one metrics row per step"
    tokens = args.batch * args.seq
    step_s = [tokens / r["tps"] for r in rows][args.warmup:]
    return {"peak_gib": max(r["mem_peak_gib"] for r in rows), "step_s": sorted(step_s),
            "loss": rows[-1]["loss"]}


def median(xs):
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--loom", default=os.path.join(ROOT, "build/bin/loom"))
    args = p.parse_args()
    results = {name: [] for name, _ in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeat):
            for name, extra in MODES:
                res = run(args, os.path.join(tmp, f"{name.replace(' ', '_')}_{r}"), extra)
                print(f"  run {r} {name:13s} peak RSS {res['peak_gib']:.3f} GiB, steps "
                      + " ".join(f"{s:.2f}" for s in res["step_s"]) + f" s, final loss {res['loss']:.6f}", flush=True)
                results[name].append(res)
    base_mem = min(r["peak_gib"] for r in results["none"])
    base_step = median([s for r in results["none"] for s in r["step_s"]])
    print(f"\n124M, seq {args.seq}, batch {args.batch}, {args.threads} threads, {args.steps} timed steps x {args.repeat}")
    print(f"{'mode':14s} {'peak RSS GiB':>12s} {'vs none':>8s} {'step s':>8s} {'vs none':>8s}  final loss")
    for name, _ in MODES:
        mem = min(r["peak_gib"] for r in results[name])
        step = median([s for r in results[name] for s in r["step_s"]])
        print(f"{name:14s} {mem:12.3f} {mem / base_mem:8.3f} {step:8.2f} {step / base_step:8.3f}  {results[name][-1]['loss']:.6f}")


if __name__ == "__main__":
    main()
