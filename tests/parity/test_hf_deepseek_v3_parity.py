"""DeepSeek-V3 against Hugging Face transformers' DeepseekV3ForCausalLM, through the `loom` commands.

Small random DeepSeek-V3 models (8 routed experts in 2 groups, topk_group 1, top 2, one shared
expert, first_k_dense_replace = 1, a non-zero e_score_correction_bias, MLA with interleaved RoPE)
in four variants: q_lora_rank unset and set, YaRN rope scaling off and on (with mscale_all_dim, so
the softmax scale changes). Saved with save_pretrained (per-expert tensors). Checked, in fp32:
  * `loom score` logits within 1e-4 of transformers', and the mean NLL it prints equals torch's;
  * `loom convert` HF -> Loom -> HF: every tensor byte-identical (the correction bias included);
  * transformers 5's fused in-memory expert layout (gate_up_proj, down_proj) loads to the same logits;
  * a checkpoint in the published fp8 layout (weights float8_e4m3fn with 128 x 128 block scales in
    `<name>_scale_inv`, written here) loads to the logits of its dequantised weights;
  * `loom generate --temperature 0` equals transformers' greedy generate token for token;
  * `loom info --checkpoint` counts transformers' parameters and the active ones per token.

Environment: LOOM_BIN (the loom executable). Exits non-zero on any mismatch.
"""

import json
import os
import re
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.utils import logging as hf_logging

from loom_parity import (check_fused_experts_layout, check_score, compare_greedy_generate, compare_round_trip,
                         hf_logits, loom, loom_score)

LOGIT_TOLERANCE = 1e-4
NLL_TOLERANCE = 1e-5
SEQ_LEN = 40
NEW_TOKENS = 16
EXPERTS, TOP_K, MOE_FFN, HIDDEN, LAYERS = 8, 2, 32, 64, 3
BLOCK = 128


def make_config(q_lora_rank, yarn):
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn:
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}
    return DeepseekV3Config(
        hidden_size=HIDDEN, intermediate_size=160, moe_intermediate_size=MOE_FFN, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=257, max_position_embeddings=128,
        rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, n_routed_experts=EXPERTS,
        n_shared_experts=1, num_experts_per_tok=TOP_K, n_group=2, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, first_k_dense_replace=1, q_lora_rank=q_lora_rank, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, rope_interleave=True, rope_parameters=rope)


def random_model(config, seed):
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p))  # routing far from ties
            else:
                p.copy_(torch.randn_like(p) * (0.5 if "embed" in name else 0.15))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn_like(b))
    return model


def check_model(label, q_lora_rank, yarn, tmp, failures):
    model = random_model(make_config(q_lora_rank, yarn), seed=11 + 2 * (q_lora_rank is not None) + yarn)
    hf_dir, loom_dir, back_dir, fused_dir = (os.path.join(tmp, f"{label}-{d}") for d in ("hf", "loom", "back", "fused"))
    model.save_pretrained(hf_dir, safe_serialization=True)
    tokens = [int(x) for x in torch.randint(0, 257, (SEQ_LEN,), generator=torch.Generator().manual_seed(3))]
    reference = hf_logits(model, tokens)

    logits = check_score(label, hf_dir, tokens, reference, os.path.join(tmp, f"{label}.safetensors"), failures,
                         LOGIT_TOLERANCE, NLL_TOLERANCE)

    loom("convert", "--input", hf_dir, "--output", loom_dir, "--to", "loom")
    loom("convert", "--input", loom_dir, "--output", back_dir, "--to", "hf")
    original, result = compare_round_trip(label, hf_dir, back_dir, failures)
    if not any(k.endswith("e_score_correction_bias") for k in result):
        failures.append(f"{label}: the round trip lost e_score_correction_bias")
    reloaded = DeepseekV3ForCausalLM.from_pretrained(back_dir, dtype=torch.float32).eval()
    back_diff = (hf_logits(reloaded, tokens) - reference).abs().max().item()
    print(f"{label}: HF -> Loom -> HF {len(original)} tensors, byte-identical: "
          f"{not any(f.startswith(label) for f in failures)}; transformers on the result {back_diff:.3e}")
    if back_diff > 0:
        failures.append(f"{label}: round-trip logits differ ({back_diff:.3e})")

    check_fused_experts_layout(label, model, hf_dir, fused_dir, tokens, logits,
                               os.path.join(tmp, f"{label}-fused.safetensors"), failures)
    return model, hf_dir, loom_dir, tokens


def quantize_block_fp8(w):
    """The published layout: float8_e4m3fn weights, one float32 scale per 128 x 128 block (weight_scale_inv)."""
    rows, cols = w.shape
    br, bc = -(-rows // BLOCK), -(-cols // BLOCK)
    scale = torch.empty(br, bc)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(br):
        for j in range(bc):
            block = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            s = block.abs().max().clamp(min=1e-12) / 448.0
            scale[i, j] = s
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (block / s).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_block_fp8(q, scale):
    rows, cols = q.shape
    full = scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return q.to(torch.float32) * full


def check_fp8(model, hf_dir, tokens, tmp, failures):
    """Every 2-D projection inside the layers quantised as DeepSeek publishes it; the reference is
    transformers on the dequantised weights."""
    fp8_dir = os.path.join(tmp, "fp8")
    os.makedirs(fp8_dir)
    state = {}
    for f in sorted(os.listdir(hf_dir)):
        if f.endswith(".safetensors"):
            state.update(load_file(os.path.join(hf_dir, f)))
    quantized, dequantized = {}, dict(state)
    for name, w in state.items():
        if ".layers." in name and name.endswith("proj.weight") and w.dim() == 2 and "layernorm" not in name:
            q, s = quantize_block_fp8(w)
            quantized[name] = q
            quantized[name + "_scale_inv"] = s
            dequantized[name] = dequantize_block_fp8(q, s)
        else:
            quantized[name] = w
    save_file(quantized, os.path.join(fp8_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK]}
    with open(os.path.join(fp8_dir, "config.json"), "w") as g:
        json.dump(config, g)
    # The reference: transformers loading the dequantised weights from disk (its loader maps the
    # per-expert keys onto its fused experts).
    dequantized_dir = os.path.join(tmp, "fp8-dequantized")
    os.makedirs(dequantized_dir)
    save_file(dequantized, os.path.join(dequantized_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(hf_dir, "config.json")) as f, open(os.path.join(dequantized_dir, "config.json"), "w") as g:
        json.dump(json.load(f), g)
    reference_model = DeepseekV3ForCausalLM.from_pretrained(dequantized_dir, dtype=torch.float32).eval()
    reference = hf_logits(reference_model, tokens)
    logits, _ = loom_score(fp8_dir, tokens, os.path.join(tmp, "fp8.safetensors"))
    diff = (logits - reference).abs().max().item()
    n = sum(1 for k in quantized if k.endswith("_scale_inv"))
    print(f"fp8 block-quantised checkpoint ({n} weights with 128x128 scales): max |dlogit| vs the dequantised "
          f"reference {diff:.3e}")
    if diff > LOGIT_TOLERANCE:
        failures.append(f"fp8: logits differ from the dequantised reference by {diff:.3e}")


def main():
    hf_logging.set_verbosity_error()
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        model, hf_dir, loom_dir, tokens = check_model("q_lora", 24, False, tmp, failures)
        check_model("plain_wq", None, False, tmp, failures)
        check_model("q_lora_yarn", 24, True, tmp, failures)
        check_model("plain_wq_yarn", None, True, tmp, failures)
        check_fp8(model, hf_dir, tokens, tmp, failures)

        compare_greedy_generate(model, hf_dir, [3, 17, 250, 9, 42, 1, 77], NEW_TOKENS, failures)

        info = loom("info", "--checkpoint", loom_dir)
        total = sum(p.numel() for p in model.parameters())
        expert = 3 * HIDDEN * MOE_FFN
        active = total - (LAYERS - 1) * (EXPERTS - TOP_K) * expert
        m_total = re.search(r"parameters: total \S+ \((\d+)\)", info)
        m_active = re.search(r"active per token: \S+ \((\d+)\)", info)
        print(f"info --checkpoint: {info.splitlines()[0]}; total {m_total.group(1) if m_total else '?'} vs "
              f"transformers {total}; active {m_active.group(1) if m_active else '?'} vs {active}")
        if "deepseek_v3" not in info or not m_total or int(m_total.group(1)) != total or not m_active or \
                int(m_active.group(1)) != active:
            failures.append(f"loom info --checkpoint does not describe the DeepSeek-V3 checkpoint:\n{info}")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("DeepSeek-V3 parity: all checks passed")


if __name__ == "__main__":
    main()
