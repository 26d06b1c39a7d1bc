"""Qwen3-MoE against Hugging Face transformers' Qwen3MoeForCausalLM, through the `loom` commands.

A small random Qwen3-MoE (8 experts, top 2, layer 0 dense through mlp_only_layers, grouped-query
attention with head_dim 24 != hidden_size / heads, QK-norms away from 1), once with norm_topk_prob
and once without, is saved with save_pretrained (per-expert tensors). Checked, in fp32:
  * `loom score` logits within 1e-4 of transformers', and the mean NLL it prints equals torch's;
  * `loom convert` HF -> Loom -> HF: every tensor byte-identical (per-expert keys written back);
  * the same weights in transformers 5's fused in-memory layout (experts.gate_up_proj [E, 2F, D],
    experts.down_proj [E, D, F]) load to the same logits;
  * `loom generate --temperature 0` equals transformers' greedy generate token for token;
  * `loom info --checkpoint` counts transformers' parameters and the active ones per token.

Environment: LOOM_BIN (the loom executable). Exits non-zero on any mismatch.
"""

import os
import re
import sys
import tempfile

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.utils import logging as hf_logging

from loom_parity import (check_fused_experts_layout, check_score, compare_greedy_generate, compare_round_trip,
                         hf_logits, loom, loom_score)

LOGIT_TOLERANCE = 1e-4
NLL_TOLERANCE = 1e-5
SEQ_LEN = 40
NEW_TOKENS = 16
EXPERTS, TOP_K, MOE_FFN, HIDDEN = 8, 2, 48, 64


def make_config(norm_topk_prob):
    return Qwen3MoeConfig(
        hidden_size=HIDDEN, intermediate_size=160, moe_intermediate_size=MOE_FFN, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, head_dim=24, vocab_size=257, max_position_embeddings=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, attention_bias=False,
        use_sliding_window=False, num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=norm_topk_prob,
        mlp_only_layers=[0], decoder_sparse_step=1)


def random_model(config, seed):
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p))  # routing far from ties
            else:
                p.copy_(torch.randn_like(p) * (0.5 if "embed" in name else 0.15))
    return model


def check_model(label, norm_topk_prob, tmp, failures):
    model = random_model(make_config(norm_topk_prob), seed=7 if norm_topk_prob else 8)
    hf_dir, loom_dir, back_dir, fused_dir = (os.path.join(tmp, f"{label}-{d}") for d in ("hf", "loom", "back", "fused"))
    model.save_pretrained(hf_dir, safe_serialization=True)
    tokens = [int(x) for x in torch.randint(0, 257, (SEQ_LEN,), generator=torch.Generator().manual_seed(3))]
    reference = hf_logits(model, tokens)

    logits = check_score(label, hf_dir, tokens, reference, os.path.join(tmp, f"{label}.safetensors"), failures,
                         LOGIT_TOLERANCE, NLL_TOLERANCE)

    loom("convert", "--input", hf_dir, "--output", loom_dir, "--to", "loom")
    loom("convert", "--input", loom_dir, "--output", back_dir, "--to", "hf")
    original, result = compare_round_trip(label, hf_dir, back_dir, failures)
    reloaded = Qwen3MoeForCausalLM.from_pretrained(back_dir, dtype=torch.float32).eval()
    back_diff = (hf_logits(reloaded, tokens) - reference).abs().max().item()
    print(f"{label}: HF -> Loom -> HF {len(original)} tensors, byte-identical: "
          f"{not any(f.startswith(label) for f in failures)}; transformers on the result {back_diff:.3e}")
    if back_diff > 0:
        failures.append(f"{label}: round-trip logits differ ({back_diff:.3e})")

    check_fused_experts_layout(label, model, hf_dir, fused_dir, tokens, logits,
                               os.path.join(tmp, f"{label}-fused.safetensors"), failures)
    return model, hf_dir, loom_dir


def main():
    hf_logging.set_verbosity_error()
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        model, hf_dir, loom_dir = check_model("norm_topk_prob", True, tmp, failures)
        check_model("unnormalised", False, tmp, failures)

        compare_greedy_generate(model, hf_dir, [3, 17, 250, 9, 42, 1, 77], NEW_TOKENS, failures)

        info = loom("info", "--checkpoint", loom_dir)
        total = sum(p.numel() for p in model.parameters())
        expert = 3 * HIDDEN * MOE_FFN
        active = total - 2 * (EXPERTS - TOP_K) * expert  # two sparse layers
        m_total = re.search(r"parameters: total \S+ \((\d+)\)", info)
        m_active = re.search(r"active per token: \S+ \((\d+)\)", info)
        print(f"info --checkpoint: {info.splitlines()[0]}; total {m_total.group(1) if m_total else '?'} vs "
              f"transformers {total}; active {m_active.group(1) if m_active else '?'} vs {active}")
        if "qwen3_moe" not in info or not m_total or int(m_total.group(1)) != total or not m_active or \
                int(m_active.group(1)) != active:
            failures.append(f"loom info --checkpoint does not describe the Qwen3-MoE checkpoint:\n{info}")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("Qwen3-MoE parity: all checks passed")


if __name__ == "__main__":
    main()
