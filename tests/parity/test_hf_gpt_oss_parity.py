"""GPT-OSS against Hugging Face transformers' GptOssForCausalLM, through the `loom` commands.

A small random GPT-OSS (3 layers, sliding_attention / full_attention / sliding_attention with a
window of 6 tokens, so 40-token sequences cross it; grouped-query attention with head_dim 16 and
learned sinks; biased q/k/v/o projections; 4 experts, top 2, a biased router; experts' weights
large enough that the clamped SwiGLU clamps; YaRN RoPE with factor 32 and an untruncated range,
as the published models) is saved with save_pretrained. Checked, in fp32:
  * `loom score` logits within 1e-4 of transformers', and the mean NLL equals torch's;
  * `loom convert` HF -> Loom -> HF: every tensor byte-identical (the interleaved gate_up_proj too);
  * the same experts stored as MXFP4 blocks and scales (the published checkpoints' format, with
    quantization_config) load to transformers' dequantisation of them: identical logits;
  * `loom generate --temperature 0` equals transformers' greedy generate token for token (the KV
    cache with sinks and the window);
  * `loom info --checkpoint` counts transformers' parameters and the active ones per token.

Environment: LOOM_BIN (the loom executable). Exits non-zero on any mismatch.
"""

import json
import os
import re
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig, GptOssForCausalLM
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.utils import logging as hf_logging

from loom_parity import check_score, compare_greedy_generate, compare_round_trip, hf_logits, loom

LOGIT_TOLERANCE = 1e-4
NLL_TOLERANCE = 1e-5
SEQ_LEN = 40
NEW_TOKENS = 16
EXPERTS, TOP_K, FFN, HIDDEN, LAYERS = 4, 2, 64, 64, 3


def make_config():
    config = GptOssConfig(
        hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=8,
        num_key_value_heads=2, head_dim=16, vocab_size=257, max_position_embeddings=256, rms_norm_eps=1e-5,
        sliding_window=6, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, tie_word_embeddings=False, attention_bias=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})
    config._attn_implementation = "eager"  # transformers' reference attention: the sinks as a softmax column
    return config


def random_model(config, seed):
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("router.weight"):
                p.copy_(torch.randn_like(p))  # routing far from ties
            elif "experts" in name:
                p.copy_(torch.randn_like(p) * 0.6)  # the clamps at +-7 engage
            elif name.endswith("sinks"):
                p.copy_(torch.randn_like(p) * 2.0)
            else:
                p.copy_(torch.randn_like(p) * (0.5 if "embed" in name else 0.15))
    return model


def clamped_fraction(model, tokens):
    """The share of gate values the first expert layer clamps, so the test knows the clamp engages."""
    seen = []
    layer = model.model.layers[0].mlp.experts
    original = layer._apply_gate

    def spy(gate_up):
        gate = gate_up[..., ::2]
        seen.append((gate > layer.limit).float().mean().item())
        return original(gate_up)

    layer._apply_gate = spy
    with torch.no_grad():
        model(torch.tensor([tokens]))
    layer._apply_gate = original
    return max(seen) if seen else 0.0


def mxfp4_checkpoint(model, hf_dir, out_dir, seed):
    """`hf_dir` with its experts replaced by random MXFP4 blocks and scales (and the model's
    experts set to transformers' dequantisation of them), as the published checkpoints store them."""
    g = torch.Generator().manual_seed(seed)
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        for name, rows, columns in (("gate_up_proj", 2 * FFN, HIDDEN), ("down_proj", HIDDEN, FFN)):
            blocks = torch.randint(0, 256, (EXPERTS, rows, columns // 32, 16), generator=g, dtype=torch.int32).to(torch.uint8)
            scales = torch.randint(121, 126, (EXPERTS, rows, columns // 32), generator=g, dtype=torch.int32).to(torch.uint8)
            dense = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            with torch.no_grad():
                getattr(experts, name).copy_(dense)
            key = f"model.layers.{i}.mlp.experts.{name}"
            del state[key]
            state[key + "_blocks"] = blocks
            state[key + "_scales"] = scales
    os.makedirs(out_dir)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                          "model.layers.*.mlp.router",
                                                                                          "model.embed_tokens", "lm_head"]}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)


def main():
    hf_logging.set_verbosity_error()
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        model = random_model(make_config(), seed=11)
        hf_dir, loom_dir, back_dir, mxfp4_dir = (os.path.join(tmp, d) for d in ("hf", "loom", "back", "mxfp4"))
        model.save_pretrained(hf_dir, safe_serialization=True)
        tokens = [int(x) for x in torch.randint(0, 257, (SEQ_LEN,), generator=torch.Generator().manual_seed(3))]
        reference = hf_logits(model, tokens)
        clamped = clamped_fraction(model, tokens)
        print(f"clamped SwiGLU: {clamped:.1%} of the first layer's gate values above the limit")
        if clamped == 0:
            failures.append("the test model's experts never reach the SwiGLU clamp: raise their scale")

        check_score("gpt_oss", hf_dir, tokens, reference, os.path.join(tmp, "score.safetensors"), failures,
                    LOGIT_TOLERANCE, NLL_TOLERANCE)

        loom("convert", "--input", hf_dir, "--output", loom_dir, "--to", "loom")
        loom("convert", "--input", loom_dir, "--output", back_dir, "--to", "hf")
        original, _ = compare_round_trip("gpt_oss", hf_dir, back_dir, failures)
        reloaded = GptOssForCausalLM.from_pretrained(back_dir, dtype=torch.float32).eval()
        back_diff = (hf_logits(reloaded, tokens) - reference).abs().max().item()
        print(f"gpt_oss: HF -> Loom -> HF {len(original)} tensors, byte-identical: "
              f"{not any(f.startswith('gpt_oss') for f in failures)}; transformers on the result {back_diff:.3e}")
        if back_diff > 0:
            failures.append(f"gpt_oss: round-trip logits differ ({back_diff:.3e})")

        compare_greedy_generate(model, hf_dir, [3, 17, 250, 9, 42, 1, 77, 5, 8, 13], NEW_TOKENS, failures)

        info = loom("info", "--checkpoint", loom_dir)
        total = sum(p.numel() for p in model.parameters())
        expert = 3 * HIDDEN * FFN + 2 * FFN + HIDDEN
        active = total - LAYERS * (EXPERTS - TOP_K) * expert
        m_total = re.search(r"parameters: total \S+ \((\d+)\)", info)
        m_active = re.search(r"active per token: \S+ \((\d+)\)", info)
        print(f"info --checkpoint: {info.splitlines()[0]}; total {m_total.group(1) if m_total else '?'} vs "
              f"transformers {total}; active {m_active.group(1) if m_active else '?'} vs {active}")
        if "gpt_oss" not in info or not m_total or int(m_total.group(1)) != total or not m_active or \
                int(m_active.group(1)) != active:
            failures.append(f"loom info --checkpoint does not describe the GPT-OSS checkpoint:\n{info}")

        # MXFP4 experts: Loom's dequantisation against transformers' on the same blocks and scales.
        mxfp4_checkpoint(model, hf_dir, mxfp4_dir, seed=5)
        check_score("gpt_oss mxfp4", mxfp4_dir, tokens, hf_logits(model, tokens),
                    os.path.join(tmp, "mxfp4.safetensors"), failures, LOGIT_TOLERANCE, NLL_TOLERANCE)

        # MXFP4 scales of the wrong shape: exit 2 and one line naming the tensors.
        bad_dir = os.path.join(tmp, "mxfp4_bad")
        os.makedirs(bad_dir)
        state = load_file(os.path.join(mxfp4_dir, "model.safetensors"))
        key = "model.layers.0.mlp.experts.down_proj_scales"
        state[key] = state[key][:, :, :1].contiguous().repeat(1, 1, 3)
        save_file(state, os.path.join(bad_dir, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(mxfp4_dir, "config.json")) as f, open(os.path.join(bad_dir, "config.json"), "w") as g:
            g.write(f.read())
        proc = subprocess.run([os.environ["LOOM_BIN"], "score", "--checkpoint", bad_dir, "--tokens", "1,2,3"],
                              capture_output=True, text=True)
        lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("[rank")]
        print(f"misshaped MXFP4 scales: exit {proc.returncode}: {lines[-1] if lines else proc.stderr.strip()!r}")
        if proc.returncode != 2 or len(lines) != 1 or "down_proj_scales" not in lines[0]:
            failures.append(f"misshaped MXFP4 scales: expected exit 2 and one line naming down_proj_scales, got "
                            f"{proc.returncode}: {proc.stderr.strip()[-1000:]}")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("GPT-OSS parity: all checks passed")


if __name__ == "__main__":
    main()
