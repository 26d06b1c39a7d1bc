"""Elastic training vs restart-from-checkpoint when ranks die (issue 48's benchmark).

Four runs of the debug model (seq 64, 3 rows per rank, FSDP over --nproc ranks, gradients clipped),
each `--steps` steps under `loom launch`:
  A. plain FSDP, no failure                          -- the tokens/s baseline
  B. fault_tolerance.enable, no failure              -- what the feature costs when nothing fails
     (the neighbour copy of every FSDP shard after each step, the per-step membership check)
  C. fault_tolerance.enable, a rank SIGKILLed inside every --kill-every-th step (the first one, then
     each replacement in turn: LOOM_FAULT_KILL_MID_STEP), --max-restarts = the failures
  D. today's recovery: checkpoint.enable (interval --checkpoint-interval, async), the same first
     kill, --max-restarts 1: every rank restarts and resumes from the newest checkpoint
Every output line is timestamped as it arrives. Per failure:
  MTTR        seconds from the kill line to the completion (its metrics line) of the step the rank
              died in, trained again;
  steps lost  applied steps trained again: C from the rows ledger (lines a resume superseded), D the
              steps between the checkpoint resumed from and the failed step.
Overhead: B's median tokens/s against A's (steps after the first).

Usage: .venv/bin/python bench/elastic_recovery.py [--nproc 4] [--steps 30] [--kill-every 10]
       [--checkpoint-interval 5] [--loom build/bin/loom]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


SEQ_LEN, LOCAL_BATCH = 64, 3


def train_args(dump, steps, extra):
    return ["train", "--config", f"{ROOT}/configs/llama3_debug.toml", "--validation.enable=false",
            f"--model.tokenizer_path={ROOT}/data/default/tokenizer.json",
            f"--training.dataset_path={ROOT}/data/default/corpus.jsonl",
            f"--job.dump_folder={dump}", f"--training.seq_len={SEQ_LEN}", f"--training.local_batch_size={LOCAL_BATCH}",
            f"--training.steps={steps}", "--training.max_norm=0.5", "--lr_scheduler.warmup_steps=2",
            "--metrics.log_freq=1", "--metrics.peak_flops=1e11", "--comm.timeout_seconds=120"] + extra


def run(loom, nproc, dump, steps, extra, launch_flags=(), env_extra=None):
    env = dict(os.environ)
    env.update(env_extra or {})
    cmd = [loom, "launch", "--nproc", str(nproc), *launch_flags, "--"] + train_args(dump, steps, extra)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, bufsize=1)
    lines = []
    for line in proc.stdout:
        lines.append((time.monotonic() - start, line.rstrip("\n")))
    proc.wait()
    if proc.returncode != 0:
        tail = "\n".join(l for _, l in lines[-30:])
        raise SystemExit(f"run failed ({proc.returncode}): {' '.join(cmd)}\n{tail}")
    return lines, time.monotonic() - start


def metrics(dump):
    rows = []
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        for line in f:
            rows.append(json.loads(line))
    return rows


def median_tps(dump):
    tps = [r["tps"] for r in metrics(dump) if "event" not in r and "tps" in r and r["step"] > 1]
    return statistics.median(tps)


STEP_LINE = re.compile(r"\[rank0\].*?\[step (\d+)/\d+|\[rank0\] step:\s+(\d+)")
KILL_LINE = re.compile(r"LOOM_FAULT_KILL_MID_STEP: rank \d+ kills itself inside step (\d+)")


def recoveries(lines):
    """(kill time, failed step, time its re-run completed) for each kill in the output."""
    out = []
    for i, (t, line) in enumerate(lines):
        m = KILL_LINE.search(line)
        if not m:
            continue
        step = int(m.group(1))
        for t2, later in lines[i + 1:]:
            s = STEP_LINE.search(later)
            if s and int(s.group(1) or s.group(2)) == step:
                out.append((t, step, t2))
                break
    return out


def superseded_by_resume(dump):
    """Ledger lines a later resume marker dropped (steps trained twice)."""
    seen, dropped = {}, 0
    for r in metrics(dump):
        if r.get("event") == "resume":
            for s in [s for s in seen if s > r["step"]]:
                del seen[s]
                dropped += 1
        if r.get("event") == "rows":
            seen[r["step"]] = r["rows"]
    return dropped


def resumed_steps(dump):
    return [r["step"] for r in metrics(dump) if r.get("event") == "resume"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--kill-every", type=int, default=10)
    ap.add_argument("--checkpoint-interval", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--local-batch", type=int, default=3, help="rows per rank; 4, 3 and 2 ranks must divide 4x it")
    ap.add_argument("--repeat", type=int, default=1, help="runs of A and B each, alternating (medians)")
    ap.add_argument("--loom", default=f"{ROOT}/build/bin/loom")
    a = ap.parse_args()
    global SEQ_LEN, LOCAL_BATCH
    SEQ_LEN, LOCAL_BATCH = a.seq_len, a.local_batch
    kills = list(range(a.kill_every, a.steps, a.kill_every))
    # The first victim is member 1; each later one is the previous victim's replacement.
    victims = [1] + [a.nproc + i for i in range(len(kills) - 1)]
    spec = ",".join(f"{m}:{s}" for m, s in zip(victims, kills))
    with tempfile.TemporaryDirectory() as tmp:
        d = {k: os.path.join(tmp, k) for k in "ABCD"}
        tps_a, tps_b = [], []
        for i in range(a.repeat):
            _, wall_a = run(a.loom, a.nproc, d["A"], a.steps, [])
            tps_a.append(median_tps(d["A"]))
            _, wall_b = run(a.loom, a.nproc, d["B"], a.steps, ["--fault_tolerance.enable=true"])
            tps_b.append(median_tps(d["B"]))
        lines_c, wall_c = run(a.loom, a.nproc, d["C"], a.steps, ["--fault_tolerance.enable=true"],
                              ["--max-restarts", str(len(kills))], {"LOOM_FAULT_KILL_MID_STEP": spec})
        lines_d, wall_d = run(a.loom, a.nproc, d["D"], a.steps,
                              ["--checkpoint.enable=true", f"--checkpoint.interval={a.checkpoint_interval}",
                               "--checkpoint.async_mode=async"],
                              ["--max-restarts", "1"], {"LOOM_FAULT_KILL_MID_STEP": f"1:{kills[0]}"})
        tps_a, tps_b = statistics.median(tps_a), statistics.median(tps_b)
        rec_c, rec_d = recoveries(lines_c), recoveries(lines_d)
        lost_c = superseded_by_resume(d["C"])
        resumed = resumed_steps(d["D"])
        lost_d = (kills[0] - 1 - resumed[0]) if resumed else float("nan")
        mttr_c = [t2 - t for t, _, t2 in rec_c]
        mttr_d = [t2 - t for t, _, t2 in rec_d]
        print(f"debug model, FSDP over {a.nproc} ranks, seq {a.seq_len} x {a.local_batch} rows per rank, {a.steps} steps, "
              f"kills at steps {kills} (members {victims})")
        print(f"{'':40s} {'elastic (C)':>14s} {'restart (D)':>14s}")
        print(f"{'failures':40s} {len(rec_c):>14d} {len(rec_d):>14d}")
        print(f"{'MTTR, s (median)':40s} {statistics.median(mttr_c) if mttr_c else float('nan'):>14.2f} "
              f"{statistics.median(mttr_d) if mttr_d else float('nan'):>14.2f}")
        print(f"{'steps lost per failure':40s} {lost_c / max(1, len(rec_c)):>14.1f} {lost_d:>14.1f}")
        print(f"{'run wall time, s':40s} {wall_c:>14.1f} {wall_d:>14.1f}   (no failure: A {wall_a:.1f}, B {wall_b:.1f})")
        print(f"tokens/s per rank, median: plain {tps_a:,.0f}, fault tolerance on {tps_b:,.0f}: "
              f"overhead {100.0 * (tps_a / tps_b - 1.0):+.1f} % of step time")


if __name__ == "__main__":
    main()
