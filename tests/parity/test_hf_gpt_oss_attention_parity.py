"""Loom's attention layer with GPT-OSS's features (learned sinks, biased q/k/v/o projections, a
sliding window) against transformers' GptOssAttention on the same weights: a sliding-window layer
(window 4 and 7, shorter than the row) and a full layer, the masks made by transformers'
create_sliding_window_causal_mask / create_causal_mask and the RoPE cos/sin by GptOssRotaryEmbedding.
Transformers runs eager attention in float64 (the reference), Loom in float32 (its flash kernel
with the sink correction). The output, the input gradient and every parameter's gradient (sinks
included) must agree within 2e-5 of the tensor's largest element. Exits non-zero on a mismatch.
The whole-model GPT-OSS parity (its MoE, YaRN RoPE) comes with the family.
"""
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding

TOLERANCE = 2e-5


def run_case(worker, window, layer, seq, failures):
    cfg = GptOssConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                       sliding_window=window, layer_types=["sliding_attention", "full_attention"],
                       num_hidden_layers=2, attention_bias=True, vocab_size=32, intermediate_size=32,
                       num_local_experts=4, num_experts_per_tok=2)
    cfg._attn_implementation = "eager"
    torch.manual_seed(window * 10 + layer)
    attn = GptOssAttention(cfg, layer_idx=layer).double()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.2)
        attn.sinks.normal_(0, 1.0)
    x = torch.randn(2, seq, 64, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(2, seq, 64, dtype=torch.float64)
    pos = torch.arange(seq).unsqueeze(0)
    kwargs = dict(config=cfg, inputs_embeds=x, attention_mask=None, cache=None, position_ids=pos)
    make_mask = create_sliding_window_causal_mask if cfg.layer_types[layer] == "sliding_attention" else create_causal_mask
    mask = make_mask(**kwargs)
    cos, sin = GptOssRotaryEmbedding(cfg)(x, pos)
    y, _ = attn(x, (cos, sin), mask)
    y.backward(dout)
    loom_window = window if cfg.layer_types[layer] == "sliding_attention" else 0

    with tempfile.TemporaryDirectory() as tmp:
        inputs = {name: p.detach().contiguous() for name, p in attn.named_parameters()}
        inputs.update(x=x.detach(), dout=dout, cos=cos[0].contiguous(), sin=sin[0].contiguous(),
                      config=torch.tensor([8, 2, 16, loom_window], dtype=torch.int64))
        save_file(inputs, os.path.join(tmp, "in.safetensors"))
        proc = subprocess.run([worker, os.path.join(tmp, "in.safetensors"), os.path.join(tmp, "out.safetensors")],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{worker} failed ({proc.returncode}): {proc.stderr.strip()}")
        got = load_file(os.path.join(tmp, "out.safetensors"))
    want = {"y": y.detach(), "dx": x.grad}
    want.update({f"d.{name}": p.grad for name, p in attn.named_parameters()})
    label = f"layer {layer} ({cfg.layer_types[layer]}, window {loom_window}), seq {seq}"
    worst = 0.0
    for name, w in want.items():
        diff = (got[name].double() - w).abs().max().item() / max(w.abs().max().item(), 1e-12)
        worst = max(worst, diff)
        if diff > TOLERANCE:
            failures.append(f"{label}: {name} differs by {diff:.2e} (relative to its largest element)")
    print(f"{label}: worst relative difference {worst:.2e} over y, dx and {len(want) - 2} parameter gradients")


def main():
    worker = os.path.join(os.environ["LOOM_BINARY_DIR"], "bin", "loom_attention_parity_worker")
    failures = []
    for window, layer in ((4, 0), (7, 0), (4, 1)):
        run_case(worker, window, layer, 24, failures)
    if failures:
        sys.exit("\n".join(failures))
    print("GPT-OSS attention parity: ok")


if __name__ == "__main__":
    main()
