"""PyTorch tensor-parallel reference trainer for the Loom TP benchmark (bench/tp_vs_pytorch_tp.py).

Trains the Llama 3 model of bench/llama_eager.py with PyTorch's own tensor parallelism
(`torch.distributed.tensor.parallel.parallelize_module`) on a 1-D DeviceMesh("cpu", [0, ..., t-1])
over Gloo, with TorchTitan's Llama plan (apply_tp with sequence and loss parallelism on):

- tok_embeddings: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1));
- norm: SequenceParallel(); output: ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
  use_local_output=False), the loss computed under `loss_parallel()` (logits never gathered);
- per block: attention_norm / ffn_norm SequenceParallel(); attention and feed_forward
  PrepareModuleInput(Shard(1) -> Replicate(), use_local_output=True); wq/wk/wv/w1/w3
  ColwiseParallel(); wo/w2 RowwiseParallel(output_layouts=Shard(1)).
  llama_eager's Attention reshapes with -1 heads, so a rank runs its n_heads/t query and
  n_kv_heads/t kv heads as TorchTitan does.

Everything else is bench/fsdp2_llama.py's (imported from it, so the two references cannot drift):
Loom's data packing (every TP rank takes the same global batch: step g uses rows
[g*B, (g+1)*B) with B the global batch, as `loom train` with data-parallel degree 1), TorchTitan's
Llama 3 init distributions (each rank draws its shards from its own generator: DTensor's random ops
are CUDA-only, so on CPU the shards are not slices of one global draw, as they are in Loom), Llama
3.1-scaled RoPE, AdamW (0.9/0.95, eps 1e-8, decay on matrices only), linear warmup then linear
decay, clipping at the global norm, fp32.

Tokens/s follow Loom's (and TorchTitan's) convention: tokens per step per rank divided by the TP
degree (the TP ranks share one batch), i.e. `tps_per_rank` = B*seq / t / step_s and `tps` (all
ranks) = B*seq / step_s, the global batch's tokens per second.

Launch with torchrun, one process per rank; rank 0 prints one JSON line: the step times after
warm-up, tokens/s, the loss and gradient norm of every step, and per rank the peak RSS during
training (VmHWM reset at the first step), the peak before training and the RSS when training starts.

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 bench/tp_llama.py \
        --steps 6 --warmup 2 --batch 4 --threads 1
Not a product path.
"""
import argparse
import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp2_llama import (build_model_and_optimizer, lr_factor, packed_stream, reset_peak_rss,  # noqa: E402
                         status_kib)
from llama_eager import add_model_args, ffn_hidden  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def apply_tp(model, mesh):
    # TorchTitan's apply_tp (torchtitan/models/llama3/infra/parallelize.py) with
    # enable_float8_tensorwise_tp off and loss_parallel on.
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.layers:
        parallelize_module(block, mesh, {
            "attention_norm": SequenceParallel(),
            # Our Attention.forward(x, cos, sin): only x is redistributed.
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None),
                                            use_local_output=True),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                               use_local_output=True),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })


def main():
    p = argparse.ArgumentParser()
    add_model_args(p)
    p.add_argument("--batch", type=int, default=4, help="global batch (sequences per step, shared by the TP ranks)")
    p.add_argument("--steps", type=int, default=6, help="timed steps after warm-up")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per rank (0: cores / ranks)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--lr-warmup-steps", type=int, default=2)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--tokenizer", default=os.path.join(ROOT, "data/default/tokenizer.json"))
    p.add_argument("--dataset", default=os.path.join(ROOT, "data/default/corpus.jsonl"))
    p.add_argument("--count-comms", action="store_true",
                   help="run the first step under DTensor's CommDebugMode and report its collectives")
    a = p.parse_args()
    if "RANK" not in os.environ:
        sys.exit("error: tp_llama.py runs one process per rank; launch it with "
                 "`python -m torch.distributed.run --standalone --nproc-per-node N bench/tp_llama.py`")
    for path in (a.tokenizer, a.dataset):
        if not os.path.isfile(path):
            sys.exit(f"error: {path} does not exist; run `make setup` (scripts/make_default_data.sh) "
                     "or pass --tokenizer/--dataset")
    a.norm_eps, a.rope_theta = 1e-5, 500000.0
    a.ffn_hidden = ffn_hidden(a.dim, a.multiple_of, a.ffn_dim_multiplier)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for what, n in (("n_heads", a.n_heads), ("n_kv_heads", a.n_kv_heads), ("ffn hidden", a.ffn_hidden),
                    ("vocab_size", a.vocab_size), ("seq_len", a.seq_len)):
        if n % world:
            sys.exit(f"error: TP degree {world} does not divide {what} = {n}")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    threads = a.threads or max(1, len(os.sched_getaffinity(0)) // local_world)
    torch.set_num_threads(threads)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))

    stream = packed_stream(a.tokenizer, a.dataset)
    row = a.seq_len + 1
    n_rows = stream.numel() // row
    rows = stream[: n_rows * row].view(n_rows, row)

    # As TorchTitan: build on the meta device, parallelize, then materialise and initialise only the
    # local shards. Replicated parameters (the norms) are initialised to ones, so they agree.
    model, opt, impl = build_model_and_optimizer(a, rank, lambda m: apply_tp(m, mesh))

    total = a.warmup + a.steps
    peak_before_kib = status_kib("VmHWM")
    rss_start_kib = status_kib("VmRSS")
    reset_peak_rss()
    times, losses, grad_norms, comm_counts = [], [], [], None
    for step in range(1, total + 1):
        t0 = time.perf_counter()
        g = step - 1
        start = (g * a.batch) % n_rows
        batch = rows[torch.arange(start, start + a.batch) % n_rows]
        for grp in opt.param_groups:
            grp["lr"] = a.lr * lr_factor(step, a.lr_warmup_steps, total)
        counting = a.count_comms and step == 1
        with CommDebugMode() if counting else contextlib.nullcontext() as comm_mode:
            with loss_parallel():
                logits = model(batch[:, :-1])  # DTensor [B, T, V], Shard(-1)
                loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
                loss.backward()
            # Mixed Shard / Replicate DTensor gradients: the total norm is a DTensor; clip with the
            # global norm as TorchTitan's clip_grad_norm_ does.
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), a.max_norm, norm, foreach=True)
            opt.step()
        if counting:
            comm_counts = {str(k).split(".")[-1]: v for k, v in comm_mode.get_comm_counts().items()}
        opt.zero_grad(set_to_none=True)
        # Every TP rank holds the same (replicated) loss; no collective needed to log it.
        lv = loss.full_tensor() if isinstance(loss, DTensor) else loss
        losses.append(lv.item())
        grad_norms.append(norm.item())
        dt = time.perf_counter() - t0
        if step > a.warmup:
            times.append(dt)

    # The replicated parameters (the SP norms) must stay equal on every rank: their gradients are
    # summed over the TP ranks. A checksum of each rank's copies shows it.
    with torch.no_grad():
        replicated = sum(float(p.to_local().double().sum()) for p in model.parameters()
                         if isinstance(p, DTensor) and all(isinstance(pl, Replicate) for pl in p.placements))
    stats = {"rank": rank, "peak_train_kib": status_kib("VmHWM"), "peak_before_train_kib": peak_before_kib,
             "rss_train_start_kib": rss_start_kib, "replicated_checksum": replicated}
    all_stats = [None] * world
    dist.all_gather_object(all_stats, stats)
    if rank == 0:
        step_s = sum(times) / len(times)
        tokens = a.batch * a.seq_len  # the global batch, shared by the TP ranks
        print(json.dumps({"impl": "pytorch_tp", "tp": world, "threads": threads, "adamw": impl,
                          "step_s": step_s, "step_times": times, "tps_per_rank": tokens / world / step_s,
                          "tps": tokens / step_s,
                          "params": sum(p.numel() for p in model.parameters()),  # global (DTensor) sizes
                          "losses": losses, "grad_norms": grad_norms, "ranks": all_stats,
                          **({"comm_counts_step1": comm_counts} if a.count_comms else {})}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
