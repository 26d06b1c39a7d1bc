"""TensorBoard event files from `loom train` read back by TensorBoard's own readers (issue 14).

A short 2-rank FSDP run with metrics.enable_tensorboard = true writes
<dump_folder>/tb/<YYYYmmdd-HHMMSS>/events.out.tfevents.*. TensorBoard's EventAccumulator must
return, for every key of every metrics.jsonl row (step excluded; null values have no point), the
same step and exactly the float32 of the JSON value (what TensorBoard stores for simple_value),
and no other tag; the raw records (RawEventFileLoader: TFRecord framing and CRCs checked by
TensorBoard's reader) start with the file_version event. The run also prints the end-of-run
summary and writes loss.svg.
"""
import glob
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
from tensorboard.compat.proto import event_pb2


def main():
    src = os.environ["LOOM_SOURCE_DIR"]
    loom = os.environ["LOOM_BIN"]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        dump = os.path.join(tmp, "run")
        cmd = [loom, "launch", "--nproc", "2", "--", "train",
               "--config", os.path.join(src, "configs/llama3_debug.toml"), "--validation.enable=false",
               f"--model.tokenizer_path={src}/data/default/tokenizer.json",
               f"--training.dataset_path={src}/data/default/corpus.jsonl",
               f"--job.dump_folder={dump}", "--training.steps=7", "--training.seq_len=64",
               "--training.local_batch_size=2", "--metrics.log_freq=2",
               "--metrics.enable_tensorboard=true"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            sys.exit(f"loom train failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")

        rows = []
        with open(os.path.join(dump, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        if [r["step"] for r in rows] != [1, 2, 4, 6, 7]:
            failures.append(f"logged steps {[r['step'] for r in rows]}, expected 1, 2, 4, 6, 7")

        files = glob.glob(os.path.join(dump, "tb", "*", "events.out.tfevents.*"))
        if len(files) != 1:
            sys.exit(f"expected one event file under {dump}/tb/<run>/, found {files}")
        run_dir = os.path.dirname(files[0])

        acc = event_accumulator.EventAccumulator(run_dir, size_guidance={event_accumulator.SCALARS: 0})
        acc.Reload()
        expected = {}  # tag -> {step: float32 value}
        for r in rows:
            for key, value in r.items():
                if key != "step" and value is not None:
                    expected.setdefault(key, {})[r["step"]] = np.float32(value)
        for key in ("loss", "grad_norm", "lr", "tps", "mfu", "mem_peak_gib", "comm_bytes",
                    "comm_bytes/dp_shard"):
            if key not in expected:
                failures.append(f"metrics.jsonl has no {key}")
        tags = sorted(acc.Tags()["scalars"])
        if tags != sorted(expected):
            failures.append(f"TensorBoard tags {tags} != metrics.jsonl keys {sorted(expected)}")
        checked = 0
        for tag, by_step in expected.items():
            if tag not in tags:
                continue
            events = acc.Scalars(tag)
            got = {e.step: e.value for e in events}
            if sorted(got) != sorted(by_step):
                failures.append(f"{tag}: TensorBoard steps {sorted(got)} != {sorted(by_step)}")
            for step, want in by_step.items():
                # TensorBoard hands simple_value back as a Python float made from the stored float32.
                if step in got and np.float32(got[step]) != want:
                    failures.append(f"{tag} at step {step}: TensorBoard {got[step]!r} != float32 {want!r}")
                checked += 1
            if any(not (1.6e9 < e.wall_time < 4.1e9) for e in events):
                failures.append(f"{tag}: wall_time is not a plausible Unix time")

        records = [event_pb2.Event.FromString(raw) for raw in RawEventFileLoader(files[0]).Load()]
        if not records or records[0].file_version != "brain.Event:2":
            failures.append("the first record is not the file_version event 'brain.Event:2'")
        if len(records) != 1 + len(rows):
            failures.append(f"{len(records)} records, expected 1 + {len(rows)} logged steps")

        out = proc.stdout
        for text in ("run summary: steps 1-7 of 7", "tensorboard --logdir " + os.path.join(dump, "tb"),
                     "plot:         " + os.path.join(dump, "loss.svg"), "[step 7/7 · "):
            if text not in out:
                failures.append(f"the output lacks {text!r}")
        if "loom generate --checkpoint" in out:
            failures.append("the summary offers loom generate on a run that saved no checkpoint")
        if not os.path.getsize(os.path.join(dump, "loss.svg")):
            failures.append("loss.svg is missing or empty")

    if failures:
        print("\n".join(failures))
        print("--- loom output ---\n" + proc.stdout + proc.stderr)
        sys.exit(1)
    print(f"ok: {checked} scalars over {len(expected)} tags equal metrics.jsonl's float32 values")


if __name__ == "__main__":
    main()
