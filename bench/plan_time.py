"""`loom plan --explain --cluster cpu`'s time model against measured tokens/s on this machine (issue 29).

Each layout of the debug Llama 3 (CPU, Gloo, fp32, one intra-op thread per rank) trains for
--warmup + --steps steps; the measured figure is the median of rank 0's tokens/s per rank over the
timed steps (metrics.jsonl `tps`); the predicted one is `loom plan --explain --json --cluster cpu`
for the same config (Cluster::this_cpu: one thread's measured GEMM peak x a fitted efficiency,
Gloo's loopback bandwidth fitted). Prints both, the error, and whether every layout is within the
target (+-20 %). The first two rows are the ones the CPU constants were fitted on.

Usage: .venv/bin/python bench/plan_time.py [--loom build/bin/loom] [--steps 6] [--warmup 2]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = 0.20
BASE = ["--config", "configs/llama3_debug.toml", "--validation.enable=false", "--training.seq_len=256",
        "--metrics.peak_flops=1e11"]
LAYOUTS = [
    ("one process (fitted: efficiency)", 1, ["--parallelism.data_parallel_shard_degree=1",
                                             "--training.local_batch_size=8", "--training.global_batch_size=8"]),
    ("FSDP 2 (fitted: loopback bandwidth)", 2, ["--parallelism.data_parallel_shard_degree=2",
                                                "--training.local_batch_size=4", "--training.global_batch_size=8"]),
    ("one process, full AC", 1, ["--parallelism.data_parallel_shard_degree=1", "--training.local_batch_size=8",
                                 "--training.global_batch_size=8", "--activation_checkpoint.mode=full"]),
    ("TP 2 (SP)", 2, ["--parallelism.data_parallel_shard_degree=1", "--parallelism.tensor_parallel_degree=2",
                      "--training.local_batch_size=8", "--training.global_batch_size=8"]),
    ("PP 2, 1F1B, 4 micro-batches", 2, ["--parallelism.data_parallel_shard_degree=1",
                                        "--parallelism.pipeline_parallel_degree=2",
                                        "--parallelism.pipeline_parallel_schedule=1F1B",
                                        "--parallelism.pipeline_parallel_microbatch_size=2",
                                        "--training.local_batch_size=8", "--training.global_batch_size=8"]),
    ("CP 2", 2, ["--parallelism.data_parallel_shard_degree=1", "--parallelism.context_parallel_degree=2",
                 "--training.local_batch_size=8", "--training.global_batch_size=8"]),
    ("HSDP 2 x 2 (4 ranks on 2 cores)", 4, ["--parallelism.data_parallel_replicate_degree=2",
                                            "--parallelism.data_parallel_shard_degree=2",
                                            "--training.local_batch_size=2", "--training.global_batch_size=8"]),
]


def measured(loom, ranks, overrides, steps, warmup):
    with tempfile.TemporaryDirectory() as dump:
        cmd = [loom, "launch", "--nproc", str(ranks), "--", "train", *BASE, *overrides, "--metrics.log_freq=1",
               f"--training.steps={steps + warmup}", f"--job.dump_folder={dump}"]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        rows = [json.loads(l) for l in open(os.path.join(dump, "metrics.jsonl"))]
        return statistics.median(r["tps"] for r in rows[warmup:])


def predicted(loom, ranks, overrides):
    cmd = [loom, "plan", "--explain", "--json", "--cluster", "cpu", "--world-size", str(ranks), *BASE, *overrides]
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1")).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--loom", default=os.path.join(ROOT, "build/bin/loom"))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    print(f"{'layout':<38} {'measured tok/s':>14} {'predicted':>10} {'error':>7}  binding")
    worst = 0.0
    for label, ranks, overrides in LAYOUTS:
        got = measured(args.loom, ranks, overrides, args.steps, args.warmup)
        pr = predicted(args.loom, ranks, overrides)
        want = pr["tokens_per_device_s"]
        err = (want - got) / got
        if "fitted" not in label:
            worst = max(worst, abs(err))
        print(f"{label:<38} {got:14.0f} {want:10.0f} {100 * err:+6.1f}%  {pr['binding']}", flush=True)
    print(f"worst error on the rows not fitted {100 * worst:.1f} %: "
          f"{'within' if worst <= TARGET else 'NOT within'} the +-{100 * TARGET:.0f} % target")
    sys.exit(0 if worst <= TARGET else 1)


if __name__ == "__main__":
    main()
