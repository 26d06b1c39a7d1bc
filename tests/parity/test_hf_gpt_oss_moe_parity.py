"""Loom's MoE layer with GPT-OSS's options against transformers' GptOssMLP (router + experts).

A GptOssMLP of 8 experts, top 4, hidden 32, intermediate 24, in float32, random weights and tokens
large enough that both clamps of the SwiGLU engage (the script counts them: gate above the limit,
up outside +-limit), runs forward and backward; the worker (tests/parity/gpt_oss_moe_worker.cpp)
loads the same tensors in transformers' layout through Loom's mapping functions
(moe::split_interleaved_gate_up, ...), runs Loom's layer (grouped GEMM, then the per-expert loop)
and returns y, dx and every parameter's gradient in transformers' layout. Each must agree within
1e-5 of its largest element. Exits non-zero on a mismatch.

Environment: LOOM_BINARY_DIR (the build folder).
"""
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

TOLERANCE = 1e-5
EXPERTS, TOP_K, HIDDEN, INTER, TOKENS = 8, 4, 32, 24, 40


def main():
    worker = os.path.join(os.environ["LOOM_BINARY_DIR"], "bin", "loom_gpt_oss_moe_parity_worker")
    config = GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                          num_experts_per_tok=TOP_K, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16, vocab_size=64)
    config._experts_implementation = "eager"  # the reference loop of modeling_gpt_oss.py
    torch.manual_seed(7)
    mlp = GptOssMLP(config).float()
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0.0, 0.4)
    x = (torch.randn(1, TOKENS, HIDDEN) * 2).requires_grad_(True)
    dy = torch.randn(1, TOKENS, HIDDEN)
    y, _ = mlp(x)
    y.backward(dy)
    # The clamps engaged: recompute the projections of every routed (token, expert) pair.
    with torch.no_grad():
        flat = x.reshape(-1, HIDDEN)
        logits = torch.nn.functional.linear(flat, mlp.router.weight, mlp.router.bias)
        chosen = logits.topk(TOP_K, dim=-1).indices
        gate_up = torch.einsum("td,edf->tef", flat, mlp.experts.gate_up_proj) + mlp.experts.gate_up_proj_bias
        picked = gate_up.gather(1, chosen.unsqueeze(-1).expand(-1, -1, 2 * INTER))
        gate, up = picked[..., ::2], picked[..., 1::2]
        clamped_gate = int((gate > config.swiglu_limit).sum())
        clamped_up = int((up.abs() > config.swiglu_limit).sum())
    print(f"clamps engaged: gate {clamped_gate}, up {clamped_up} of {gate.numel()} values")
    if clamped_gate < gate.numel() // 20 or clamped_up < up.numel() // 20:
        sys.exit("the inputs do not engage the clamps enough to test them")
    want = {"y": y.detach().reshape(TOKENS, HIDDEN), "dx": x.grad.reshape(TOKENS, HIDDEN),
            "router_weight": mlp.router.weight.grad, "router_bias": mlp.router.bias.grad,
            "gate_up_proj": mlp.experts.gate_up_proj.grad, "gate_up_proj_bias": mlp.experts.gate_up_proj_bias.grad,
            "down_proj": mlp.experts.down_proj.grad, "down_proj_bias": mlp.experts.down_proj_bias.grad}
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        inputs = os.path.join(tmp, "in.safetensors")
        save_file({"x": x.detach().reshape(TOKENS, HIDDEN).contiguous(), "dy": dy.reshape(TOKENS, HIDDEN).contiguous(),
                   "router_weight": mlp.router.weight.detach().contiguous(),
                   "router_bias": mlp.router.bias.detach().contiguous(),
                   "gate_up_proj": mlp.experts.gate_up_proj.detach().contiguous(),
                   "gate_up_proj_bias": mlp.experts.gate_up_proj_bias.detach().contiguous(),
                   "down_proj": mlp.experts.down_proj.detach().contiguous(),
                   "down_proj_bias": mlp.experts.down_proj_bias.detach().contiguous()}, inputs)
        for path in ("grouped", "loop"):
            out = os.path.join(tmp, f"{path}.safetensors")
            proc = subprocess.run([worker, inputs, out, str(TOP_K), path], capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"{worker} failed ({proc.returncode}): {proc.stderr.strip()}")
            got = load_file(out)
            for name, w in want.items():
                if got[name].shape != w.shape:
                    failures.append(f"{path} {name}: shape {tuple(got[name].shape)} != {tuple(w.shape)}")
                    continue
                scale = w.double().abs().max().item()
                if not scale > 0:
                    failures.append(f"{name}: transformers' value is all zeros, nothing compared")
                    continue
                err = ((got[name].double() - w.double()).abs().max() / scale).item()
                print(f"{path} {name}: max |loom - transformers| / max |transformers| ({scale:.3g}) = {err:.3g}")
                if not err <= TOLERANCE:
                    failures.append(f"{path} {name}: {err:.3g}")
    if failures:
        sys.exit("mismatch: " + "; ".join(failures))
    print("ok")


if __name__ == "__main__":
    main()
