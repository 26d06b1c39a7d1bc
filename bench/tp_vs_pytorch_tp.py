"""Loom TP 2 (plain and async) vs Loom FSDP 2 vs PyTorch TP 2: same Llama config, ranks, threads and
batches, one run.

Trains the ~124M Llama 3 of bench/llama3_124m_fsdp.toml on 2 ranks (1 intra-op thread each, fp32,
Gloo) four ways, alternating between them with --repeats:

- Loom TP: `loom launch --nproc 2 -- train --config bench/llama3_124m_fsdp.toml
  --parallelism.tensor_parallel_degree=2 --parallelism.data_parallel_shard_degree=1
  --training.local_batch_size=4` (sequence parallel and loss parallel on, Loom's defaults);
- Loom TP async: the same plus `--parallelism.enable_async_tensor_parallel=true` (collective
  matmuls overlap the sequence gathers / reduce-scatters with the projections);
- Loom FSDP: the same config as bench/fsdp_vs_fsdp2.py (FSDP over 2 ranks, local batch 2);
- PyTorch TP: bench/tp_llama.py under torchrun (`parallelize_module` with TorchTitan's Llama plan,
  SP and loss parallel, on a 1-D DeviceMesh over Gloo).

Every step is the same global batch in all three: 4 sequences x 256 tokens (1024 tokens), the rows
g*4 .. g*4+3 of Loom's packing at step g (TP ranks share the batch; FSDP ranks take 2 rows each).
Prints:

- tokens/s of each: the global batch's tokens over the median step time of all timed steps of all
  runs. For TP this is Loom's (and TorchTitan's) convention, tokens per step per rank divided by
  the TP degree, summed over the ranks; for FSDP, tokens per rank summed over the ranks;
- per-rank peak RSS of each, measured from outside as bench/fsdp_vs_fsdp2.py does (VmHWM of every
  rank process sampled every 5 ms; the largest of any run), with the in-process peaks as a
  cross-check;
- the ratios Loom TP / PyTorch TP (targets of issue 10: >= 1.2x tokens/s, <= 0.8x peak RSS of the
  larger rank) and Loom TP / Loom FSDP;
- the per-step wire bytes Loom counts (`comm_bytes`, ring model) of Loom TP and Loom FSDP, and with
  --count-comms PyTorch TP's collectives of one step (DTensor's CommDebugMode);
- the loss of every step of all three: all start near ln(vocab) and must fall alike, and the two TP
  curves must agree closely over the first steps (same data; same init distributions but not the
  same draws), else the script exits 1.

Usage: .venv/bin/python bench/tp_vs_pytorch_tp.py [--steps 6] [--warmup 2] [--repeats 1]
                                                  [--threads 1] [--loom build/bin/loom] [--count-comms]
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp_vs_fsdp2 import gib, run_sampled, thread_env  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "bench/llama3_124m_fsdp.toml")
NPROC = 2  # TP degree 2, FSDP degree 2
SEQ, GLOBAL_BATCH = 256, 4
# The shapes of CONFIG (flavor 124M of src/loom/models/llama3), passed to the PyTorch trainer.
MODEL = {"dim": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 4, "vocab_size": 32000,
         "seq_len": SEQ, "batch": GLOBAL_BATCH, "lr": 3e-4, "lr_warmup_steps": 2}
NAMES = {"loom_tp": "Loom TP 2", "loom_tp_async": "Loom TP async", "loom_fsdp": "Loom FSDP 2",
         "pytorch_tp": "PyTorch TP 2"}


def run_loom(args, dump, tp, async_tp=False):
    total = args.warmup + args.steps
    local_batch = GLOBAL_BATCH if tp else GLOBAL_BATCH // NPROC
    cmd = [args.loom, "launch", "--nproc", str(NPROC), "--", "train", "--config", CONFIG,
           f"--job.dump_folder={dump}", f"--training.steps={total}", "--metrics.log_freq=1",
           f"--training.local_batch_size={local_batch}",
           # Skip the trainer's own GEMM-peak measurement; MFU is not used here.
           "--metrics.peak_flops=1e11"]
    if tp:
        cmd += ["--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1"]
    if async_tp:
        cmd += ["--parallelism.enable_async_tensor_parallel=true"]
    peak_kib = run_sampled(cmd, thread_env(args.threads), subprocess.DEVNULL)
    rows = [json.loads(l) for l in open(os.path.join(dump, "metrics.jsonl"))]
    assert len(rows) == total, f"expected {total} metric rows from Loom, got {len(rows)}"
    # tps is per rank and per logged step (log_freq 1): local tokens / step_s / (TP degree).
    per_rank_tokens = local_batch * SEQ / (NPROC if tp else 1)
    return {"step_times": [per_rank_tokens / r["tps"] for r in rows[args.warmup:]],
            "losses": [r["loss"] for r in rows], "grad_norms": [r["grad_norm"] for r in rows],
            "peak_kib": peak_kib, "rank0_train_peak_kib": max(r["mem_peak_gib"] for r in rows) * 1024**2,
            "comm_bytes": rows[-1].get("comm_bytes")}


def run_pytorch_tp(args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}",
           os.path.join(ROOT, "bench/tp_llama.py"), "--steps", str(args.steps), "--warmup",
           str(args.warmup), "--threads", str(args.threads)]
    if args.count_comms and args.warmup >= 1:
        cmd.append("--count-comms")  # CommDebugMode around step 1, a warm-up step (untimed)
    cmd += [f"--{k.replace('_', '-')}={v}" for k, v in MODEL.items()]
    with tempfile.TemporaryFile("w+") as out:
        peak_kib = run_sampled(cmd, thread_env(args.threads), out)
        out.seek(0)
        result = json.loads(out.read().strip().splitlines()[-1])
    result["peak_kib"] = peak_kib
    return result


def run_one(name, args):
    if name == "pytorch_tp":
        return run_pytorch_tp(args)
    with tempfile.TemporaryDirectory() as dump:
        return run_loom(args, dump, tp=name.startswith("loom_tp"), async_tp=name == "loom_tp_async")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6, help="timed steps after warm-up")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per rank (0: cores / 2)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each, alternating")
    p.add_argument("--loom", default=os.path.join(ROOT, "build/bin/loom"))
    p.add_argument("--count-comms", action="store_true",
                   help="count PyTorch TP's collectives in its first (warm-up) step with CommDebugMode; "
                        "off by default: the mode's bookkeeping is inside the measured peak RSS")
    args = p.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        sys.exit("error: need --steps >= 1, --warmup >= 0 and --repeats >= 1")
    if not os.access(args.loom, os.X_OK):
        sys.exit(f"error: {args.loom} is not an executable; build it (cmake --build build --target loom) "
                 "or pass --loom")
    args.threads = args.threads or max(1, len(os.sched_getaffinity(0)) // NPROC)
    try:
        load_start = os.getloadavg()
    except OSError:
        load_start = None

    # Alternate the order (A B C, C B A, ...) so a change in machine load hits all three.
    order = ["loom_tp", "loom_tp_async", "loom_fsdp", "pytorch_tp"]
    runs = {name: [] for name in order}
    for i in range(args.repeats):
        for name in (order if i % 2 == 0 else order[::-1]):
            runs[name].append(run_one(name, args))
            print(f"  run {i + 1}/{args.repeats} {NAMES[name]}: step times "
                  + " ".join(f"{t:.2f}" for t in runs[name][-1]["step_times"]) + " s", file=sys.stderr)
    load_end = os.getloadavg() if load_start is not None else None

    tokens = GLOBAL_BATCH * SEQ
    res = {}
    for name in order:
        r = dict(runs[name][0])  # losses of the first run (every run trains the same)
        times = [t for x in runs[name] for t in x["step_times"]]
        r["step_s"], r["step_s_min"] = statistics.median(times), min(times)
        r["tps"] = tokens / r["step_s"]
        r["peak_kib"] = {rank: max(x["peak_kib"].get(rank, 0) for x in runs[name]) for rank in range(NPROC)}
        r["peak_max_kib"] = max(r["peak_kib"].values())
        r["all_step_times"] = times
        res[name] = r
    ltp, lta, lfs, ptp = res["loom_tp"], res["loom_tp_async"], res["loom_fsdp"], res["pytorch_tp"]
    tps_ratio, mem_ratio = ltp["tps"] / ptp["tps"], ltp["peak_max_kib"] / ptp["peak_max_kib"]
    async_tps_ratio, async_mem_ratio = lta["tps"] / ptp["tps"], lta["peak_max_kib"] / ptp["peak_max_kib"]
    tps_vs_fsdp, mem_vs_fsdp = ltp["tps"] / lfs["tps"], ltp["peak_max_kib"] / lfs["peak_max_kib"]

    print(f"config: {os.path.relpath(CONFIG, ROOT)}, {NPROC} ranks x {args.threads} thread(s), global batch "
          f"{GLOBAL_BATCH} x {SEQ} = {tokens} tokens/step (TP: local batch {GLOBAL_BATCH} shared by the 2 TP "
          f"ranks; FSDP: local batch {GLOBAL_BATCH // NPROC}), {args.warmup} warm-up + {args.steps} timed "
          f"steps, {args.repeats} run(s) of each")
    if load_start is not None:
        print(f"load average (1/5/15 min): start {load_start[0]:.2f}/{load_start[1]:.2f}/{load_start[2]:.2f}, "
              f"end {load_end[0]:.2f}/{load_end[1]:.2f}/{load_end[2]:.2f}")
    print("tokens/s = global batch tokens / median step (TP: tokens per step per rank / TP degree, "
          "summed over ranks, as Loom and TorchTitan count)")
    for name in order:
        r = res[name]
        extra = f"; AdamW {r['adamw']}" if "adamw" in r else ""
        if r.get("comm_bytes") is not None:
            extra += f"; comm {r['comm_bytes'] / 1e6:.1f} MB/step/rank (Loom's ring-model count)"
        print(f"{NAMES[name]:<13} {r['tps']:7.1f} tokens/s (median {r['step_s']:.3f} s/step, "
              f"min {r['step_s_min']:.3f}{extra})")
    if "comm_counts_step1" in ptp:
        print(f"PyTorch TP collectives in step 1 (CommDebugMode): {ptp['comm_counts_step1']}")
    for name in order:
        per_rank = ", ".join(f"rank {k} {gib(v):.3f}" for k, v in sorted(res[name]["peak_kib"].items()))
        print(f"peak RSS {NAMES[name]:<13} {per_rank} GiB")
    print("  in-process training peaks: PyTorch TP "
          + ", ".join(f"rank {s['rank']} {gib(s['peak_train_kib']):.3f}" for s in ptp["ranks"])
          + f" GiB (RSS at the first step {gib(ptp['ranks'][0]['rss_train_start_kib']):.3f}); "
          f"Loom TP rank 0 {gib(ltp['rank0_train_peak_kib']):.3f}, Loom FSDP rank 0 "
          f"{gib(lfs['rank0_train_peak_kib']):.3f} GiB")
    print(f"Loom TP / PyTorch TP: tokens/s {tps_ratio:.3f}x (target >= 1.2), "
          f"peak RSS per rank {mem_ratio:.3f}x (target <= 0.8)")
    print(f"Loom TP async / PyTorch TP: tokens/s {async_tps_ratio:.3f}x (target >= 1.2), "
          f"peak RSS per rank {async_mem_ratio:.3f}x (target <= 0.8)")
    print(f"Loom TP / Loom FSDP:  tokens/s {tps_vs_fsdp:.3f}x, peak RSS per rank {mem_vs_fsdp:.3f}x")
    for name in order:
        print(f"loss {NAMES[name]:<13} " + " ".join(f"{l:.3f}" for l in res[name]["losses"]))
    for name in ("loom_tp", "pytorch_tp"):
        print(f"grad norm {NAMES[name]:<13} " + " ".join(f"{g:.3f}" for g in res[name]["grad_norms"]))

    # Same training: all start near ln(vocab) and fall alike; the TP curves agree on the first steps.
    ln_v = math.log(MODEL["vocab_size"])
    ok = all(abs(r["losses"][0] - ln_v) < 1.0 and r["losses"][-1] < r["losses"][0] - 0.5 for r in res.values())
    drop = ltp["losses"][0] - ltp["losses"][-1]
    ok = ok and all(abs(ltp["losses"][-1] - r["losses"][-1]) < 0.15 * drop for r in (lta, lfs, ptp))
    # Async TP is the same computation as TP: the same loss to float32 rounding.
    ok = ok and max(abs(x - y) for x, y in zip(ltp["losses"], lta["losses"])) < 1e-3
    first = min(3, len(ltp["losses"]))
    first_diff = max(abs(x - y) for x, y in zip(ltp["losses"][:first], ptp["losses"][:first]))
    ok = ok and first_diff < 0.1
    checks = {s["replicated_checksum"] for s in ptp["ranks"]}
    ok = ok and len(checks) == 1  # PyTorch TP's replicated norms stayed in sync
    print(f"max |loss Loom TP - loss PyTorch TP| over the first {first} steps: {first_diff:.3f}")
    print(json.dumps({"bench": "tp_vs_pytorch_tp", "nproc": NPROC, "threads": args.threads,
                      "repeats": args.repeats, "global_batch_tokens": tokens, "load_start": load_start,
                      "load_end": load_end,
                      **{f"{n}_tps": res[n]["tps"] for n in order},
                      **{f"{n}_step_times": res[n]["all_step_times"] for n in order},
                      **{f"{n}_peak_rss_gib": {k: gib(v) for k, v in res[n]["peak_kib"].items()} for n in order},
                      **{f"{n}_losses": res[n]["losses"] for n in order},
                      "pytorch_tp_comm_counts_step1": ptp.get("comm_counts_step1"),
                      "loom_tp_comm_bytes": ltp["comm_bytes"], "loom_fsdp_comm_bytes": lfs["comm_bytes"],
                      "tps_ratio_vs_pytorch_tp": tps_ratio, "async_tps_ratio_vs_pytorch_tp": async_tps_ratio,
                      "async_peak_rss_ratio_vs_pytorch_tp": async_mem_ratio, "peak_rss_ratio_vs_pytorch_tp": mem_ratio,
                      "tps_ratio_vs_loom_fsdp": tps_vs_fsdp, "peak_rss_ratio_vs_loom_fsdp": mem_vs_fsdp,
                      "same_training": ok}))
    if not ok:
        sys.exit(f"error: the runs do not train alike (ln(vocab) = {ln_v:.3f}); see the losses above")


if __name__ == "__main__":
    main()
