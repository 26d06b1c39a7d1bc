"""Loom vs PyTorch eager and torch.compile on one GPU: Llama 3 1B shape, seq 2048, local batch 4, bf16.

Issue 9's speed target: Loom >= 1.0x torch.compile tokens/s (about 46 % MFU on an H100) at
<= 1.0x its peak memory. One run measures, on the same device and shapes:

- `loom train` of model.flavor 1B (dim 2048, 16 layers, 32 heads / 8 kv, ffn 8192, vocab 128256,
  untied head), one process, training.device=cuda, training.mixed_precision_param=bfloat16 (bf16
  autocast, fp32 master weights and AdamW state), on the default corpus;
- PyTorch eager on the same shapes (bench/llama_eager.py's Transformer: RMSNorm, RoPE, GQA through
  SDPA, SwiGLU), fp32 parameters under torch.autocast(bfloat16), fused AdamW, clipping at 1.0,
  random tokens (throughput does not depend on the data or the init);
- the same PyTorch model under torch.compile (default mode).

Each prints tokens/s (mean step time over the steps after --warmup, device-synchronised), MFU
against the device's dense bf16 peak (the same table as Loom's; --peak overrides) with
FLOPs/token = 6N + 12 L H d T (TorchTitan's formula, N = non-embedding parameters), and peak
device memory (torch.cuda.max_memory_allocated; Loom's mem_peak_gib, which reads the same
allocator statistic). Then the ratios Loom / eager and Loom / compile.

Levers (issue 24): Loom's CUDA kernels are switched by `training.cuda_kernels` (swiglu, rms_norm,
rope, cross_entropy, adamw, add_rms_norm: the residual add fused into the norm after it; `none` =
the ATen code), the sync-free step by
`training.step_readback` (`every_step` switches it off). `--ablation` adds, in the same invocation,
Loom with no kernel, all of them, all minus each kernel and all without the sync-free step
(`--ablation-alone`: each kernel alone too), and prints one table of tokens/s, MFU, peak memory and
each lever's gain. Loom's tokens/s is measured over its log windows (`--log-freq`, 5 steps), since
a log step synchronises with the device. `--extra-loom-args` passes further flags to every
Loom run (e.g. Float8: `--extra-loom-args=--float8.enable=true`).

Usage (on the GPU machine, with the CUDA torch that Loom was built against):
    python3 bench/gpu_vs_pytorch.py --loom build-cuda/bin/loom [--steps 20 --warmup 5] [--ablation]
A CPU smoke run of the script itself (no speed meaning): --device cpu --flavor debugmodel --seq-len 64
--batch 2 --no-compile.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from llama_eager import Transformer, ffn_hidden  # noqa: E402

# Loom's flavors (src/loom/models/llama3/model_args.cpp) that this benchmark uses.
FLAVORS = {
    "1B": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
               multiple_of=256, ffn_dim_multiplier=1.5),
    "debugmodel": dict(dim=256, n_layers=6, n_heads=16, n_kv_heads=16, vocab_size=2048,
                       multiple_of=256, ffn_dim_multiplier=0.0),
}


def peak_bf16_flops(name):
    """Dense bf16 peaks by device name: the table in src/loom/core/device.cpp."""
    table = [("H200", 989e12), ("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12),
             ("H20", 148e12), ("B200", 2250e12), ("A100", 312e12), ("L40S", 362e12),
             ("L4", 121e12), ("A10G", 70e12), ("A10", 125e12)]
    for key, value in table:
        if key in name:
            return value
    return None


def model_args(flavor, seq_len):
    a = argparse.Namespace(**FLAVORS[flavor])
    a.seq_len, a.norm_eps, a.rope_theta = seq_len, 1e-5, 500000.0
    a.ffn_hidden = ffn_hidden(a.dim, a.multiple_of, a.ffn_dim_multiplier)
    return a


def flops_per_token(a):
    hd = a.dim // a.n_heads
    kv = a.n_kv_heads * hd
    per_layer = a.dim * (a.dim + 2 * kv) + a.dim * a.dim + 3 * a.dim * a.ffn_hidden + 2 * a.dim
    non_embedding = a.n_layers * per_layer + a.dim + a.dim * a.vocab_size  # + final norm + head
    return 6 * non_embedding + 12 * a.n_layers * a.n_heads * hd * a.seq_len


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_pytorch(args, compiled):
    device = torch.device(args.device)
    a = model_args(args.flavor, args.seq_len)
    torch.manual_seed(0)
    model = Transformer(a).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)
    step_model = torch.compile(model) if compiled else model
    g = torch.Generator(device="cpu").manual_seed(1)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    loss = None
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, a.vocab_size, (args.batch, a.seq_len + 1), generator=g)
        tokens = tokens.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tokens
        sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = step_model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    step_s = sum(times) / len(times)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {"impl": "torch.compile" if compiled else "pytorch eager",
            "tps": args.batch * a.seq_len / step_s, "step_s": step_s,
            "mem_gib": peak / 2**30, "loss": loss.item()}


def run_loom(args, kernels="all", steps=None, warmup=None, extra=()):
    steps = args.steps if steps is None else steps
    warmup = args.warmup if warmup is None else warmup
    a = model_args(args.flavor, args.seq_len)
    with tempfile.TemporaryDirectory(prefix="loom_gpu_bench_") as dump:
        cmd = [args.loom, "train", "--config", os.path.join(ROOT, "configs/llama3_debug.toml"), "--validation.enable=false",
               f"--model.flavor={args.flavor}", f"--model.vocab_size={a.vocab_size}",
               f"--model.tokenizer_path={os.path.join(ROOT, 'data/default/tokenizer.json')}",
               f"--training.dataset_path={os.path.join(ROOT, 'data/default/corpus.jsonl')}",
               f"--job.dump_folder={dump}", f"--training.device={args.device}",
               "--training.mixed_precision_param=bfloat16",
               "--parallelism.data_parallel_shard_degree=1",
               f"--training.seq_len={a.seq_len}", f"--training.local_batch_size={args.batch}",
               f"--training.steps={warmup + steps}", f"--metrics.log_freq={args.log_freq}",
               "--lr_scheduler.warmup_steps=2", "--optimizer.lr=3e-4",
               "--checkpoint.enable=false", f"--training.cuda_kernels={kernels}", *args.extra_loom_args,
               *extra]
        name = f"loom [{kernels}]" + (" " + " ".join(extra) if extra else "")
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            tail = proc.stderr.strip().splitlines()[-3:]
            print(f"{name}: FAILED (exit {proc.returncode}): {' | '.join(tail)}", flush=True)
            return {"impl": name, "tps": float("nan"), "step_s": float("nan"),
                    "mem_gib": float("nan"), "loss": float("nan")}
        rows = [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]
    rows = [r for r in rows if "event" not in r]
    step_s, mem, loss = timed_windows(rows, warmup, args.batch * a.seq_len, name)
    return {"impl": name, "tps": args.batch * a.seq_len / step_s, "step_s": step_s, "mem_gib": mem,
            "loss": loss}


def timed_windows(rows, warmup, tokens, name="loom"):
    """(seconds per step, peak GiB, last loss) over Loom's logged windows after the warm-up.

    Each logged row's tps covers the steps since the previous log step (a window): the windows
    that start after the warm-up, weighted by their lengths."""
    timed, seconds, counted, prev = [], 0.0, 0, 0
    for r in rows:
        window = r["step"] - prev
        if prev >= warmup and window > 0:
            timed.append(r)
            seconds += window * tokens / r["tps"]
            counted += window
        prev = r["step"]
    if not timed:
        raise SystemExit(f"{name}: no logged window after {warmup} warm-up steps; raise --steps or lower --log-freq")
    return seconds / counted, max(r["mem_peak_gib"] for r in timed), timed[-1]["loss"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loom", default=os.path.join(ROOT, "build-cuda/bin/loom"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--flavor", default="1B", choices=sorted(FLAVORS))
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--peak", type=float, default=0.0, help="peak FLOP/s for MFU (default: by device)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile run")
    p.add_argument("--no-pytorch", action="store_true", help="Loom only (no eager, no compile)")
    p.add_argument("--ablation", action="store_true",
                   help="also run Loom with no kernel, each alone, and all minus each")
    p.add_argument("--ablation-steps", type=int, default=10)
    p.add_argument("--ablation-warmup", type=int, default=5)
    p.add_argument("--ablation-alone", action="store_true",
                   help="also each kernel alone (4 more Loom runs)")
    p.add_argument("--log-freq", type=int, default=5,
                   help="Loom's metrics.log_freq: tokens/s is measured over these windows (every log "
                        "step synchronises with the device; step_readback defers its reads to them)")
    p.add_argument("--extra-loom-args", action="append", default=[],
                   help="a flag passed to every loom run (repeatable)")
    p.add_argument("--json", default="", help="also write every row to this JSON file")
    args = p.parse_args()

    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = args.peak or peak_bf16_flops(name)
    a = model_args(args.flavor, args.seq_len)
    fpt = flops_per_token(a)
    print(f"device: {name}; flavor {args.flavor}, seq {args.seq_len}, local batch {args.batch}, "
          f"bf16; {fpt / 1e9:.2f} GFLOP/token; peak {peak / 1e12 if peak else float('nan'):.0f} TFLOP/s")

    def show(r):
        mfu = 100.0 * r["tps"] * fpt / peak if peak else float("nan")
        r["mfu"] = mfu
        print(f"{r['impl']:>44}: {r['tps']:10,.0f} tokens/s  {r['step_s'] * 1e3:8.1f} ms/step  "
              f"MFU {mfu:5.1f} %  peak memory {r['mem_gib']:6.2f} GiB  last loss {r['loss']:.3f}",
              flush=True)

    results = [run_loom(args)] if args.no_pytorch else [run_loom(args), run_pytorch(args, compiled=False)]
    for r in results:
        show(r)
    if not args.no_compile and not args.no_pytorch:
        results.append(run_pytorch(args, compiled=True))
        show(results[-1])
    loom = results[0]
    for peer in results[1:]:
        mem = loom["mem_gib"] / peer["mem_gib"] if peer["mem_gib"] else float("nan")
        print(f"loom / {peer['impl']}: tokens/s {loom['tps'] / peer['tps']:.3f}x, "
              f"peak memory {mem:.3f}x", flush=True)
    if args.ablation:
        kernels = ["swiglu", "rms_norm", "rope", "cross_entropy", "adamw", "add_rms_norm"]
        # (label, training.cuda_kernels, further flags): the kernels, then the other levers, each
        # switched off from "all".
        configs = [("none", "none", ())] + ([(k, k, ()) for k in kernels] if args.ablation_alone else []) + \
            [("all", "all", ())] + \
            [("all - " + drop, ",".join(k for k in kernels if k != drop), ()) for drop in kernels] + \
            [("all - sync-free step", "all", ("--training.step_readback=every_step",))]
        print(f"\nablation: {args.ablation_steps} steps after {args.ablation_warmup} warm-up each",
              flush=True)
        rows = []
        for label, c, extra in configs:
            rows.append(run_loom(args, kernels=c, steps=args.ablation_steps,
                                 warmup=args.ablation_warmup, extra=extra))
            rows[-1]["lever"] = label
            show(rows[-1])
        base = rows[0]["tps"]
        top = next(r["tps"] for r in rows if r["lever"] == "all")
        peers = {r["impl"]: r for r in results[1:]}
        print("\n| Loom levers | tokens/s | MFU % | peak GiB | vs none | vs all | vs eager | vs compile |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for (c, _, _), r in zip(configs, rows):
            eager = peers.get("pytorch eager", {}).get("tps", float("nan"))
            comp = peers.get("torch.compile", {}).get("tps", float("nan"))
            print(f"| {c} | {r['tps']:,.0f} | {r['mfu']:.1f} | {r['mem_gib']:.2f} | "
                  f"{r['tps'] / base:.3f}x | {r['tps'] / top:.3f}x | {r['tps'] / eager:.3f}x | "
                  f"{r['tps'] / comp:.3f}x |")
        results += rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "flavor": args.flavor, "seq_len": args.seq_len,
                       "batch": args.batch, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
