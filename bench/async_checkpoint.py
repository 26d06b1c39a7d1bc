"""Step time with an async checkpoint every step vs no checkpointing (issue 4's async-save target).

Runs `loom train` on the 124M benchmark config (bench/llama3_124m.toml: single process, seq 256,
batch 4, fp32) without checkpointing and with
`--checkpoint.enable=true --checkpoint.interval=1 --checkpoint.async_mode=async`, alternating,
`--repeat` times each, and prints the median step time of both and their ratio. Each save holds the
parameters and both AdamW moments (~1.4 GiB).

The step time is the trainer's wall time per loop iteration: the training step (including any wait
for the previous save's staging before the optimizer step) plus the checkpoint call after it
(planning, the JSON state, and any wait for the previous save's write). Warm-up steps are skipped,
and so is the last step, whose save is waited for to the end (a run's final checkpoint must be on
disk); its time is printed separately. Also printed: how long training waited per save (from the
saver's log) and the extra CPU time per save (all threads, from the children's rusage).

Usage: .venv/bin/python bench/async_checkpoint.py [--steps 6] [--warmup 2] [--threads 2]
       [--repeat 2] [--loom build/bin/loom]
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


def median(xs):
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=2,
                   help="runs of each, alternating, so a burst of other load hits both alike")
    p.add_argument("--loom", default=os.path.join(ROOT, "build/bin/loom"))
    args = p.parse_args()
    ckpt_args = ["--checkpoint.enable=true", "--checkpoint.interval=1",
                 "--checkpoint.async_mode=async", "--checkpoint.keep_latest_k=2"]
    plains, saveds = [], []
    with tempfile.TemporaryDirectory(dir=os.path.join(ROOT, "outputs")) as tmp:
        for r in range(args.repeat):
            plains.append(run(args, os.path.join(tmp, f"plain{r}"), []))
            saveds.append(run(args, os.path.join(tmp, f"async{r}"), ckpt_args))
            folder = os.path.join(tmp, f"async{r}", "checkpoint")
            complete = sorted(d for d in os.listdir(folder)
                              if os.path.exists(os.path.join(folder, d, "COMPLETE")))
            size = sum(os.path.getsize(os.path.join(folder, complete[-1], f))
                       for f in os.listdir(os.path.join(folder, complete[-1])))
            shutil.rmtree(folder)
    for plain, saved in zip(plains, saveds):
        assert plain["loss"] == saved["loss"], "checkpointing changed the training losses"
    fmt = lambda xs: ", ".join(f"{x:.3f}" for x in xs)
    # Step time: the median over every timed step of every run (robust to bursts of other load
    # on a shared machine); the means are printed too.
    plain_steps = [x for r in plains for x in r["steps"]]
    saved_steps = [x for r in saveds for x in r["steps"]]
    plain_s, saved_s = median(plain_steps), median(saved_steps)
    ratio = saved_s / plain_s
    print(f"no checkpointing:        median {plain_s:.3f} s/step, mean "
          f"{sum(plain_steps) / len(plain_steps):.3f}  (steps: {fmt(plain_steps)})")
    print(f"async save every step:   median {saved_s:.3f} s/step, mean "
          f"{sum(saved_steps) / len(saved_steps):.3f}  (steps: {fmt(saved_steps)}; last step incl. "
          f"final write: {fmt([r['last_s'] for r in saveds])})")
    waited = [x for r in saveds for x in r["waited"]]
    if waited:
        print(f"training waited per save: {sum(waited) / len(waited):.3f} s (max {max(waited):.3f})")
    extra_cpu = sum(s["cpu_s"] - p["cpu_s"] for p, s in zip(plains, saveds)) / sum(
        s["total"] for s in saveds)
    print(f"CPU time per step:       {sum(p['cpu_s'] for p in plains) / sum(p['total'] for p in plains):.2f} s "
          f"without saving, {sum(s['cpu_s'] for s in saveds) / sum(s['total'] for s in saveds):.2f} s "
          f"with ({extra_cpu:+.2f} CPU-s per save; whole runs incl. start-up)")
    print(f"checkpoint size:         {size / 2**30:.2f} GiB ({complete[-1]})")
    print(f"ratio async / no saving: {ratio:.3f}x ({(ratio - 1) * 100:+.1f} %; target <= +10 %)")
    print(json.dumps({"bench": "async_checkpoint", "plain_step_s": plain_s, "async_step_s": saved_s,
                      "ratio": ratio, "checkpoint_bytes": size, "extra_cpu_s_per_save": extra_cpu}))


if __name__ == "__main__":
    main()
