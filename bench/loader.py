"""The data loader's pretokenizing against Hugging Face `tokenizers`: tokens/s from a Parquet file.

Builds a corpus of about `--mb` MB of UTF-8 text (the texts of data/default/corpus.jsonl, repeated)
as a Parquet file with one "text" column in row groups of 10,000 rows, then, for each thread
count N (default 1 and 2), measures in the same run:
  - Loom: `loom tokenizer pretokenize --tokenizer data/default/tokenizer.json --input corpus.parquet
    --format parquet --workers N --output x.tokens`, the wall time of the whole process
    (time.perf_counter around the subprocess: process start, loading the tokenizer, reading the
    Parquet file, tokenizing, writing the token file); tokens from the token file's header;
  - HF: `tokenizers` (the same tokenizer.json) in a child Python per N with RAYON_NUM_THREADS=N
    (rayon reads it once, so it is set before `tokenizers` is imported), timing only
    `tok.encode_batch(texts, add_special_tokens=False)` on the texts already read into memory.
Best of `--repeat` runs each. Tokens/s counts the documents' tokens for both (the token file's
num_tokens less the one EOS it writes after each document); the two counts must agree (same
tokenizer, same documents), else the script fails. Prints a table (threads, Loom tokens/s, HF
tokens/s, Loom / HF) and the target line; exits 1 when Loom with 2 workers is below 1.0x HF with 2
threads.

Usage: .venv/bin/python bench/loader.py [--mb 20] [--threads 1,2] [--repeat 3] [--loom build/bin/loom]
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS_JSONL = os.path.join(ROOT, "data", "default", "corpus.jsonl")
TOKENIZER = os.path.join(ROOT, "data", "default", "tokenizer.json")
ROW_GROUP = 10_000
TARGET = 1.0  # Loom (2 workers) tokens/s over HF tokenizers' (2 threads)

# The HF child: argv = parquet, tokenizer, repeat; prints one JSON line {tokens, documents, seconds}.
HF_CHILD = r"""
import json, sys, time
import pyarrow.parquet as pq
from tokenizers import Tokenizer  # after RAYON_NUM_THREADS is in the environment
parquet, tokenizer, repeat = sys.argv[1], sys.argv[2], int(sys.argv[3])
texts = [t for t in pq.read_table(parquet, columns=["text"]).column("text").to_pylist() if t]
tok = Tokenizer.from_file(tokenizer)
best, tokens = float("inf"), None
for _ in range(repeat):
    start = time.perf_counter()
    encodings = tok.encode_batch(texts, add_special_tokens=False)
    best = min(best, time.perf_counter() - start)
    n = sum(len(e.ids) for e in encodings)
    if tokens is not None and n != tokens:
        sys.exit(f"HF tokenizers gave {n} tokens, {tokens} in an earlier run")
    tokens = n
    del encodings
print(json.dumps({"tokens": tokens, "documents": len(texts), "seconds": best}))
"""


def make_corpus(path, megabytes):
    with open(CORPUS_JSONL) as f:
        docs = [t for t in (json.loads(line)["text"] for line in f) if t]
    texts, size, target = [], 0, int(megabytes * 1e6)
    while size < target:
        for t in docs:
            texts.append(t)
            size += len(t.encode("utf-8"))
            if size >= target:
                break
    pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), path, row_group_size=ROW_GROUP)
    return len(texts), size


def token_file_header(path):
    """(num_tokens, num_documents) of a Loom token file (64-byte header, src/loom/data/sources.h)."""
    with open(path, "rb") as f:
        magic, version, _bpt, num_tokens, num_documents = struct.unpack("<8sIIQQ", f.read(32))
    if magic != b"LOOMTOK\0" or version != 1:
        sys.exit(f"{path} is not a version-1 Loom token file ({magic!r}, version {version})")
    return num_tokens, num_documents


def run_loom(args, parquet, output, workers):
    """Best wall seconds of `--repeat` runs and the document tokens / documents of the token file."""
    cmd = [args.loom, "tokenizer", "pretokenize", "--tokenizer", TOKENIZER, "--input", parquet,
           "--format", "parquet", "--workers", str(workers), "--output", output]
    env = dict(os.environ, OMP_NUM_THREADS=str(workers))
    best, counts = float("inf"), None
    for _ in range(args.repeat):
        if os.path.exists(output):
            os.remove(output)
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
        num_tokens, num_documents = token_file_header(output)
        run_counts = (num_tokens - num_documents, num_documents)  # less one EOS per document
        if counts is not None and run_counts != counts:
            sys.exit(f"Loom wrote {run_counts} (tokens, documents) with {workers} workers, {counts} in an earlier run")
        counts, best = run_counts, min(best, seconds)
    return best, counts


def run_hf(args, parquet, threads):
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="true")
    proc = subprocess.run([sys.executable, "-c", HF_CHILD, parquet, TOKENIZER, str(args.repeat)],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"HF tokenizers child ({threads} threads) failed ({proc.returncode}): {proc.stderr.strip()}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result["seconds"], (result["tokens"], result["documents"])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=20, help="corpus size in MB of UTF-8 text")
    p.add_argument("--threads", default="1,2", help="thread counts to measure (must include 2)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each measurement; the best counts")
    p.add_argument("--loom", default=os.path.join(ROOT, "build/bin/loom"))
    args = p.parse_args()
    threads = [int(n) for n in args.threads.split(",")]
    if 2 not in threads or min(threads) < 1:
        p.error("--threads must list positive thread counts including 2 (the target is at 2 threads)")
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    args.loom = os.path.abspath(args.loom)
    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="loom_bench_loader_") as tmp:
        parquet, output = os.path.join(tmp, "corpus.parquet"), os.path.join(tmp, "x.tokens")
        documents, size = make_corpus(parquet, args.mb)
        print(f"corpus: {documents} documents, {size / 1e6:.1f} MB of text, Parquet {os.path.getsize(parquet) / 1e6:.1f} MB "
              f"in {pq.ParquetFile(parquet).num_row_groups} row groups of up to {ROW_GROUP} rows; "
              f"tokenizer data/default/tokenizer.json; best of {args.repeat}", flush=True)
        for n in threads:
            loom_s, loom_counts = run_loom(args, parquet, output, n)
            hf_s, hf_counts = run_hf(args, parquet, n)
            print(f"  {n} thread(s): Loom {loom_s:.3f} s, {loom_counts[0]} tokens / {loom_counts[1]} documents; "
                  f"HF {hf_s:.3f} s, {hf_counts[0]} tokens / {hf_counts[1]} documents", flush=True)
            if loom_counts != hf_counts:
                sys.exit(f"FAIL: token counts differ with {n} thread(s): Loom {loom_counts[0]} tokens in "
                         f"{loom_counts[1]} documents, HF tokenizers {hf_counts[0]} in {hf_counts[1]} "
                         f"(same tokenizer and documents: they must agree)")
            rows.append((n, loom_counts[0] / loom_s, hf_counts[0] / hf_s))
    print(f"\nload average {load_before:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    print(f"{'threads':>7} | {'Loom tokens/s':>14} | {'HF tokens/s':>12} | {'Loom / HF':>9}")
    for n, loom_tps, hf_tps in rows:
        print(f"{n:>7} | {loom_tps:>14,.0f} | {hf_tps:>12,.0f} | {loom_tps / hf_tps:>8.2f}x")
    print("(Loom: the whole process, reading the Parquet file and writing the token file included; HF: encode_batch only)")
    ratio = next(loom_tps / hf_tps for n, loom_tps, hf_tps in rows if n == 2)
    print(f"loader with 2 threads: {ratio:.2f}x HF tokenizers with 2 threads (target >= {TARGET:.1f}x)")
    return 0 if ratio >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
