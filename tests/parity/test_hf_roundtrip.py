"""HF -> Loom -> HF round trip through `loom convert`.

A random Llama (GQA, llama3 rope scaling, untied head) saved by transformers is converted to a Loom
checkpoint (the trainer's sharded format: rank-0.safetensors, metadata.json with the model config,
COMPLETE) and back; every tensor of the result must be byte-identical to the original, transformers
must load the result, and Loom's logits (loom score) on the Loom checkpoint and on the result must
match transformers' within 1e-4.
"""
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_hf_llama_parity import hf_logits, loom_score, make_config, random_model  # noqa: E402


def loom(*args):
    proc = subprocess.run([os.environ["LOOM_BIN"], *args], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"loom {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")


def tensors(folder):
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, f)))
    return out


def main():
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, loom_dir, back_dir = (os.path.join(tmp, d) for d in ("hf", "loom", "back"))
        model = random_model(make_config(), seed=11)
        model.save_pretrained(hf_dir, safe_serialization=True)
        loom("convert", "--input", hf_dir, "--output", loom_dir, "--to", "loom")
        for f in ("rank-0.safetensors", "metadata.json", "COMPLETE"):
            if not os.path.exists(os.path.join(loom_dir, f)):
                failures.append(f"the Loom checkpoint has no {f}")
        loom("convert", "--input", loom_dir, "--output", back_dir, "--to", "hf")
        original, result = tensors(hf_dir), tensors(back_dir)
        if sorted(original) != sorted(result):
            failures.append(f"tensor names differ: {sorted(set(original) ^ set(result))}")
        for name, t in original.items():
            r = result.get(name)
            if r is None or r.dtype != t.dtype or r.shape != t.shape or not torch.equal(
                    r.view(torch.uint8) if r.dtype != torch.uint8 else r, t.view(torch.uint8)):
                failures.append(f"{name}: not byte-identical after the round trip")
        reloaded = LlamaForCausalLM.from_pretrained(back_dir, torch_dtype=torch.float32).eval()
        tokens = [int(x) for x in torch.randint(0, model.config.vocab_size, (24,), generator=torch.Generator().manual_seed(3))]
        ref = hf_logits(reloaded, tokens)
        logits, _, _ = loom_score(back_dir, tokens, os.path.join(tmp, "logits.safetensors"))
        diff = (logits - ref).abs().max().item()
        ckpt_logits, _, _ = loom_score(loom_dir, tokens, os.path.join(tmp, "ckpt_logits.safetensors"))
        ckpt_diff = (ckpt_logits - hf_logits(model.eval(), tokens)).abs().max().item()
        print(f"HF -> Loom -> HF: {len(original)} tensors byte-identical: {not failures}; "
              f"max |dlogit| loom vs transformers: on the Loom checkpoint {ckpt_diff:.3e}, "
              f"after the round trip {diff:.3e}")
        if diff > 1e-4:
            failures.append(f"logits differ by {diff:.3e} after the round trip")
        if ckpt_diff > 1e-4:
            failures.append(f"logits on the Loom checkpoint differ by {ckpt_diff:.3e}")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("HF round trip: all checks passed")


if __name__ == "__main__":
    main()
