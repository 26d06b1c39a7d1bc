"""model.flavor = "hf": a Hugging Face checkpoint of every supported family trains at its own shape.

For each family (Llama, Qwen3, Qwen3-MoE, DeepSeek-V3, GPT-OSS) a small random transformers model in a shape
no built-in Loom flavor has (odd widths, other head counts and head_dim, another vocabulary larger
than the tokenizer's, another expert count and top-k) is saved with save_pretrained. Then:
  * `loom train` with model.flavor = "hf" and checkpoint.initial_load_path at that directory (no
    other shape setting) runs 2 steps on a token file; its step-1 loss equals the mean
    cross-entropy transformers computes on the same two packed rows (BOS + document, rows of
    seq_len + 1) within 1e-5 relative, fp32 (the SFT parity test's tolerance);
  * its step-2 checkpoint (trained weights) exported with `loom convert --to hf` is a directory
    transformers loads at the original shape, whose logits equal `loom score`'s on the checkpoint
    within 1e-4 (the HF parity tests' logit tolerance);
  * for Llama, a LoRA run on the same base (model.flavor = "hf", adapters B = 0) has the same
    step-1 loss as transformers;
  * a config.json the family cannot express (Llama with hidden_act gelu) stops `loom train` with
    exit 2 and one line naming the field and its value.

Environment: LOOM_BIN (the loom executable). Exits non-zero on any mismatch.
"""

import json
import os
import struct
import subprocess
import sys
import tempfile

import torch
from tokenizers import Tokenizer
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, GptOssConfig, GptOssForCausalLM, LlamaConfig,
                          LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)
from transformers.utils import logging as hf_logging

from loom_parity import hf_logits, loom, loom_score

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "data/default/tokenizer.json")
LOSS_TOLERANCE = 1e-5  # relative
LOGIT_TOLERANCE = 1e-4
SEQ_LEN, ROWS = 32, 2


def llama():
    return LlamaForCausalLM, LlamaConfig(
        hidden_size=48, intermediate_size=100, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
        vocab_size=2053, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False)


def qwen3():
    return Qwen3ForCausalLM, Qwen3Config(
        hidden_size=40, intermediate_size=72, num_hidden_layers=2, num_attention_heads=5, num_key_value_heads=1,
        head_dim=12, vocab_size=2077, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True, attention_bias=False, use_sliding_window=False)


def qwen3_moe():
    return Qwen3MoeForCausalLM, Qwen3MoeConfig(
        hidden_size=40, intermediate_size=88, moe_intermediate_size=20, num_hidden_layers=3, num_attention_heads=5,
        num_key_value_heads=1, head_dim=12, vocab_size=2069, max_position_embeddings=128, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=False, attention_bias=False, use_sliding_window=False,
        num_experts=6, num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1)


def deepseek_v3():
    return DeepseekV3ForCausalLM, DeepseekV3Config(
        hidden_size=56, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3, num_attention_heads=3,
        num_key_value_heads=3, vocab_size=2061, max_position_embeddings=128, rms_norm_eps=1e-6,
        tie_word_embeddings=False, attention_bias=False, n_routed_experts=5, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.5,
        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=10, rope_interleave=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def gpt_oss():
    # Full attention on layer 0, a window of 5 (shorter than the rows) on layers 1 and 2.
    return GptOssForCausalLM, GptOssConfig(
        hidden_size=48, intermediate_size=32, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
        head_dim=8, vocab_size=2083, max_position_embeddings=128, rms_norm_eps=1e-5, sliding_window=5,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"], num_local_experts=6,
        num_experts_per_tok=3, tie_word_embeddings=False, attention_bias=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16})


FAMILIES = {"llama3": llama, "qwen3": qwen3, "qwen3_moe": qwen3_moe, "deepseek_v3": deepseek_v3, "gpt_oss": gpt_oss}
SHAPE_KEYS = ["hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "num_experts", "num_experts_per_tok", "n_routed_experts",
              "n_shared_experts", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
              "tie_word_embeddings", "mlp_only_layers", "first_k_dense_replace", "num_local_experts", "sliding_window",
              "layer_types"]


def random_model(cls, config, seed):
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight") or name.endswith("mlp.router.weight"):
                p.copy_(torch.randn_like(p))  # routing far from ties
            else:
                p.copy_(torch.randn_like(p) * (0.5 if "embed" in name else 0.15))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn_like(b))
    return model


def write_token_file(path, document, vocab, bos, eos):
    """One document in Loom's token file format (data/sources.h), EOS after it."""
    ids = document + [eos]
    with open(path, "wb") as f:
        f.write(b"LOOMTOK\0" + struct.pack("<IIQQqqq", 1, 2, len(ids), 1, vocab, bos, eos) + bytes(8))
        f.write(struct.pack(f"<{len(ids)}H", *ids))


def train_args(name, folder, hf_dir, data, steps=2, extra=()):
    return ["train", "--config", os.path.join(ROOT, "configs/llama3_debug.toml"), "--model.name", name,
            "--model.flavor", "hf", "--checkpoint.initial_load_path", hf_dir, "--model.tokenizer_path", TOKENIZER,
            "--training.dataset_path", data, "--training.dataset_format", "tokens", "--training.seq_len", str(SEQ_LEN),
            "--training.local_batch_size", str(ROWS), "--training.steps", str(steps), "--training.deterministic",
            "true", "--validation.enable", "false", "--metrics.log_freq", "1", "--metrics.peak_flops", "1e12",
            "--metrics.memory_breakdown", "false", "--parallelism.data_parallel_shard_degree", "1",
            "--checkpoint.enable", "true", "--checkpoint.interval", str(steps), "--job.dump_folder", folder, *extra]


def step_one_loss(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if record.get("step") == 1 and "loss" in record:
                return record["loss"]
    sys.exit(f"no step-1 loss in {folder}/metrics.jsonl")


def hf_loss(model, rows):
    with torch.no_grad():
        logits = model(rows[:, :-1]).logits.to(torch.float32)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1)).item()


def check_family(name, tmp, rows, data, failures):
    cls, config = FAMILIES[name]()
    model = random_model(cls, config, seed=len(name))
    hf_dir, folder, back = (os.path.join(tmp, f"{name}-{d}") for d in ("hf", "run", "back"))
    model.save_pretrained(hf_dir, safe_serialization=True)
    expected = hf_loss(model, rows)

    loom(*train_args(name, folder, hf_dir, data))
    got = step_one_loss(folder)
    relative = abs(got - expected) / abs(expected)
    print(f"{name}: step-1 loss loom {got:.8f} transformers {expected:.8f} (relative {relative:.1e})")
    if relative > LOSS_TOLERANCE:
        failures.append(f"{name}: step-1 loss {got} differs from transformers' {expected} by {relative:.1e}")

    # The trained checkpoint exports at its own shape; transformers computes what `loom score` does.
    checkpoint = os.path.join(folder, "checkpoint")
    loom("convert", "--input", checkpoint, "--output", back, "--to", "hf")
    with open(os.path.join(back, "config.json")) as f:
        exported = json.load(f)
    original = config.to_dict()
    for key in SHAPE_KEYS:
        if key in original and key in exported and original[key] != exported[key]:
            failures.append(f"{name}: exported config.json has {key} {exported[key]}, the original {original[key]}")
    reloaded = cls.from_pretrained(back, dtype=torch.float32).eval()
    tokens = rows[0].tolist()
    logits, _ = loom_score(checkpoint, tokens, os.path.join(tmp, f"{name}-logits.safetensors"))
    diff = (hf_logits(reloaded, tokens) - logits).abs().max().item()
    print(f"{name}: exported step-2 checkpoint, transformers' logits vs loom score: max |diff| {diff:.2e}")
    if diff > LOGIT_TOLERANCE:
        failures.append(f"{name}: the exported checkpoint's logits differ from loom score's by {diff:.2e}")
    return model, hf_dir, expected


def main():
    torch.set_num_threads(2)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    failures = []
    tokenizer = Tokenizer.from_file(TOKENIZER)
    vocab = tokenizer.get_vocab_size()
    bos, eos = tokenizer.token_to_id("<|begin_of_text|>"), tokenizer.token_to_id("<|end_of_text|>")
    generator = torch.Generator().manual_seed(5)
    document = [int(x) for x in torch.randint(0, vocab - 3, (ROWS * (SEQ_LEN + 1) * 3,), generator=generator)]
    # The packed stream is BOS + document + EOS; the first step takes its first ROWS rows of SEQ_LEN + 1.
    stream = [bos] + document
    rows = torch.tensor([stream[r * (SEQ_LEN + 1):(r + 1) * (SEQ_LEN + 1)] for r in range(ROWS)])
    with tempfile.TemporaryDirectory(prefix="loom_hf_flavor_") as tmp:
        data = os.path.join(tmp, "tokens.bin")
        write_token_file(data, document, vocab, bos, eos)
        bases = {name: check_family(name, tmp, rows, data, failures) for name in FAMILIES}

        # LoRA on an "hf"-flavored base: B = 0, so step 1 is the base's loss.
        _, hf_dir, expected = bases["llama3"]
        folder = os.path.join(tmp, "llama3-lora")
        loom(*train_args("llama3", folder, hf_dir, data, extra=("--lora.rank", "4", "--lora.alpha", "8",
                                                               "--lora.target_modules", "q_proj,v_proj,down_proj")))
        got = step_one_loss(folder)
        relative = abs(got - expected) / abs(expected)
        print(f"llama3 LoRA: step-1 loss loom {got:.8f} transformers {expected:.8f} (relative {relative:.1e})")
        if relative > LOSS_TOLERANCE:
            failures.append(f"llama3 LoRA: step-1 loss {got} differs from transformers' {expected} by {relative:.1e}")

        # A config.json Llama cannot express: exit 2, one line naming the field and its value.
        bad = os.path.join(tmp, "gelu")
        os.makedirs(bad)
        with open(os.path.join(hf_dir, "config.json")) as f:
            config = json.load(f)
        config["hidden_act"] = "gelu"
        with open(os.path.join(bad, "config.json"), "w") as f:
            json.dump(config, f)
        proc = subprocess.run([os.environ["LOOM_BIN"], *train_args("llama3", os.path.join(tmp, "bad-run"), bad, data)],
                              capture_output=True, text=True)
        errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
        print(f"unsupported field: exit {proc.returncode}: {errors[-1] if errors else proc.stderr.strip()}")
        if proc.returncode != 2 or len(errors) != 1 or "hidden_act 'gelu'" not in errors[0]:
            failures.append(f"hidden_act gelu: exit {proc.returncode}, errors {errors}, stderr {proc.stderr.strip()}")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("model.flavor = \"hf\": all checks passed")


if __name__ == "__main__":
    main()
