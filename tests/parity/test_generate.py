"""`loom generate` against Hugging Face transformers' generate.

A small random Llama (grouped-query attention: 8 query heads, 2 key/value heads) is saved with
save_pretrained. Checked:
  * greedy decoding (--temperature 0) of 32 new tokens equals LlamaForCausalLM.generate
    (do_sample=False) token for token, through loom's key/value cache (prefill of the prompt, then
    one token per forward);
  * sampling with a seed (--temperature 0.9 --top-k 50 --top-p 0.9 --seed 7) gives the same tokens
    twice, and another seed other tokens.
The weights are drawn with a large initializer range so the logits are far apart and float32
rounding cannot flip a greedy choice.

Environment: LOOM_BIN (the loom executable). Exits non-zero on any mismatch.
"""

import os
import subprocess
import sys
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

NEW_TOKENS = 32
PROMPT = [1, 5, 9, 17, 42, 7, 300]


def loom_generate(model_dir, *flags):
    cmd = [os.environ["LOOM_BIN"], "generate", "--checkpoint", model_dir,
           "--prompt-tokens", ",".join(map(str, PROMPT)), "--max-new-tokens", str(NEW_TOKENS), "--ids", *flags]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"loom generate failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return [int(t) for t in result.stdout.strip().split(",")]


def main():
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=320, num_hidden_layers=3, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=301, max_position_embeddings=128, rope_theta=10000.0,
                         rms_norm_eps=1e-5, initializer_range=0.2, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        with torch.no_grad():
            want = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                  pad_token_id=0)[0, len(PROMPT):].tolist()
        got = loom_generate(tmp, "--temperature", "0")
        print(f"greedy, {NEW_TOKENS} tokens: transformers {want}")
        print(f"                        loom         {got}")
        if got != want:
            first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            sys.exit(f"greedy decoding differs from transformers at new token {first}")
        sampled = [loom_generate(tmp, "--temperature", "0.9", "--top-k", "50", "--top-p", "0.9", "--seed", seed)
                   for seed in ("7", "7", "8")]
        print(f"sampled, seed 7 twice: {sampled[0]}\n                       {sampled[1]}\nseed 8: {sampled[2]}")
        if sampled[0] != sampled[1]:
            sys.exit("sampling with the same seed gave different tokens")
        if sampled[0] == sampled[2]:
            sys.exit("sampling with another seed gave the same tokens")
        if sampled[0] == want:
            sys.exit("sampling at temperature 0.9 gave exactly the greedy tokens: the sampler is not sampling")
    print("ok")


if __name__ == "__main__":
    main()
