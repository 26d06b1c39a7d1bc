#!/usr/bin/env python3
"""Greedy exact-match accuracy of the RL toy task (docs/rl.md): for every prompt of
data/rl_toy/prompts.jsonl, `loom generate --temperature 0` on the base, with each adapter revision
given, and the share of completions equal to the answer (the reward `loom rl` uses, greedily).

    python3 scripts/rl_toy_accuracy.py --base outputs/llama3_rl_toy_sft/checkpoint/step-60 \
        [--adapter outputs/llama3_rl_toy/adapters/step-150 ...]
Prints one line per model: "<name>: <right>/<prompts>".
"""
import argparse
import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True)
    ap.add_argument("--adapter", action="append", default=[])
    ap.add_argument("--prompts", default=os.path.join(ROOT, "data/rl_toy/prompts.jsonl"))
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, "data/default/tokenizer.json"))
    ap.add_argument("--loom", default=os.path.join(ROOT, "build/bin/loom"))
    ap.add_argument("--max-new-tokens", type=int, default=4)
    args = ap.parse_args()
    rows = [json.loads(line) for line in open(args.prompts) if line.strip()]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for adapter in [None] + args.adapter:
        right = 0
        for row in rows:
            cmd = [args.loom, "generate", "--checkpoint", args.base, "--tokenizer", args.tokenizer,
                   "--prompt", row["prompt"], "--no-bos", "--temperature", "0",
                   "--max-new-tokens", str(args.max_new_tokens)]
            if adapter:
                cmd += ["--adapter", adapter]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
            completion = out[len(row["prompt"]):].strip() if out.startswith(row["prompt"]) else out.strip()
            right += completion == str(row["answer"]).strip()
        print(f"{adapter or 'base'}: {right}/{len(rows)}", flush=True)


if __name__ == "__main__":
    main()
