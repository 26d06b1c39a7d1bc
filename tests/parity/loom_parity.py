"""Helpers the Hugging Face parity scripts share: running `loom`, reading its scores and checkpoint
tensors, transformers' logits, and the byte-for-byte comparison of a round trip.

Environment: LOOM_BIN (the loom executable).
"""

import os
import re
import subprocess
import sys

import torch
from safetensors.torch import load_file


def loom(*args):
    """Runs `loom ARGS`; exits the script with loom's stderr when it fails. Returns stdout."""
    proc = subprocess.run([os.environ["LOOM_BIN"], *args], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"loom {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def loom_score(checkpoint, tokens, logits_out):
    """`loom score` of `tokens`: (the logits it wrote to `logits_out`, the mean NLL it printed)."""
    out = loom("score", "--checkpoint", checkpoint, "--tokens", ",".join(map(str, tokens)), "--logits-out", logits_out)
    match = re.search(r"mean NLL: ([0-9.eE+-]+)", out)
    if not match:
        sys.exit(f"no 'mean NLL' in loom score output:\n{out}")
    return load_file(logits_out)["logits"], float(match.group(1))


def tensors(folder):
    """Every tensor of the safetensors files in `folder`, by name."""
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, f)))
    return out


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].to(torch.float32)


def compare_round_trip(label, original_dir, result_dir, failures):
    """Appends to `failures` every tensor name or byte that differs between the two folders."""
    original, result = tensors(original_dir), tensors(result_dir)
    if sorted(original) != sorted(result):
        failures.append(f"{label}: tensor names differ after the round trip: {sorted(set(original) ^ set(result))}")
    for name, t in original.items():
        r = result.get(name)
        if r is None or r.dtype != t.dtype or r.shape != t.shape or not torch.equal(r.view(torch.uint8), t.view(torch.uint8)):
            failures.append(f"{label}: {name} not byte-identical after the round trip")
    return original, result


def compare_greedy_generate(model, checkpoint, prompt, new_tokens, failures):
    """`loom generate --temperature 0` from `checkpoint` against transformers' greedy generate."""
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                  min_new_tokens=new_tokens)[0, len(prompt):].tolist()
    out = loom("generate", "--checkpoint", checkpoint, "--prompt-tokens", ",".join(map(str, prompt)),
               "--max-new-tokens", str(new_tokens), "--temperature", "0", "--ids")
    got = [int(t) for t in out.strip().split(",")]
    print(f"greedy generate: loom {got[:8]}... transformers {expected[:8]}... equal: {got == expected}")
    if got != expected:
        failures.append(f"greedy generate differs: loom {got} transformers {expected}")


def check_score(label, checkpoint, tokens, reference, logits_out, failures, logit_tolerance=1e-4, nll_tolerance=1e-5):
    """`loom score` of `tokens` against transformers' `reference` logits and the NLL torch computes
    from them; appends to `failures` what is off. Returns Loom's logits."""
    logits, nll = loom_score(checkpoint, tokens, logits_out)
    diff = (logits - reference).abs().max().item()
    ref_nll = torch.nn.functional.cross_entropy(reference[:-1].double(), torch.tensor(tokens[1:])).item()
    print(f"{label}: score max |dlogit| {diff:.3e} (max |logit| {reference.abs().max().item():.2f}), "
          f"mean NLL loom {nll:.8f} torch {ref_nll:.8f}")
    if diff > logit_tolerance:
        failures.append(f"{label}: score logits differ by {diff:.3e}")
    if abs(nll - ref_nll) > nll_tolerance:
        failures.append(f"{label}: mean NLL differs by {abs(nll - ref_nll):.3e}")
    return logits


def check_fused_experts_layout(label, model, hf_dir, fused_dir, tokens, logits, logits_out, failures):
    """The model's in-memory state dict (transformers 5's fused experts.gate_up_proj / down_proj)
    saved with `hf_dir`'s config must score exactly like the per-expert checkpoint (`logits`)."""
    from safetensors.torch import save_file
    import json
    os.makedirs(fused_dir)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if not any(k.endswith("experts.gate_up_proj") for k in state):
        failures.append(f"{label}: transformers' state dict has no fused gate_up_proj to test")
    save_file(state, os.path.join(fused_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(hf_dir, "config.json")) as f, open(os.path.join(fused_dir, "config.json"), "w") as g:
        json.dump(json.load(f), g)
    fused_logits, _ = loom_score(fused_dir, tokens, logits_out)
    fused_diff = (fused_logits - logits).abs().max().item()
    print(f"{label}: fused gate_up_proj/down_proj layout: logits equal to the per-expert load: {fused_diff == 0}")
    if fused_diff != 0:
        failures.append(f"{label}: the fused layout scores differently ({fused_diff:.3e})")
