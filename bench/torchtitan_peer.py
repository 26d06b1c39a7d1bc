"""One TorchTitan 0.3.0 training run on one device, as the peer of bench/torchtitan_vs_loom.py.

TorchTitan is driven from Python, not through its CLI, so that the run uses exactly the shapes,
batch and data of the Loom run it is compared with:

- the model is one of TorchTitan's own registry entries (llama3 "1B", qwen3 "30B-A3B"), its layer
  list cut to --layers when asked (the MoE shape that fits one GPU), the 1B's output head untied
  as Loom's 1B flavor has it;
- the data is Loom's default corpus (data/default/corpus.jsonl) tokenized with its tokenizer
  (the tokenizers package), documents joined with EOS and cut into windows of seq_len + 1, each
  row one window: what Loom's loader feeds, so the two losses fall alike (random tokens would
  leave both at ln(vocab));
- single device: bf16 autocast over fp32 master weights and AdamW (TorchTitan's
  training.mixed_precision_param on one device), clipping at 1.0, no activation checkpointing, no
  checkpoint or validation; --compile turns on torch.compile of the model and loss, --float8 the
  rowwise Float8 converters (linears; with --moe-float8 the grouped experts too: TorchTitan's
  recipe needs torchao).

Tokens/s is the mean over the steps after --warmup, timed between two device synchronisations
(no synchronisation inside the timed steps); peak memory is torch.cuda.max_memory_allocated.
Prints one JSON line: {"impl", "tps", "step_s", "mem_gib", "loss", "losses", "params",
"active_params", "flops_per_token"}.

Usage (the GPU machine, TorchTitan's wheels unpacked on PYTHONPATH: scripts/gpu_check.sh does it):
    python3 bench/torchtitan_peer.py --model llama3_1B --seq-len 2048 --batch 4 --steps 20 [--compile]
On a machine without CUDA the script builds the trainer and runs one forward on the CPU
(--cpu-smoke; TorchTitan 0.3.0's flex attention has no CPU backward), which checks the plumbing:
configs, data, shapes.
"""
import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass

os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_patches():
    """TorchTitan assumes an accelerator; on the CPU its device helpers point at torch.cpu."""
    import torchtitan.tools.utils as utils

    # Before any module that copies these names at import.
    utils.device_type, utils.device_module = "cpu", torch.cpu
    import torchtitan.components.metrics as metrics

    class CpuMemory:
        device_name, device_capacity, device_capacity_gib = "cpu", 0, 0

        def get_peak_stats(self):
            return metrics.DeviceMemStats(0, 0, 0, 0, 0, 0)

        def reset_peak_stats(self):
            pass

    metrics.build_device_memory_monitor = lambda: CpuMemory()


def corpus_tokens(corpus, tokenizer_path, need):
    """At least `need` token ids of the corpus (documents joined with EOS, repeated if short)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    eos = None
    for name in ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"):
        eos = tok.token_to_id(name)
        if eos is not None:
            break
    ids = []
    with open(corpus) as f:
        docs = [json.loads(line)["text"] for line in f if line.strip()]
    while len(ids) < need:
        for d in docs:
            ids.extend(tok.encode(d, add_special_tokens=False).ids)
            if eos is not None:
                ids.append(eos)
            if len(ids) >= need:
                break
    return torch.tensor(ids[:need], dtype=torch.int64)


def make_loader_class():
    from torchtitan.components.dataloader import BaseDataLoader

    class CorpusWindows(BaseDataLoader):
        """Rows of seq_len + 1 consecutive corpus tokens; positions 0..seq_len-1 (one causal span)."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            tokens_file: str = ""

        def __init__(self, config, *, dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=2048,
                     local_batch_size=1, **_):
            self.tokens = torch.load(config.tokens_file)
            self.seq_len, self.batch, self.cursor = seq_len, local_batch_size, 0

        def __iter__(self):
            window = self.seq_len + 1
            while True:
                rows = []
                for _ in range(self.batch):
                    if self.cursor + window > self.tokens.numel():
                        self.cursor = 0
                    rows.append(self.tokens[self.cursor:self.cursor + window])
                    self.cursor += window
                x = torch.stack(rows)
                positions = torch.arange(self.seq_len).unsqueeze(0).expand(self.batch, -1).contiguous()
                yield {"input": x[:, :-1], "positions": positions}, x[:, 1:]

        def state_dict(self):
            return {"cursor": self.cursor}

        def load_state_dict(self, state):
            self.cursor = state["cursor"]

    return CorpusWindows


def build_config(args, tokens_file, tok_dir, dump):
    from torchtitan.trainer import Trainer  # noqa: F401  (registers the config classes)

    converters = []
    if args.float8:
        from torchtitan.components.quantization.float8 import (Float8GroupedExpertsConverter,
                                                                Float8LinearConverter)
        converters.append(Float8LinearConverter.Config(recipe_name="rowwise",
                                                       model_compile_enabled=args.compile))
        if args.moe_float8:
            converters.append(Float8GroupedExpertsConverter.Config())
    if args.model == "llama3_1B":
        from torchtitan.models.llama3 import model_registry
        from torchtitan.models.llama3.config_registry import llama3_8b as base
        cfg = base()
        cfg.model_spec = model_registry("1B", converters=converters or None)
        cfg.model_spec.model.enable_weight_tying = False  # Loom's 1B flavor has its own output head
    elif args.model == "llama3_debugmodel":
        from torchtitan.models.llama3 import model_registry
        from torchtitan.models.llama3.config_registry import llama3_8b as base
        cfg = base()
        cfg.model_spec = model_registry("debugmodel", converters=converters or None)
    elif args.model == "qwen3_30b_a3b":
        from torchtitan.models.qwen3 import model_registry
        from torchtitan.models.qwen3.config_registry import qwen3_30b_a3b as base
        cfg = base()
        cfg.model_spec = model_registry("30B-A3B", converters=converters or None)
    else:
        raise SystemExit(f"unknown --model {args.model}")
    model = cfg.model_spec.model
    if args.layers:
        if args.layers > len(model.layers):
            raise SystemExit(f"--layers {args.layers}: the model has {len(model.layers)}")
        model.layers = model.layers[:args.layers]
    cfg.hf_assets_path = tok_dir
    cfg.dump_folder = dump
    cfg.dataloader = make_loader_class().Config(tokens_file=tokens_file)
    cfg.training.seq_len, cfg.training.local_batch_size = args.seq_len, args.batch
    cfg.training.steps, cfg.training.max_norm = args.warmup + args.steps, 1.0
    cfg.training.dtype, cfg.training.mixed_precision_param = "float32", "bfloat16"
    cfg.parallelism.data_parallel_shard_degree = 1
    cfg.parallelism.data_parallel_replicate_degree = 1
    from torchtitan.components.optimizer.optimizer import default_adamw
    cfg.optimizer = default_adamw(lr=3e-4)  # betas (0.9, 0.95), weight decay 0.1: Loom's defaults
    cfg.lr_scheduler.warmup_steps = 2
    cfg.activation_checkpoint = None
    cfg.checkpoint.enable = False
    cfg.validator.enable = False
    cfg.profiler.enable_profiling = False
    cfg.metrics.enable_tensorboard = False
    cfg.metrics.log_freq = 1_000_000  # no per-step host reads inside the timed window
    cfg.compile.enable = args.compile
    return cfg


def count_params(model):
    """(all parameters, active per token) of the built model: routed experts count top_k / n_experts
    (read from the router), shared experts and everything else in full."""
    share = 1.0
    for module in model.modules():
        if hasattr(module, "top_k") and hasattr(module, "num_experts"):
            share = module.top_k / module.num_experts
            break
    total, active = 0, 0.0
    for name, p in model.named_parameters():
        total += p.numel()
        active += p.numel() * (share if "routed_experts" in name else 1.0)
    return total, int(active)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3_1B",
                   choices=["llama3_1B", "llama3_debugmodel", "qwen3_30b_a3b"])
    p.add_argument("--layers", type=int, default=0, help="keep the first N layers (0: all)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--float8", action="store_true", help="rowwise Float8 linears")
    p.add_argument("--moe-float8", action="store_true", help="and Float8 grouped experts")
    p.add_argument("--corpus", default=os.path.join(ROOT, "data/default/corpus.jsonl"))
    p.add_argument("--tokenizer", default=os.path.join(ROOT, "data/default/tokenizer.json"))
    p.add_argument("--cpu-smoke", action="store_true",
                   help="no CUDA: build the trainer and run one forward (plumbing check)")
    p.add_argument("--label", default="")
    args = p.parse_args()

    import tempfile

    if args.cpu_smoke or not torch.cuda.is_available():
        if not args.cpu_smoke:
            raise SystemExit("torchtitan_peer.py: no CUDA device; pass --cpu-smoke for the plumbing check")
        cpu_patches()
    import torchtitan

    work = tempfile.mkdtemp(prefix="tt_peer_")
    tok_dir = os.path.join(work, "tokenizer")
    os.makedirs(tok_dir)
    with open(args.tokenizer) as src, open(os.path.join(tok_dir, "tokenizer.json"), "w") as dst:
        dst.write(src.read())
    need = (args.warmup + args.steps + 2) * args.batch * (args.seq_len + 1)
    tokens_file = os.path.join(work, "tokens.pt")
    torch.save(corpus_tokens(args.corpus, args.tokenizer, need), tokens_file)
    cfg = build_config(args, tokens_file, tok_dir, os.path.join(work, "dump"))
    trainer = cfg.build()
    model = trainer.model_parts[0]
    total, active = count_params(model)
    embedding = sum(p.numel() for n, p in model.named_parameters() if "tok_embeddings" in n)
    mcfg = cfg.model_spec.model
    layers = len(mcfg.layers)
    attn = mcfg.layers[0].attention
    n_heads = attn.n_heads
    head_dim = attn.head_dim or (mcfg.dim // n_heads)
    # TorchTitan's count (get_dense_model_nparams_and_flops / the MoE variant): 6 N_active + 12 L H d T.
    fpt = 6 * (active - embedding) + 12 * layers * n_heads * head_dim * args.seq_len

    if args.cpu_smoke:
        inputs, labels = next(iter(trainer.dataloader))
        inputs, labels, extra = trainer.post_dataloading_process(inputs, labels)
        with torch.no_grad():
            out = model(inputs, **extra)
            # The chunked loss applies the output head itself (the model returns hidden states).
            loss, _ = trainer.loss_fn(out, labels, torch.tensor(float(labels.numel())),
                                      positions=extra["positions"])
        print(json.dumps({"impl": "torchtitan " + torchtitan.__version__ + " (cpu smoke: one forward)",
                          "loss": loss.item(), "params": total, "active_params": active,
                          "flops_per_token": fpt, "output": list(out.shape)}), flush=True)
        return

    # Timing: wrap train_step; synchronise once before the first timed step and once after the last.
    device = trainer.device
    marks, losses = {}, []
    original_step = trainer.train_step
    original_fb = trainer.forward_backward_step

    def forward_backward_step(*a, **kw):
        loss = original_fb(*a, **kw)
        losses.append(loss.detach())
        return loss

    def train_step(*a, **kw):
        step = trainer.step  # incremented before train_step is called
        if step == args.warmup + 1:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            marks["t0"] = time.perf_counter()
        out = original_step(*a, **kw)
        if step == args.warmup + args.steps:
            torch.cuda.synchronize(device)
            marks["t1"] = time.perf_counter()
        return out

    trainer.forward_backward_step = forward_backward_step
    trainer.train_step = train_step
    torch.cuda.reset_peak_memory_stats(device)
    trainer.train()
    step_s = (marks["t1"] - marks["t0"]) / args.steps
    tokens = args.batch * args.seq_len
    values = [float(x) for x in losses]
    name = args.label or ("torchtitan " + torchtitan.__version__ + (" + compile" if args.compile else "")
                          + (" + float8" if args.float8 else ""))
    print(json.dumps({"impl": name, "tps": tokens / step_s, "step_s": step_s,
                      "mem_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                      "loss": values[-1] if values else float("nan"), "losses": values,
                      "params": total, "active_params": active, "flops_per_token": fpt}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
