"""Qwen3 against Hugging Face transformers' Qwen3ForCausalLM, through the `loom` commands.

A small random Qwen3 with grouped-query attention (8 query heads, 2 key/value heads), head_dim 24
(not hidden_size / num_attention_heads = 8), QK-norm weights drawn away from 1, rope theta 1e6 and
a tied head is saved with save_pretrained. Checked, in fp32:
  * `loom score` logits within 1e-4 of transformers', and the mean NLL it prints equals torch's;
  * `loom convert` HF -> Loom -> HF: every tensor byte-identical, no lm_head.weight written for the
    tied model, config.json loads back in transformers with the same logits;
  * the same model untied (lm_head stored): score within 1e-4, round trip byte-identical;
  * `loom generate --temperature 0` equals transformers' greedy generate token for token (through
    the key/value cache);
  * `loom info --checkpoint` reads the Loom checkpoint's recorded Qwen3 config and counts the
    parameters transformers counts.

Environment: LOOM_BIN (the loom executable). Exits non-zero on any mismatch.
"""

import os
import re
import sys
import tempfile

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.utils import logging as hf_logging

from loom_parity import check_score, compare_greedy_generate, compare_round_trip, hf_logits, loom, loom_score

LOGIT_TOLERANCE = 1e-4
NLL_TOLERANCE = 1e-5
SEQ_LEN = 40
NEW_TOKENS = 24


def make_config(tie_word_embeddings):
    return Qwen3Config(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=24,
        vocab_size=257,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=tie_word_embeddings,
        attention_bias=False,
        use_sliding_window=False,
    )


def random_model(config, seed):
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    # Larger-than-default weights so logits have O(1-10) magnitude and any mismatch shows; every
    # norm (the QK-norms included) away from its unit initialization.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 if "embed" in name else 0.15))
    return model


def check_model(label, tied, tmp, failures):
    model = random_model(make_config(tied), seed=5 if tied else 6)
    hf_dir, loom_dir, back_dir = (os.path.join(tmp, f"{label}-{d}") for d in ("hf", "loom", "back"))
    model.save_pretrained(hf_dir, safe_serialization=True)
    tokens = [int(x) for x in torch.randint(0, 257, (SEQ_LEN,), generator=torch.Generator().manual_seed(2))]
    reference = hf_logits(model, tokens)

    logits = check_score(label, hf_dir, tokens, reference, os.path.join(tmp, f"{label}.safetensors"), failures,
                         LOGIT_TOLERANCE, NLL_TOLERANCE)

    loom("convert", "--input", hf_dir, "--output", loom_dir, "--to", "loom")
    loom("convert", "--input", loom_dir, "--output", back_dir, "--to", "hf")
    original, result = compare_round_trip(label, hf_dir, back_dir, failures)
    if tied and "lm_head.weight" in result:
        failures.append(f"{label}: lm_head.weight written for a tied model")
    reloaded = Qwen3ForCausalLM.from_pretrained(back_dir, dtype=torch.float32).eval()
    if reloaded.config.tie_word_embeddings != tied or reloaded.config.head_dim != 24:
        failures.append(f"{label}: the exported config.json loads as tie={reloaded.config.tie_word_embeddings}, "
                        f"head_dim={reloaded.config.head_dim}")
    back_diff = (hf_logits(reloaded, tokens) - reference).abs().max().item()
    ckpt_logits, _ = loom_score(loom_dir, tokens, os.path.join(tmp, f"{label}-ckpt.safetensors"))
    ckpt_diff = (ckpt_logits - reference).abs().max().item()
    print(f"{label}: HF -> Loom -> HF {len(original)} tensors, byte-identical: "
          f"{not any(label in f for f in failures)}; transformers on the result {back_diff:.3e}, "
          f"loom score on the Loom checkpoint {ckpt_diff:.3e}")
    if back_diff > 0 or ckpt_diff > LOGIT_TOLERANCE:
        failures.append(f"{label}: round-trip logits differ ({back_diff:.3e}, {ckpt_diff:.3e})")
    return model, hf_dir, loom_dir


def main():
    hf_logging.set_verbosity_error()
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        tied_model, tied_hf, tied_loom = check_model("tied", True, tmp, failures)
        check_model("untied", False, tmp, failures)

        compare_greedy_generate(tied_model, tied_hf, [3, 17, 250, 9, 42, 1, 77], NEW_TOKENS, failures)

        info = loom("info", "--checkpoint", tied_loom)
        total = sum(p.numel() for p in tied_model.parameters())
        match = re.search(r"parameters: total \S+ \((\d+)\)", info)
        print(f"info --checkpoint: {info.splitlines()[0]}; total {match.group(1) if match else '?'} vs transformers {total}")
        if "qwen3" not in info or not match or int(match.group(1)) != total:
            failures.append(f"loom info --checkpoint does not describe the Qwen3 checkpoint:\n{info}")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("Qwen3 parity: all checks passed")


if __name__ == "__main__":
    main()
