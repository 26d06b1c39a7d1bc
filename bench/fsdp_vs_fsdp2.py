"""Loom FSDP vs PyTorch FSDP2: same Llama config, same ranks and threads, fp32, Gloo, one run.

Trains the model of bench/llama3_124m_fsdp.toml (the ~124M Llama 3, local batch 2, seq 256) on 2
ranks with `loom launch --nproc 2 -- train` and with bench/fsdp2_llama.py under torchrun (PyTorch
`fully_shard` per block + root, as TorchTitan's apply_fsdp), on the same data, and prints:

- tokens/s over all ranks of both (median step time over the steps after warm-up, over all
  --repeats runs, which alternate between the two) and the ratio Loom / FSDP2 (target >= 1.3);
- peak RSS of every rank of both and the ratio of the larger per-rank peaks (target <= 0.8).
  Both are measured the same way, from outside: a sampler reads VmHWM (the kernel's high-water
  mark of resident memory) of each rank process every 5 ms and keeps the largest value; Loom
  resets VmHWM at every logged step (that is its per-step `mem_peak_gib`), so the sampler sees each
  step's peak before the reset. The in-process figures (Loom rank 0's largest `mem_peak_gib`, FSDP2's
  VmHWM since its first step) are printed as a cross-check;
- the loss of every step of both: both start near ln(vocab) and must fall alike (same data, same
  init distributions, same LR schedule), else the script exits 1.

Usage: .venv/bin/python bench/fsdp_vs_fsdp2.py [--steps 6] [--warmup 2] [--repeats 1] [--nproc 2]
                                               [--threads 1] [--loom build/bin/loom]
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "bench/llama3_124m_fsdp.toml")
# The shapes of CONFIG, passed to the FSDP2 trainer (flavor 124M of src/loom/models/llama3).
MODEL = {"dim": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 4, "vocab_size": 32000,
         "seq_len": 256, "batch": 2, "lr": 3e-4, "lr_warmup_steps": 2}


def read_status(pid):
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmHWM", "VmRSS"):
                    out[key] = int(rest.split()[0])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return out


def rank_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    r = env.get(b"RANK")
    return int(r) if r is not None else None


def descendants(pid):
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(c) for c in f.read().split()]
                out.extend(kids)
                todo.extend(kids)
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


class RankMemorySampler:
    """Largest VmHWM (KiB) seen for every rank process under a launcher, sampled every 5 ms."""

    def __init__(self, launcher_pid, interval=0.005):
        self.launcher_pid, self.interval = launcher_pid, interval
        self.peak_kib, self.ranks = {}, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        while not self._stop.is_set():
            for pid in descendants(self.launcher_pid):
                if pid not in self.ranks:
                    r = rank_of(pid)
                    if r is None:
                        continue
                    self.ranks[pid] = r
                s = read_status(pid)
                if s and "VmHWM" in s:
                    r = self.ranks[pid]
                    self.peak_kib[r] = max(self.peak_kib.get(r, 0), s["VmHWM"])
            time.sleep(self.interval)


def run_sampled(cmd, env, stdout, sample=True):
    """Runs cmd; returns each rank's peak VmHWM (KiB) when `sample`, else {}. The sampler scans /proc
    every 5 ms, which takes CPU from the ranks on a 2-core machine: runs that only time steps skip it."""
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=stdout, stderr=subprocess.PIPE, text=True)
    if sample:
        with RankMemorySampler(proc.pid) as sampler:
            _, err = proc.communicate()
        peak_kib = sampler.peak_kib
    else:
        _, err = proc.communicate()
        peak_kib = {}
    if proc.returncode != 0:
        sys.exit(f"error: `{' '.join(cmd)}` failed with exit code {proc.returncode}:\n{err[-3000:]}")
    return peak_kib


def thread_env(threads):
    return dict(os.environ, OMP_NUM_THREADS=str(threads), LOOM_NUM_THREADS=str(threads))


def run_loom(args, dump, extra=(), sample_memory=True):
    """One Loom run of CONFIG; `extra`: more `--key=value` overrides (e.g. FSDP bucket settings)."""
    total = args.warmup + args.steps
    cmd = [args.loom, "launch", "--nproc", str(args.nproc), "--", "train", "--config", CONFIG,
           f"--job.dump_folder={dump}", f"--training.steps={total}", "--metrics.log_freq=1",
           # Skip the trainer's own GEMM-peak measurement; MFU is not used here.
           "--metrics.peak_flops=1e11", *extra]
    peak_kib = run_sampled(cmd, thread_env(args.threads), subprocess.DEVNULL, sample_memory)
    rows = [json.loads(l) for l in open(os.path.join(dump, "metrics.jsonl"))]
    assert len(rows) == total, f"expected {total} metric rows from Loom, got {len(rows)}"
    tokens = MODEL["batch"] * MODEL["seq_len"]
    # tps is per rank and per logged step (log_freq 1): turn it back into step times.
    return {"step_times": [tokens / r["tps"] for r in rows[args.warmup:]], "losses": [r["loss"] for r in rows],
            "peak_kib": peak_kib, "rank0_train_peak_kib": max(r["mem_peak_gib"] for r in rows) * 1024**2,
            "comm_bytes": rows[-1].get("comm_bytes"),
            # Exposed communication: the seconds per step the training thread waited for collectives.
            "exposed_s": [r.get("comm_exposed_s", 0.0) for r in rows[args.warmup:]],
            "exposed_pct": [r.get("comm_exposed_pct", 0.0) for r in rows[args.warmup:]]}


def run_fsdp2(args, sample_memory=True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           os.path.join(ROOT, "bench/fsdp2_llama.py"), "--steps", str(args.steps), "--warmup",
           str(args.warmup), "--threads", str(args.threads)]
    cmd += [f"--{k.replace('_', '-')}={v}" for k, v in MODEL.items()]
    with tempfile.TemporaryFile("w+") as out:
        peak_kib = run_sampled(cmd, thread_env(args.threads), out, sample_memory)
        out.seek(0)
        result = json.loads(out.read().strip().splitlines()[-1])
    result["peak_kib"] = peak_kib
    return result


def gib(kib):
    return kib / 1024**2


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6, help="timed steps after warm-up")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per rank (0: cores / nproc)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each, alternating")
    p.add_argument("--loom", default=os.path.join(ROOT, "build/bin/loom"))
    args = p.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.nproc < 2 or args.repeats < 1:
        sys.exit("error: need --steps >= 1, --warmup >= 0, --repeats >= 1 and --nproc >= 2 "
                 "(FSDP shards over ranks)")
    if not os.access(args.loom, os.X_OK):
        sys.exit(f"error: {args.loom} is not an executable; build it (cmake --build build --target loom) "
                 "or pass --loom")
    args.threads = args.threads or max(1, len(os.sched_getaffinity(0)) // args.nproc)

    # Alternate the two (L F L F ...) so a change in machine load hits both; the step time of each
    # is the median over all timed steps of all its runs, the memory the largest peak of any run.
    runs = {"loom": [], "fsdp2": []}
    for i in range(args.repeats):
        for name in (("loom", "fsdp2") if i % 2 == 0 else ("fsdp2", "loom")):
            if name == "loom":
                with tempfile.TemporaryDirectory() as dump:
                    runs[name].append(run_loom(args, dump))
            else:
                runs[name].append(run_fsdp2(args))
    tokens = args.nproc * MODEL["batch"] * MODEL["seq_len"]
    loom, fsdp2 = runs["loom"][0], runs["fsdp2"][0]
    for res, all_runs in ((loom, runs["loom"]), (fsdp2, runs["fsdp2"])):
        times = [t for r in all_runs for t in r["step_times"]]
        res["step_s"] = statistics.median(times)
        res["step_s_min"] = min(times)
        res["tps"] = tokens / res["step_s"]
        res["peak_kib"] = {rank: max(r["peak_kib"].get(rank, 0) for r in all_runs) for rank in range(args.nproc)}

    ranks = range(args.nproc)
    loom_peak = max(loom["peak_kib"].get(r, 0) for r in ranks)
    fsdp2_peak = max(fsdp2["peak_kib"].get(r, 0) for r in ranks)
    tps_ratio, mem_ratio = loom["tps"] / fsdp2["tps"], loom_peak / fsdp2_peak
    print(f"config: {os.path.relpath(CONFIG, ROOT)}, {args.nproc} ranks x {args.threads} threads, "
          f"{args.warmup} warm-up + {args.steps} timed steps, {args.repeats} run(s) of each")
    print(f"PyTorch FSDP2: {fsdp2['tps']:.1f} tokens/s (median {fsdp2['step_s']:.3f} s/step, "
          f"min {fsdp2['step_s_min']:.3f}; AdamW {fsdp2['adamw']})")
    print(f"Loom FSDP:     {loom['tps']:.1f} tokens/s (median {loom['step_s']:.3f} s/step, "
          f"min {loom['step_s_min']:.3f})")
    print(f"tokens/s ratio Loom / FSDP2: {tps_ratio:.3f}x (target >= 1.3)")
    for name, res in (("PyTorch FSDP2", fsdp2), ("Loom FSDP", loom)):
        per_rank = ", ".join(f"rank {r} {gib(res['peak_kib'].get(r, 0)):.3f}" for r in ranks)
        print(f"peak RSS {name}: {per_rank} GiB")
    print(f"  in-process training peaks: FSDP2 "
          + ", ".join(f"rank {s['rank']} {gib(s['peak_train_kib']):.3f}" for s in fsdp2["ranks"])
          + f" GiB (RSS at the first step {gib(fsdp2['ranks'][0]['rss_train_start_kib']):.3f}); "
          f"Loom rank 0 {gib(loom['rank0_train_peak_kib']):.3f} GiB")
    print(f"peak RSS per rank ratio Loom / FSDP2: {mem_ratio:.3f}x (target <= 0.8)")
    print("loss FSDP2: " + " ".join(f"{l:.3f}" for l in fsdp2["losses"]))
    print("loss Loom:  " + " ".join(f"{l:.3f}" for l in loom["losses"]))

    # Same training: both start near ln(vocab) and fall alike.
    ln_v = math.log(MODEL["vocab_size"])
    ok = all(abs(r["losses"][0] - ln_v) < 1.0 and r["losses"][-1] < r["losses"][0] - 0.5 for r in (loom, fsdp2))
    ok = ok and abs(loom["losses"][-1] - fsdp2["losses"][-1]) < 0.15 * (loom["losses"][0] - loom["losses"][-1])
    print(json.dumps({"bench": "fsdp_vs_fsdp2", "nproc": args.nproc, "threads": args.threads,
                      "repeats": args.repeats, "loom_tps": loom["tps"], "fsdp2_tps": fsdp2["tps"],
                      "tps_ratio": tps_ratio, "loom_step_times": [t for r in runs["loom"] for t in r["step_times"]],
                      "fsdp2_step_times": [t for r in runs["fsdp2"] for t in r["step_times"]],
                      "loom_peak_rss_gib": gib(loom_peak), "fsdp2_peak_rss_gib": gib(fsdp2_peak),
                      "peak_rss_ratio": mem_ratio, "loom_losses": loom["losses"],
                      "fsdp2_losses": fsdp2["losses"], "same_training": ok}))
    if not ok:
        sys.exit(f"error: the two runs do not train alike (ln(vocab) = {ln_v:.3f}); see the losses above")


if __name__ == "__main__":
    main()
