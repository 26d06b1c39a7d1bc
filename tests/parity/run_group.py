#!/usr/bin/env python3
"""Runs several parity scripts (tests/parity/test_*.py) in one interpreter, one after another.

Each script is run as its own __main__ (runpy), exactly as `python test_x.py` would run it; a
script passes when it ends without an exception and with exit code 0 or None. One interpreter per
group rather than per script: importing torch and transformers takes ~5 s on the CI machine, most of
what a short parity script costs. Prints one line per script (passed / FAILED, seconds) and exits 1
when any failed. The scripts stay runnable alone: `python tests/parity/test_hf_qwen3_parity.py`
with LOOM_BIN set.

Usage: run_group.py SCRIPT...
"""
import os
import runpy
import sys
import time
import traceback


def run_script(path: str) -> bool:
    saved_argv = sys.argv
    sys.argv = [path]
    try:
        runpy.run_path(path, run_name="__main__")
        return True
    except SystemExit as e:
        if e.code in (None, 0):
            return True
        if not isinstance(e.code, int):
            print(e.code, file=sys.stderr)  # sys.exit("message") prints its message
        return False
    except BaseException:  # noqa: BLE001 - any failure of the script is its failure
        traceback.print_exc()
        return False
    finally:
        sys.argv = saved_argv
        sys.stdout.flush()
        sys.stderr.flush()


def main() -> int:
    scripts = sys.argv[1:]
    if not scripts:
        print("usage: run_group.py SCRIPT...", file=sys.stderr)
        return 2
    # The scripts import their helpers (loom_parity, test_hf_llama_parity) from their own folder.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    failed = []
    for path in scripts:
        name = os.path.basename(path)
        print(f"=== {name}", flush=True)
        start = time.time()
        ok = run_script(path)
        print(f"=== {name}: {'passed' if ok else 'FAILED'} ({time.time() - start:.1f} s)", flush=True)
        if not ok:
            failed.append(name)
    print(f"{len(scripts) - len(failed)} of {len(scripts)} parity scripts passed"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
