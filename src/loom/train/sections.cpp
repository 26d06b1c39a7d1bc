#include "loom/train/sections.h"

#include "loom/nn/fused.h"

#include <cmath>

namespace loom::train {

const options::EnumNames<StepReadback>& option_names(StepReadback) {
  static const options::EnumNames<StepReadback> names = {
      {"auto", StepReadback::kAuto}, {"every_step", StepReadback::kEveryStep}, {"log_steps", StepReadback::kLogSteps}};
  return names;
}

namespace {

void check_job(const JobSection& j) {
  options::require(!j.dump_folder.empty(), job_section(), "dump_folder", "a non-empty path", &j);
}

void check_training(const TrainingSection& t) {
  const options::Section& s = training_section();
  nn::parse_cuda_kernels(t.cuda_kernels);  // a usage error naming an unknown kernel
  options::require(t.local_batch_size > 0, s, "local_batch_size", "> 0", &t);
  options::require(t.global_batch_size == -1 || (t.global_batch_size > 0 && t.global_batch_size % t.local_batch_size == 0),
                   s, "global_batch_size",
                   c10::str("-1 or a positive multiple of training.local_batch_size (", t.local_batch_size, ")"), &t);
  options::require(t.seq_len > 0, s, "seq_len", "> 0", &t);
  options::require(t.max_norm >= 0.0, s, "max_norm", ">= 0 (0 = no clipping)", &t);
  options::require(t.steps > 0, s, "steps", "> 0", &t);
  options::require(t.skip_nonfinite_steps >= 0, s, "skip_nonfinite_steps", ">= 0", &t);
  options::require(t.data_workers >= 0, s, "data_workers", ">= 0 (0 = the rank's intra-op threads)", &t);
  // A mixture's weights, before any rank starts (TokenCorpus::mix checks them again).
  double total = 0.0;
  for (size_t i = 0; i < t.datasets.size(); ++i) {
    const data::DatasetSource& d = t.datasets[i];
    LOOM_REQUIRE_USAGE(!d.path.empty(), "training.datasets[", i, "] has no path; give each [[training.datasets]] entry ",
                       "a path (a file, a directory or a glob)");
    LOOM_REQUIRE_USAGE(std::isfinite(d.weight) && d.weight >= 0.0, "training.datasets[", i, "].weight = ",
                       options::format_double(d.weight), " (", d.path,
                       ") must be a finite number >= 0; a source's share is weight / sum of weights");
    LOOM_REQUIRE_USAGE(d.format != data::DatasetFormat::kSft, "training.datasets[", i,
                       "].format = \"sft\" is not supported in a mixture; train sft data through training.dataset_path");
    total += d.weight;
  }
  LOOM_REQUIRE_USAGE(t.datasets.empty() || total > 0.0, "every [[training.datasets]] weight is 0; give at least one ",
                     "source a weight above 0");
}

void check_metrics(const MetricsSection& m) {
  const options::Section& s = metrics_section();
  options::require(m.log_freq > 0, s, "log_freq", "> 0", &m);
  options::require(m.peak_flops >= 0.0, s, "peak_flops", ">= 0 (0 = measure)", &m);
}

void check_validation(const ValidationSection& v) {
  if (!v.enable) return;
  const options::Section& s = validation_section();
  // Whether the file can be read is checked when it is loaded (as training.dataset_path is), so
  // a config with relative paths can be read from anywhere.
  LOOM_REQUIRE_USAGE(!v.dataset_path.empty(), "validation.enable = true needs held-out data, but "
                     "validation.dataset_path is empty; point it at a file (e.g. "
                     "data/default/validation.jsonl) or set validation.enable = false");
  options::require(v.freq > 0, s, "freq", "> 0", &v);
  options::require(v.steps == -1 || v.steps > 0, s, "steps", "> 0, or -1 (the whole file once)", &v);
  options::require(v.local_batch_size >= 0, s, "local_batch_size", ">= 0 (0 = training.local_batch_size)", &v);
  options::require(v.seq_len >= 0, s, "seq_len", ">= 0 (0 = training.seq_len)", &v);
}

}  // namespace

const options::Section& job_section() {
  using S = JobSection;
  static const options::Section section{
      "job",
      {
          {LOOM_OPTION(S, dump_folder),
           "Folder for this run's outputs: `config.toml`, `metrics.jsonl`, `loss.svg`, checkpoints, "
           "`tb/` (TensorBoard). Created if missing."},
          {LOOM_OPTION(S, description), "Free-text description of the job."},
          {LOOM_OPTION(S, print_config), "Print the resolved config (as TOML) at startup."},
      },
      {},
      {},
      &options::validate_as<S, check_job>};
  return section;
}

const options::Section& training_section() {
  using S = TrainingSection;
  static const options::Section section{
      "training",
      {
          {LOOM_OPTION(S, dataset_path),
           "Training data: a file, a directory (every non-hidden regular file below it, sorted) or a glob. "
           "A FIFO, device or socket is refused (reading one could block forever)."},
          {LOOM_OPTION(S, dataset_format),
           "How every data file is read, whatever its name: `jsonl`: one `{\"text\": ...}` object per"
           " line; `text`: plain UTF-8, one document per file; `tokens`: a token file written by "
           "`loom tokenizer pretokenize`; `sft`: supervised fine-tuning data, one `{\"prompt\": ..., "
           "\"completion\": ...}` or `{\"messages\": [...]}` object per line, rendered with "
           "`sft.chat_template`, the loss on completion and assistant tokens only (docs/lora.md; not "
           "kept in the token cache); `parquet`: Parquet files, each value of the `training.text_column` column a document, read a "
           "row group at a time; `arrow`: Arrow IPC files, such as a `datasets` cache's `data-*.arrow` "
           "shards, likewise (a directory read as `parquet`/`arrow` contributes its `*.parquet`/`*.arrow` "
           "files only); `auto`: guess each file's format (token, Parquet and Arrow files by their "
           "magic, `.jsonl`/`.ndjson` as JSONL, anything else as text; never `sft`). A token file under "
           "`jsonl`/`text`/`sft`, or any other file under `tokens`, is an error naming the file. Token ids "
           "are checked against the model's vocabulary at load."},
          {LOOM_OPTION(S, jsonl_field), "The JSONL field holding each document's text."},
          {LOOM_OPTION(S, text_column),
           "The Parquet/Arrow column holding each document's text (a string column; null values are "
           "skipped). A file without it is an error listing its columns."},
          {LOOM_OPTION(S, datasets),
           "A weighted mixture of sources, as `[[training.datasets]]` tables (`path`, `format`, "
           "`weight`, `text_column`); when given it replaces `dataset_path`/`dataset_format`. The "
           "sources are interleaved document by document, each within about one document of its "
           "share `weight / sum`, in an order fixed by `training.seed`; an epoch lasts until every "
           "source has given each of its documents once (a source weighted above its size repeats). "
           "The loader's checkpoint records each source's position. See docs/data.md."},
          {LOOM_OPTION(S, data_workers),
           "Threads that tokenize text while the data is loaded (documents stay in input order); "
           "`0` = the rank's intra-op threads."},
          {LOOM_OPTION(S, token_cache),
           "Tokenize each text or JSONL file once: its tokens are kept as a token file in "
           "`$LOOM_CACHE_DIR/tokens` (else `$XDG_CACHE_HOME/loom/tokens`, else `~/.cache/loom/tokens`), "
           "named by the file's and the tokenizer's contents, and later runs (every rank, any layout, "
           "validation too) memory-map it instead of tokenizing again. A changed file or tokenizer gets "
           "a new entry; delete the folder to reclaim the space. `false`: tokenize at every start."},
          {LOOM_OPTION(S, local_batch_size), "Sequences per rank per micro-batch."},
          {LOOM_OPTION(S, global_batch_size),
           "Sequences per optimizer step over all ranks. `-1` = `local_batch_size x` data-parallel "
           "degree. Otherwise it must be a multiple of `local_batch_size x dp` and the trainer "
           "accumulates gradients over `global / (local x dp)` micro-batches."},
          {LOOM_OPTION(S, seq_len), "Tokens per sequence."},
          {LOOM_OPTION(S, max_norm),
           "Gradients are clipped to this global 2-norm (over all shards); `0` = no clipping (the norm is still "
           "computed and logged), as in TorchTitan."},
          {LOOM_OPTION(S, steps), "Optimizer steps to run."},
          {LOOM_OPTION(S, seed), "Seed for parameter initialization and data order."},
          {LOOM_OPTION(S, deterministic),
           "Use deterministic algorithms: the same seed and layout give bitwise-identical losses."},
          {LOOM_OPTION(S, mixed_precision_param),
           "Dtype parameters are gathered and computed in; master weights, gradients and optimizer "
           "state stay float32. With FSDP the parameters are cast to it when gathered; without FSDP "
           "(one device, or DDP) the forward runs under autocast in this dtype (matmuls and attention"
           " in bfloat16, norms, softmax and the loss in float32), as TorchTitan does. TorchTitan "
           "defaults to bfloat16; on CPUs without fast bf16 GEMMs float32 is much faster."},
          {LOOM_OPTION(S, mixed_precision_reduce),
           "Dtype gradients are reduced (all-reduce / reduce-scatter) in. `bfloat16` needs FSDP: "
           "without it the gradients are the float32 master weights' own, and `bfloat16` is a "
           "one-line error."},
          {LOOM_OPTION(S, skip_nonfinite_steps),
           "A step whose loss or gradient norm is NaN/inf is skipped (no optimizer or LR-schedule "
           "step) up to this many times per run. Past that, or with `0`, training stops with one line"
           " naming the step and the first parameter with a non-finite gradient, exit code 3 (`loom "
           "launch` does not restart it), before the bad update reaches the weights or any "
           "checkpoint."},
          {LOOM_OPTION(S, device),
           "Device each rank computes on: `auto` = the rank's GPU (`cuda:LOCAL_RANK`) when CUDA is "
           "usable, else the CPU. `cuda` without a usable GPU, or with a libtorch built without CUDA, "
           "is a one-line error (exit 2). Each rank uses its own GPU; collectives on device tensors go "
           "through NCCL (Gloo carries host-side values). The default is `cpu`; on CUDA the model, its "
           "buffers, FSDP's flat buffers, gradients, optimizer state and every batch live on the device."},
          {LOOM_OPTION(S, allow_tf32),
           "Let float32 matmuls and convolutions on CUDA use TF32 tensor cores (PyTorch's "
           "`allow_tf32`): several times faster float32 GEMMs whose inputs are rounded to a 10-bit "
           "mantissa. No effect on the CPU or in bfloat16."},
          {LOOM_OPTION(S, cuda_kernels),
           "Loom's own CUDA kernels used on a CUDA device: `all`, `none`, or a comma-separated list of "
           "`swiglu`, `rms_norm`, `rope`, `cross_entropy` (the fused classifier: softmax, loss and "
           "logit gradient in one pass per chunk), `adamw` (the fused AdamW update of float32 "
           "parameters, in place of `at::_fused_adamw_`), `add_rms_norm` (a block's residual add fused "
           "into the norm after it, forward and backward). A kernel left out runs its ATen composition "
           "instead; bench/gpu_vs_pytorch.py --ablation measures each. No effect on the CPU."},
          {LOOM_OPTION(S, step_readback),
           "When the host reads a step's loss and gradient norm. `every_step`: after the backward, "
           "before the optimizer step (the device idles while the host decides). `log_steps`: only at "
           "log steps, all pending steps in one copy; clipping and the non-finite guard run inside the "
           "fused AdamW update on the device (a skipped step changes no weight or optimizer state, but "
           "the LR schedule advances, as with torch.amp's GradScaler; the first non-finite gradient is "
           "not named). Needs `optimizer.name = \"AdamW\"`. `auto`: `log_steps` on a GPU with AdamW, "
           "else `every_step`."},
      },
      {},
      {},
      &options::validate_as<S, check_training>};
  return section;
}

const options::Section& metrics_section() {
  using S = MetricsSection;
  static const options::Section section{
      "metrics",
      {
          {LOOM_OPTION(S, log_freq), "Log every this many steps."},
          {LOOM_OPTION(S, enable_jsonl), "Write `metrics.jsonl`."},
          {LOOM_OPTION(S, enable_tensorboard),
           "Rank 0 also writes TensorBoard event files (`events.out.tfevents.*`) to "
           "`<dump_folder>/tb/<YYYYmmdd-HHMMSS>/`, one folder per fresh run (a resumed run continues the "
           "newest): the scalars of `metrics.jsonl`, same keys and steps, as float32. View with "
           "`tensorboard --logdir <dump_folder>/tb`."},
          {LOOM_OPTION(S, memory_breakdown),
           "Split each step's peak memory per rank into parameters, gradients, optimizer state, "
           "activations, buffers in flight (FSDP's unsharded buffers) and other, by watching c10's "
           "allocator: printed once after the first step and written with every logged step "
           "(`mem_params_gib`, `mem_grads_gib`, `mem_optimizer_gib`, `mem_activations_gib`, "
           "`mem_buffers_gib`, `mem_other_gib`, `mem_step_peak_gib`); see docs/memory.md. Off while "
           "`profiling.enable_profiling` records (both use c10's one memory-reporting slot)."},
          {LOOM_OPTION(S, peak_flops),
           "Peak FLOP/s per rank that MFU is measured against. `0` = on the CPU, measure this "
           "machine's fp32 GEMM peak at startup (best rate of 1024x1024 matmuls for ~0.3 s at the "
           "rank's thread count); on a GPU, its dense bf16 peak from the data-sheet table in "
           "`core/device.cpp` (H100 SXM 989e12, A100 312e12, ...), and no MFU (with a warning) for a "
           "GPU the table does not know. Set it to compare runs across machines."},
      },
      R"md(Every `log_freq` steps rank 0 prints one line (step, loss, grad_norm, lr, tokens/s, MFU %,
peak memory) and appends one JSON object to `<dump_folder>/metrics.jsonl` with the keys `step`,
`loss`, `grad_norm`, `lr`, `tps` (tokens/s per rank), `mfu` (percent), `mem_peak_gib` (peak
resident memory of the rank since the previous log; on a GPU, the peak allocated by the CUDA
caching allocator), plus extra keys: `comm_bytes` (bytes sent per step) and `comm_bytes/<dim>`
(the same per mesh dim that carried traffic: `dp_shard`, `tp`, `cp`, ...), `comm_exposed_s` (the
seconds per step the training thread blocked waiting for collectives: the communication compute did
not hide; on a GPU only host-side waits, NCCL's stream waits are not counted), `comm_exposed_pct`
(its share of the step) and `comm_exposed_s/<dim>`, and on a GPU
`mem_reserved_gib` (held by the caching allocator) and `mem_peak_pct` (peak as a percentage of the
device's memory). Each line is flushed when written; NaN/inf are written as `null` (and an MFU that
cannot be computed prints as `n/a`). The console line starts with the step, the time since training
started and an ETA (`[step 120/400 · 1m32s · eta 3m35s]`: the mean time of the last 100 steps, the
first step of the process excluded as warm-up, times the steps left); on a terminal a line with the
latest step and loss is redrawn in place between log steps. At the end rank 0 prints a summary
(steps, tokens, wall time, mean tokens/s and MFU, first/last/best loss, peak memory, where the run's
files are, commands to try next) and, when `enable_jsonl` is on, draws `<dump_folder>/loss.svg` from
`metrics.jsonl` (what `loom plot` draws: loss, learning rate and tokens/s against step).)md",
      {},
      &options::validate_as<S, check_metrics>};
  return section;
}

const options::Section& validation_section() {
  using S = ValidationSection;
  static const options::Section section{
      "validation",
      {
          {LOOM_OPTION(S, enable), "Evaluate the loss on held-out data every `freq` steps and at the last step."},
          {LOOM_OPTION(S, dataset_path),
           "The held-out data: a file, directory or glob in any format `training.dataset_path` takes "
           "(`data/default/validation.jsonl` is the default corpus's held-out set)."},
          {LOOM_OPTION(S, dataset_format),
           "Format of `dataset_path` (the formats of `training.dataset_format`); `auto` guesses it from each "
           "file. `sft` data is scored on its trained tokens only, rendered as `[sft]` says."},
          {LOOM_OPTION(S, freq), "Evaluate every this many steps, and at the last step."},
          {LOOM_OPTION(S, steps),
           "Batches per evaluation (each `local_batch_size` rows on every data-parallel rank), always "
           "from the first held-out row, capped at one pass over the file; `-1` = the whole file once."},
          {LOOM_OPTION(S, local_batch_size), "Rows per data-parallel rank per batch; `0` = `training.local_batch_size`."},
          {LOOM_OPTION(S, seq_len),
           "Tokens per row; `0` = `training.seq_len` (a larger value is refused: the model's position "
           "tables cover `training.seq_len`)."},
      },
      {},
      {},
      &options::validate_as<S, check_validation>};
  return section;
}

}  // namespace loom::train
