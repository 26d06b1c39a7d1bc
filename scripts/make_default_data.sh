#!/usr/bin/env bash
# Builds data/default/corpus.txt from Debian's `fortunes` package: every English fortune file,
# one document per fortune, documents separated by a blank line and wrapped as JSONL too.
# The corpus is real English text (quotes, jokes, literature excerpts) under the BSD licence of
# fortune-mod; it is made at set-up from the package rather than committed.
# Documents are shuffled with a fixed seed, as a pre-training corpus is: the package groups fortunes
# by topic (art … zippy), and reading topics in order would make the loss curve a tour of topics
# rather than a measure of learning.
# The held-out set for validation (validation.jsonl, `[validation]` in configs/llama3_debug.toml) is
# text training never sees: the GNU GPL version 3 from Debian's base-files
# (/usr/share/common-licenses/GPL-3, present on every Debian system), one document per paragraph.
# Every fortune already goes into the corpus, so holding some out would change the training stream
# and `make train`'s loss figures; the price is that it is English of another kind (legal prose), so
# its loss measures how the model generalises beyond its corpus, not in-distribution overfitting.
set -euo pipefail
cd "$(dirname "$0")/.."
src=/usr/share/games/fortunes
held_out=/usr/share/common-licenses/GPL-3
[ -d "$src" ] || { echo "error: $src missing: install the Debian package 'fortunes' (make setup)" >&2; exit 1; }
[ -f "$held_out" ] || { echo "error: $held_out missing: it comes with Debian's base-files package" >&2; exit 1; }
mkdir -p data/default
python3 - "$src" data/default "$(cat scripts/default_data.version)" "$held_out" <<'PY'
import json, os, random, sys
src, out, VERSION, held_out = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
docs = []
for name in sorted(os.listdir(src)):
    path = os.path.join(src, name)
    if "." in name or os.path.islink(path) or not os.path.isfile(path):
        continue
    raw = open(path, "rb").read().decode("utf-8", errors="replace")
    for d in raw.split("\n%\n"):
        d = d.strip("\n%")
        # fortunes are tab-indented and rot13'd in the offensive set (not shipped by this package)
        if len(d.strip()) >= 20:
            docs.append(d)
random.Random(0).shuffle(docs)
with open(os.path.join(out, "corpus.txt"), "w") as f:
    f.write("\n\n".join(docs) + "\n")
with open(os.path.join(out, "corpus.jsonl"), "w") as f:
    for d in docs:
        f.write(json.dumps({"text": d}) + "\n")
# Paragraphs in file order; whitespace inside a paragraph kept as written.
paragraphs = [p.strip("\n") for p in open(held_out, encoding="utf-8").read().split("\n\n")]
paragraphs = [p for p in paragraphs if len(p.strip()) >= 20]
with open(os.path.join(out, "validation.jsonl"), "w") as f:
    for p in paragraphs:
        f.write(json.dumps({"text": p}) + "\n")
with open(os.path.join(out, "VERSION"), "w") as f:
    f.write(VERSION + "\n")
print(f"default data: {len(docs)} documents, {sum(map(len, docs))} characters -> {out}/corpus.txt; "
      f"held out: {len(paragraphs)} documents -> {out}/validation.jsonl")
PY
