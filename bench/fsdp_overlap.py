"""Exposed communication of Loom FSDP, buckets off and on, against PyTorch FSDP2 (issue 28).

For 2 and 4 ranks (one thread each, Gloo, fp32) trains the ~124M Llama 3 of
bench/llama3_124m_fsdp.toml three ways in the same run, as bench/fsdp_vs_fsdp2.py does:
  - Loom, buckets off: one FSDP group per block (`parallelism.fsdp_bucket_mb = 0`), the next
    group's all-gather prefetched (`fsdp_prefetch_depth = 1`);
  - Loom, buckets on: consecutive blocks merged into buckets (`fsdp_bucket_mb`, default -1 = the
    automatic 25 MB) and the next `--depth` groups' all-gathers issued ahead (default 2);
  - PyTorch FSDP2 (bench/fsdp2_llama.py: fully_shard per block + root, torchrun).
Both Loom runs also have the head (final norm + output) as its own FSDP group, so its
reduce-scatter overlaps the rest of the backward. For each it prints tokens/s (all ranks together)
and the ratio to FSDP2 (target >= 1.3x with buckets on), and the exposed communication per step: the
seconds the training thread waited for collectives (`comm_exposed_s` of metrics.jsonl, every wait
on a collective timed where it blocks) and its share of the step (target <= 10 % with buckets on).
Memory is not sampled here (bench/fsdp_vs_fsdp2.py compares it): the sampler's 5 ms scans of /proc
would take CPU from the ranks. Medians over the timed steps of every round: with --rounds R the three runs alternate R times
(Loom off, Loom on, FSDP2, Loom off, ...), so that the drift of a shared machine's speed over
minutes falls on all three alike instead of on whichever ran last.

Usage: .venv/bin/python bench/fsdp_overlap.py [--ranks 2,4] [--steps 4] [--warmup 2] [--rounds 2]
           [--bucket-mb -1] [--depth 2] [--loom build/bin/loom]
"""
import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fsdp_vs_fsdp2 as peer  # noqa: E402

TARGET_RATIO = 1.3      # Loom tokens/s over FSDP2's, buckets on
TARGET_EXPOSED = 10.0   # exposed communication, % of the step, buckets on


def loom_variants(bucket_mb, depth):
    """(label, overrides) of the Loom runs, in the order they run."""
    return [("buckets off", ["--parallelism.fsdp_bucket_mb=0", "--parallelism.fsdp_prefetch_depth=1"]),
            (f"buckets on ({'auto' if bucket_mb == -1 else f'{bucket_mb:g} MB'}, depth {depth})",
             [f"--parallelism.fsdp_bucket_mb={bucket_mb:g}", f"--parallelism.fsdp_prefetch_depth={depth}"])]


def summarize(results, tokens):
    """Medians over the timed steps of all rounds' runs of one variant."""
    pooled = {k: [v for r in results for v in r[k]] for k in ("step_times", "exposed_s", "exposed_pct")}
    return {"tps": tokens / statistics.median(pooled["step_times"]),
            "step_s": statistics.median(pooled["step_times"]),
            "exposed_s": statistics.median(pooled["exposed_s"]),
            "exposed_pct": statistics.median(pooled["exposed_pct"])}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--steps", type=int, default=4, help="timed steps after warm-up")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="alternations of the three runs (medians pool them)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--bucket-mb", type=float, default=-1, help="fsdp_bucket_mb of the buckets-on run (-1: automatic)")
    p.add_argument("--depth", type=int, default=2, help="fsdp_prefetch_depth of the buckets-on run")
    p.add_argument("--loom", default=os.path.join(peer.ROOT, "build/bin/loom"))
    args = p.parse_args()
    if args.depth < 1:
        p.error("--depth must be >= 1 (the number of groups whose all-gathers are issued ahead)")
    if args.bucket_mb != -1 and args.bucket_mb <= 0:
        p.error("--bucket-mb must be -1 (automatic) or a size in MB > 0")
    variants = loom_variants(args.bucket_mb, args.depth)
    rows = []  # (ranks, label, summary, fsdp2 tokens/s)
    for nproc in [int(n) for n in args.ranks.split(",")]:
        run_args = argparse.Namespace(steps=args.steps, warmup=args.warmup, nproc=nproc, threads=args.threads,
                                      loom=os.path.abspath(args.loom))
        tokens = nproc * peer.MODEL["batch"] * peer.MODEL["seq_len"]
        loom = {label: [] for label, _ in variants}
        fsdp2 = []
        for _ in range(args.rounds):
            for label, overrides in variants:
                with tempfile.TemporaryDirectory() as dump:
                    loom[label].append(peer.run_loom(run_args, dump, overrides, sample_memory=False))
            fsdp2.append(peer.run_fsdp2(run_args, sample_memory=False))
        fsdp2_tps = tokens / statistics.median([t for r in fsdp2 for t in r["step_times"]])
        rows += [(nproc, label, summarize(results, tokens), fsdp2_tps) for label, results in loom.items()]

    print(f"config: bench/llama3_124m_fsdp.toml, {args.threads} thread(s) per rank, {args.warmup} warm-up + "
          f"{args.steps} timed steps, {args.rounds} alternating round(s) (medians of all timed steps); "
          f"tokens/s of all ranks together")
    print(f"{'ranks':>5} | {'Loom':<28} | {'tok/s':>8} {'FSDP2 tok/s':>11} {'ratio':>6} | {'step s':>7} "
          f"{'exposed s':>9} {'exposed %':>9}")
    met = True
    for nproc, label, s, fsdp2_tps in rows:
        ratio = s["tps"] / fsdp2_tps
        print(f"{nproc:>5} | {label:<28} | {s['tps']:>8.1f} {fsdp2_tps:>11.1f} {ratio:>5.2f}x | {s['step_s']:>7.3f} "
              f"{s['exposed_s']:>9.3f} {s['exposed_pct']:>8.1f}%")
        if label != variants[0][0]:
            met = met and ratio >= TARGET_RATIO and s["exposed_pct"] <= TARGET_EXPOSED
    print(f"targets with buckets on: tokens/s >= {TARGET_RATIO}x FSDP2 and exposed <= {TARGET_EXPOSED:g} % of the "
          f"step: {'met' if met else 'NOT met'} at every rank count")


if __name__ == "__main__":
    main()
