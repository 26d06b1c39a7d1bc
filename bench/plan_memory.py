"""`loom plan --explain`'s memory model against Loom's measured memory breakdown (issue 29).

For each layout below (the debug Llama 3 or Qwen3-MoE, CPU, Gloo, fp32) it runs `loom train` for a few steps with
`metrics.memory_breakdown` on, reads rank 0's step peak of the last step (metrics.jsonl:
mem_step_peak_gib = parameters + gradients + optimizer state + activations + buffers in flight +
other, from Loom's allocation tracker), and asks `loom plan --explain --json` for the same config
and world size; it prints both, the relative error, and whether every layout is within the target
(+-10 %). Under pipeline parallelism the comparison is rank 0's (the first stage), which is the
rank metrics.jsonl reports.

Usage: .venv/bin/python bench/plan_memory.py [--loom build/bin/loom] [--steps 3]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = 0.10
BASE = ["--validation.enable=false", "--training.seq_len=256", "--metrics.log_freq=1", "--metrics.peak_flops=1e11"]
LLAMA = ["--config", "configs/llama3_debug.toml"]
MOE = ["--config", "configs/qwen3_moe_debug.toml"]
# (label, ranks, overrides; the debug Llama 3 unless the overrides name a config): FSDP, HSDP, TP,
# PP, CP, AC, a plain run, and the debug Qwen3-MoE alone and with its experts split over 2 ranks.
LAYOUTS = [
    ("one process, batch 8", 1, ["--parallelism.data_parallel_shard_degree=1", "--training.local_batch_size=8"]),
    ("one process, full AC", 1, ["--parallelism.data_parallel_shard_degree=1", "--training.local_batch_size=8",
                                 "--activation_checkpoint.mode=full"]),
    ("one process, selective AC every 2", 1, ["--parallelism.data_parallel_shard_degree=1",
                                              "--training.local_batch_size=8",
                                              "--activation_checkpoint.mode=selective"]),
    ("FSDP 2", 2, ["--parallelism.data_parallel_shard_degree=2", "--training.local_batch_size=4"]),
    ("HSDP 2 x 2", 4, ["--parallelism.data_parallel_replicate_degree=2",
                       "--parallelism.data_parallel_shard_degree=2", "--training.local_batch_size=4"]),
    ("TP 2 (SP)", 2, ["--parallelism.data_parallel_shard_degree=1", "--parallelism.tensor_parallel_degree=2",
                      "--training.local_batch_size=8"]),
    ("PP 2, 1F1B, 4 micro-batches", 2, ["--parallelism.data_parallel_shard_degree=1",
                                        "--parallelism.pipeline_parallel_degree=2",
                                        "--parallelism.pipeline_parallel_schedule=1F1B",
                                        "--parallelism.pipeline_parallel_microbatch_size=2",
                                        "--training.local_batch_size=8"]),
    ("PP 2 x FSDP 2, 1F1B", 4, ["--parallelism.data_parallel_shard_degree=2",
                                "--parallelism.pipeline_parallel_degree=2",
                                "--parallelism.pipeline_parallel_schedule=1F1B",
                                "--parallelism.pipeline_parallel_microbatch_size=2",
                                "--training.local_batch_size=4"]),
    ("CP 2", 2, ["--parallelism.data_parallel_shard_degree=1", "--parallelism.context_parallel_degree=2",
                 "--training.local_batch_size=8"]),
    ("Qwen3-MoE, one process", 1, MOE + ["--parallelism.data_parallel_shard_degree=1",
                                         "--training.local_batch_size=8"]),
    ("Qwen3-MoE, FSDP 2 x EP 2", 2, MOE + ["--parallelism.data_parallel_shard_degree=2",
                                           "--parallelism.expert_parallel_degree=2",
                                           "--training.local_batch_size=4"]),
]


def with_config(overrides):
    return overrides if "--config" in overrides else LLAMA + overrides


def measured(loom, ranks, overrides, steps):
    with tempfile.TemporaryDirectory() as dump:
        cmd = [loom, "launch", "--nproc", str(ranks), "--", "train", *with_config(overrides), *BASE,
               f"--training.steps={steps}", "--metrics.memory_breakdown=true", f"--job.dump_folder={dump}"]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        rows = [json.loads(l) for l in open(os.path.join(dump, "metrics.jsonl"))]
        return rows[-1]


def predicted(loom, ranks, overrides):
    cmd = [loom, "plan", "--explain", "--json", "--world-size", str(ranks), *with_config(overrides), *BASE]
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--loom", default=os.path.join(ROOT, "build/bin/loom"))
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    print(f"{'layout':<34} {'measured MiB':>12} {'predicted MiB':>13} {'error':>7}   "
          f"(measured: params / grads / optim / activ. / buffers MiB)")
    worst = 0.0
    for label, ranks, overrides in LAYOUTS:
        m = measured(args.loom, ranks, overrides, args.steps)
        pr = predicted(args.loom, ranks, overrides)
        got = m["mem_step_peak_gib"] * 1024
        want = pr["rank_peaks_gib"][0] * 1024
        err = (want - got) / got
        worst = max(worst, abs(err))
        parts = " / ".join(f"{m[k] * 1024:.1f}" for k in
                           ("mem_params_gib", "mem_grads_gib", "mem_optimizer_gib", "mem_activations_gib",
                            "mem_buffers_gib"))
        print(f"{label:<34} {got:12.1f} {want:13.1f} {100 * err:+6.1f}%   ({parts})", flush=True)
    print(f"worst error {100 * worst:.1f} %: {'within' if worst <= TARGET else 'NOT within'} the +-"
          f"{100 * TARGET:.0f} % target")
    sys.exit(0 if worst <= TARGET else 1)


if __name__ == "__main__":
    main()
