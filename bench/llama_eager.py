"""PyTorch eager reference trainer for the Loom throughput benchmark.

Trains the same Llama 3 architecture as Loom (RMSNorm, RoPE, GQA through SDPA, SwiGLU, untied
head) in plain PyTorch eager, fp32, AdamW, on random tokens, and prints one JSON line with the
measured tokens/s. Used by bench/train_vs_eager.py; not a product path.
"""
import argparse
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(head_dim, seq_len, theta):
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    t = torch.arange(seq_len).float()
    ang = torch.outer(t, freqs)
    return ang.cos(), ang.sin()


def apply_rope(x, cos, sin):
    # x: [B, T, H, D], rotate-half convention (as HF Llama).
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    c = cos[None, :, None, :]
    s = sin[None, :, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class Attention(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.nh, self.nkv = a.n_heads, a.n_kv_heads
        self.hd = a.dim // a.n_heads
        self.wq = nn.Linear(a.dim, self.nh * self.hd, bias=False)
        self.wk = nn.Linear(a.dim, self.nkv * self.hd, bias=False)
        self.wv = nn.Linear(a.dim, self.nkv * self.hd, bias=False)
        self.wo = nn.Linear(self.nh * self.hd, a.dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        # Head counts from the projections' outputs (-1), as TorchTitan: under tensor parallelism
        # (bench/tp_llama.py) wq/wk/wv are colwise-sharded and a rank holds n_heads/tp query and
        # n_kv_heads/tp kv heads; in one process -1 is n_heads / n_kv_heads, so nothing changes.
        q = apply_rope(self.wq(x).view(b, t, -1, self.hd), cos, sin)
        k = apply_rope(self.wk(x).view(b, t, -1, self.hd), cos, sin)
        v = self.wv(x).view(b, t, -1, self.hd)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.attention = Attention(a)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        self.feed_forward = FeedForward(a.dim, a.ffn_hidden)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
        cos, sin = rope_tables(a.dim // a.n_heads, a.seq_len, a.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        t = tokens.shape[1]
        for layer in self.layers:
            h = layer(h, self.cos[:t], self.sin[:t])
        return self.output(self.norm(h))


def ffn_hidden(dim, multiple_of, multiplier):
    hidden = int(2 * (4 * dim) / 3)
    if multiplier:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def add_model_args(p):
    """The ~124M Llama 3 shape of bench/llama3_124m.toml; shared with fsdp2_llama.py."""
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--n-layers", type=int, default=12)
    p.add_argument("--n-heads", type=int, default=12)
    p.add_argument("--n-kv-heads", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--multiple-of", type=int, default=256)
    p.add_argument("--ffn-dim-multiplier", type=float, default=0.0)
    p.add_argument("--seq-len", type=int, default=256)


def main():
    p = argparse.ArgumentParser()
    add_model_args(p)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-4)
    a = p.parse_args()
    a.norm_eps, a.rope_theta = 1e-5, 500000.0
    a.ffn_hidden = ffn_hidden(a.dim, a.multiple_of, a.ffn_dim_multiplier)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = Transformer(a)
    # foreach (multi-tensor) AdamW: PyTorch's fastest eager CPU path; fused=True is CPU-supported too.
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1, fused=True)
    g = torch.Generator().manual_seed(1)
    times = []
    for step in range(a.warmup + a.steps):
        tokens = torch.randint(0, a.vocab_size, (a.batch, a.seq_len + 1), generator=g)
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        if step >= a.warmup:
            times.append(dt)
    tokens_per_step = a.batch * a.seq_len
    n_params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"impl": "pytorch_eager", "tps": tokens_per_step * len(times) / sum(times),
                      "step_s": sum(times) / len(times), "params": n_params, "loss": loss.item()}))


if __name__ == "__main__":
    main()
