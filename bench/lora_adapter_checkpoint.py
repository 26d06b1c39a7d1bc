"""Adapter revisions (issue 27): an adapter-only checkpoint against a full one, and switching adapters
on a resident base against loading a model.

For each model (the debug config and the 124M benchmark config, single process, fp32):
  1. full fine-tuning: `loom train` with a checkpoint every step (parameters + both AdamW moments),
     its last save kept as the base (the peer);
  2. LoRA on that base (`checkpoint.initial_load_path`; rank 8 on q, k, v, o by default) with a
     checkpoint every step: adapters + their AdamW moments, the base referenced by path and checksum.
Printed: each checkpoint's bytes on disk and median save time (the saver's own log line), and the
ratios; then the handoff: `loom score` of the base with the adapter (`--adapter`), which reports the
base's load time and the adapter's attach time (what switching to another adapter revision costs)
against loading the whole fine-tuned model (`loom score` of the full checkpoint). Warm page cache,
so both are read from memory, not disk.

Usage: .venv/bin/python bench/lora_adapter_checkpoint.py [--loom build/bin/loom] [--steps 3]
       [--models debug,124M] [--rank 8] [--targets q_proj,k_proj,v_proj,o_proj] [--threads 2]
"""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {
    "debug": ["--config", os.path.join(ROOT, "configs/llama3_debug.toml"), "--training.seq_len=64",
              "--training.local_batch_size=2", "--parallelism.data_parallel_shard_degree=1"],
    "124M": ["--config", os.path.join(ROOT, "bench/llama3_124m.toml"), "--training.seq_len=64",
             "--training.local_batch_size=1"],
}


def run(args, cmd):
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), LOOM_NUM_THREADS=str(args.threads))
    return subprocess.run([os.path.abspath(args.loom), *cmd], check=True, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True).stdout


def train(args, model, dump, extra):
    out = run(args, ["train", *CONFIGS[model], f"--job.dump_folder={dump}", f"--training.steps={args.steps}",
                     "--validation.enable=false", "--metrics.log_freq=1", "--checkpoint.enable=true",
                     "--checkpoint.interval=1", "--checkpoint.keep_latest_k=2", *extra])
    # "saved checkpoint '<dir>' (N MiB on rank 0, S s)" per save.
    seconds = [float(s) for s in re.findall(r"saved checkpoint '[^']*' \([0-9]+ MiB on rank 0, ([0-9.e+-]+) s\)", out)]
    assert len(seconds) == args.steps, f"expected {args.steps} saves in:\n{out}"
    step = os.path.join(dump, "checkpoint", f"step-{args.steps}")
    size = sum(os.path.getsize(os.path.join(step, f)) for f in os.listdir(step))
    return step, size, statistics.median(seconds)


def score(args, cmd):
    out = run(args, ["score", *cmd, "--tokens", "1,2,3,4,5,6,7,8"])
    load = float(re.search(r"base load: ([0-9.]+) s", out).group(1))
    attach = re.search(r"attached in ([0-9.]+) s, ([0-9]+) bytes read", out)
    return load, (float(attach.group(1)), int(attach.group(2))) if attach else None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--loom", default=os.path.join(ROOT, "build/bin/loom"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--models", default="debug,124M")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    rows = []
    tmp = tempfile.mkdtemp(prefix="loom_lora_bench_")
    try:
        for model in args.models.split(","):
            full_dir, full_bytes, full_s = train(args, model, os.path.join(tmp, model, "full"), [])
            lora_dir, lora_bytes, lora_s = train(
                args, model, os.path.join(tmp, model, "lora"),
                [f"--checkpoint.initial_load_path={full_dir}", f"--lora.rank={args.rank}", "--lora.alpha=16",
                 f"--lora.target_modules={args.targets}"])
            full_load, _ = score(args, ["--checkpoint", full_dir])
            base_load, (attach_s, attach_bytes) = score(args, ["--checkpoint", full_dir, "--adapter", lora_dir])
            rows.append((model, full_bytes, full_s, lora_bytes, lora_s, full_load, base_load, attach_s, attach_bytes))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"LoRA rank {args.rank} on {args.targets}; {args.steps} saves per run, median save time; "
          f"{args.threads} threads")
    print(f"{'model':>6} | {'full ckpt':>12} {'save s':>7} | {'adapter ckpt':>12} {'save s':>7} | "
          f"{'size ratio':>10} {'time ratio':>10} | {'load model s':>12} {'attach s':>8} {'bytes':>10} {'handoff':>8}")
    for model, fb, fs_, lb, ls, fl, bl, at, ab in rows:
        print(f"{model:>6} | {fb:>12,} {fs_:>7.3f} | {lb:>12,} {ls:>7.3f} | {fb / lb:>9.1f}x {fs_ / ls:>9.1f}x | "
              f"{fl:>12.3f} {at:>8.4f} {ab:>10,} {fl / max(at, 1e-4):>7.0f}x")
    print("size/time ratio: full checkpoint / adapter checkpoint; handoff: loading the fine-tuned model / "
          "attaching the adapter to the resident base (base load once: "
          + ", ".join(f"{r[0]} {r[6]:.3f} s" for r in rows) + ")")


if __name__ == "__main__":
    main()
