"""Many policies over one resident base (issue 51, MinT's two headline comparisons), for `loom rl`.

For each model (the debug flavor and the 124M benchmark config with the prompts' 2048-token
vocabulary; random weights saved by a 1-step `loom train` as the base; LoRA rank 8 on q, k, v, o; the rl_toy prompts; exact-match reward):
  (a) adapter hand-off: an adapter revision (the PEFT directory `loom rl` exports) against a merged
      full checkpoint of the same policy (`loom convert --merge-adapter --to hf`): bytes on disk,
      and the time to make it (`loom convert --to peft` of the revision vs `--merge-adapter --to hf`:
      what is merged and written after the load, the command's own log line) and to take it up (the adapter attached to the resident base, `loom score --adapter`'s
      "attached in" vs loading the merged model, `loom score`'s "base load").
  (b) step time: 4 concurrent policies (rl.policies, P prompts x G each) against 1 policy with 4P
      prompts (equal total rollouts) and against 4 sequential one-policy runs of P prompts: wall
      time per policy-step (the steps' step_seconds from metrics.jsonl; the model load excluded).
  (c) peak memory (max RSS of the process, getrusage): 4 policies against 1 policy (P prompts),
      and against 1 policy + 3 x (adapter + its 2 AdamW moments) bytes.
Every figure is measured in the same run as its peer; the ratios are what to read (CPU, shared).

Usage: .venv/bin/python bench/rl_policies.py [--loom build/bin/loom] [--models debug,124M] [--steps 7]
       [--prompts 2] [--group 4] [--threads 1]
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {
    "debug": ["--config", os.path.join(ROOT, "configs/llama3_debug.toml"), "--training.seq_len=64",
              "--training.local_batch_size=1", "--parallelism.data_parallel_shard_degree=1"],
    # The vocabulary of the prompts' tokenizer (data/default, 2048), not the config's 32000: a random
    # model samples every id of its head and each completion is decoded (78.7M parameters then).
    "124M": ["--config", os.path.join(ROOT, "bench/llama3_124m.toml"), "--training.seq_len=64",
             "--training.local_batch_size=1", "--model.vocab_size=0"],
}
FLAVOR = {"debug": "debugmodel", "124M": "124M"}


def env(args):
    return dict(os.environ, OMP_NUM_THREADS=str(args.threads), LOOM_NUM_THREADS=str(args.threads))


def run(args, cmd):
    return subprocess.run([os.path.abspath(args.loom), *cmd], check=True, env=env(args), cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True).stdout


def run_measured(args, cmd):
    """Runs loom in a fresh Python child so that getrusage(RUSAGE_CHILDREN) is this command's alone:
    (wall seconds, max RSS bytes)."""
    probe = ("import resource, subprocess, sys, time; t = time.time(); "
             "r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
             "print(time.time() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, r.returncode)")
    out = subprocess.run([sys.executable, "-c", probe, os.path.abspath(args.loom), *cmd], check=True, env=env(args),
                         cwd=ROOT, stdout=subprocess.PIPE, text=True).stdout.split()
    assert out[2] == "0", f"loom {' '.join(cmd)} failed"
    return float(out[0]), int(out[1]) * 1024


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def rl_config(path, model, base, dump, args, prompts, policies, seed):
    with open(path, "w") as f:
        f.write(f"""[job]
dump_folder = "{dump}"
[model]
name = "llama3"
flavor = "{FLAVOR[model]}"
tokenizer_path = "data/default/tokenizer.json"
vocab_size = 0
[optimizer]
lr = 1e-3
weight_decay = 0.0
[training]
steps = {args.steps}
seed = {seed}
max_norm = 1.0
[lora]
rank = 8
alpha = 16.0
[checkpoint]
initial_load_path = "{base}"
[rl]
prompts = "data/rl_toy/prompts.jsonl"
prompts_per_step = {prompts}
group_size = {args.group}
max_new_tokens = {args.max_new_tokens}
temperature = 1.0
reward = "exact"
policies = "{policies}"
""")


def step_seconds(dump):
    """Per step: the time from the step's start to its last policy's update (metrics.jsonl)."""
    per_step = {}
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        for line in f:
            j = json.loads(line)
            per_step[j["step"]] = max(per_step.get(j["step"], 0.0), j["step_seconds"])
    # The first step warms up allocators and caches: left out.
    return [per_step[s] for s in sorted(per_step)][1:]


def typical(seconds):
    """The median step time: the machine is shared, so a mean would carry other jobs' bursts."""
    return statistics.median(seconds)


def bench_model(args, model, work):
    base_run = os.path.join(work, f"{model}-base")
    run(args, ["train", *MODELS[model], f"--job.dump_folder={base_run}", "--training.steps=1",
               "--validation.enable=false", "--checkpoint.enable=true", "--checkpoint.interval=1"])
    base = os.path.join(base_run, "checkpoint", "step-1")
    p = args.prompts
    runs = {}

    def rl(name, prompts, policies, seed=0):
        dump = os.path.join(work, f"{model}-{name}")
        cfg = dump + ".toml"
        rl_config(cfg, model, base, dump, args, prompts, policies, seed)
        wall, rss = run_measured(args, ["rl", "--config", cfg])
        runs[name] = (dump, wall, rss, step_seconds(dump))
        return runs[name]

    rl("one", p, "")
    rl("four", p, "a,b,c,d")
    rl("one_4p", 4 * p, "")
    sequential = [rl(f"seq{k}", p, "", seed=k) for k in range(4)]

    # (a) hand-off of policy a's last revision.
    revision = os.path.join(runs["four"][0], "adapters", "a", f"step-{args.steps}")
    peft = os.path.join(work, f"{model}-handoff-peft")
    merged = os.path.join(work, f"{model}-handoff-merged")
    written = r"written in ([0-9.e+-]+) s"
    t = time.time()
    out = run(args, ["convert", "--input", revision, "--output", peft, "--to", "peft", "--base", base])
    wall_adapter, export_adapter = time.time() - t, float(re.search(written, out).group(1))
    t = time.time()
    out = run(args, ["convert", "--input", revision, "--output", merged, "--to", "hf", "--merge-adapter", "--base", base])
    wall_merged, export_merged = time.time() - t, float(re.search(written, out).group(1))
    out = run(args, ["score", "--checkpoint", base, "--adapter", peft, "--tokens", "1,2,3,4,5,6,7,8"])
    attach = float(re.search(r"attached in ([0-9.]+) s", out).group(1))
    out = run(args, ["score", "--checkpoint", merged, "--tokens", "1,2,3,4,5,6,7,8"])
    load_merged = float(re.search(r"base load: ([0-9.]+) s", out).group(1))
    adapter_bytes, merged_bytes = dir_bytes(peft), dir_bytes(merged)
    safetensors = os.path.join(revision, "adapter_model.safetensors")
    adapter_tensor_bytes = os.path.getsize(safetensors)

    print(f"\n== {model} (LoRA rank 8 on q,k,v,o; P = {p} prompts x G = {args.group} per policy, "
          f"{args.max_new_tokens} new tokens at most, {args.steps} steps, first left out)")
    print("(a) adapter hand-off vs merged full checkpoint")
    print(f"    bytes      adapter {adapter_bytes:>12,}  merged {merged_bytes:>12,}  ratio {merged_bytes / adapter_bytes:7.1f}x")
    print(f"    export s   adapter {export_adapter:12.4f}  merged {export_merged:12.4f}  ratio "
          f"{export_merged / export_adapter:7.1f}x  (written / merged and written, after the load)")
    print(f"    take-up s  attach  {attach:12.4f}  load   {load_merged:12.4f}  ratio {load_merged / max(attach, 1e-4):7.1f}x"
          f"  (adapter on the resident base vs loading the merged model)")
    hand_adapter, hand_merged = export_adapter + attach, export_merged + load_merged
    print(f"    hand-off s adapter {hand_adapter:12.4f}  merged {hand_merged:12.4f}  ratio "
          f"{hand_merged / hand_adapter:7.1f}x  (export + take-up; MinT: 18.3x on a 4B model)")
    print(f"    convert wall s (process start and base load included): adapter {wall_adapter:.2f}, merged {wall_merged:.2f}")

    s_one = typical(runs["one"][3])
    s_four = typical(runs["four"][3])
    s_one4 = typical(runs["one_4p"][3])
    s_seq = sum(typical(r[3]) for r in sequential)
    print("(b) wall time per policy-step (median step_seconds / policies)")
    print(f"    4 concurrent policies      {s_four / 4:8.3f} s")
    print(f"    4 sequential one-policy    {s_seq / 4:8.3f} s   sequential / concurrent = {s_seq / s_four:5.2f}x")
    print(f"    1 policy, 4P prompts       {s_one4 / 4:8.3f} s   (equal total rollouts: 4 policies / 1 policy step "
          f"time = {s_four / s_one4:5.2f}x)")
    print(f"    1 policy, P prompts        {s_one:8.3f} s   per step")
    rss_one, rss_four = runs["one"][2], runs["four"][2]
    bound = rss_one + 3 * 3 * adapter_tensor_bytes
    print("(c) peak memory (max RSS)")
    print(f"    1 policy {rss_one / 2**20:9.1f} MiB   4 policies {rss_four / 2**20:9.1f} MiB   ratio {rss_four / rss_one:5.3f}x")
    print(f"    1 policy + 3 x (adapter + AdamW moments = 3 x {adapter_tensor_bytes / 2**20:.2f} MiB) = "
          f"{bound / 2**20:.1f} MiB; 4 policies / that = {rss_four / bound:5.3f}x (acceptance: <= 1.1)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", default=os.path.join(ROOT, "build/bin/loom"))
    ap.add_argument("--models", default="debug,124M")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="loom_rl_policies_")
    try:
        for model in args.models.split(","):
            bench_model(args, model, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
