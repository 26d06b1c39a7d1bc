"""Loom's Muon against Python references.

1. Newton-Schulz: Keller Jordan's zeropower_via_newtonschulz5 (github.com/KellerJordan/Muon),
   written out below in float32 (the original runs in bfloat16 on GPUs; Loom iterates in float32),
   on random wide, tall and square matrices and on an ill-conditioned one: within 1e-5.
2. Muon steps: torch.optim.Muon (PyTorch's implementation: lerp momentum, Nesterov, decoupled
   weight decay, "match_rms_adamw" and "original" lr adjustment) for 3 steps, with its bfloat16
   Newton-Schulz swapped for the float32 one so that both sides round alike: within 1e-5.
   torch.optim.Muon keeps B' = (1 - mu) B (lerp) where Loom keeps B = mu B + G as Moonlight does;
   the two directions differ only by the factor (1 - mu), which the normalisation inside
   Newton-Schulz removes.

Loom's side is build/bin/loom_muon_reference (tests/parity/muon_worker.cpp).
"""
import os
import subprocess
import sys
import tempfile

import torch
import torch.optim._muon as torch_muon
from safetensors.torch import load_file, save_file

TOLERANCE = 1e-5


def zeropower_via_newtonschulz5(G, steps=5, eps=1e-7):
    """Keller Jordan's quintic Newton-Schulz iteration, in float32."""
    assert G.ndim == 2
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.float()
    if G.size(0) > G.size(1):
        X = X.T
    X = X / (X.norm() + eps)
    for _ in range(steps):
        A = X @ X.T
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(0) > G.size(1):
        X = X.T
    return X


def float32_newtonschulz(grad, ns_coefficients, ns_steps, eps):
    assert tuple(ns_coefficients) == (3.4445, -4.7750, 2.0315)
    return zeropower_via_newtonschulz5(grad, ns_steps, eps)


def loom_reference(tmp, tensors, lr, weight_decay, momentum, nesterov, adjust):
    src, dst = os.path.join(tmp, "in.safetensors"), os.path.join(tmp, "out.safetensors")
    save_file({k: v.contiguous() for k, v in tensors.items()}, src)
    tool = os.path.join(os.environ["LOOM_BINARY_DIR"], "bin", "loom_muon_reference")
    proc = subprocess.run([tool, src, dst, repr(lr), repr(weight_decay), repr(momentum),
                           "1" if nesterov else "0", adjust], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"loom_muon_reference failed ({proc.returncode}): {proc.stderr.strip()}")
    return load_file(dst)


def main():
    failures = []
    g = torch.Generator().manual_seed(0)
    inputs = {f"x.{r}x{c}": torch.randn(r, c, generator=g) for r, c in [(64, 128), (128, 64), (96, 96), (256, 768)]}
    u, _ = torch.linalg.qr(torch.randn(64, 64, generator=g))
    v, _ = torch.linalg.qr(torch.randn(128, 64, generator=g))
    inputs["x.ill_conditioned"] = u @ torch.diag(torch.logspace(0, -4, 64)) @ v.T
    with tempfile.TemporaryDirectory() as tmp:
        out = loom_reference(tmp, inputs, 0.02, 0.1, 0.95, True, "match_rms_adamw")
        for name, x in inputs.items():
            key = "ns." + name[2:]
            diff = (out[key] - zeropower_via_newtonschulz5(x)).abs().max().item()
            print(f"Newton-Schulz {name[2:]:>16}: max |Loom - Python| = {diff:.2e}")
            if diff > TOLERANCE:
                failures.append(f"Newton-Schulz of {name[2:]} differs by {diff:.2e} > {TOLERANCE}")

        torch_muon._zeropower_via_newtonschulz = float32_newtonschulz
        for shape in [(48, 80), (80, 48)]:
            for nesterov in (True, False):
                for adjust in ("match_rms_adamw", "original"):
                    lr, wd, mu = 0.02, 0.1, 0.95
                    param = torch.randn(*shape, generator=g)
                    grads = [torch.randn(*shape, generator=g) for _ in range(3)]
                    tensors = {"param": param, **{f"grad.{i}": gr for i, gr in enumerate(grads)}}
                    got = loom_reference(tmp, tensors, lr, wd, mu, nesterov, adjust)["param"]
                    p = torch.nn.Parameter(param.clone())
                    opt = torch.optim.Muon([p], lr=lr, weight_decay=wd, momentum=mu, nesterov=nesterov,
                                           adjust_lr_fn=adjust)
                    for gr in grads:
                        p.grad = gr.clone()
                        opt.step()
                    diff = (got - p.detach()).abs().max().item()
                    moved = (p.detach() - param).abs().max().item()
                    print(f"3 Muon steps {shape[0]}x{shape[1]} nesterov={nesterov!s:5} {adjust:>15}: "
                          f"max |Loom - torch.optim.Muon| = {diff:.2e} (parameters moved up to {moved:.2e})")
                    if diff > TOLERANCE:
                        failures.append(f"Muon steps {shape} nesterov={nesterov} {adjust} differ by {diff:.2e}")
    if failures:
        sys.exit("\n".join(failures))
    print("ok")


if __name__ == "__main__":
    main()
