"""LoRA adapters between Loom and PEFT (issue 27), on one small Llama base.
import os
os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' loading bars

A base is trained by `loom train` for 2 steps and exported to a Hugging Face directory; a LoRA run
(r = 4, alpha = 8 on q_proj, v_proj, o_proj and down_proj) trains adapters on it for 4 steps,
saving adapter-only checkpoints. Checked, in fp32:
  * the adapter checkpoint holds no base weight and references the base by path and checksum;
  * `loom convert --to peft` writes a directory PeftModel.from_pretrained loads, whose logits are
    within 1e-4 of `loom score --adapter` on the same base;
  * PEFT's merge_and_unload equals `loom convert --to hf --merge-adapter` within 1e-5;
  * an adapter made by peft itself (random A and B, save_pretrained) loads into Loom and scores the
    same within 1e-4;
  * `loom score` with three adapters (the Loom checkpoint, its PEFT export, the peft-made one) loads
    the base once and reports three results; `loom generate` with two adapters in turn samples
    greedily what PeftModel.generate does;
  * bad input, one line and exit 2: a PEFT directory made for another base shape, target_modules
    naming no module of the model, a negative rank.

Environment: LOOM_BIN (the loom executable). Exits non-zero on any mismatch.
"""

import json
import os
import re
import subprocess
import sys
import tempfile

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from loom_parity import hf_logits, loom, tensors

LOGIT_TOLERANCE = 1e-4
MERGE_TOLERANCE = 1e-5
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]
# The debug model on the bundled corpus, small and short so the script runs in seconds.
TRAIN = ["train", "--config", os.path.join(ROOT, "configs/llama3_debug.toml"), "--training.seq_len", "64",
         "--training.local_batch_size", "2", "--metrics.log_freq", "1", "--validation.enable", "false",
         "--model.tokenizer_path", os.path.join(ROOT, "data/default/tokenizer.json"),
         "--training.dataset_path", os.path.join(ROOT, "data/default/corpus.jsonl")]


def loom_fails(*args):
    """Runs loom expecting a usage error: (exit code, stderr's last line)."""
    proc = subprocess.run([os.environ["LOOM_BIN"], *args], capture_output=True, text=True)
    lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
    return proc.returncode, lines[-1] if lines else ""


def main():
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        base_run, base_hf = os.path.join(tmp, "base_run"), os.path.join(tmp, "base_hf")
        loom(*TRAIN, "--job.dump_folder", base_run, "--training.steps", "2", "--checkpoint.enable", "true",
             "--checkpoint.model_only", "true", "--checkpoint.interval", "1000")
        loom("convert", "--input", os.path.join(base_run, "checkpoint"), "--output", base_hf, "--to", "hf")

        lora_run = os.path.join(tmp, "lora_run")
        loom(*TRAIN, "--job.dump_folder", lora_run, "--training.steps", "4", "--optimizer.lr", "2e-3",
             "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--checkpoint.initial_load_path", base_hf,
             "--lora.rank", "4", "--lora.alpha", "8", "--lora.target_modules", ",".join(TARGETS))
        adapter_ckpt = os.path.join(lora_run, "checkpoint", "step-4")
        meta = json.load(open(os.path.join(adapter_ckpt, "metadata.json")))
        model_tensors = [n for n, t in meta["tensors"].items() if t["component"] == "model"]
        base = meta["json"].get("base", {})
        print(f"adapter checkpoint: {len(model_tensors)} model tensors, base {base}")
        if not model_tensors or any(".lora." not in n for n in model_tensors):
            failures.append(f"the adapter checkpoint holds non-adapter model tensors: "
                            f"{[n for n in model_tensors if '.lora.' not in n][:4]}")
        if base.get("path") != os.path.abspath(base_hf) or not str(base.get("checksum", "")).startswith("crc32c:"):
            failures.append(f"the adapter checkpoint does not reference its base by path and checksum: {base}")

        peft_export = os.path.join(tmp, "peft_export")
        loom("convert", "--input", os.path.join(lora_run, "checkpoint"), "--output", peft_export, "--to", "peft")
        config = json.load(open(os.path.join(peft_export, "adapter_config.json")))
        print(f"PEFT export config: r {config['r']}, lora_alpha {config['lora_alpha']}, "
              f"target_modules {config['target_modules']}, base {config['base_model_name_or_path']}")

        # A peft-made adapter: random A and B (init_lora_weights=False), so every factor matters.
        peft_made = os.path.join(tmp, "peft_made")
        made = get_peft_model(LlamaForCausalLM.from_pretrained(base_hf),
                              LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False,
                                         lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"))
        made.save_pretrained(peft_made)

        tokens = [1, 17, 250, 3, 999, 42, 7, 1500, 88, 2047, 5, 600, 31, 1024, 77, 9]
        logits_out = os.path.join(tmp, "logits.safetensors")
        adapters = [adapter_ckpt, peft_export, peft_made]
        out = loom("score", "--checkpoint", base_hf, "--tokens", ",".join(map(str, tokens)), "--logits-out", logits_out,
                   *[a for d in adapters for a in ("--adapter", d)])
        summary = [l for l in out.splitlines() if l.startswith(("checkpoint:", "base load", "adapter ", "tokens scored"))
                   or "adapters scored" in l]
        print("loom score log:\n  " + "\n  ".join(summary))
        if len(re.findall(r"mean NLL", out)) != 3 or "3 adapters scored over 1 base load" not in out:
            failures.append("loom score with 3 adapters did not report 3 results over one base load")
        logits = load_file(logits_out)

        def peft_logits(adapter_dir):
            model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base_hf), adapter_dir)
            model.eval()
            return hf_logits(model, tokens), model

        for i, (label, adapter_dir) in enumerate([("loom checkpoint (as exported to PEFT)", peft_export),
                                                  ("its PEFT export", peft_export), ("peft-made adapter", peft_made)]):
            reference, _ = peft_logits(adapter_dir)
            diff = (logits[f"logits.{i}"] - reference).abs().max().item()
            print(f"{label}: max |logit - PeftModel| {diff:.3e}")
            if diff > LOGIT_TOLERANCE:
                failures.append(f"{label}: logits differ from PeftModel by {diff:.3e} > {LOGIT_TOLERANCE}")
        # The adapters changed the model (so the comparison above tests them, not the base).
        base_logits = hf_logits(LlamaForCausalLM.from_pretrained(base_hf), tokens)
        moved = (logits["logits.0"] - base_logits).abs().max().item()
        print(f"trained adapter moves the logits by {moved:.3e}")
        if moved < 1e-3:
            failures.append(f"the trained adapter barely changes the logits ({moved:.3e}): nothing was tested")

        # `loom generate` over the same base with two adapters in turn, greedy, against PeftModel's.
        prompt, new_tokens = tokens[:6], 8
        out = loom("generate", "--checkpoint", base_hf, "--prompt-tokens", ",".join(map(str, prompt)),
                   "--max-new-tokens", str(new_tokens), "--temperature", "0", "--ids",
                   "--adapter", peft_export, "--adapter", peft_made)
        got = [[int(t) for t in line.split(",")] for line in out.strip().splitlines()]
        for label, adapter_dir, ids in zip(["PEFT export", "peft-made"], [peft_export, peft_made], got):
            _, model = peft_logits(adapter_dir)
            with torch.no_grad():
                expected = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                          min_new_tokens=new_tokens)[0, len(prompt):].tolist()
            print(f"generate --adapter ({label}): loom {ids} PeftModel {expected}")
            if ids != expected:
                failures.append(f"generate with the {label} adapter differs: loom {ids} PeftModel {expected}")
        if len(got) != 2:
            failures.append(f"loom generate with 2 adapters printed {len(got)} generations")

        merged = os.path.join(tmp, "merged")
        loom("convert", "--input", adapter_ckpt, "--output", merged, "--to", "hf", "--merge-adapter")
        _, model = peft_logits(peft_export)
        reference = {k: v for k, v in model.merge_and_unload().state_dict().items()}
        got = tensors(merged)
        worst = max((got[k] - reference[k]).abs().max().item() for k in got)
        print(f"merged export vs PEFT merge_and_unload: {len(got)} tensors, max |difference| {worst:.3e}")
        if sorted(got) != sorted(k for k in reference if k in got) or worst > MERGE_TOLERANCE:
            failures.append(f"merged weights differ from PEFT's merge_and_unload by {worst:.3e}")
        merged_logits = hf_logits(LlamaForCausalLM.from_pretrained(merged), tokens)
        print(f"merged model logits vs loom score --adapter: {(merged_logits - logits['logits.0']).abs().max().item():.3e}")

        # Bad input.
        other_hf, other_peft = os.path.join(tmp, "other_hf"), os.path.join(tmp, "other_peft")
        other = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                             num_attention_heads=4, num_key_value_heads=4, vocab_size=2048))
        other.save_pretrained(other_hf)
        get_peft_model(other, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS)).save_pretrained(other_peft)
        for label, args, expect in [
            ("PEFT dir of another base shape",
             ["score", "--checkpoint", base_hf, "--tokens", "1,2,3", "--adapter", other_peft], "another shape"),
            ("target_modules naming no module",
             [*TRAIN, "--job.dump_folder", os.path.join(tmp, "bad1"), "--training.steps", "1",
              "--lora.rank", "4", "--lora.target_modules", "q_proj,qkv_proj"], "qkv_proj"),
            ("negative rank",
             [*TRAIN, "--job.dump_folder", os.path.join(tmp, "bad2"), "--training.steps", "1", "--lora.rank", "-1"],
             "lora.rank"),
        ]:
            code, line = loom_fails(*args)
            print(f"bad input, {label}: exit {code}: {line}")
            if code != 2 or expect not in line:
                failures.append(f"{label}: expected exit 2 and one line naming '{expect}', got {code}: {line}")

    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("LoRA/PEFT parity: all checks passed")


if __name__ == "__main__":
    main()
