"""PyTorch FSDP2 reference trainer for the Loom FSDP benchmark (bench/fsdp_vs_fsdp2.py).

Trains the Llama 3 model of bench/llama_eager.py with `torch.distributed.fsdp.fully_shard` applied
as TorchTitan's apply_fsdp does (each transformer block, then the root; "default" reshard policy:
every block but the last reshards after forward, and FSDP2 keeps the root gathered), on CPU over
Gloo, fp32, AdamW, with the same data, initialisation, LR schedule and clipping as `loom train`:

- data: the JSONL corpus tokenized with the same tokenizer.json (HF `tokenizers`), packed as Loom's
  loader packs it (BOS + document + EOS, concatenated, cut into rows of seq_len + 1; global step g,
  rank r takes rows [g*B*W + r*B, g*B*W + (r+1)*B)), so both trainers see the same batches;
- init: TorchTitan's Llama 3 init as Loom's `parameter_init` (embedding N(0, 1), norms 1, wq/wk/wv/w1
  truncated N(0, 0.02), wo/w2/w3 depth-scaled, output truncated N(0, 1/sqrt(dim)) at 3 std);
- RoPE with Llama 3.1 frequency scaling (factor 8, low 1, high 4, original context 8192);
- AdamW (betas 0.9/0.95, eps 1e-8, weight decay on matrices only), linear warmup then linear decay.

Launch with torchrun (one process per rank); rank 0 prints one JSON line: mean step time after
warm-up (and each step's), tokens/s (all ranks and per rank), the loss of every step (mean over ranks), and per rank
the peak RSS during training (VmHWM reset at the first step, as `loom train` does for
`mem_peak_gib`), the peak before training, and the RSS when training starts.

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 bench/fsdp2_llama.py \
        --steps 8 --warmup 2
Not a product path.
"""
import argparse
import json
import math
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_eager import Transformer, add_model_args, ffn_hidden  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def status_kib(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/self/status")


def reset_peak_rss():
    # Same mechanism as loom::memory::reset_peak_rss: VmHWM restarts from the current RSS.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def scaled_rope_tables(head_dim, seq_len, theta, factor=8.0, low=1.0, high=4.0, old_context=8192):
    # Llama 3.1 RoPE frequency scaling, as Loom applies it for every flavor with use_scaled_rope.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    inv_freq = torch.where(medium, smoothed, scaled)
    ang = torch.outer(torch.arange(seq_len).float(), inv_freq)
    return ang.cos(), ang.sin()


@torch.no_grad()
def init_weights(model, a):
    # TorchTitan's Llama 3 init (depth_init), the same distributions as Loom's parameter_init.
    std = 0.02
    for name, p in model.named_parameters():
        if name == "tok_embeddings.weight":
            torch.nn.init.normal_(p, std=1.0)
        elif name.endswith("norm.weight"):
            torch.nn.init.ones_(p)
        elif name == "output.weight":
            s = a.dim ** -0.5
            torch.nn.init.trunc_normal_(p, std=s, a=-3 * s, b=3 * s)
        else:
            layer_id = int(name.split(".")[1])
            if name.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight")):
                torch.nn.init.trunc_normal_(p, std=std, a=-2.0, b=2.0)
            elif name.endswith(("wo.weight", "w2.weight", "w3.weight")):
                torch.nn.init.trunc_normal_(p, std=std / math.sqrt(2 * (layer_id + 1)), a=-2.0, b=2.0)
            else:
                raise ValueError(f"no Llama 3 initializer for parameter {name!r}")


def packed_stream(tokenizer_path, dataset_path):
    # BOS d0 ... EOS BOS d1 ... EOS ..., as loom::data::TokenCorpus packs a JSONL corpus.
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(tokenizer_path)
    bos, eos = tok.token_to_id("<|begin_of_text|>"), tok.token_to_id("<|end_of_text|>")
    if bos is None or eos is None:
        sys.exit(f"error: {tokenizer_path} has no <|begin_of_text|>/<|end_of_text|> tokens; "
                 "use the Loom tokenizer the benchmark config names")
    with open(dataset_path) as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    stream = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        stream.append(bos)
        stream.extend(enc.ids)
        stream.append(eos)
    return torch.tensor(stream, dtype=torch.int64)


def lr_factor(k, warmup, steps):
    # Loom's linear_warmup_stable_decay with decay over all post-warmup steps, min factor 0;
    # k is the 1-based training step.
    warmup = min(warmup, steps)
    if k <= warmup:
        return k / warmup
    decay = steps - warmup
    return 1.0 - (k - warmup - 1) / decay


def apply_fsdp(model):
    # TorchTitan's apply_fsdp with reshard_after_forward_policy = "default" and no PP: the last
    # block stays gathered (its backward starts right after forward), the root is sharded last.
    n = len(model.layers)
    for i, block in enumerate(model.layers):
        fully_shard(block, reshard_after_forward=i < n - 1)
    fully_shard(model)


def build_model_and_optimizer(a, rank, parallelize):
    """Builds the model on the meta device, applies `parallelize(model)`, materialises and
    initialises only the local shards (each rank from its own generator: DTensor's random ops are
    CUDA-only), fills the RoPE tables, and makes AdamW with weight decay on matrices only.
    Returns (model, optimizer, "fused" | "foreach"). Shared with tp_llama.py."""
    with torch.device("meta"):
        model = Transformer(a)
    parallelize(model)
    model.to_empty(device="cpu")
    torch.manual_seed(rank)
    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
    init_weights(model, a)
    cos, sin = scaled_rope_tables(a.dim // a.n_heads, a.seq_len, a.rope_theta)
    with torch.no_grad():
        model.cos.copy_(cos)
        model.sin.copy_(sin)

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    try:
        return model, torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=True), "fused"
    except (RuntimeError, ValueError):
        return model, torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95), eps=1e-8, foreach=True), "foreach"


def main():
    p = argparse.ArgumentParser()
    add_model_args(p)
    p.add_argument("--batch", type=int, default=2, help="local batch (sequences per rank)")
    p.add_argument("--steps", type=int, default=8, help="timed steps after warm-up")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per rank (0: cores / ranks)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--lr-warmup-steps", type=int, default=2)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--tokenizer", default=os.path.join(ROOT, "data/default/tokenizer.json"))
    p.add_argument("--dataset", default=os.path.join(ROOT, "data/default/corpus.jsonl"))
    a = p.parse_args()
    if "RANK" not in os.environ:
        sys.exit("error: fsdp2_llama.py runs one process per rank; launch it with "
                 "`python -m torch.distributed.run --standalone --nproc-per-node N bench/fsdp2_llama.py`")
    for path in (a.tokenizer, a.dataset):
        if not os.path.isfile(path):
            sys.exit(f"error: {path} does not exist; run `make setup` (scripts/make_default_data.sh) "
                     "or pass --tokenizer/--dataset")
    a.norm_eps, a.rope_theta = 1e-5, 500000.0
    a.ffn_hidden = ffn_hidden(a.dim, a.multiple_of, a.ffn_dim_multiplier)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    threads = a.threads or max(1, len(os.sched_getaffinity(0)) // local_world)
    torch.set_num_threads(threads)

    stream = packed_stream(a.tokenizer, a.dataset)
    row = a.seq_len + 1
    n_rows = stream.numel() // row
    rows = stream[: n_rows * row].view(n_rows, row)

    # As TorchTitan: build on the meta device, shard, then materialise and initialise only the local
    # shards, so no rank ever holds the whole model (Loom materialises per shard too). DTensor's
    # random ops are CUDA-only, so on CPU each rank draws its shards from its own generator; the
    # per-rank seed keeps the two halves of a matrix from being identical copies.
    model, opt, impl = build_model_and_optimizer(a, rank, apply_fsdp)

    total = a.warmup + a.steps
    peak_before_kib = status_kib("VmHWM")
    rss_start_kib = status_kib("VmRSS")
    reset_peak_rss()
    times, losses = [], []
    for step in range(1, total + 1):
        t0 = time.perf_counter()
        g = step - 1
        start = (g * a.batch * world + rank * a.batch) % n_rows
        batch = rows[torch.arange(start, start + a.batch) % n_rows]
        for grp in opt.param_groups:
            grp["lr"] = a.lr * lr_factor(step, a.lr_warmup_steps, total)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        # DTensor gradients: the norm is a Partial-summed DTensor; clip with the global norm.
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.max_norm, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        # The mean loss over ranks, as Loom logs it (one small all-reduce per step in both).
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / world)
        dt = time.perf_counter() - t0
        if step > a.warmup:
            times.append(dt)

    stats = {"rank": rank, "peak_train_kib": status_kib("VmHWM"), "peak_before_train_kib": peak_before_kib,
             "rss_train_start_kib": rss_start_kib}
    all_stats = [None] * world
    dist.all_gather_object(all_stats, stats)
    if rank == 0:
        step_s = sum(times) / len(times)
        tokens = a.batch * a.seq_len
        print(json.dumps({"impl": "pytorch_fsdp2", "world": world, "threads": threads, "adamw": impl,
                          "step_s": step_s, "step_times": times, "tps_per_rank": tokens / step_s, "tps": world * tokens / step_s,
                          "params": sum(p.numel() for p in model.parameters()), "losses": losses,
                          "ranks": all_stats}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
