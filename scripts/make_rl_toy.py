#!/usr/bin/env python3
"""The toy task of `loom rl` (issue 51), small enough for a CPU: add two one-digit numbers.

Writes data/rl_toy/sft.jsonl (prompt/completion pairs for a short SFT warm-up, configs/
llama3_rl_toy_sft.toml) and data/rl_toy/prompts.jsonl (prompt/answer lines for `loom rl --config
configs/llama3_rl_toy.toml`, scored by exact match). A person can check any line by eye.
"""
import argparse
import json
import os
import random


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="data/rl_toy")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rng = random.Random(args.seed)
    pairs = [(a, b) for a in range(10) for b in range(10)]
    rng.shuffle(pairs)
    with open(os.path.join(args.out, "sft.jsonl"), "w") as f:
        for a, b in pairs:
            f.write(json.dumps({"prompt": f"{a}+{b}=", "completion": f"{a + b}"}) + "\n")
    with open(os.path.join(args.out, "prompts.jsonl"), "w") as f:
        for a, b in pairs:
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    print(f"wrote {len(pairs)} SFT pairs and {len(pairs)} RL prompts to {args.out}")


if __name__ == "__main__":
    main()
