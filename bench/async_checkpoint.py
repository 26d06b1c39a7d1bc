"""Step time with an async checkpoint every step vs no checkpointing (issue 4's async-save target).

Runs `loom train` twice on the 124M benchmark config (bench/llama3_124m.toml: single process, seq
256, batch 4, fp32), once without checkpointing and once with
`--checkpoint.enable=true --checkpoint.interval=1 --checkpoint.async_mode=async`, and prints the
mean step time of both and their ratio. Each save holds the parameters and both AdamW moments
(~1.5 GiB).

The step time is the trainer's wall time per loop iteration: the training step (including any wait
for the previous save's staging before the optimizer step) plus the checkpoint call after it
(planning, the JSON state, and any wait for the previous save's write). Warm-up steps are skipped,
and so is the last step, whose save is waited for to the end (a run's final checkpoint must be on
disk); its time is printed separately.

Usage: .venv/bin/python bench/async_checkpoint.py [--steps 6] [--warmup 2] [--threads 2]
       [--loom build/bin/loom]
"""
import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENS_PER_STEP = 4 * 256  # local_batch_size * seq_len of llama3_124m.toml


def run(args, dump, extra):
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), LOOM_NUM_THREADS=str(args.threads))
    total = args.warmup + args.steps + 1
    cmd = [args.loom, "train", "--config", os.path.join(ROOT, "bench/llama3_124m.toml"),
           f"--job.dump_folder={dump}", f"--training.steps={total}", "--metrics.log_freq=1",
           "--metrics.peak_flops=1e11"] + extra
    start = time.perf_counter()
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True).stdout
    wall = time.perf_counter() - start
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU seconds of the whole run (all threads): robust to other load, unlike wall time.
    cpu_s = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    # The saver logs, per async save, how long the training thread waited for it (planning plus
    # waiting for the staging copy before the next optimizer step).
    waited = [float(x) for x in re.findall(r"training waited ([0-9.e+-]+) s", out)]
    rows = [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == list(range(1, total + 1)), "expected one metrics row per step"
    step_s = [TOKENS_PER_STEP / r["tps"] for r in rows]
    timed = step_s[args.warmup:-1]
    return {"step_s": sum(timed) / len(timed), "steps": timed, "last_s": step_s[-1], "wall_s": wall,
            "loss": rows[-1]["loss"], "waited": waited[args.warmup:-1], "cpu_s": cpu_s, "total": total}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--loom", default=os.path.join(ROOT, "build/bin/loom"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=os.path.join(ROOT, "outputs")) as tmp:
        plain = run(args, os.path.join(tmp, "plain"), [])
        ckpt_args = ["--checkpoint.enable=true", "--checkpoint.interval=1",
                     "--checkpoint.async_mode=async", "--checkpoint.keep_latest_k=2"]
        saved = run(args, os.path.join(tmp, "async"), ckpt_args)
        folder = os.path.join(tmp, "async", "checkpoint")
        complete = sorted(d for d in os.listdir(folder) if os.path.exists(os.path.join(folder, d, "COMPLETE")))
        size = sum(os.path.getsize(os.path.join(folder, complete[-1], f))
                   for f in os.listdir(os.path.join(folder, complete[-1])))
        shutil.rmtree(folder)
    assert plain["loss"] == saved["loss"], "checkpointing changed the training losses"
    ratio = saved["step_s"] / plain["step_s"]
    fmt = lambda xs: ", ".join(f"{x:.3f}" for x in xs)
    print(f"no checkpointing:        {plain['step_s']:.3f} s/step  (steps: {fmt(plain['steps'])}; "
          f"last step {plain['last_s']:.3f} s)")
    print(f"async save every step:   {saved['step_s']:.3f} s/step  (steps: {fmt(saved['steps'])}; "
          f"last step incl. final write {saved['last_s']:.3f} s)")
    if saved["waited"]:
        print(f"training waited per save: {sum(saved['waited']) / len(saved['waited']):.3f} s "
              f"(timed steps: {fmt(saved['waited'])})")
    extra_cpu = (saved["cpu_s"] - plain["cpu_s"]) / saved["total"]
    print(f"CPU time per step:       {plain['cpu_s'] / plain['total']:.2f} s without saving, "
          f"{saved['cpu_s'] / saved['total']:.2f} s with (+{extra_cpu:.2f} CPU-s per save; whole "
          f"runs incl. start-up)")
    print(f"checkpoint size:         {size / 2**30:.2f} GiB ({complete[-1]})")
    print(f"ratio async / no saving: {ratio:.3f}x ({(ratio - 1) * 100:+.1f} %; target <= +10 %)")
    print(json.dumps({"bench": "async_checkpoint", "plain_step_s": plain["step_s"],
                      "async_step_s": saved["step_s"], "ratio": ratio,
                      "checkpoint_bytes": size, "async_last_step_s": saved["last_s"],
                      "extra_cpu_s_per_save": extra_cpu}))


if __name__ == "__main__":
    main()
