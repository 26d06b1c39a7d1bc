#!/usr/bin/env python3
"""Parquet and Arrow inputs of `loom tokenizer pretokenize` against pyarrow + Hugging Face `tokenizers`.

About 300 documents of the default corpus, plus edge cases (Unicode text, one very long document
of 50 documents, an empty string and a null), are written twice:
  * a Parquet file with pyarrow, in row groups of 64 rows, the text column "body" after an int64
    "id" column and a struct column "meta" {source: string, score: double};
  * a 2-shard `datasets` cache (Dataset.save_to_disk(num_shards=2): data-0000{0,1}-of-00002.arrow,
    dataset_info.json, state.json), the text column "content"; the folder is given as the input.
`loom tokenizer pretokenize --format parquet|arrow --text-column ... --workers 2` writes a token
file for each. The reference reads the same files with pyarrow (the Parquet column; the Arrow
shards as IPC streams in name order), skips nulls and empty strings, encodes every document with
`tokenizers` (add_special_tokens=False) and appends EOS. Checked: the header (magic, version,
2-byte ids, vocab size, EOS id of the tokenizer, file size), the token stream equal token for
token, the document count; the Parquet file with --workers 1 gives a byte-identical token file.
Bad input exits with code 2 and one "error: " line on stderr: a text column that does not exist (the line
names it and lists the file's columns), a truncated Parquet file ("Parquet"), random bytes given
as Parquet ("PAR1"), a glob that matches nothing.

Environment (set by ctest): LOOM_BIN, LOOM_SOURCE_DIR. Exits non-zero on any mismatch.
"""
import json
import os
import random
import struct
import subprocess
import sys
import tempfile

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
from tokenizers import Tokenizer

LOOM_BIN = os.environ.get("LOOM_BIN", "build/bin/loom")
SOURCE_DIR = os.environ.get("LOOM_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
CORPUS_JSONL = os.path.join(SOURCE_DIR, "data", "default", "corpus.jsonl")
TOKENIZER = os.path.join(SOURCE_DIR, "data", "default", "tokenizer.json")
NUM_DOCS = 300
HEADER = struct.Struct("<8sIIQQqqq8s")  # 64 bytes, see src/loom/data/sources.h
assert HEADER.size == 64


def documents():
    """The corpus's first NUM_DOCS texts with the edge cases spread among them (so they land in
    different row groups and shards)."""
    with open(CORPUS_JSONL) as f:
        docs = [json.loads(line)["text"] for _, line in zip(range(NUM_DOCS + 50), f)]
    long_doc = "\n\n".join(docs[NUM_DOCS:NUM_DOCS + 50])
    texts = docs[:NUM_DOCS]
    for at, value in [(0, "naïve café — 東京 🚀"), (63, ""), (64, None), (130, long_doc),
                      (200, "\u00a0tabs\tand\r\nCRLF, emoji 👨‍👩‍👧‍👦 🇩🇪, русский, العربية"), (len(texts), None),
                      (len(texts) + 1, "")]:
        texts.insert(at, value)
    return texts


def pretokenize(args, expect_ok=True):
    proc = subprocess.run([LOOM_BIN, "tokenizer", "pretokenize", "--tokenizer", TOKENIZER] + args,
                          capture_output=True, text=True)
    if expect_ok and proc.returncode != 0:
        sys.exit(f"FAIL: loom tokenizer pretokenize {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def read_token_file(path):
    with open(path, "rb") as f:
        data = f.read()
    magic, version, bpt, num_tokens, num_docs, vocab, bos, eos, reserved = HEADER.unpack_from(data)
    header = dict(version=version, bytes_per_token=bpt, num_tokens=num_tokens, num_documents=num_docs,
                  vocab_size=vocab, bos_id=bos, eos_id=eos)
    if magic != b"LOOMTOK\0" or version != 1 or bpt not in (2, 4) or reserved != bytes(8):
        raise AssertionError(f"{path}: bad header {magic!r} {header} reserved {reserved!r}")
    if len(data) != 64 + num_tokens * bpt:
        raise AssertionError(f"{path}: {len(data)} bytes, header says 64 + {num_tokens} x {bpt}")
    ids = list(struct.unpack_from(f"<{num_tokens}{'H' if bpt == 2 else 'I'}", data, 64))
    return header, ids


def reference(tok, texts, eos_id):
    """(token stream, document count) as Loom documents it: non-empty texts, each + EOS."""
    kept = [t for t in texts if t]  # skips None and ""
    stream = []
    for enc in tok.encode_batch(kept, add_special_tokens=False):
        stream.extend(enc.ids)
        stream.append(eos_id)
    return stream, len(kept)


def compare(label, path, texts, tok, eos_id):
    header, ids = read_token_file(path)
    expected, docs = reference(tok, texts, eos_id)
    print(f"  {label}: loom {header['num_tokens']} tokens / {header['num_documents']} documents, reference "
          f"{len(expected)} tokens / {docs} documents ({len(texts) - docs} null or empty skipped), "
          f"{header['bytes_per_token']} bytes per token")
    if header["vocab_size"] != tok.get_vocab_size() or header["eos_id"] != eos_id:
        raise AssertionError(f"{label}: header vocab_size {header['vocab_size']} eos_id {header['eos_id']}, "
                             f"expected {tok.get_vocab_size()} and {eos_id}")
    if header["num_documents"] != docs:
        raise AssertionError(f"{label}: {header['num_documents']} documents, expected {docs}")
    if ids != expected:
        k = next((i for i in range(min(len(ids), len(expected))) if ids[i] != expected[i]), min(len(ids), len(expected)))
        doc = expected[:k].count(eos_id)
        raise AssertionError(f"{label}: token streams differ at token {k} (document {doc} of the non-empty ones; "
                             f"loom {len(ids)} tokens, reference {len(expected)}): loom {ids[k:k + 8]} "
                             f"reference {expected[k:k + 8]}")


def stderr_lines(proc):
    """stderr without Loom's log lines ("[rankN] info: ...", which may come before an error), as
    tests/faults counts them: what is left of a usage error must be its one "error: " line."""
    return [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("[rank")]


def check_bad_input(label, args, words, failures):
    proc = pretokenize(args, expect_ok=False)
    lines = stderr_lines(proc)
    print(f"  {label}: exit code {proc.returncode}: {lines[-1] if lines else proc.stderr.strip()!r}")
    if (proc.returncode != 2 or len(lines) != 1 or not lines[0].startswith("error: ")
            or not all(w in lines[0] for w in words)):
        failures.append(f"{label}: expected exit code 2 and one error line containing {words}, got exit code "
                        f"{proc.returncode} and stderr:\n{proc.stderr.strip()[-2000:]}")


def main():
    for path in (CORPUS_JSONL, TOKENIZER):
        if not os.path.exists(path):
            sys.exit(f"FAIL: {path} missing: run scripts/make_default_data.sh")
    import datasets  # here, not at the top: its import is slow and only this script needs it
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()

    tok = Tokenizer.from_file(TOKENIZER)
    eos_id = tok.token_to_id("<|end_of_text|>")
    texts = documents()
    ids = list(range(len(texts)))
    failures = []
    with tempfile.TemporaryDirectory(prefix="loom_arrow_parity_") as workdir:
        # The Parquet file: the text column third, after an int64 and a struct column.
        parquet = os.path.join(workdir, "docs.parquet")
        meta_type = pa.struct([("source", pa.string()), ("score", pa.float64())])
        table = pa.table({
            "id": pa.array(ids, pa.int64()),
            "meta": pa.array([{"source": f"corpus-{i % 7}", "score": i / 3} for i in ids], meta_type),
            "body": pa.array(texts, pa.string()),
        })
        pq.write_table(table, parquet, row_group_size=64)
        row_groups = pq.ParquetFile(parquet).num_row_groups
        print(f"{len(texts)} documents; Parquet: {row_groups} row groups, {os.path.getsize(parquet)} bytes")
        assert row_groups > 1

        # The `datasets` cache: two Arrow IPC stream shards and its JSON files.
        arrow_dir = os.path.join(workdir, "arrow_cache")
        datasets.Dataset.from_dict({"id": ids, "content": texts}).save_to_disk(arrow_dir, num_shards=2)
        shards = sorted(f for f in os.listdir(arrow_dir) if f.endswith(".arrow"))
        print(f"Arrow cache: {sorted(os.listdir(arrow_dir))}")
        assert shards == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"], shards

        # The reference reads the files, not `texts`: what pyarrow sees in them is what Loom must see.
        parquet_texts = pq.read_table(parquet).column("body").to_pylist()
        arrow_texts = []
        for shard in shards:
            with pa.memory_map(os.path.join(arrow_dir, shard)) as source:
                arrow_texts.extend(ipc.open_stream(source).read_all().column("content").to_pylist())
        assert parquet_texts == texts and arrow_texts == texts, "pyarrow reads back other texts than were written"

        out1, out1_serial, out2 = (os.path.join(workdir, n) for n in ("out1.tokens", "out1_w1.tokens", "out2.tokens"))
        pretokenize(["--input", parquet, "--format", "parquet", "--text-column", "body", "--workers", "2",
                     "--output", out1])
        pretokenize(["--input", parquet, "--format", "parquet", "--text-column", "body", "--workers", "1",
                     "--output", out1_serial])
        pretokenize(["--input", arrow_dir, "--format", "arrow", "--text-column", "content", "--workers", "2",
                     "--output", out2])
        for label, path, source_texts in [("parquet, 2 workers", out1, parquet_texts),
                                          ("arrow (2 shards), 2 workers", out2, arrow_texts)]:
            try:
                compare(label, path, source_texts, tok, eos_id)
            except AssertionError as e:
                failures.append(str(e))
        with open(out1, "rb") as a, open(out1_serial, "rb") as b:
            identical = a.read() == b.read()
        print(f"  parquet: --workers 1 and --workers 2 token files byte-identical: {identical}")
        if not identical:
            failures.append("parquet: the token file with --workers 1 differs from the one with --workers 2")

        # Issue 46 (11): a dictionary-encoded text column (pandas' categoricals; pyarrow's
        # dictionary_encode, kept as such through the Arrow schema Parquet stores) is text: read,
        # not refused with a hint to pick another column. Both formats, nulls skipped.
        dict_texts = [t if i % 5 else None for i, t in enumerate(texts)]
        dict_body = pa.array(dict_texts, pa.string()).dictionary_encode()
        dict_parquet = os.path.join(workdir, "dict.parquet")
        pq.write_table(pa.table({"body": dict_body}), dict_parquet, row_group_size=64)
        dict_arrow = os.path.join(workdir, "dict.arrow")
        with ipc.new_file(dict_arrow, pa.schema([("body", dict_body.type)])) as writer:
            writer.write_table(pa.table({"body": dict_body}))
        assert pa.types.is_dictionary(pq.read_schema(dict_parquet).field("body").type)
        kept = [t for t in dict_texts if t is not None]
        for label, path, fmt in [("dictionary-encoded Parquet column", dict_parquet, "parquet"),
                                 ("dictionary-encoded Arrow column", dict_arrow, "arrow")]:
            out = os.path.join(workdir, fmt + "_dict.tokens")
            pretokenize(["--input", path, "--format", fmt, "--text-column", "body", "--output", out])
            try:
                compare(label, out, kept, tok, eos_id)
            except AssertionError as e:
                failures.append(str(e))

        # Bad input: exit code 2 and one error line.
        out_bad = os.path.join(workdir, "bad.tokens")
        check_bad_input("missing text column", ["--input", parquet, "--format", "parquet", "--text-column", "nosuch",
                                                "--output", out_bad], ["nosuch", "id", "meta", "body"], failures)
        truncated = os.path.join(workdir, "truncated.parquet")
        with open(parquet, "rb") as f, open(truncated, "wb") as g:
            data = f.read()
            g.write(data[:len(data) // 2])
        check_bad_input("truncated Parquet file", ["--input", truncated, "--format", "parquet", "--text-column", "body",
                                                   "--output", out_bad], ["Parquet"], failures)
        garbage = os.path.join(workdir, "garbage.parquet")
        with open(garbage, "wb") as f:
            f.write(random.Random(7).randbytes(4096))
        check_bad_input("random bytes as Parquet", ["--input", garbage, "--format", "parquet", "--text-column", "body",
                                                    "--output", out_bad], ["PAR1"], failures)
        check_bad_input("glob matching nothing", ["--input", "/tmp/does-not-exist-*.parquet", "--format", "parquet",
                                                  "--output", out_bad], ["does-not-exist"], failures)

        # Training reads the same files: a mixture of the Parquet file and the Arrow cache trains, and
        # bad data input stops with exit code 2 and one error line before step 1.
        def train(extra):
            return subprocess.run(
                [LOOM_BIN, "train", "--config", os.path.join(SOURCE_DIR, "configs", "llama3_debug.toml"),
                 "--model.tokenizer_path", TOKENIZER, "--training.steps=2", "--training.seq_len=32",
                 "--training.local_batch_size=2", "--metrics.log_freq=1", "--training.token_cache=false",
                 "--job.dump_folder=" + os.path.join(workdir, "run")] + extra,
                capture_output=True, text=True, cwd=SOURCE_DIR)  # the config's paths are the checkout's
        mixture = (f'[{{ path = "{parquet}", format = "parquet", text_column = "body", weight = 3 }}, '
                   f'{{ path = "{arrow_dir}", format = "arrow", text_column = "content", weight = 1 }}]')
        ok = train(["--training.datasets", mixture])
        out = ok.stdout + ok.stderr
        print(f"  train on the Parquet + Arrow mixture: exit code {ok.returncode}")
        if ok.returncode != 0 or "step 2/2" not in out or "75 %" not in out:
            failures.append(f"training on the mixture failed: exit code {ok.returncode}: {out[-2000:]}")
        for label, extra, words in [
            ("train: missing text column", ["--training.dataset_path", parquet, "--training.dataset_format=parquet",
                                            "--training.text_column=nosuch"], ["nosuch", "id, meta, body",
                                                                               "training.text_column"]),
            ("train: truncated Parquet file", ["--training.dataset_path", truncated,
                                               "--training.dataset_format=parquet"], ["Parquet", "truncated"]),
            ("train: glob matching nothing", ["--training.dataset_path", "/tmp/does-not-exist-*.parquet"],
             ["does-not-exist", "names no file"]),
            ("train: negative weight", ["--training.datasets", f'[{{ path = "{parquet}", weight = -1 }}]'],
             ["training.datasets[0].weight", ">= 0"]),
            ("train: weights all zero", ["--training.datasets",
                                         f'[{{ path = "{parquet}", weight = 0 }}, {{ path = "{parquet}", weight = 0 }}]'],
             ["weight is 0"]),
        ]:
            proc = train(extra)
            lines = stderr_lines(proc)
            print(f"  {label}: exit code {proc.returncode}: {lines[-1] if lines else proc.stderr.strip()!r}")
            if (proc.returncode != 2 or len(lines) != 1 or not lines[0].startswith("error: ")
                    or not all(w in lines[0] for w in words) or "[step 1" in proc.stdout + proc.stderr):
                failures.append(f"{label}: expected exit code 2 and one error line containing {words} before step 1, "
                                f"got exit code {proc.returncode} and stderr:\n{proc.stderr.strip()[-2000:]}")

    for f in failures:
        print("FAIL:", f)
    print(f"Parquet/Arrow parity {'FAILED' if failures else 'passed'}: {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
