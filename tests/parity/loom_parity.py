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
