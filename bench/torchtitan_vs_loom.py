"""Loom vs TorchTitan 0.3.0 itself on one GPU, in one invocation (issue 49's reference).

Three cases, each on the same model shape, batch, sequence, precision and data (Loom's default
corpus and tokenizer; bench/torchtitan_peer.py feeds TorchTitan the same token stream):

  dense    Llama 3 1B shape (dim 2048, 16 layers, 32 heads / 8 kv, untied head, vocab 128256),
           seq 2048, local batch 4, bf16 autocast over fp32 weights and AdamW: Loom (every CUDA
           kernel) vs TorchTitan eager and TorchTitan + torch.compile.
           Goal: Loom >= 1.1x TorchTitan + compile.
  float8   the same with rowwise Float8 linears: Loom float8 vs Loom bf16 (goal >= 1.15x) and vs
           TorchTitan + compile + Float8 rowwise (torchao); both losses after the run.
  moe      Qwen3-30B-A3B's block widths (dim 2048, 128 experts, top 8, expert width 768, 32 heads
           / 4 kv of 128) with --moe-layers layers (4 fit one H200 with fp32 AdamW), seq 4096,
           local batch 2: Loom vs TorchTitan eager and + compile.
           Goal: Loom >= 1.1x TorchTitan at <= 1.0x its peak memory.

Each row: tokens/s (mean over the steps after --warmup), MFU with TorchTitan's count (6 N_active
+ 12 L H d T, N without the embedding; the same number for both, printed with the count TorchTitan's
built model gives), peak device memory over the timed steps, the first and last loss. Then the
ratios. If TorchTitan cannot run on this machine (its wheels absent, or it needs a newer torch than
the one installed), its rows say why and the hand-written PyTorch reference
(bench/gpu_vs_pytorch.py) stays the peer.

Usage (GPU machine; scripts/gpu_check.sh unpacks the TorchTitan wheels that
scripts/pack_torchtitan.sh downloaded into .device/torchtitan and runs this):
    PYTHONPATH=/tmp/ttlib python3 bench/torchtitan_vs_loom.py --loom build-cuda/bin/loom \
        [--cases dense,float8,moe] [--steps 20 --warmup 5] [--json out.json]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from gpu_vs_pytorch import flops_per_token, model_args, peak_bf16_flops, timed_windows  # noqa: E402

# Qwen3-30B-A3B (src/loom/models/qwen3_moe/model.cpp's "30B-A3B"; TorchTitan's qwen3 "30B-A3B").
QWEN3_30B_A3B = dict(dim=2048, n_heads=32, n_kv_heads=4, head_dim=128, n_experts=128, top_k=8,
                     moe_ffn=768, vocab_size=151936)


def moe_flops_per_token(layers, seq_len):
    """TorchTitan's count for the MoE shape: 6 x active non-embedding parameters + attention."""
    a = argparse.Namespace(**QWEN3_30B_A3B)
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    attention = a.dim * q + 2 * a.dim * kv + q * a.dim + 2 * a.head_dim  # q/k/v/o, q_norm, k_norm
    experts = a.top_k * 3 * a.dim * a.moe_ffn
    per_layer = attention + a.dim * a.n_experts + experts + 2 * a.dim  # router, two norms
    non_embedding = layers * per_layer + a.dim + a.dim * a.vocab_size  # final norm + head
    return 6 * non_embedding + 12 * layers * a.n_heads * a.head_dim * seq_len


def run_loom(args, label, config, flags, seq_len, batch):
    with tempfile.TemporaryDirectory(prefix="loom_tt_bench_") as dump:
        cmd = [args.loom, "train", "--config", os.path.join(ROOT, config), "--validation.enable=false",
               f"--model.tokenizer_path={os.path.join(ROOT, 'data/default/tokenizer.json')}",
               f"--training.dataset_path={os.path.join(ROOT, 'data/default/corpus.jsonl')}",
               f"--job.dump_folder={dump}", "--training.device=cuda",
               "--training.mixed_precision_param=bfloat16",
               "--parallelism.data_parallel_shard_degree=1", "--activation_checkpoint.mode=none",
               f"--training.seq_len={seq_len}", f"--training.local_batch_size={batch}",
               f"--training.steps={args.warmup + args.steps}", f"--metrics.log_freq={args.log_freq}",
               "--lr_scheduler.warmup_steps=2", "--optimizer.lr=3e-4", "--training.max_norm=1.0",
               "--checkpoint.enable=false", *flags]
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            why = " | ".join(proc.stderr.strip().splitlines()[-3:])
            return failed(label, f"exit {proc.returncode}: {why}")
        rows = [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]
    rows = [r for r in rows if "event" not in r]
    step_s, mem, last = timed_windows(rows, args.warmup, batch * seq_len, label)
    return {"impl": label, "tps": batch * seq_len / step_s, "step_s": step_s, "mem_gib": mem,
            "first_loss": rows[0]["loss"], "loss": last}


def run_torchtitan(args, label, model, seq_len, batch, extra=()):
    cmd = [sys.executable, os.path.join(ROOT, "bench/torchtitan_peer.py"), "--model", model,
           "--seq-len", str(seq_len), "--batch", str(batch), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--label", label, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        err = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        return failed(label, f"exit {proc.returncode}: {' | '.join(err[-3:])}")
    r = json.loads(lines[-1])
    r["first_loss"] = r["losses"][0] if r.get("losses") else float("nan")
    return r


def failed(label, why):
    print(f"{label}: FAILED ({why})", flush=True)
    nan = float("nan")
    return {"impl": label, "tps": nan, "step_s": nan, "mem_gib": nan, "first_loss": nan, "loss": nan,
            "failed": why}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loom", default=os.path.join(ROOT, "build-cuda/bin/loom"))
    p.add_argument("--cases", default="dense,float8,moe")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--log-freq", type=int, default=5)
    p.add_argument("--moe-layers", type=int, default=4)
    p.add_argument("--moe-seq-len", type=int, default=4096)
    p.add_argument("--moe-batch", type=int, default=2)
    p.add_argument("--no-eager", action="store_true", help="skip TorchTitan without compile")
    p.add_argument("--peak", type=float, default=0.0, help="peak FLOP/s for MFU (default: by device)")
    p.add_argument("--json", default="")
    args = p.parse_args()

    import torch
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    peak = args.peak or peak_bf16_flops(name) or float("nan")
    try:
        import torchtitan
        tt_version = torchtitan.__version__
    except Exception as e:  # noqa: BLE001 (any import failure means: no TorchTitan here)
        tt_version = f"absent ({type(e).__name__}: {e})"
    print(f"device: {name}; torch {torch.__version__}; torchtitan {tt_version}", flush=True)
    cases = [c for c in args.cases.split(",") if c]
    report = {"device": name, "torch": torch.__version__, "torchtitan": tt_version, "cases": {}}

    def show(r, fpt):
        r["mfu"] = 100.0 * r["tps"] * fpt / peak
        print(f"{r['impl']:>40}: {r['tps']:10,.0f} tokens/s  MFU {r['mfu']:5.1f} %  peak {r['mem_gib']:6.2f} GiB"
              f"  loss {r['first_loss']:.3f} -> {r['loss']:.3f}", flush=True)

    def ratio(a, b, what):
        mem = a["mem_gib"] / b["mem_gib"] if b["mem_gib"] else float("nan")
        line = f"{a['impl']} / {b['impl']}: tokens/s {a['tps'] / b['tps']:.3f}x, peak memory {mem:.3f}x ({what})"
        print(line, flush=True)
        return line

    dense = model_args("1B", 2048)
    dense_fpt = flops_per_token(dense)
    dense_flags = ["--model.flavor=1B", f"--model.vocab_size={dense.vocab_size}"]
    loom_bf16 = None
    if "dense" in cases or "float8" in cases:
        print(f"\n== dense: Llama 3 1B shape, seq 2048, batch 4, bf16; {dense_fpt / 1e9:.2f} GFLOP/token", flush=True)
        loom_bf16 = run_loom(args, "loom", "configs/llama3_debug.toml", dense_flags, 2048, 4)
        rows = [loom_bf16]
        if "dense" in cases:
            if not args.no_eager:
                rows.append(run_torchtitan(args, "torchtitan", "llama3_1B", 2048, 4))
            rows.append(run_torchtitan(args, "torchtitan + compile", "llama3_1B", 2048, 4, ["--compile"]))
        for r in rows:
            show(r, dense_fpt)
        lines = [ratio(loom_bf16, r, "goal >= 1.1x vs + compile") for r in rows[1:]]
        report["cases"]["dense"] = {"rows": rows, "ratios": lines}
    if "float8" in cases:
        print("\n== float8: the same, rowwise Float8 linears", flush=True)
        rows = [run_loom(args, "loom float8", "configs/llama3_debug.toml",
                         dense_flags + ["--float8.enable=true", "--float8.recipe=rowwise"], 2048, 4),
                run_torchtitan(args, "torchtitan + compile + float8", "llama3_1B", 2048, 4,
                               ["--compile", "--float8"])]
        for r in rows:
            show(r, dense_fpt)
        lines = [ratio(rows[0], loom_bf16, "goal >= 1.15x"), ratio(rows[0], rows[1], "vs TorchTitan's Float8")]
        loss_gap = abs(rows[0]["loss"] - loom_bf16["loss"]) / loom_bf16["loss"]
        lines.append(f"loom float8 last loss vs loom bf16: {100 * loss_gap:.2f} % apart "
                     f"after {args.warmup + args.steps} steps")
        print(lines[-1], flush=True)
        report["cases"]["float8"] = {"rows": rows, "ratios": lines}
    if "moe" in cases:
        fpt = moe_flops_per_token(args.moe_layers, args.moe_seq_len)
        print(f"\n== moe: Qwen3-30B-A3B block widths, {args.moe_layers} layers, seq {args.moe_seq_len}, "
              f"batch {args.moe_batch}, bf16; {fpt / 1e9:.2f} GFLOP/token", flush=True)
        flags = ["--model.name=qwen3_moe", "--model.flavor=30B-A3B", f"--model.n_layers={args.moe_layers}",
                 f"--model.vocab_size={QWEN3_30B_A3B['vocab_size']}"]
        rows = [run_loom(args, "loom", "configs/qwen3_moe_debug.toml", flags, args.moe_seq_len, args.moe_batch)]
        tt = ["--layers", str(args.moe_layers)]
        if not args.no_eager:
            rows.append(run_torchtitan(args, "torchtitan", "qwen3_30b_a3b", args.moe_seq_len, args.moe_batch, tt))
        rows.append(run_torchtitan(args, "torchtitan + compile", "qwen3_30b_a3b", args.moe_seq_len,
                                   args.moe_batch, tt + ["--compile"]))
        for r in rows:
            show(r, fpt)
            if "flops_per_token" in r:
                print(f"{'':>40}  (TorchTitan's own count of the built model: "
                      f"{r['flops_per_token'] / 1e9:.2f} GFLOP/token, {r['active_params'] / 1e6:.0f}M active "
                      f"of {r['params'] / 1e6:.0f}M)", flush=True)
        lines = [ratio(rows[0], r, "goal >= 1.1x at <= 1.0x memory") for r in rows[1:]]
        report["cases"]["moe"] = {"rows": rows, "ratios": lines}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
