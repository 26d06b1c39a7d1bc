"""Exposed communication of Loom FSDP, and its throughput against PyTorch FSDP2 (issue 28).

For 2 and 4 ranks (one thread each, Gloo, fp32) trains the ~124M Llama 3 of
bench/llama3_124m_fsdp.toml with Loom FSDP and with PyTorch FSDP2 (bench/fsdp2_llama.py: fully_shard
per block + root, torchrun), alternating, as bench/fsdp_vs_fsdp2.py does, and prints per rank count:
tokens/s of both and the ratio (target >= 1.3x), and Loom's exposed communication per step, the
seconds the training thread waited for collectives (`comm_exposed_s` of metrics.jsonl: every wait
on a collective timed where it blocks), with its share of the step (target <= 10 %). Loom's FSDP
prefetches the next block's all-gather during the current block's compute and reduce-scatters
asynchronously; buckets (several blocks per collective) are not built yet, so the table has no
"buckets on" column.

Usage: .venv/bin/python bench/fsdp_overlap.py [--ranks 2,4] [--steps 4] [--warmup 2] [--loom build/bin/loom]
"""
import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fsdp_vs_fsdp2 as peer  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--steps", type=int, default=4, help="timed steps after warm-up")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--loom", default=os.path.join(peer.ROOT, "build/bin/loom"))
    args = p.parse_args()
    rows = []
    for nproc in [int(n) for n in args.ranks.split(",")]:
        run_args = argparse.Namespace(steps=args.steps, warmup=args.warmup, nproc=nproc, threads=args.threads,
                                      loom=os.path.abspath(args.loom))
        with tempfile.TemporaryDirectory() as dump:
            loom = peer.run_loom(run_args, dump)
        fsdp2 = peer.run_fsdp2(run_args)
        tokens = nproc * peer.MODEL["batch"] * peer.MODEL["seq_len"]
        loom_tps = tokens / statistics.median(loom["step_times"])
        fsdp2_tps = tokens / statistics.median(fsdp2["step_times"])
        rows.append((nproc, loom_tps, fsdp2_tps, statistics.median(loom["exposed_s"]),
                     statistics.median(loom["exposed_pct"]), statistics.median(loom["step_times"])))
    print(f"config: bench/llama3_124m_fsdp.toml, {args.threads} thread(s) per rank, {args.warmup} warm-up + "
          f"{args.steps} timed steps (medians)")
    print(f"{'ranks':>5} | {'Loom tok/s':>10} {'FSDP2 tok/s':>11} {'ratio':>6} | {'step s':>7} {'exposed s':>9} "
          f"{'exposed %':>9} | buckets")
    for nproc, lt, ft, es, ep, st in rows:
        print(f"{nproc:>5} | {lt:>10.1f} {ft:>11.1f} {lt / ft:>5.2f}x | {st:>7.3f} {es:>9.3f} {ep:>8.1f}% | "
              f"not built")


if __name__ == "__main__":
    main()
