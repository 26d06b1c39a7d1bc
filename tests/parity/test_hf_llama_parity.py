"""Parity of `loom score` against Hugging Face transformers' LlamaForCausalLM.

A small random Llama with grouped-query attention (8 query heads, 2 key/value heads) and Llama 3.1
RoPE scaling is saved with save_pretrained; `loom score` loads the directory and writes its logits.
Checked, in fp32:
  * single-file checkpoint: max |logit difference| <= 1e-4 and the mean NLL loom prints equals the
    one computed with torch from transformers' logits;
  * the same model saved sharded (model.safetensors.index.json);
  * a bf16 checkpoint (loom converts to fp32 on load) against transformers on the same bf16 values;
  * a tied-embedding checkpoint (no lm_head.weight in the file).
The scaling band is made to matter: original_max_position_embeddings is 32 and the sequence is 48
tokens long, and the script checks that transformers without rope scaling differs clearly.

  * the fp32 model computed in bf16 (`loom score --dtype bfloat16`): its distance from
    transformers' fp32 logits is at most 1.5x that of transformers' own bf16 model.

Environment: LOOM_BIN (the loom executable); LOOM_SCORE_DEVICE (cpu, the default, or cuda: loom
scores on the GPU, and without one the script exits 77, which ctest reports as skipped). Exits
non-zero on any mismatch.
"""

import copy
import os
import re
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

LOGIT_TOLERANCE = 1e-4
NLL_TOLERANCE = 1e-5
# bf16 compute is judged against transformers' own bf16 error on the same model (x1.5).
BF16_ERROR_RATIO = 1.5
BF16_NLL_TOLERANCE = 2e-2
DEVICE = os.environ.get("LOOM_SCORE_DEVICE", "cpu")
SKIPPED = 77
SEQ_LEN = 48


def make_config(tie_word_embeddings=False, rope_scaling=True):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        # head_dim 16, theta 1e4: wavelengths 6.3, 19.9, 62.8, ... against cuts at 8 and 32, so
        # the kept, smoothed and divided bands are all present.
        "original_max_position_embeddings": 32,
    }
    return LlamaConfig(
        hidden_size=128,
        intermediate_size=320,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=301,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=scaling if rope_scaling else None,
        tie_word_embeddings=tie_word_embeddings,
        attention_bias=False,
        mlp_bias=False,
    )


def random_model(config, seed):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    # Larger-than-default weights so logits have O(1-10) magnitude and any mismatch shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 if "embed" in name else 0.12))
    return model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].to(torch.float32)


def torch_mean_nll(logits, tokens):
    targets = torch.tensor(tokens[1:])
    return torch.nn.functional.cross_entropy(logits[:-1].double(), targets).item()


def loom_score(checkpoint, tokens, logits_out, dtype="float32"):
    cmd = [
        os.environ["LOOM_BIN"],
        "score",
        "--checkpoint",
        checkpoint,
        "--tokens",
        ",".join(str(t) for t in tokens),
        "--logits-out",
        logits_out,
        "--device",
        DEVICE,
        "--dtype",
        dtype,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"loom score failed ({proc.returncode}): {proc.stderr.strip()}")
    match = re.search(r"mean NLL: ([0-9.eE+-]+)", proc.stdout)
    if not match:
        sys.exit(f"no 'mean NLL' in loom score output:\n{proc.stdout}")
    return load_file(logits_out)["logits"], float(match.group(1)), proc.stdout


def check(label, checkpoint, reference_logits, tokens, workdir, failures, dtype="float32",
          logit_tolerance=LOGIT_TOLERANCE):
    nll_tolerance = BF16_NLL_TOLERANCE if dtype == "bfloat16" else NLL_TOLERANCE
    logits, nll, _ = loom_score(
        checkpoint, tokens, os.path.join(workdir, label.replace(" ", "_") + ".safetensors"), dtype
    )
    if logits.shape != reference_logits.shape or logits.dtype != torch.float32:
        failures.append(f"{label}: logits {tuple(logits.shape)} {logits.dtype}")
        return
    max_diff = (logits - reference_logits).abs().max().item()
    ref_nll = torch_mean_nll(reference_logits, tokens)
    nll_diff = abs(nll - ref_nll)
    print(
        f"{label:>14}: max |dlogit| = {max_diff:.3e} (max |logit| "
        f"{reference_logits.abs().max().item():.2f}), mean NLL loom {nll:.8f} "
        f"torch {ref_nll:.8f} (|d| = {nll_diff:.1e})"
    )
    if max_diff > logit_tolerance:
        failures.append(f"{label}: max |dlogit| {max_diff:.3e} > {logit_tolerance}")
    if nll_diff > nll_tolerance:
        failures.append(f"{label}: NLL differs by {nll_diff:.3e} > {nll_tolerance}")


def main():
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return SKIPPED
    print(f"loom score on {DEVICE}")
    torch.set_num_threads(2)
    hf_logging.disable_progress_bar()
    failures = []
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 301, (SEQ_LEN,), generator=generator).tolist()

    with tempfile.TemporaryDirectory(prefix="loom_hf_parity_") as workdir:
        model = random_model(make_config(), seed=0)
        reference = hf_logits(model, tokens)

        # The test only means something if the llama3 scaling changes the logits.
        unscaled = random_model(make_config(rope_scaling=False), seed=0)
        unscaled.load_state_dict(model.state_dict())
        scaling_effect = (hf_logits(unscaled, tokens) - reference).abs().max().item()
        print(f"effect of llama3 rope scaling on transformers' logits: {scaling_effect:.3e}")
        if scaling_effect < 1e-2:
            failures.append(f"rope scaling barely matters ({scaling_effect:.1e}); test is weak")

        single = os.path.join(workdir, "single")
        model.save_pretrained(single, safe_serialization=True)
        check("single file", single, reference, tokens, workdir, failures)
        with torch.no_grad():
            hf_bf16 = copy.deepcopy(model).to(torch.bfloat16)(torch.tensor([tokens])).logits[0]
        hf_bf16_error = (hf_bf16.to(torch.float32) - reference).abs().max().item()
        print(f"transformers in bf16: max |dlogit| = {hf_bf16_error:.3e} from its fp32 logits")
        check("bf16 compute", single, reference, tokens, workdir, failures, dtype="bfloat16",
              logit_tolerance=BF16_ERROR_RATIO * hf_bf16_error)

        sharded = os.path.join(workdir, "sharded")
        model.save_pretrained(sharded, safe_serialization=True, max_shard_size="200KB")
        if not os.path.exists(os.path.join(sharded, "model.safetensors.index.json")):
            failures.append("save_pretrained did not shard; the index path went untested")
        check("sharded", sharded, reference, tokens, workdir, failures)

        # Reference: the bf16-rounded weights computed in fp32, as loom does. (Rounding through
        # model.to() would also round transformers' inv_freq buffer, so load a state dict.)
        bf16_dir = os.path.join(workdir, "bf16")
        random_model(make_config(), seed=0).to(torch.bfloat16).save_pretrained(
            bf16_dir, safe_serialization=True
        )
        rounded = random_model(make_config(), seed=0)
        rounded.load_state_dict(
            {k: v.to(torch.bfloat16).to(torch.float32) for k, v in model.state_dict().items()}
        )
        check("bf16 weights", bf16_dir, hf_logits(rounded, tokens), tokens, workdir, failures)

        tied = random_model(make_config(tie_word_embeddings=True), seed=2)
        tied_dir = os.path.join(workdir, "tied")
        tied.save_pretrained(tied_dir, safe_serialization=True)
        check("tied", tied_dir, hf_logits(tied, tokens), tokens, workdir, failures)

    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("HF Llama parity: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
