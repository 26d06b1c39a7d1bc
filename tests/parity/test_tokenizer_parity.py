#!/usr/bin/env python3
"""Tokenizer parity: loom's C++ byte-level BPE against Hugging Face `tokenizers`.

1. `loom tokenizer train` on the default corpus; HF loads the tokenizer.json it wrote.
2. A GPT-2-style tokenizer trained by HF's own BpeTrainer (a file loom did not write), and
   variants of it: add_prefix_space, the Llama 3 Split + ByteLevel pre-tokenizer with
   ignore_merges, and added tokens with lstrip / rstrip / single_word.
For each: identical ids on every document of the default corpus (add_special_tokens=False) and on
tricky and randomly generated Unicode text, and decode(encode(x)) == x for every text, in C++ and
in HF. Exits non-zero on any mismatch.

Environment (set by ctest): LOOM_BIN, LOOM_SOURCE_DIR.
"""
import json
import os
import random
import subprocess
import sys
import tempfile
import time

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

LOOM_BIN = os.environ.get("LOOM_BIN", "build/bin/loom")
SOURCE_DIR = os.environ.get("LOOM_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
CORPUS_TXT = os.path.join(SOURCE_DIR, "data", "default", "corpus.txt")
CORPUS_JSONL = os.path.join(SOURCE_DIR, "data", "default", "corpus.jsonl")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")

TRICKY = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\r\nCRLF line\r\nendings\n\n\nand blank lines\n",
    "numbers 1234567890 3.14159 -42 1,000,000 2024-01-01 ²³ ½ Ⅻ ١٢٣",
    "unicode: naïve café, Ünïcödé, Ελληνικά, русский, 日本語のテキスト, 한국어, العربية, हिन्दी",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇩🇪🇯🇵",
    "contractions: I'm, you're, we've, they'll, he'd, it's, don't, DON'T, 'S, 'Re, x'ſ",
    "symbols <>&*^%$#@!~`|\\/{}[]()?;:'\" and ...ellipsis---dashes",
    "\u00a0non-breaking\u2003em space\u3000ideographic\u0085next line\u2028separator\u000b\u000c",
    " " * 80 + "long run of spaces",
    "=" * 100,
    "a\u0000nul and \u007f DEL",
    "",
    " ",
    "\n",
    "special tokens <|end_of_text|> inside <|begin_of_text|>text<|pad|> and <|endoftext|>",
    "added <mask> tokens  <mask>  fortune fortunes unfortunate fortune.",
]

POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    " " * 6 + "\t\n\r\u00a0\u2003\u3000\u0085\u000b",
    ".,;:!?'\"-()[]{}<>/\\|@#$%^&*_+=~`",
    "'s't're've'm'll'd'S'T'RE",
    "àéîõüßçñøåæœſ",
    "αβγδεζηθικλμνξοπρστυφχψω",
    "абвгдежзийклмнопрстуфхцчшщ",
    "日本語中文字漢字かなカナ",
    "한국어",
    "\u0301\u0308\u0327\u200d\u200c\ufe0f",  # combining marks, joiners, variation selector
    "²³¹¼½¾ⅠⅡⅫ١٢٣٤",
    "😀😂👍🏽🚀🇩🇪✨",
    "\U00010400\U0001d400\U00020000",  # astral letters
    "\U0001e4d0\U00011f04\U000105c0\U00016d70",  # letters and a digit new in Unicode 15 and 16
]


def random_texts(count, seed=1234):
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        pools = rng.sample(POOLS, rng.randint(1, 4))
        texts.append("".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 60))))
    return texts


def run(args):
    proc = subprocess.run([LOOM_BIN] + args, capture_output=True)
    if proc.returncode != 0:
        sys.exit(f"FAIL: loom {' '.join(args)} exited {proc.returncode}: {proc.stderr.decode(errors='replace')}")
    return proc.stdout.decode("utf-8")


def write_jsonl(path, texts):
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")


def loom_encode(tokenizer_path, jsonl_path):
    lines = run(["tokenizer", "encode", "--tokenizer", tokenizer_path, "--jsonl", jsonl_path]).split("\n")
    return [[int(x) for x in line.split()] for line in lines[:-1]]


def loom_decode(tokenizer_path, ids_path):
    out = run(["tokenizer", "decode", "--tokenizer", tokenizer_path, "--ids-file", ids_path])
    # JSON escapes "\n" inside strings, but not U+0085 or U+2028, which str.splitlines() splits on.
    return [json.loads(line)["text"] for line in out.split("\n")[:-1]]


def check(name, tokenizer_path, texts, workdir, lossless=True):
    """Returns the number of mismatching texts and prints the first few. A mismatch is different
    ids, or a decode that differs from HF's decode of the same ids, or (for a lossless tokenizer:
    no add_prefix_space, no stripping added tokens) a decode that is not the original text."""
    hf = Tokenizer.from_file(tokenizer_path)
    jsonl = os.path.join(workdir, f"{name}.jsonl")
    write_jsonl(jsonl, texts)
    start = time.perf_counter()
    ours = loom_encode(tokenizer_path, jsonl)
    encode_seconds = time.perf_counter() - start
    theirs = [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
    failures = 0
    if len(ours) != len(texts):
        print(f"FAIL {name}: loom printed {len(ours)} lines for {len(texts)} texts")
        return len(texts)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            failures += 1
            if failures <= 3:
                k = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
                print(f"FAIL {name}: text {i} {texts[i][:80]!r}: ids differ at {k}: loom {a[k:k + 5]} "
                      f"({[hf.id_to_token(t) for t in a[k:k + 5]]}) vs HF {b[k:k + 5]} "
                      f"({[hf.id_to_token(t) for t in b[k:k + 5]]})")
    ids_path = os.path.join(workdir, f"{name}.ids")
    with open(ids_path, "w") as f:
        for ids in ours:
            f.write(" ".join(map(str, ids)) + "\n")
    decoded = loom_decode(tokenizer_path, ids_path)
    hf_decoded = hf.decode_batch(ours, skip_special_tokens=False)
    for i, text in enumerate(texts):
        if decoded[i] != hf_decoded[i] or (lossless and decoded[i] != text):
            failures += 1
            if failures <= 3:
                print(f"FAIL {name}: round trip of text {i} {text[:60]!r}: loom {decoded[i][:60]!r}, "
                      f"HF {hf_decoded[i][:60]!r}")
    tokens = sum(map(len, ours))
    print(f"  {name}: {len(texts)} texts, {tokens} tokens, {failures} mismatches "
          f"(loom encode incl. process start {encode_seconds:.2f} s)")
    return failures


def hf_gpt2_style(path, vocab_size):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([CORPUS_TXT], trainer)
    tok.save(path)


def variant(src, dst, edit):
    with open(src) as f:
        spec = json.load(f)
    edit(spec)
    with open(dst, "w") as f:
        json.dump(spec, f)


def main():
    if not os.path.exists(CORPUS_JSONL):
        sys.exit(f"FAIL: {CORPUS_JSONL} missing: run scripts/make_default_data.sh")
    with open(CORPUS_JSONL) as f:
        docs = [json.loads(line)["text"] for line in f]
    texts = docs + TRICKY + random_texts(3000)
    subset = docs[:3000] + TRICKY + random_texts(1000, seed=99)  # variants: HF's encode is the slow part
    failures = 0
    with tempfile.TemporaryDirectory(prefix="loom_tok_parity_") as workdir:
        # 1. loom's own trainer, read by HF.
        ours = os.path.join(workdir, "loom", "tokenizer.json")
        start = time.perf_counter()
        summary = run(["tokenizer", "train", "--input", CORPUS_TXT, "--vocab-size", "2048", "--output", ours])
        train_seconds = time.perf_counter() - start
        print(summary.strip(), flush=True)
        spec = json.load(open(ours))
        if len(spec["model"]["vocab"]) != 2048:
            print(f"FAIL: trained vocab has {len(spec['model']['vocab'])} tokens, expected 2048")
            failures += 1
        failures += check("loom-trained", ours, texts, workdir)

        # 2. Files written by HF itself, and variants of their pre-tokenizer and added tokens.
        hf_path = os.path.join(workdir, "hf_gpt2.json")
        hf_gpt2_style(hf_path, 1500)
        failures += check("hf-gpt2", hf_path, texts, workdir)

        prefix = os.path.join(workdir, "hf_prefix.json")
        def gpt2_hub_format(s):  # as the GPT-2 file on the Hub: string merges, empty affixes
            s["pre_tokenizer"]["add_prefix_space"] = True
            s["model"]["merges"] = [" ".join(m) for m in s["model"]["merges"]]
            s["model"].update(continuing_subword_prefix="", end_of_word_suffix="")
        variant(hf_path, prefix, gpt2_hub_format)
        # Prefix spaces and stripping added tokens change the text, so these decode to HF's decode.
        failures += check("hf-prefix-space", prefix, subset, workdir, lossless=False)

        def llama3(s):
            s["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
            s["model"]["ignore_merges"] = True
        llama = os.path.join(workdir, "hf_llama3.json")
        variant(hf_path, llama, llama3)
        failures += check("hf-llama3-split", llama, texts, workdir)

        added = os.path.join(workdir, "hf_added.json")
        tok = Tokenizer.from_file(llama)
        tok.add_special_tokens([AddedToken("<mask>", lstrip=True, rstrip=True, normalized=False),
                                AddedToken("<|end_of_text|>", normalized=False)])
        tok.add_tokens([AddedToken("fortune", single_word=True), AddedToken("<|begin", normalized=False)])
        tok.save(added)
        failures += check("hf-added-tokens", added, subset, workdir, lossless=False)

    status = "FAILED" if failures else "passed"
    print(f"tokenizer parity {status}: {failures} mismatches over 5 tokenizers on up to {len(texts)} texts "
          f"(all {len(docs)} corpus documents for 3 of them); loom train vocab 2048 {train_seconds:.2f} s "
          f"incl. process start")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
