"""Loom's Float8 linear (CPU emulation) against a PyTorch reference written from torchao's recipe
definitions: forward y = x W^T and backward dx = dy W, dW = dy^T x, each operand quantized along the
GEMM's contracted dim (rowwise: per-row scales rounded down to powers of 2, e4m3 everywhere;
tensorwise: one scale per tensor, e5m2 for dy), dequantized and multiplied in float64. Loom's
results must agree within 1e-6 of each result's largest element. Exits non-zero on a mismatch.
"""
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def qdq(t, dtype, rowwise):
    """Quantize-dequantize a 2-D tensor contracting its last dim, as float64."""
    fmax = torch.finfo(dtype).max
    t = t.float()
    amax = t.abs().amax(dim=1, keepdim=True) if rowwise else t.abs().max()
    scale = (fmax / amax.double().clamp(min=1e-12)).float()
    if rowwise:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    q = (t * scale).clamp(-fmax, fmax).to(dtype)
    return q.double() / scale.double()


def reference(x, w, dy, recipe):
    rowwise = recipe == "rowwise"
    grad = E4M3 if rowwise else E5M2
    y = qdq(x, E4M3, rowwise) @ qdq(w, E4M3, rowwise).T
    dx = qdq(dy, grad, rowwise) @ qdq(w.T.contiguous(), E4M3, rowwise).T
    dw = qdq(dy.T.contiguous(), grad, rowwise) @ qdq(x.T.contiguous(), E4M3, rowwise).T
    return {"y": y, "dx": dx, "dw": dw}


def main():
    worker = os.path.join(os.environ["LOOM_BINARY_DIR"], "bin", "loom_float8_parity_worker")
    gen = torch.Generator().manual_seed(5)
    m, k, n = 64, 96, 48
    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 2, m).unsqueeze(1)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-2, 1, n).unsqueeze(1)
    dy = torch.randn(m, n, generator=gen) * torch.logspace(-6, -1, m).unsqueeze(1)
    x[3] = 0
    w[5] = 0
    x[1, 2] = 900.0
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        inputs = os.path.join(tmp, "in.safetensors")
        save_file({"x": x, "w": w, "dy": dy}, inputs)
        for recipe in ("rowwise", "tensorwise"):
            out = os.path.join(tmp, f"{recipe}.safetensors")
            proc = subprocess.run([worker, inputs, out, recipe], capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"{worker} failed ({proc.returncode}): {proc.stderr.strip()}")
            got = load_file(out)
            want = reference(x, w, dy, recipe)
            for name in ("y", "dx", "dw"):
                err = ((got[name].double() - want[name]).abs().max() / want[name].abs().max()).item()
                print(f"{recipe} {name}: max |loom - reference| / max |reference| = {err:.3g}")
                if not err <= 1e-6:
                    failures.append(f"{recipe} {name}: {err:.3g}")
    if failures:
        sys.exit("mismatch: " + "; ".join(failures))
    print("ok")


if __name__ == "__main__":
    main()
