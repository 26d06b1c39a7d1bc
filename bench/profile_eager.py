"""Where one PyTorch eager training step's time goes, for comparison with loom_step_profile.

Same model and step as bench/llama_eager.py (124M Llama 3, seq 256, batch 4, fp32, fused AdamW,
clipping), profiled with torch.profiler; prints per-op self CPU time per step, largest first, and
the phase totals.

Usage: .venv/bin/python bench/profile_eager.py [--steps 3] [--warmup 2] [--threads 2]
"""
import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_eager  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    a = argparse.Namespace(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=32000,
                           multiple_of=256, ffn_dim_multiplier=0.0, seq_len=256, batch=4,
                           lr=3e-4, norm_eps=1e-5, rope_theta=500000.0)
    a.ffn_hidden = llama_eager.ffn_hidden(a.dim, a.multiple_of, a.ffn_dim_multiplier)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = llama_eager.Transformer(a)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1, fused=True)
    rf = torch.profiler.record_function

    def step():
        tokens = torch.randint(0, a.vocab_size, (a.batch, a.seq_len + 1))
        with rf("## forward + loss"):
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        with rf("## backward"):
            loss.backward()
        with rf("## clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        with rf("## optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        wall = time.perf_counter() - t0
    n = args.steps
    print(f"PyTorch eager step profile: batch {a.batch} x seq {a.seq_len}, {torch.get_num_threads()} "
          f"threads, {n} steps, {wall / n:.3f} s/step wall (profiled)")
    events = prof.key_averages()
    for e in sorted(events, key=lambda e: e.key):
        if e.key.startswith("## "):
            print(f"  {e.key:<22} {e.cpu_time_total / 1e3 / n:9.1f} ms/step")
    print(f"{'op (self time)':<60} {'ms/step':>12} {'calls':>8}")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total):
        ms = e.self_cpu_time_total / 1e3 / n
        if ms < 1.0 or e.key.startswith("## "):
            continue
        print(f"{e.key[:60]:<60} {ms:12.1f} {e.count // n:8d}")


if __name__ == "__main__":
    main()
