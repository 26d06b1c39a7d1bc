#!/usr/bin/env bash
# Builds data/default/corpus.txt from Debian's `fortunes` package: every English fortune file,
# one document per fortune, documents separated by a blank line and wrapped as JSONL too.
# The corpus is real English text (quotes, jokes, literature excerpts) under the BSD licence of
# fortune-mod; it is made at set-up from the package rather than committed.
# Documents are shuffled with a fixed seed, as a pre-training corpus is: the package groups fortunes
# by topic (art … zippy), and reading topics in order would make the loss curve a tour of topics
# rather than a measure of learning.
set -euo pipefail
cd "$(dirname "$0")/.."
src=/usr/share/games/fortunes
[ -d "$src" ] || { echo "error: $src missing: install the Debian package 'fortunes' (make setup)" >&2; exit 1; }
mkdir -p data/default
python3 - "$src" data/default "$(cat scripts/default_data.version)" <<'PY'
import json, os, random, sys
src, out, VERSION = sys.argv[1], sys.argv[2], sys.argv[3]
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
with open(os.path.join(out, "VERSION"), "w") as f:
    f.write(VERSION + "\n")
print(f"default data: {len(docs)} documents, {sum(map(len, docs))} characters -> {out}/corpus.txt")
PY
