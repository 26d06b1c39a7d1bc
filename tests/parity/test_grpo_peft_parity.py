"""GRPO's loss and gradients between `loom rl` and a PyTorch + peft reference (issue 51).

The Llama debug model is trained by `loom train` for 1 step and exported to a Hugging Face
directory (the base); peft makes LoRA adapters on every linear with random A and B (the starting
policy). Fixed rollouts for 3 GRPO steps are written to a file: random prompts and completions of
different lengths, rewards, and rollout log-probabilities (the starting policy's, moved by noise so
the ratio leaves 1 and clipping acts on both sides). Loom's side is build/bin/loom_grpo_parity_worker
(tests/parity/grpo_worker.cpp: `loom rl`'s own batch, advantages, loss, reference, optimizer, LR
schedule and clipping); the reference below is written independently from TRL's GRPOTrainer
formulas over PeftModel, with torch's clip_grad_norm_, AdamW and LambdaLR. Per update, in fp32:
the loss, the gradient norm before clipping and every adapter gradient within 1e-5, and at the end
every adapter within 2e-4 (AdamW's first steps move each element by about lr x sign(g), so where a
gradient is near 0 its float32 rounding becomes a difference of a fraction of lr; the later
updates' gradients, taken at those adapters, still agree within 1e-5). Three cases cover the three aggregations, the KL term (beta > 0, the reference being
the base with the adapters disabled), more than one update per rollout, an LR warmup, weight decay,
unscaled advantages and clip-higher; in each, max_norm is below every gradient norm, so clipping
engages on every update (checked).

Environment: LOOM_BIN (the loom executable), LOOM_BINARY_DIR (the build folder). Exits non-zero on
any mismatch.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' loading bars

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import LlamaForCausalLM
from transformers.utils import logging as hf_logging

from loom_parity import loom

TOLERANCE = 1e-5
ADAPTER_TOLERANCE = 2e-4
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = ["train", "--config", os.path.join(ROOT, "configs/llama3_debug.toml"), "--training.seq_len", "32",
         "--training.local_batch_size", "1", "--metrics.log_freq", "1", "--validation.enable", "false",
         "--model.tokenizer_path", os.path.join(ROOT, "data/default/tokenizer.json"),
         "--training.dataset_path", os.path.join(ROOT, "data/default/corpus.jsonl")]
PROMPTS, GROUP, STEPS, MAX_NEW_TOKENS = 2, 4, 3, 6

# name, [rl] keys, [optimizer] keys, [lr_scheduler] keys, training.max_norm
CASES = [
    ("grpo", {"loss_type": "grpo", "kl_beta": 0.0, "temperature": 1.0, "updates_per_rollout": 1},
     {"lr": 1e-2, "weight_decay": 0.0}, {"warmup_steps": 0}, 0.02),
    ("bnpo+kl", {"loss_type": "bnpo", "kl_beta": 0.1, "temperature": 0.8, "updates_per_rollout": 2},
     {"lr": 5e-3, "weight_decay": 0.1}, {"warmup_steps": 3}, 0.02),
    ("dr_grpo+kl", {"loss_type": "dr_grpo", "kl_beta": 0.05, "temperature": 1.0, "updates_per_rollout": 1,
                    "scale_rewards": "none", "clip_high": 0.28},
     {"lr": 1e-2, "weight_decay": 0.01}, {"warmup_steps": 0}, 0.01),
]
OPTIMIZER = {"name": "AdamW", "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}


def toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    return repr(v)


def write_config(path, base_hf, rl, optimizer, schedule, max_norm):
    sections = {
        "model": {"name": "llama3", "flavor": "debugmodel",
                  "tokenizer_path": os.path.join(ROOT, "data/default/tokenizer.json")},
        "checkpoint": {"initial_load_path": base_hf},
        "lora": {"rank": 4, "alpha": 8.0, "target_modules": "all-linear"},
        "optimizer": {**OPTIMIZER, **optimizer},
        "lr_scheduler": {"decay_ratio": 0.0, **schedule},
        "training": {"max_norm": max_norm, "seed": 0},
        "rl": {"prompts": path + ".unused.jsonl", "prompts_per_step": PROMPTS, "group_size": GROUP,
               "max_new_tokens": MAX_NEW_TOKENS, **rl},
    }
    with open(path, "w") as f:
        for name, keys in sections.items():
            f.write(f"[{name}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in keys.items()))


def padded_batch(prompts, completions):
    """[B, T] tokens right-padded with 0, and the [B, T - 1] mask of completion targets."""
    t = max(len(p) + len(c) for p, c in zip(prompts, completions))
    tokens = torch.zeros(len(prompts), t, dtype=torch.long)
    mask = torch.zeros(len(prompts), t - 1)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        tokens[i, :len(p) + len(c)] = torch.tensor(p + c)
        mask[i, len(p) - 1:len(p) + len(c) - 1] = 1
    return tokens, mask


def token_logprobs(model, tokens, temperature):
    logits = model(input_ids=tokens[:, :-1]).logits.float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


def make_rollouts(model, generator):
    """3 steps of P x G completions with rewards and noisy rollout log-probabilities (float32)."""
    steps = []
    for _ in range(STEPS):
        prompts, completions, rewards = [], [], []
        for _ in range(PROMPTS):
            prompt = torch.randint(3, 2000, (int(torch.randint(3, 9, (1,), generator=generator)),),
                                   generator=generator).tolist()
            group = torch.randint(0, 3, (GROUP,), generator=generator).float() / 2
            group[0], group[1] = 0.0, 1.0  # never a group of equal rewards
            for g in range(GROUP):
                n = int(torch.randint(1, MAX_NEW_TOKENS + 1, (1,), generator=generator))
                prompts.append(prompt)
                completions.append(torch.randint(3, 2000, (n,), generator=generator).tolist())
                rewards.append(float(group[g]))
        tokens, mask = padded_batch(prompts, completions)
        with torch.no_grad():
            logp = token_logprobs(model, tokens, 1.0)
        logp = logp + 0.3 * torch.randn(logp.shape, generator=generator)
        rows = [[float(logp[i, len(p) - 1 + j]) for j in range(len(c))] for i, (p, c) in enumerate(zip(prompts, completions))]
        steps.append({"prompts": prompts, "completions": completions, "logp": rows, "rewards": rewards})
    return {"steps": steps}


def group_advantages(rewards, scale):
    r = rewards.view(-1, GROUP)
    centred = r - r.mean(1, keepdim=True)
    if scale == "none":
        return centred.reshape(-1)
    return (centred / (r.std(1, keepdim=True) + 1e-4)).reshape(-1)


def grpo_loss(logp, old, ref, advantages, mask, rl):
    """TRL GRPOTrainer._compute_loss: clipped ratio, k3 KL, the three aggregations."""
    ratio = torch.exp(logp - old)
    clipped = torch.clamp(ratio, 1 - rl.get("clip_low", 0.2), 1 + rl.get("clip_high", 0.2))
    per_token = -torch.min(ratio * advantages.unsqueeze(1), clipped * advantages.unsqueeze(1))
    if rl["kl_beta"] > 0:
        per_token = per_token + rl["kl_beta"] * (torch.exp(ref - logp) - (ref - logp) - 1)
    clip_share = (((ratio < 1 - rl.get("clip_low", 0.2)) & (advantages.unsqueeze(1) < 0)) |
                  ((ratio > 1 + rl.get("clip_high", 0.2)) & (advantages.unsqueeze(1) > 0))).float()
    clip_share = ((clip_share * mask).sum() / mask.sum()).item()
    if rl["loss_type"] == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean(), clip_share
    if rl["loss_type"] == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1), clip_share
    return (per_token * mask).sum() / (per_token.size(0) * MAX_NEW_TOKENS), clip_share


def reference_run(base_hf, adapter_dir, rollouts, rl, optimizer, schedule, max_norm):
    model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base_hf), adapter_dir, is_trainable=True)
    model.eval()
    params = {n.replace(".default", ""): p for n, p in model.named_parameters() if p.requires_grad}
    adamw = torch.optim.AdamW(params.values(), lr=optimizer["lr"], betas=(OPTIMIZER["beta1"], OPTIMIZER["beta2"]),
                              eps=OPTIMIZER["eps"], weight_decay=optimizer["weight_decay"])
    warmup = schedule["warmup_steps"]
    # TorchTitan's linear warmup with decay_ratio 0 (no decay): factor (s + 1) / warmup, then 1.
    lr_schedule = torch.optim.lr_scheduler.LambdaLR(adamw, lambda s: (s + 1) / warmup if s < warmup else 1.0)
    results = []
    for step in rollouts["steps"]:
        tokens, mask = padded_batch(step["prompts"], step["completions"])
        old = torch.zeros_like(mask)
        for i, (p, row) in enumerate(zip(step["prompts"], step["logp"])):
            old[i, len(p) - 1:len(p) - 1 + len(row)] = torch.tensor(row, dtype=torch.float32)
        advantages = group_advantages(torch.tensor(step["rewards"], dtype=torch.float32), rl.get("scale_rewards", "group"))
        ref = None
        if rl["kl_beta"] > 0:
            with torch.no_grad(), model.disable_adapter():
                ref = token_logprobs(model, tokens, rl["temperature"])
        for _ in range(rl["updates_per_rollout"]):
            lr = adamw.param_groups[0]["lr"]
            logp = token_logprobs(model, tokens, rl["temperature"])
            loss, clip_share = grpo_loss(logp, old, ref, advantages, mask, rl)
            adamw.zero_grad(set_to_none=True)
            loss.backward()
            grads = {n: p.grad.detach().clone() for n, p in params.items()}
            norm = torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm).item()
            adamw.step()
            lr_schedule.step()
            results.append({"loss": loss.item(), "grad_norm": norm, "lr": lr, "grads": grads, "clip_share": clip_share})
    return results, {n: p.detach().clone() for n, p in params.items()}


def main():
    # One thread, here and in the loom processes: the model is tiny, and two spinning OpenMP threads
    # on a shared 2-core machine made each Loom process 10x slower.
    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        check()
    finally:
        torch.set_num_threads(threads)
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = omp


def check():
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    worker = os.path.join(os.environ["LOOM_BINARY_DIR"], "bin", "loom_grpo_parity_worker")
    failures = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        base_run, base_hf = os.path.join(tmp, "base_run"), os.path.join(tmp, "base_hf")
        loom(*TRAIN, "--job.dump_folder", base_run, "--training.steps", "1", "--checkpoint.enable", "true",
             "--checkpoint.model_only", "true", "--checkpoint.interval", "1000")
        loom("convert", "--input", os.path.join(base_run, "checkpoint"), "--output", base_hf, "--to", "hf")
        adapter_dir = os.path.join(tmp, "adapter")
        start = get_peft_model(LlamaForCausalLM.from_pretrained(base_hf),
                               LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                                          lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"))
        with torch.no_grad():  # B small enough that the adapted model stays near its base
            for n, p in start.named_parameters():
                if "lora_B" in n:
                    p.mul_(0.05)
        start.save_pretrained(adapter_dir)
        print(f"base (loom train + convert) and starting adapters: {time.monotonic() - started:.1f} s")
        start.eval()
        rollouts = make_rollouts(start, torch.Generator().manual_seed(1))
        rollouts_file = os.path.join(tmp, "rollouts.json")
        with open(rollouts_file, "w") as f:
            json.dump(rollouts, f)

        for name, rl, optimizer, schedule, max_norm in CASES:
            config = os.path.join(tmp, f"{name}.toml")
            write_config(config, base_hf, rl, optimizer, schedule, max_norm)
            out = os.path.join(tmp, f"{name}.safetensors")
            proc = subprocess.run([worker, config, rollouts_file, adapter_dir, out], capture_output=True, text=True)
            if proc.returncode != 0:
                failures.append(f"{name}: loom_grpo_parity_worker failed: {proc.stderr.strip()}")
                continue
            got = load_file(out)
            print(f"{name}: loom worker done at {time.monotonic() - started:.1f} s")
            expected, final = reference_run(base_hf, adapter_dir, rollouts, rl, optimizer, schedule, max_norm)
            for u, e in enumerate(expected):
                loss, norm, lr = got[f"{u}.loss"].item(), got[f"{u}.grad_norm"].item(), got[f"{u}.lr"].item()
                grads = {k[len(f"{u}.grad."):]: v for k, v in got.items() if k.startswith(f"{u}.grad.")}
                if sorted(grads) != sorted(e["grads"]):
                    failures.append(f"{name} update {u}: gradient names differ: {sorted(set(grads) ^ set(e['grads']))[:4]}")
                    continue
                worst = max((grads[k] - e["grads"][k]).abs().max().item() for k in grads)
                largest = max(g.abs().max().item() for g in grads.values())
                print(f"{name} update {u}: loss loom {loss:.8f} torch {e['loss']:.8f}, grad norm loom {norm:.6f} "
                      f"torch {e['grad_norm']:.6f} (max_norm {max_norm}), lr {lr:.2e}/{e['lr']:.2e}, "
                      f"ratio clipped {e['clip_share']:.2f}, {len(grads)} gradients: max |diff| {worst:.2e} "
                      f"(max |grad| {largest:.2e})")
                if abs(loss - e["loss"]) > TOLERANCE:
                    failures.append(f"{name} update {u}: loss {loss} vs {e['loss']}")
                if abs(norm - e["grad_norm"]) > TOLERANCE:
                    failures.append(f"{name} update {u}: grad norm {norm} vs {e['grad_norm']}")
                if abs(lr - e["lr"]) > 1e-12:
                    failures.append(f"{name} update {u}: lr {lr} vs {e['lr']}")
                if worst > TOLERANCE:
                    failures.append(f"{name} update {u}: gradients differ by {worst:.3e}")
                if e["grad_norm"] <= max_norm:
                    failures.append(f"{name} update {u}: grad norm {e['grad_norm']} <= max_norm {max_norm}: no clipping")
            if all(e["clip_share"] == 0 for e in expected):
                failures.append(f"{name}: the ratio was never clipped")
            worst = max((got[f"final.{k}"] - v).abs().max().item() for k, v in final.items())
            moved = max((final[k] - v).abs().max().item() for k, v in load_file(
                os.path.join(adapter_dir, "adapter_model.safetensors")).items())
            print(f"{name}: adapters after {len(expected)} updates: max |loom - torch| {worst:.2e} "
                  f"(moved by up to {moved:.2e})")
            if worst > ADAPTER_TOLERANCE:
                failures.append(f"{name}: adapters after the updates differ by {worst:.3e}")

    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print(f"GRPO/PyTorch+peft parity: all checks passed ({time.monotonic() - started:.1f} s)")


if __name__ == "__main__":
    main()
