"""`loom plot` output rendered by a real browser (issue 14): headless Chromium screenshots the SVG
of two overlaid runs and the picture must not be blank: it has dark pixels (axes, ticks, text) and
pixels of both runs' colours (the legend and the curves). Exits 77 (skipped) where Chromium is not
installed; scripts/setup.sh installs it (Debian's `chromium`).
"""
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
from PIL import Image

# The first two colours of the plot's cycle (src/loom/train/plot.cpp).
RUN_COLOURS = {"run_a": (0x1F, 0x77, 0xB4), "run_b": (0xFF, 0x7F, 0x0E)}


def write_run(folder, steps, scale):
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for s in steps:
            f.write(json.dumps({"step": s, "loss": scale * (2 + 6 * math.exp(-s / 40)), "grad_norm": 1.0,
                                "lr": 1e-3 * min(1.0, s / 10), "tps": 5000 + 10 * s, "mfu": 1.0,
                                "mem_peak_gib": 0.5, "comm_bytes": 1e6}) + "\n")


def main():
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print("skipped: chromium is not installed (scripts/setup.sh installs Debian's chromium)")
        sys.exit(77)
    with tempfile.TemporaryDirectory() as tmp:
        write_run(os.path.join(tmp, "run_a"), range(1, 201, 10), 1.0)
        write_run(os.path.join(tmp, "run_b"), range(1, 151, 10), 1.1)
        svg = os.path.join(tmp, "compare.svg")
        proc = subprocess.run([os.environ["LOOM_BIN"], "plot", os.path.join(tmp, "run_a"),
                               os.path.join(tmp, "run_b"), "--out", svg], capture_output=True, text=True)
        if proc.returncode != 0 or "wrote" not in proc.stdout:
            sys.exit(f"loom plot failed ({proc.returncode}): {proc.stdout}{proc.stderr}")
        png = os.path.join(tmp, "shot.png")
        # --no-sandbox: set-up and CI run as root, where Chromium's sandbox refuses to start.
        shot = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                               f"--user-data-dir={os.path.join(tmp, 'profile')}", "--window-size=960,1000",
                               f"--screenshot={png}", "file://" + svg],
                              capture_output=True, text=True, timeout=120)
        if not os.path.exists(png):
            sys.exit(f"chromium wrote no screenshot ({shot.returncode}): {shot.stderr[-2000:]}")
        pixels = np.asarray(Image.open(png).convert("RGB"), dtype=np.int32)  # height x width x 3
    height, width = pixels.shape[:2]
    failures = []
    if (width, height) != (960, 1000):
        failures.append(f"screenshot is {width}x{height}, expected 960x1000")
    dark = int((pixels.max(axis=2) < 100).sum())
    not_white = int((pixels.min(axis=2) < 250).sum())
    if dark < 1000:
        failures.append(f"only {dark} dark pixels: no axes or text rendered")
    if not_white < 0.01 * width * height:
        failures.append(f"only {not_white} of {width * height} pixels are not white: blank")
    for run, colour in RUN_COLOURS.items():
        near = int((np.abs(pixels - np.array(colour)).max(axis=2) <= 24).sum())
        if near < 200:
            failures.append(f"{run}'s colour #{bytes(colour).hex()} is on only {near} pixels")
        else:
            print(f"{run}: {near} pixels of its colour")
    if failures:
        sys.exit("\n".join(failures))
    print(f"ok: {width}x{height} screenshot, {not_white} non-white pixels, {dark} dark")


if __name__ == "__main__":
    main()
