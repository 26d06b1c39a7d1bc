#!/usr/bin/env python3
"""The GEMM efficiency curve of one device: achieved FLOP/s of the three GEMMs of a training
linear (forward x @ W^T, the input gradient dY @ W, the weight gradient dY^T @ x) by shape, as a
fraction of the device's dense peak -- the data `loom plan`'s time model needs to price a layout
whose tensor parallelism shrinks the GEMMs (issue 29: "compute from FLOPs and a per-device
efficiency curve by GEMM size").

Shapes: the linears of Llama 3 8B, 70B and 405B (fused QKV, the attention output, the gate/up and
down projections of the MLP) split as TP 1, 2, 4 and 8 split them (column-parallel layers divide
their output features, row-parallel ones their input features), at several token counts per
micro-batch; and square GEMMs from 256 to 16384 for a generic curve.

    python3 bench/gemm_efficiency.py --device cuda --dtype bf16 --peak-tflops 989 --json out.json
    python3 bench/gemm_efficiency.py --device cpu --dtype fp32 --threads 1 --quick

Timing: CUDA events around enough repetitions to pass --min-ms after a warm-up; on the CPU,
perf_counter. Prints one line per shape and a summary per model and TP degree (the FLOP-weighted
efficiency of the block's linears: what the time model would multiply the peak by).
"""
import argparse
import json
import time

import torch

# name: (dim, ffn hidden, heads, kv heads)
MODELS = {
    "debugmodel": (256, 768, 16, 16),  # the CPU plan benchmark's model (bench/plan_time.py)
    "llama3_8b": (4096, 14336, 32, 8),
    "llama3_70b": (8192, 28672, 64, 8),
    "llama3_405b": (16384, 53248, 128, 8),
}


def linears(dim, ffn, heads, kv_heads, tp):
    head_dim = dim // heads
    qkv = dim + 2 * kv_heads * head_dim
    # (name, in_features, out_features) local to one TP rank; column-parallel split the output,
    # row-parallel the input. The gate and the up projection are two GEMMs of the same shape.
    return [
        ("qkv", dim, qkv // tp, 1),
        ("wo", dim // tp, dim, 1),
        ("w1_w3", dim, ffn // tp, 2),
        ("w2", ffn // tp, dim, 1),
    ]


def timer(device):
    if device.startswith("cuda"):
        def run(fn, min_ms):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            reps = 1
            while True:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(reps):
                    fn()
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
                if ms >= min_ms or reps >= 1 << 14:
                    return ms / 1e3 / reps
                reps = max(reps * 2, int(reps * min_ms / max(ms, 1e-3) * 1.2))
    else:
        def run(fn, min_ms):
            fn()
            reps = 1
            while True:
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                s = time.perf_counter() - t0
                if s * 1e3 >= min_ms or reps >= 1 << 12:
                    return s / reps
                reps = max(reps * 2, int(reps * min_ms / max(s * 1e3, 1e-3) * 1.2))
    return run


def training_linear_seconds(m, k, n, dtype, device, run, min_ms):
    """Seconds of forward + input gradient + weight gradient of a linear k -> n on m tokens."""
    if dtype == "float8":
        return float8_linear_seconds(m, k, n, device, run, min_ms)
    x = torch.randn(m, k, dtype=dtype, device=device)
    w = torch.randn(n, k, dtype=dtype, device=device)
    dy = torch.randn(m, n, dtype=dtype, device=device)
    fwd = run(lambda: torch.mm(x, w.t()), min_ms)
    dgrad = run(lambda: torch.mm(dy, w), min_ms)
    wgrad = run(lambda: torch.mm(dy.t(), x), min_ms)
    del x, w, dy
    return fwd, dgrad, wgrad


def float8_linear_seconds(m, k, n, device, run, min_ms):
    """The same three GEMMs as row-wise scaled float8 GEMMs (torch._scaled_mm, e4m3 operands, one
    fp32 scale per row of A and per column of B, bf16 out), as Loom's float8 recipe issues them.
    The GEMMs only: the quantization passes are not timed (the end-to-end runs count them)."""
    e4m3 = torch.float8_e4m3fn

    def operand(rows, cols):
        return (torch.randn(rows, cols, device=device) * 8).to(e4m3), torch.ones(rows, 1, device=device)

    def gemm(a, b):  # a [M, K] row-major, b [N, K] row-major: a b^T
        (ad, as_), (bd, bs) = a, b
        return lambda: torch._scaled_mm(ad, bd.t(), scale_a=as_, scale_b=bs.view(1, -1), out_dtype=torch.bfloat16)

    fwd = run(gemm(operand(m, k), operand(n, k)), min_ms)
    dgrad = run(gemm(operand(m, n), operand(k, n)), min_ms)
    wgrad = run(gemm(operand(n, m), operand(k, m)), min_ms)
    return fwd, dgrad, wgrad


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "float8"],
                   help="float8: row-wise scaled e4m3 GEMMs (torch._scaled_mm), against the bf16 peak")
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="the device's dense peak for --dtype (H100/H200 SXM bf16: 989); 0: efficiency not printed")
    p.add_argument("--tokens", default="2048,4096,8192,16384", help="tokens per micro-batch (GEMM m)")
    p.add_argument("--tp", default="1,2,4,8")
    p.add_argument("--models", default=",".join(m for m in MODELS if m != "debugmodel"))
    p.add_argument("--square", default="256,512,1024,2048,4096,8192,16384")
    p.add_argument("--min-ms", type=float, default=20.0)
    p.add_argument("--threads", type=int, default=0, help="CPU: intra-op threads (0: torch's default)")
    p.add_argument("--quick", action="store_true", help="CPU-sized: 8B only, 512/2048 tokens, squares to 2048")
    p.add_argument("--json", default="")
    args = p.parse_args()
    if args.quick:
        args.models, args.tokens, args.square = "llama3_8b", "512,2048", "256,512,1024,2048"
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "float8": "float8"}[args.dtype]
    run = timer(args.device)
    peak = args.peak_tflops * 1e12
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu x{torch.get_num_threads()}"
    print(f"device {name}, {args.dtype}, peak {args.peak_tflops} TFLOP/s, torch {torch.__version__}", flush=True)
    rows = []

    def record(kind, label, m, k, n, count, secs):
        flops = 2.0 * m * k * n
        fwd, dgrad, wgrad = secs
        row = {"kind": kind, "label": label, "m": m, "k": k, "n": n, "count": count,
               "fwd_s": fwd, "dgrad_s": dgrad, "wgrad_s": wgrad,
               "tflops": 3 * flops / (fwd + dgrad + wgrad) / 1e12,
               "fwd_tflops": flops / fwd / 1e12, "dgrad_tflops": flops / dgrad / 1e12,
               "wgrad_tflops": flops / wgrad / 1e12}
        if peak:
            row["efficiency"] = row["tflops"] * 1e12 / peak
        rows.append(row)
        eff = f" eff {row['efficiency']:.3f}" if peak else ""
        print(f"{kind:6} {label:28} m {m:6} k {k:6} n {n:6}: {row['tflops']:8.1f} TFLOP/s "
              f"(fwd {row['fwd_tflops']:.1f}, dgrad {row['dgrad_tflops']:.1f}, wgrad {row['wgrad_tflops']:.1f}){eff}",
              flush=True)
        return row

    for s in [int(v) for v in args.square.split(",") if v]:
        record("square", f"{s}", s, s, s, 1, training_linear_seconds(s, s, s, dtype, args.device, run, args.min_ms))

    summary = []
    for model in [m for m in args.models.split(",") if m]:
        dim, ffn, heads, kv = MODELS[model]
        for tp in [int(v) for v in args.tp.split(",") if v]:
            for m in [int(v) for v in args.tokens.split(",") if v]:
                flops = secs = 0.0
                for lname, k, n, count in linears(dim, ffn, heads, kv, tp):
                    row = record("linear", f"{model} tp{tp} {lname}", m, k, n, count,
                                 training_linear_seconds(m, k, n, dtype, args.device, run, args.min_ms))
                    flops += count * 6.0 * m * k * n
                    secs += count * (row["fwd_s"] + row["dgrad_s"] + row["wgrad_s"])
                block = {"model": model, "tp": tp, "tokens": m, "tflops": flops / secs / 1e12}
                if peak:
                    block["efficiency"] = flops / secs / peak
                summary.append(block)
    print("\nblock linears, FLOP-weighted (model, TP, tokens per micro-batch -> TFLOP/s, efficiency):")
    for b in summary:
        eff = f"  {b['efficiency']:.3f}" if peak else ""
        print(f"  {b['model']:12} tp {b['tp']}  m {b['tokens']:6}  {b['tflops']:8.1f}{eff}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "dtype": args.dtype, "peak_tflops": args.peak_tflops,
                       "torch": torch.__version__, "rows": rows, "blocks": summary}, f, indent=1)


if __name__ == "__main__":
    main()
