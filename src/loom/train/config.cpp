#include "loom/train/config.h"

#include "loom/train/compatibility.h"

#include "loom/nn/fused.h"

#include <toml++/toml.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <unordered_map>

#include "loom/core/error.h"
#include "loom/models/spec.h"

namespace loom::train {
namespace {

template <auto Section, auto Member>
ConfigField bind(JobConfig& config) {
  return &((config.*Section).*Member);
}

// Expands to the first three ConfigKey fields: section name, key name, field binding.
#define LOOM_CONFIG_KEY(section, key) \
  #section, #key, &bind<&JobConfig::section, &decltype(JobConfig::section)::key>

const std::vector<ConfigKey> kSchema = {
    // [job]
    {LOOM_CONFIG_KEY(job, dump_folder),
     "Folder for this run's outputs: `config.toml`, `metrics.jsonl`, `loss.svg`, checkpoints, "
     "`tb/` (TensorBoard). Created if missing.", {}},
    {LOOM_CONFIG_KEY(job, description),
     "Free-text description of the job.", {}},
    {LOOM_CONFIG_KEY(job, print_config),
     "Print the resolved config (as TOML) at startup.", {}},
    // [model]
    {LOOM_CONFIG_KEY(model, name),
     "Model family to train.", models::spec_names()},
    {LOOM_CONFIG_KEY(model, flavor),
     "Size within the family: `debugmodel`, `8B`, `70B`, `405B`, ... (the family's list of "
     "flavors decides what is valid).", {}},
    {LOOM_CONFIG_KEY(model, tokenizer_path),
     "Hugging Face `tokenizer.json` (byte-level BPE). `make train` creates the default one from"
     " the bundled corpus.", {}},
    {LOOM_CONFIG_KEY(model, vocab_size),
     "Rows of the token embedding and output projection; `0` = the tokenizer's vocabulary size."
     " A larger value pads the vocabulary (e.g. to a multiple of the TP degree).", {}},
    {LOOM_CONFIG_KEY(model, n_layers),
     "Transformer layers, overriding the flavor's (e.g. a deeper debug model to split into more "
     "pipeline stages); `0` = the flavor's.", {}},
    // [optimizer]
    {LOOM_CONFIG_KEY(model, attention_mask),
     "Which earlier tokens a token attends to. `causal`: every earlier token of its row. "
     "`block_causal`: only those of its own document (documents are packed into rows, each "
     "starting with BOS), TorchTitan's default for pre-training.", {"causal", "block_causal"}},
    {LOOM_CONFIG_KEY(optimizer, name),
     "Optimizer. AdamW follows `torch.optim.AdamW` exactly (bias correction, decoupled weight "
     "decay). AdamW8bit: the same update with both moments stored in 8 bits (bitsandbytes' "
     "block-wise dynamic quantization, one float32 scale per `block_size` elements; parameters "
     "under 4096 elements or not whole blocks keep float32 moments): about 2 bytes of state per "
     "parameter instead of 8. CPU only, not with tensor parallelism. Muon: every 2-D weight "
     "matrix except the token embedding and output head is updated with momentum orthogonalised "
     "by Newton-Schulz iterations (Moonlight's RMS-matched scaling, so it shares AdamW's `lr` and "
     "`weight_decay`); every other parameter with AdamW. Under FSDP each matrix lives whole on "
     "one rank. Not with tensor parallelism (docs/muon.md).",
     parallel::optimizer_names()},
    {LOOM_CONFIG_KEY(optimizer, lr),
     "Peak learning rate, reached at the end of warmup.", {}},
    {LOOM_CONFIG_KEY(optimizer, eps),
     "Added to the denominator `sqrt(v_hat)`.", {}},
    {LOOM_CONFIG_KEY(optimizer, beta1),
     "First-moment decay, in [0, 1).", {}},
    {LOOM_CONFIG_KEY(optimizer, beta2),
     "Second-moment decay, in [0, 1).", {}},
    {LOOM_CONFIG_KEY(optimizer, weight_decay),
     "Decoupled weight decay for every matrix, including the token embedding and output "
     "projection; 1-D parameters (norm scales) and biases get 0.", {}},
    {LOOM_CONFIG_KEY(optimizer, implementation),
     "`fused`: one vectorised kernel (`at::_fused_adamw_`) per parameter group and dtype, one "
     "pass over parameter, gradient and both moments (about 4x faster than foreach on CPU). "
     "`foreach`: the multi-tensor `at::_foreach_*` sequence of PyTorch's `foreach=True`. Both "
     "give the same result to float rounding.",
     {"fused", "foreach"}},
    {LOOM_CONFIG_KEY(optimizer, block_size),
     "AdamW8bit: elements per quantization block (one float32 scale per moment per block; "
     "bitsandbytes uses 256 for its CPU/paged and 2048 for its GPU optimizers). A multiple of the "
     "FSDP planner's alignment: 4 elements (16 bytes of float32), 8 under bfloat16 mixed "
     "precision. FSDP plans each quantized parameter in whole blocks, so no block is cut across "
     "ranks.", {}},
    {LOOM_CONFIG_KEY(optimizer, muon_momentum),
     "Muon: momentum `mu` of the buffer `B = mu B + G`, in [0, 1).", {}},
    {LOOM_CONFIG_KEY(optimizer, muon_nesterov),
     "Muon: orthogonalise the Nesterov direction `G + mu B` (true) or the buffer `B` (false).", {}},
    {LOOM_CONFIG_KEY(optimizer, muon_ns_steps),
     "Muon: Newton-Schulz iterations (quintic coefficients 3.4445, -4.7750, 2.0315), >= 1.", {}},
    {LOOM_CONFIG_KEY(optimizer, muon_adjust_lr),
     "Muon: the factor on the orthogonalised update of a rows x cols matrix. `match_rms_adamw`: "
     "`0.2 sqrt(max(rows, cols))` (Moonlight; the update's RMS matches AdamW's, so AdamW's lr "
     "and weight decay carry over). `original`: `sqrt(max(1, rows / cols))` (Keller Jordan's; "
     "needs a larger lr).",
     {"match_rms_adamw", "original"}},
    // [lr_scheduler]
    {LOOM_CONFIG_KEY(lr_scheduler, warmup_steps),
     "Linear warmup steps (shortened to `training.steps` if longer).", {}},
    {LOOM_CONFIG_KEY(lr_scheduler, decay_ratio),
     "Fraction of the steps spent decaying at the end, in [0, 1] (Warmup-Stable-Decay, "
     "arXiv:2404.06395). Unset, a negative value in TOML, or `none` on the command line = decay"
     " over all steps after warmup.",
     {}},
    {LOOM_CONFIG_KEY(lr_scheduler, decay_type),
     "Shape of the decay.",
     {"linear", "sqrt", "cosine"}},
    {LOOM_CONFIG_KEY(lr_scheduler, min_lr_factor),
     "The decay ends at `lr * min_lr_factor`, in [0, 1].", {}},
    // [training]
    {LOOM_CONFIG_KEY(training, dataset_path),
     "Training data: a file, a directory (every non-hidden regular file below it, sorted) or a glob. "
     "A FIFO, device or socket is refused (reading one could block forever).", {}},
    {LOOM_CONFIG_KEY(training, dataset_format),
     "How every data file is read, whatever its name: `jsonl`: one `{\"text\": ...}` object per"
     " line; `text`: plain UTF-8, one document per file; `tokens`: a token file written by "
     "`loom tokenizer pretokenize`; `auto`: guess each file's format (token files by their "
     "magic, `.jsonl`/`.ndjson` as JSONL, anything else as text). A token file under "
     "`jsonl`/`text`, or any other file under `tokens`, is an error naming the file. Token ids "
     "are checked against the model's vocabulary at load.",
     {"jsonl", "text", "tokens", "auto"}},
    {LOOM_CONFIG_KEY(training, jsonl_field),
     "The JSONL field holding each document's text.", {}},
    {LOOM_CONFIG_KEY(training, local_batch_size),
     "Sequences per rank per micro-batch.", {}},
    {LOOM_CONFIG_KEY(training, global_batch_size),
     "Sequences per optimizer step over all ranks. `-1` = `local_batch_size x` data-parallel "
     "degree. Otherwise it must be a multiple of `local_batch_size x dp` and the trainer "
     "accumulates gradients over `global / (local x dp)` micro-batches.",
     {}},
    {LOOM_CONFIG_KEY(training, seq_len),
     "Tokens per sequence.", {}},
    {LOOM_CONFIG_KEY(training, max_norm),
     "Gradients are clipped to this global 2-norm (over all shards), `> 0`.", {}},
    {LOOM_CONFIG_KEY(training, steps),
     "Optimizer steps to run.", {}},
    {LOOM_CONFIG_KEY(training, seed),
     "Seed for parameter initialization and data order.", {}},
    {LOOM_CONFIG_KEY(training, deterministic),
     "Use deterministic algorithms: the same seed and layout give bitwise-identical losses.", {}},
    {LOOM_CONFIG_KEY(training, mixed_precision_param),
     "Dtype parameters are gathered and computed in; master weights, gradients and optimizer "
     "state stay float32. With FSDP the parameters are cast to it when gathered; without FSDP "
     "(one device, or DDP) the forward runs under autocast in this dtype (matmuls and attention"
     " in bfloat16, norms, softmax and the loss in float32), as TorchTitan does. TorchTitan "
     "defaults to bfloat16; on CPUs without fast bf16 GEMMs float32 is much faster.",
     {"float32", "bfloat16"}},
    {LOOM_CONFIG_KEY(training, mixed_precision_reduce),
     "Dtype gradients are reduced (all-reduce / reduce-scatter) in. `bfloat16` needs FSDP: "
     "without it the gradients are the float32 master weights' own, and `bfloat16` is a "
     "one-line error.",
     {"float32", "bfloat16"}},
    {LOOM_CONFIG_KEY(training, skip_nonfinite_steps),
     "A step whose loss or gradient norm is NaN/inf is skipped (no optimizer or LR-schedule "
     "step) up to this many times per run. Past that, or with `0`, training stops with one line"
     " naming the step and the first parameter with a non-finite gradient, exit code 3 (`loom "
     "launch` does not restart it), before the bad update reaches the weights or any "
     "checkpoint.",
     {}},
    {LOOM_CONFIG_KEY(training, device),
     "Device each rank computes on: `auto` = the rank's GPU (`cuda:LOCAL_RANK`) when CUDA is "
     "usable, else the CPU. `cuda` without a usable GPU, or with a libtorch built without CUDA, "
     "is a one-line error (exit 2). Each rank uses its own GPU; collectives on device tensors go "
     "through NCCL (Gloo carries host-side values). The default is `cpu`; on CUDA the model, its "
     "buffers, FSDP's flat buffers, gradients, optimizer state and every batch live on the device.",
     {"auto", "cpu", "cuda"}},
    {LOOM_CONFIG_KEY(training, allow_tf32),
     "Let float32 matmuls and convolutions on CUDA use TF32 tensor cores (PyTorch's "
     "`allow_tf32`): several times faster float32 GEMMs whose inputs are rounded to a 10-bit "
     "mantissa. No effect on the CPU or in bfloat16.",
     {}},
    {LOOM_CONFIG_KEY(training, cuda_kernels),
     "Loom's own CUDA kernels used on a CUDA device: `all`, `none`, or a comma-separated list of "
     "`swiglu`, `rms_norm`, `rope`, `cross_entropy` (the fused classifier: softmax, loss and "
     "logit gradient in one pass per chunk), `adamw` (the fused AdamW update of float32 "
     "parameters, in place of `at::_fused_adamw_`). A kernel left out runs its ATen composition "
     "instead; bench/gpu_vs_pytorch.py --ablation measures each. No effect on the CPU.",
     {}},
    {LOOM_CONFIG_KEY(training, step_readback),
     "When the host reads a step's loss and gradient norm. `every_step`: after the backward, "
     "before the optimizer step (the device idles while the host decides). `log_steps`: only at "
     "log steps, all pending steps in one copy; clipping and the non-finite guard run inside the "
     "fused AdamW update on the device (a skipped step changes no weight or optimizer state, but "
     "the LR schedule advances, as with torch.amp's GradScaler; the first non-finite gradient is "
     "not named). Needs `optimizer.name = \"AdamW\"`. `auto`: `log_steps` on a GPU with AdamW, "
     "else `every_step`.",
     {"auto", "every_step", "log_steps"}},
    // [parallelism]
    {LOOM_CONFIG_KEY(parallelism, data_parallel_replicate_degree),
     "Replicated data-parallel ranks: DDP, or HSDP together with sharding.", {}},
    {LOOM_CONFIG_KEY(parallelism, data_parallel_shard_degree),
     "Sharded data-parallel ranks (FSDP); `-1` = the ranks left over by the other degrees.", {}},
    {LOOM_CONFIG_KEY(parallelism, fsdp_reshard_after_forward),
     "Whether FSDP frees gathered parameters after forward (re-gathering them in backward). "
     "`default`: all groups but the last (whose backward starts immediately); `always`; "
     "`never`; or a positive integer world size to reshard to (keeps a partially gathered "
     "copy).",
     {"default", "always", "never"}, /*integer_allowed=*/true},
    {LOOM_CONFIG_KEY(parallelism, tensor_parallel_degree),
     "Tensor-parallel ranks (Megatron-LM's scheme, TorchTitan's plan: attention heads, FFN hidden "
     "units and the vocabulary split over `t` neighbouring ranks; see docs/tensor_parallel.md). It "
     "must divide n_heads, n_kv_heads, the FFN hidden size and the vocabulary, and with sequence "
     "parallelism `training.seq_len`; a degree that does not is a one-line error listing the ones "
     "that would.", {}},
    {LOOM_CONFIG_KEY(parallelism, disable_sequence_parallel),
     "With tensor parallelism, keep the residual stream whole on every rank between blocks instead "
     "of splitting it along the sequence (norms then run on every token on every rank; the "
     "communication volume is the same).", {}},
    {LOOM_CONFIG_KEY(parallelism, disable_loss_parallel),
     "With tensor parallelism, gather the vocabulary-sharded logits for the loss instead of computing "
     "the cross-entropy on the shards (loss parallel, which never materializes the whole logits).", {}},
    {LOOM_CONFIG_KEY(parallelism, enable_async_tensor_parallel),
     "Overlap tensor parallelism's sequence all-gathers and reduce-scatters with the matmuls around "
     "them (collective matmuls: the transfer goes around the ring one sequence chunk at a time while "
     "the previous chunk's matmul runs). Needs sequence parallelism; same numerics as plain TP.", {}},
    {LOOM_CONFIG_KEY(parallelism, context_parallel_degree),
     "Context-parallel ranks: each sequence is cut into 2 x degree chunks and rank i of the `cp` "
     "group holds chunks i and 2 x degree - 1 - i (equal causal work). Attention runs over every "
     "rank's keys (see context_parallel_rotate_method); FSDP shards parameters over dp_shard x cp. "
     "`training.seq_len` must be divisible by 2 x degree (x the TP degree with sequence parallel).", {}},
    {LOOM_CONFIG_KEY(parallelism, context_parallel_rotate_method),
     "How context-parallel attention reaches the other ranks' keys and values: `allgather` (one "
     "all-gather per layer, then local blocks) or `ring` (they travel around the ring, each "
     "transfer overlapped with the previous block's attention).", {"allgather", "ring"}},
    {LOOM_CONFIG_KEY(parallelism, pipeline_parallel_degree),
     "Pipeline ranks: the model's layers are split into stages (one per rank, or several with the "
     "multi-stage schedules) that pass activations forward and gradients back point to point; "
     "see docs/pipeline_parallel.md.", {}},
    {LOOM_CONFIG_KEY(parallelism, pipeline_parallel_schedule),
     "The pipeline schedule (TorchTitan's and PyTorch's names). `GPipe` and `1F1B` put one stage "
     "on each rank; `Interleaved1F1B`, `LoopedBFS` and `InterleavedZeroBubble` loop over several "
     "stages per rank (2 unless `pipeline_parallel_layers_per_stage` or `split_points` say "
     "otherwise); `ZBVZeroBubble` and `DualPipeV` place two stages per rank in a V. The zero-bubble "
     "schedules split each backward into input and weight gradients. Each schedule needs enough "
     "micro-batches (a one-line error names the rule).",
     {"GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
      "DualPipeV"}},
    {LOOM_CONFIG_KEY(parallelism, pipeline_parallel_schedule_csv),
     "A hand-written schedule instead of `pipeline_parallel_schedule`: PyTorch's CSV format, one "
     "row per pipeline rank of actions such as `0F0,0B0` (`loom pipeline schedule --csv` writes "
     "one to start from). It is simulated at start-up: a schedule that would deadlock is a one-line "
     "error naming the action. Empty = none.", {}},
    {LOOM_CONFIG_KEY(parallelism, pipeline_parallel_microbatch_size),
     "Rows per pipeline micro-batch: each loaded batch of `training.local_batch_size` rows is "
     "split into local_batch_size / microbatch_size micro-batches, which must divide.", {}},
    {LOOM_CONFIG_KEY(parallelism, pipeline_parallel_layers_per_stage),
     "Transformer layers per pipeline stage; with it the number of stages is n_layers / "
     "layers_per_stage (a multiple of the degree). `0` = split the layers evenly over the "
     "schedule's stages.", {}},
    {LOOM_CONFIG_KEY(parallelism, pipeline_parallel_split_points),
     "The first layer of every stage but the first, comma-separated (`\"layers.2,layers.5\"`, "
     "TorchTitan's spelling, or bare ids); the number of stages is one more than the points. "
     "Empty = not set.", {}},
    // [activation_checkpoint]
    {LOOM_CONFIG_KEY(activation_checkpoint, mode),
     "Recompute activations in backward instead of keeping them from forward (see "
     "docs/activation_checkpointing.md). `none`; `full`: every transformer block keeps only its "
     "input and is re-run in backward; `selective`: as `selective_ac_option` says. Same losses as "
     "`none` (bitwise in deterministic mode), less memory, more compute.",
     {"none", "full", "selective"}},
    {LOOM_CONFIG_KEY(activation_checkpoint, selective_ac_option),
     "With `mode = \"selective\"`: a positive integer N checkpoints every N-th block (layer ids "
     "N-1, 2N-1, ...; `1` = every block, as `full`), or `op`: every block keeps the outputs of "
     "its matmuls and attention and recomputes only norms, RoPE, SiLU x mul and residual adds.",
     {"op"}, /*integer_allowed=*/true},
    // [float8]
    {LOOM_CONFIG_KEY(float8, enable),
     "Train the linear layers in Float8 (see docs/float8.md): every linear whose name matches none "
     "of `filter_fqns` runs its forward and backward GEMMs on float8 operands with dynamic "
     "scaling, its weights staying in high precision. On the CPU the float8 GEMMs are emulated "
     "exactly (quantize, dequantize, float32 matmul); on CUDA they are `_scaled_mm`. Needs the "
     "converted layers' dims to be multiples of 16; not with tensor parallelism or pipeline "
     "parallelism.", {}},
    {LOOM_CONFIG_KEY(float8, recipe),
     "torchao's recipes. `rowwise`: inputs, weights and output gradients in float8_e4m3fn, one "
     "scale per row along each GEMM's contracted dim, scales rounded down to powers of 2. "
     "`tensorwise`: one scale per tensor, inputs and weights in e4m3fn, output gradients in e5m2.",
     {"rowwise", "tensorwise"}},
    {LOOM_CONFIG_KEY(float8, filter_fqns),
     "Comma-separated substrings: a linear whose fully qualified name (`layers.0.attention.wq`, "
     "`output`) contains one stays in high precision. The default keeps the output head, as "
     "TorchTitan does.", {}},
    // [metrics]
    {LOOM_CONFIG_KEY(metrics, log_freq),
     "Log every this many steps.", {}},
    {LOOM_CONFIG_KEY(metrics, enable_jsonl),
     "Write `metrics.jsonl`.", {}},
    {LOOM_CONFIG_KEY(metrics, enable_tensorboard),
     "Rank 0 also writes TensorBoard event files (`events.out.tfevents.*`) to "
     "`<dump_folder>/tb/<YYYYmmdd-HHMMSS>/`, one folder per fresh run (a resumed run continues the "
     "newest): the scalars of `metrics.jsonl`, same keys and steps, as float32. View with "
     "`tensorboard --logdir <dump_folder>/tb`.", {}},
    {LOOM_CONFIG_KEY(metrics, memory_breakdown),
     "Split each step's peak memory per rank into parameters, gradients, optimizer state, "
     "activations, buffers in flight (FSDP's unsharded buffers) and other, by watching c10's "
     "allocator: printed once after the first step and written with every logged step "
     "(`mem_params_gib`, `mem_grads_gib`, `mem_optimizer_gib`, `mem_activations_gib`, "
     "`mem_buffers_gib`, `mem_other_gib`, `mem_step_peak_gib`); see docs/memory.md. Off while "
     "`profiling.enable_profiling` records (both use c10's one memory-reporting slot).", {}},
    {LOOM_CONFIG_KEY(metrics, peak_flops),
     "Peak FLOP/s per rank that MFU is measured against. `0` = on the CPU, measure this "
     "machine's fp32 GEMM peak at startup (best rate of 1024x1024 matmuls for ~0.3 s at the "
     "rank's thread count); on a GPU, its dense bf16 peak from the data-sheet table in "
     "`core/device.cpp` (H100 SXM 989e12, A100 312e12, ...), and no MFU (with a warning) for a "
     "GPU the table does not know. Set it to compare runs across machines.", {}},
    // [checkpoint]
    {LOOM_CONFIG_KEY(checkpoint, enable),
     "Save checkpoints (and resume from the newest one in the folder at startup).", {}},
    {LOOM_CONFIG_KEY(checkpoint, folder),
     "Checkpoint folder, relative to `job.dump_folder`.", {}},
    {LOOM_CONFIG_KEY(checkpoint, interval),
     "Save every this many steps, and at the last step.", {}},
    {LOOM_CONFIG_KEY(checkpoint, keep_latest_k),
     "Keep only the newest k checkpoints; `0` keeps all. `1` is rejected: the newest may still "
     "be being written when the previous one would be deleted.",
     {}},
    {LOOM_CONFIG_KEY(checkpoint, async_mode),
     "`disabled`: save inside the training loop. `async`: the save returns after planning; "
     "background threads copy the state into reused host buffers while the next step's forward "
     "and backward run (its optimizer step waits for the copy, not for the write) and write it "
     "with O_DIRECT where the filesystem allows.",
     {"disabled", "async"}},
    {LOOM_CONFIG_KEY(checkpoint, model_only),
     "The final save holds model weights only (in `export_dtype`), without optimizer, "
     "scheduler, data loader and RNG state; it cannot resume training.", {}},
    {LOOM_CONFIG_KEY(checkpoint, export_dtype),
     "Dtype of model-only final weights.",
     {"float32", "bfloat16", "float16"}},
    {LOOM_CONFIG_KEY(checkpoint, initial_load_path),
     "Model weights to start from when the run's own checkpoint folder is empty: a Loom "
     "checkpoint (`loom convert --to loom` output, another run's `step-N`, or a checkpoint "
     "folder = its newest complete step; model tensors only, resharded to this layout) or a "
     "Hugging Face directory of the same model family (read by its config.json's model_type); empty = none.", {}},
    // [validation]
    {LOOM_CONFIG_KEY(validation, enable),
     "Evaluate the loss on held-out data every `freq` steps and at the last step.", {}},
    {LOOM_CONFIG_KEY(validation, dataset_path),
     "The held-out data: a file, directory or glob in any format `training.dataset_path` takes "
     "(`data/default/validation.jsonl` is the default corpus's held-out set).", {}},
    {LOOM_CONFIG_KEY(validation, dataset_format),
     "Format of `dataset_path`; `auto` guesses it from each file.",
     {"auto", "jsonl", "text", "tokens"}},
    {LOOM_CONFIG_KEY(validation, freq),
     "Evaluate every this many steps, and at the last step.", {}},
    {LOOM_CONFIG_KEY(validation, steps),
     "Batches per evaluation (each `local_batch_size` rows on every data-parallel rank), always "
     "from the first held-out row, capped at one pass over the file; `-1` = the whole file once.",
     {}},
    {LOOM_CONFIG_KEY(validation, local_batch_size),
     "Rows per data-parallel rank per batch; `0` = `training.local_batch_size`.", {}},
    {LOOM_CONFIG_KEY(validation, seq_len),
     "Tokens per row; `0` = `training.seq_len` (a larger value is refused: the model's position "
     "tables cover `training.seq_len`).", {}},
    // [comm]
    {LOOM_CONFIG_KEY(comm, timeout_seconds),
     "Timeout for rendezvous and for each collective, in seconds: 1 to 604800 (one week; larger"
     " values would overflow the millisecond timeouts).", {}},
    // [profiling]
    {LOOM_CONFIG_KEY(profiling, enable_profiling),
     "Record Kineto (PyTorch profiler) traces: in every window of `profile_freq` steps, "
     "`profiler_warmup` steps of warm-up then `profiler_active` recorded steps, written after the "
     "window's last step as `<dump_folder>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json` "
     "(Chrome trace JSON: open in Perfetto or chrome://tracing). See docs/profiling.md.", {}},
    {LOOM_CONFIG_KEY(profiling, save_traces_folder),
     "Trace folder, relative to `job.dump_folder`.", {}},
    {LOOM_CONFIG_KEY(profiling, profile_freq),
     "Length of a profiling window in steps; the traces (and memory snapshots) are written at "
     "every multiple of it. At least `profiler_warmup + profiler_active`.", {}},
    {LOOM_CONFIG_KEY(profiling, profiler_active),
     "Steps recorded at the end of each window (>= 1).", {}},
    {LOOM_CONFIG_KEY(profiling, profiler_warmup),
     "Steps before the recorded ones during which the profiler is set up but discards its "
     "events, so that its start-up cost stays out of the trace (>= 0).", {}},
    {LOOM_CONFIG_KEY(profiling, enable_memory_snapshot),
     "Record memory. On CUDA: the caching allocator's history, dumped at every multiple of "
     "`profile_freq` (and at the end) as `iteration_<step>/rank<r>_memory_snapshot.pickle`, the "
     "format of `torch.cuda.memory._dump_snapshot` (open in pytorch.org/memory_viz). On the CPU: "
     "`rank<r>_rss_timeline.json`, every step's time and current and peak resident set size, "
     "rewritten at every multiple of `profile_freq` and at the end.", {}},
    {LOOM_CONFIG_KEY(profiling, save_memory_snapshot_folder),
     "Memory snapshot folder, relative to `job.dump_folder`.", {}},
};

// Prose of docs/config.md around a section's table (the keys' own text is in kSchema).
struct SectionDoc {
  std::string_view section;
  std::string_view before;  // between the heading and the table
  std::string_view after;   // after the table
};

const std::vector<SectionDoc> kSectionDocs = {
    {"lr_scheduler",
     R"md(Linear warmup, an optional stable phase, then decay: TorchTitan's `linear_warmup_stable_decay`.
Training step *k* (1-based) runs at `lr * factor(k - 1)`:

- warmup (`k <= warmup_steps`): `factor = k / warmup_steps`, so the first step runs at
  `lr / warmup_steps` and the last warmup step at `lr`;
- `decay_steps = round(steps * decay_ratio)` (or `steps - warmup_steps` when `decay_ratio` is
  unset), shortened if warmup + decay exceed the run; the stable phase is what is left plus one
  virtual step, so the last training step is not at exactly the floor;
- decay: with progress `p = (k - warmup - stable) / decay_steps`, `factor = min_lr_factor +
  (1 - min_lr_factor) * f(p)`, `f = 1 - p` (linear), `1 - sqrt(p)` (sqrt) or `(1 + cos(pi p)) / 2`
  (cosine).)md",
     R"md()md"},
    {"parallelism",
     R"md(The degrees multiply to the number of ranks; `data_parallel_shard_degree = -1` takes whatever the
others leave.)md",
     R"md()md"},
    {"metrics",
     R"md(Every `log_freq` steps rank 0 prints one line (step, loss, grad_norm, lr, tokens/s, MFU %,
peak memory) and appends one JSON object to `<dump_folder>/metrics.jsonl` with the keys `step`,
`loss`, `grad_norm`, `lr`, `tps` (tokens/s per rank), `mfu` (percent), `mem_peak_gib` (peak
resident memory of the rank since the previous log; on a GPU, the peak allocated by the CUDA
caching allocator), plus extra keys: `comm_bytes` (bytes sent per step) and `comm_bytes/<dim>`
(the same per mesh dim that carried traffic: `dp_shard`, `tp`, `cp`, ...), and on a GPU
`mem_reserved_gib` (held by the caching allocator) and `mem_peak_pct` (peak as a percentage of the
device's memory). Each line is flushed when written; NaN/inf are written as `null` (and an MFU that
cannot be computed prints as `n/a`). The console line starts with the step, the time since training
started and an ETA (`[step 120/400 · 1m32s · eta 3m35s]`: the mean time of the last 100 steps, the
first step of the process excluded as warm-up, times the steps left); on a terminal a line with the
latest step and loss is redrawn in place between log steps. At the end rank 0 prints a summary
(steps, tokens, wall time, mean tokens/s and MFU, first/last/best loss, peak memory, where the run's
files are, commands to try next) and, when `enable_jsonl` is on, draws `<dump_folder>/loss.svg` from
`metrics.jsonl` (what `loom plot` draws: loss, learning rate and tokens/s against step).)md",
     R"md()md"},
};

#undef LOOM_CONFIG_KEY

const std::unordered_map<std::string, const ConfigKey*>& schema_index() {
  static const auto index = [] {
    std::unordered_map<std::string, const ConfigKey*> m;
    for (const ConfigKey& k : kSchema) m.emplace(k.name(), &k);
    return m;
  }();
  return index;
}

const ConfigKey* find_key(const std::string& name) {
  const auto& index = schema_index();
  auto it = index.find(name);
  return it == index.end() ? nullptr : it->second;
}

bool is_section(std::string_view name) {
  for (const ConfigKey& k : kSchema) {
    if (k.section == name) return true;
  }
  return false;
}

template <typename Range>
std::string nearest(std::string_view name, const Range& candidates) {
  std::string best;
  size_t best_distance = std::numeric_limits<size_t>::max();
  for (const auto& candidate : candidates) {
    const size_t d = edit_distance(name, candidate);
    if (d < best_distance) {
      best_distance = d;
      best = std::string(candidate);
    }
  }
  return best;
}

std::vector<std::string> all_key_names() {
  std::vector<std::string> names;
  for (const ConfigKey& k : kSchema) names.push_back(k.name());
  return names;
}

// The full "section.key" name nearest to `name`. A name without a section ("steps") is matched
// against the key part of every name, since comparing it with whole names favours short sections
// ("model.name") over the key the user meant ("training.steps").
std::string suggest_key(std::string_view name) {
  if (name.find('.') != std::string_view::npos) return nearest(name, all_key_names());
  std::string best;
  size_t best_distance = std::numeric_limits<size_t>::max();
  for (const ConfigKey& k : kSchema) {
    const size_t d = edit_distance(name, k.key);
    if (d < best_distance) {
      best_distance = d;
      best = k.name();
    }
  }
  return best;
}

// A TOML basic string: double quotes, backslash escapes for quotes, backslashes and controls.
std::string toml_string(std::string_view s) {
  std::string out = "\"";
  for (const char ch : s) {
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\t': out += "\\t"; break;
      case '\n': out += "\\n"; break;
      case '\f': out += "\\f"; break;
      case '\r': out += "\\r"; break;
      default:
        if (static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04X",
                        static_cast<unsigned>(static_cast<unsigned char>(ch)));
          out += buf;
        } else {
          out += ch;
        }
    }
  }
  return out + "\"";
}

// The shortest %g form that reads back to exactly `v` ("0.0008", "1e-08", "3.0"), as TOML.
std::string format_double(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::string s(buf);
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

bool is_positive_integer(std::string_view s) {
  int64_t v = 0;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  return ec == std::errc() && ptr == s.data() + s.size() && v > 0;
}

// "a", "b" or "c" (with `last` as a final unquoted alternative when non-empty).
std::string join_choices(const std::vector<std::string_view>& choices, std::string_view last = {}) {
  std::vector<std::string> items;
  for (std::string_view c : choices) items.push_back(toml_string(c));
  if (!last.empty()) items.emplace_back(last);
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += i + 1 == items.size() ? " or " : ", ";
    out += items[i];
  }
  return out;
}

// Checks a string value against the key's allowed choices.
void check_choice(const ConfigKey& key, const std::string& value, const std::string& where) {
  if (key.choices.empty()) return;
  for (std::string_view c : key.choices) {
    if (value == c) return;
  }
  if (key.integer_allowed && is_positive_integer(value)) return;
  // One rule for every enum-valued key: values are matched as written (a config file reads the
  // same everywhere, and the names are TorchTitan's own), and a value that differs only in case
  // gets a short error naming the exact spelling.
  auto folded = [](std::string_view text) {
    std::string out(text);
    for (char& ch : out) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    return out;
  };
  for (std::string_view c : key.choices) {
    if (folded(c) == folded(value)) {
      fail_usage("config key '", key.name(), "' is case-sensitive: got ", toml_string(value), " in ",
                 where, "; did you mean '", c, "'?");
    }
  }
  fail_usage("config key '", key.name(), "' must be ",
             join_choices(key.choices, key.integer_allowed ? "a positive integer" : ""), ", got ",
             toml_string(value), " in ",
             where, " (did you mean ", toml_string(nearest(value, key.choices)), "?)");
}

// ---- TOML file values ----

std::string location(const toml::source_region& source, const std::string& origin) {
  return c10::str(origin, ":", source.begin.line, ":", source.begin.column);
}

std::string describe_node(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::string: return "string " + toml_string(*node.value<std::string>());
    case toml::node_type::integer: return c10::str("integer ", *node.value<int64_t>());
    case toml::node_type::floating_point: return "float " + format_double(*node.value<double>());
    case toml::node_type::boolean: return *node.value<bool>() ? "boolean true" : "boolean false";
    case toml::node_type::array: return "an array";
    case toml::node_type::table: return "a table";
    case toml::node_type::date: return "a date";
    case toml::node_type::time: return "a time";
    case toml::node_type::date_time: return "a date-time";
    default: return "nothing";
  }
}

void set_from_node(JobConfig& config, const ConfigKey& key, const toml::node& node,
                   const std::string& where) {
  auto wrong_type = [&] {
    fail_usage("config key '", key.name(), "' expects ", key.type_description(), ", got ",
               describe_node(node), " in ", where);
  };
  std::visit(
      [&](auto* field) {
        using T = std::remove_pointer_t<decltype(field)>;
        if constexpr (std::is_same_v<T, bool>) {
          if (!node.is_boolean()) wrong_type();
          *field = *node.value<bool>();
        } else if constexpr (std::is_same_v<T, int64_t>) {
          if (!node.is_integer()) wrong_type();
          *field = *node.value<int64_t>();
        } else if constexpr (std::is_same_v<T, double>) {
          if (!node.is_number()) wrong_type();
          *field = *node.value<double>();
        } else if constexpr (std::is_same_v<T, std::optional<double>>) {
          if (!node.is_number()) wrong_type();
          const double v = *node.value<double>();
          // Negative means unset; -inf is kept so that validate() rejects it as non-finite.
          *field = v < 0.0 && std::isfinite(v) ? std::nullopt : std::optional<double>(v);
        } else {
          static_assert(std::is_same_v<T, std::string>);
          if (node.is_string()) {
            *field = *node.value<std::string>();
          } else if (key.integer_allowed && node.is_integer()) {
            *field = std::to_string(*node.value<int64_t>());
          } else {
            wrong_type();
          }
          check_choice(key, *field, where);
        }
      },
      key.field(config));
}

// ---- Command-line values ----

template <typename T>
bool parse_number(std::string_view s, T& out) {
  if (s.empty()) return false;
  const char* begin = s.data();
  if constexpr (std::is_floating_point_v<T>) {
    if (*begin == '+') ++begin;  // from_chars takes no leading '+'
  }
  const auto [ptr, ec] = std::from_chars(begin, s.data() + s.size(), out);
  return ec == std::errc() && ptr == s.data() + s.size();
}

void set_from_string(JobConfig& config, const ConfigKey& key, const std::string& value,
                     const std::string& where) {
  auto wrong_type = [&] {
    fail_usage("config key '", key.name(), "' expects ", key.type_description(), ", got ",
               toml_string(value), " in ", where);
  };
  std::visit(
      [&](auto* field) {
        using T = std::remove_pointer_t<decltype(field)>;
        if constexpr (std::is_same_v<T, bool>) {
          if (value == "true") {
            *field = true;
          } else if (value == "false") {
            *field = false;
          } else {
            wrong_type();
          }
        } else if constexpr (std::is_same_v<T, int64_t>) {
          if (!parse_number(value, *field)) wrong_type();
        } else if constexpr (std::is_same_v<T, double>) {
          if (!parse_number(value, *field)) wrong_type();
        } else if constexpr (std::is_same_v<T, std::optional<double>>) {
          double v = 0.0;
          if (value == "none" || value == "null") {
            *field = std::nullopt;
          } else if (parse_number(value, v)) {
            *field = v < 0.0 && std::isfinite(v) ? std::nullopt : std::optional<double>(v);
          } else {
            wrong_type();
          }
        } else {
          static_assert(std::is_same_v<T, std::string>);
          check_choice(key, value, where);
          *field = value;
        }
      },
      key.field(config));
}

void require(bool ok, const ConfigKey& key, std::string_view requirement, const JobConfig& config) {
  if (!ok) {
    fail_usage("config key '", key.name(), "' must be ", requirement, ", got ",
               key.value_as_toml(config));
  }
}

}  // namespace

// ---- ConfigKey ----

std::string ConfigKey::name() const { return c10::str(section, ".", key); }

std::string ConfigKey::type_description() const {
  JobConfig probe;
  return std::visit(
      [&](auto* field) -> std::string {
        using T = std::remove_pointer_t<decltype(field)>;
        if constexpr (std::is_same_v<T, bool>) {
          return "a boolean";
        } else if constexpr (std::is_same_v<T, int64_t>) {
          return "an integer";
        } else if constexpr (std::is_same_v<T, double>) {
          return "a number";
        } else if constexpr (std::is_same_v<T, std::optional<double>>) {
          return "a number or none";
        } else {
          return integer_allowed ? "a string or an integer" : "a string";
        }
      },
      field(probe));
}

std::string ConfigKey::value_as_toml(const JobConfig& config) const {
  // Reading through the non-const binding is safe: nothing is written.
  return std::visit(
      [&](auto* value) -> std::string {
        using T = std::remove_pointer_t<decltype(value)>;
        if constexpr (std::is_same_v<T, bool>) {
          return *value ? "true" : "false";
        } else if constexpr (std::is_same_v<T, int64_t>) {
          return std::to_string(*value);
        } else if constexpr (std::is_same_v<T, double>) {
          return format_double(*value);
        } else if constexpr (std::is_same_v<T, std::optional<double>>) {
          return value->has_value() ? format_double(**value) : "none";
        } else {
          return integer_allowed && is_positive_integer(*value) ? *value : toml_string(*value);
        }
      },
      field(const_cast<JobConfig&>(config)));
}

const std::vector<ConfigKey>& config_schema() { return kSchema; }

std::string ConfigKey::doc_type() const {
  JobConfig probe;
  std::string choice_list;
  for (std::string_view c : choices) {
    choice_list += c10::str(choice_list.empty() ? "" : " \\| ", "`\"", c, "\"`");
  }
  return std::visit(
      [&](auto* field) -> std::string {
        using T = std::remove_pointer_t<decltype(field)>;
        if constexpr (std::is_same_v<T, bool>) {
          return "bool";
        } else if constexpr (std::is_same_v<T, int64_t>) {
          return "int";
        } else if constexpr (std::is_same_v<T, double>) {
          return "float";
        } else if constexpr (std::is_same_v<T, std::optional<double>>) {
          return "float or unset";
        } else {
          if (choice_list.empty()) return "string";
          return integer_allowed ? choice_list + " \\| int" : choice_list;
        }
      },
      field(probe));
}

std::string config_reference_markdown() {
  const JobConfig defaults;
  std::string out;
  for (std::string_view section : config_sections()) {
    out += c10::str("## [", section, "]\n\n");
    const SectionDoc* doc = nullptr;
    for (const SectionDoc& d : kSectionDocs) {
      if (d.section == section) doc = &d;
    }
    if (doc != nullptr && !doc->before.empty()) out += c10::str(doc->before, "\n\n");
    out += "| key | type | default | meaning |\n| --- | --- | --- | --- |\n";
    for (const ConfigKey& k : kSchema) {
      if (k.section != section) continue;
      const std::string value = k.value_as_toml(defaults);
      const std::string shown = value == "none" ? "unset" : c10::str("`", value, "`");
      out += c10::str("| `", k.name(), "` | ", k.doc_type(), " | ", shown, " | ", k.help, " |\n");
    }
    if (doc != nullptr && !doc->after.empty()) out += c10::str("\n", doc->after, "\n");
    out += "\n";
  }
  return out + compatibility_markdown();
}

std::vector<std::string_view> config_sections() {
  std::vector<std::string_view> sections;
  for (const ConfigKey& k : kSchema) {
    if (sections.empty() || sections.back() != k.section) sections.push_back(k.section);
  }
  return sections;
}

// ---- JobConfig ----

std::string JobConfig::to_toml() const {
  std::ostringstream os;
  std::string_view section;
  for (const ConfigKey& k : kSchema) {
    if (k.section != section) {
      os << (section.empty() ? "" : "\n") << "[" << k.section << "]\n";
      section = k.section;
    }
    const std::string value = k.value_as_toml(*this);
    if (value == "none") {
      // TOML has no null: an unset optional is written as a comment and read back as unset.
      os << "# " << k.key << " is unset\n";
    } else {
      os << k.key << " = " << value << "\n";
    }
  }
  return os.str();
}

// ---- Loading ----

JobConfig parse_config_toml(std::string_view toml_text, const std::string& origin) {
  toml::table root;
  try {
    root = toml::parse(toml_text, origin);
  } catch (const toml::parse_error& e) {
    std::string description(e.description());
    std::replace(description.begin(), description.end(), '\n', ' ');  // keep the error one line
    fail_usage("malformed TOML in ", location(e.source(), origin), ": ", description);
  }
  JobConfig config;
  for (auto&& [section_key, section_node] : root) {
    const std::string section(section_key.str());
    const std::string where = location(section_key.source(), origin);
    if (!section_node.is_table()) {
      // A bare key outside any [section]: point at the key of the nearest name.
      fail_usage("config key '", section, "' in ", where, " is outside any [section] (did you mean '",
                 suggest_key(section), "'?)");
    }
    if (!is_section(section)) {
      fail_usage("unknown config section '", section, "' in ", where, " (did you mean '",
                 nearest(section, config_sections()), "'?)");
    }
    for (auto&& [key, node] : *section_node.as_table()) {
      const std::string name = section + "." + std::string(key.str());
      const ConfigKey* spec = find_key(name);
      if (spec == nullptr) {
        fail_usage("unknown config key '", name, "' in ", location(key.source(), origin),
                   " (did you mean '", nearest(name, all_key_names()), "'?)");
      }
      set_from_node(config, *spec, node, location(node.source(), origin));
    }
  }
  return config;
}

JobConfig load_config_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    fail_usage("config file '", path, "' is a directory; pass a TOML file, e.g. --config ",
               "configs/llama3_debug.toml");
  }
  if (!std::filesystem::is_regular_file(path, ec)) {
    fail_usage("config file '", path, "' not found; pass an existing TOML file, e.g. --config ",
               "configs/llama3_debug.toml");
  }
  std::ifstream in(path, std::ios::binary);
  LOOM_REQUIRE_USAGE(in.good(), "cannot read config file '", path, "'; check its permissions");
  std::stringstream text;
  text << in.rdbuf();
  return parse_config_toml(text.str(), path);
}

void apply_overrides(JobConfig& config, const std::vector<std::string>& args) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg.size() < 3 || arg.compare(0, 2, "--") != 0) {
      fail_usage("unexpected argument '", arg, "'; config overrides look like --section.key=value");
    }
    const std::string body = arg.substr(2);
    const size_t eq = body.find('=');
    const std::string name = body.substr(0, eq);
    const ConfigKey* spec = find_key(name);
    if (spec == nullptr) {
      fail_usage("unknown config key '", name, "' in command-line override '", arg,
                 "' (did you mean '", suggest_key(name), "'?)");
    }
    std::string value;
    std::string where;
    if (eq != std::string::npos) {
      value = body.substr(eq + 1);
      where = "command-line override '" + arg + "'";
    } else {
      const bool is_bool = std::holds_alternative<bool*>(spec->field(config));
      const bool has_next = i + 1 < args.size() && args[i + 1].compare(0, 2, "--") != 0;
      if (is_bool && !(has_next && (args[i + 1] == "true" || args[i + 1] == "false"))) {
        value = "true";  // a bare boolean flag
      } else if (!has_next) {
        fail_usage("config override '", arg, "' needs a value: --", name, "=VALUE or --", name,
                   " VALUE");
      } else {
        value = args[++i];
      }
      where = "command-line override '" + arg + " " + value + "'";
    }
    set_from_string(config, *spec, value, where);
  }
}

JobConfig load_job_config(const std::string& path, const std::vector<std::string>& overrides) {
  JobConfig config = path.empty() ? JobConfig{} : load_config_file(path);
  apply_overrides(config, overrides);
  validate(config);
  return config;
}

void validate(const JobConfig& c) {
  auto key = [](const char* name) -> const ConfigKey& {
    const ConfigKey* k = find_key(name);
    TORCH_INTERNAL_ASSERT(k != nullptr, "validate() names unknown config key ", name);
    return *k;
  };
  // Every number first, over the whole schema so a new key cannot be missed: inf and nan (which
  // TOML and the command line both accept) pass the range checks below (inf >= 0) or make their
  // messages confusing, and would reach the optimizer as a NaN loss much later.
  for (const ConfigKey& k : kSchema) {
    std::visit(
        [&](auto* field) {
          using T = std::remove_pointer_t<decltype(field)>;
          bool finite = true;
          if constexpr (std::is_same_v<T, double>) {
            finite = std::isfinite(*field);
          } else if constexpr (std::is_same_v<T, std::optional<double>>) {
            finite = !field->has_value() || std::isfinite(**field);
          }
          require(finite, k, "a finite number", c);
        },
        k.field(const_cast<JobConfig&>(c)));  // only read
  }
  require(!c.job.dump_folder.empty(), key("job.dump_folder"), "a non-empty path", c);
  nn::parse_cuda_kernels(c.training.cuda_kernels);  // a usage error naming an unknown kernel
  require(c.model.vocab_size >= 0, key("model.vocab_size"), ">= 0", c);
  require(c.model.n_layers >= 0, key("model.n_layers"), ">= 0 (0 = the flavor's)", c);
  require(c.optimizer.lr >= 0.0, key("optimizer.lr"), ">= 0", c);
  require(c.optimizer.eps >= 0.0, key("optimizer.eps"), ">= 0", c);
  require(c.optimizer.beta1 >= 0.0 && c.optimizer.beta1 < 1.0, key("optimizer.beta1"),
          "in [0, 1)", c);
  require(c.optimizer.beta2 >= 0.0 && c.optimizer.beta2 < 1.0, key("optimizer.beta2"),
          "in [0, 1)", c);
  require(c.optimizer.weight_decay >= 0.0, key("optimizer.weight_decay"), ">= 0", c);
  require(c.optimizer.muon_momentum >= 0.0 && c.optimizer.muon_momentum < 1.0,
          key("optimizer.muon_momentum"), "in [0, 1)", c);
  require(c.optimizer.muon_ns_steps >= 1, key("optimizer.muon_ns_steps"), ">= 1", c);
  // The optimizer's own refusals (its registry entry), before any process group.
  const parallel::OptimizerSpec& optimizer = parallel::optimizer_spec(c.optimizer.name);
  if (optimizer.check_layout) {
    parallel::OptimizerLayout layout;
    layout.tensor_parallel_degree = c.parallelism.tensor_parallel_degree;
    layout.device = c.training.device;
    layout.half_precision_shards =
        c.training.mixed_precision_param == "bfloat16" || c.training.mixed_precision_reduce == "bfloat16";
    optimizer.check_layout(optimizer_request(c), layout);
  }
  require(c.lr_scheduler.warmup_steps >= 0, key("lr_scheduler.warmup_steps"), ">= 0", c);
  require(!c.lr_scheduler.decay_ratio || *c.lr_scheduler.decay_ratio <= 1.0,
          key("lr_scheduler.decay_ratio"), "in [0, 1] or unset", c);
  require(c.lr_scheduler.min_lr_factor >= 0.0 && c.lr_scheduler.min_lr_factor <= 1.0,
          key("lr_scheduler.min_lr_factor"), "in [0, 1]", c);
  require(c.training.local_batch_size > 0, key("training.local_batch_size"), "> 0", c);
  require(c.training.global_batch_size == -1 ||
              (c.training.global_batch_size > 0 &&
               c.training.global_batch_size % c.training.local_batch_size == 0),
          key("training.global_batch_size"),
          c10::str("-1 or a positive multiple of training.local_batch_size (",
                   c.training.local_batch_size, ")"),
          c);
  require(c.training.seq_len > 0, key("training.seq_len"), "> 0", c);
  require(c.training.max_norm > 0.0, key("training.max_norm"), "> 0", c);
  require(c.training.steps > 0, key("training.steps"), "> 0", c);
  require(c.training.skip_nonfinite_steps >= 0, key("training.skip_nonfinite_steps"), ">= 0", c);
  require(c.parallelism.data_parallel_replicate_degree >= 1,
          key("parallelism.data_parallel_replicate_degree"), ">= 1", c);
  require(c.parallelism.data_parallel_shard_degree == -1 ||
              c.parallelism.data_parallel_shard_degree >= 1,
          key("parallelism.data_parallel_shard_degree"), "-1 or >= 1", c);
  require(c.parallelism.tensor_parallel_degree >= 1, key("parallelism.tensor_parallel_degree"),
          ">= 1", c);
  require(c.parallelism.context_parallel_degree >= 1, key("parallelism.context_parallel_degree"),
          ">= 1", c);
  require(c.parallelism.pipeline_parallel_degree >= 1,
          key("parallelism.pipeline_parallel_degree"), ">= 1", c);
  require(c.parallelism.pipeline_parallel_microbatch_size >= 1,
          key("parallelism.pipeline_parallel_microbatch_size"), ">= 1", c);
  require(c.parallelism.pipeline_parallel_layers_per_stage >= 0,
          key("parallelism.pipeline_parallel_layers_per_stage"), ">= 0 (0 = not set)", c);
  if (c.parallelism.pipeline_parallel_degree > 1) {
    const int64_t rows = c.training.local_batch_size, mb = c.parallelism.pipeline_parallel_microbatch_size;
    LOOM_REQUIRE_USAGE(rows % mb == 0, "parallelism.pipeline_parallel_microbatch_size = ", mb,
                       " does not divide training.local_batch_size = ", rows,
                       " (each loaded batch is cut into micro-batches of that many rows); use a divisor of ",
                       rows);
  }
  {
    const int64_t seq = c.training.seq_len, cp = c.parallelism.context_parallel_degree;
    LOOM_REQUIRE_USAGE(cp == 1 || seq % (2 * cp) == 0, "training.seq_len = ", seq,
                       " is not divisible by 2 x parallelism.context_parallel_degree = ", 2 * cp,
                       " (context parallel cuts each sequence into that many equal chunks); use a multiple of ",
                       2 * cp, ", e.g. ", (seq / (2 * cp) + 1) * 2 * cp);
  }
  require(c.metrics.log_freq > 0, key("metrics.log_freq"), "> 0", c);
  require(c.metrics.peak_flops >= 0.0, key("metrics.peak_flops"), ">= 0 (0 = measure)", c);
  require(!c.checkpoint.folder.empty(), key("checkpoint.folder"), "a non-empty path", c);
  require(c.checkpoint.interval > 0, key("checkpoint.interval"), "> 0", c);
  require(c.checkpoint.keep_latest_k == 0 || c.checkpoint.keep_latest_k >= 2,
          key("checkpoint.keep_latest_k"), "0 (keep all) or >= 2", c);
  if (c.validation.enable) {
    const ValidationSection& v = c.validation;
    // Whether the file can be read is checked when it is loaded (as training.dataset_path is), so
    // a config with relative paths can be read from anywhere.
    LOOM_REQUIRE_USAGE(!v.dataset_path.empty(), "validation.enable = true needs held-out data, but "
                       "validation.dataset_path is empty; point it at a file (e.g. "
                       "data/default/validation.jsonl) or set validation.enable = false");
    require(v.freq > 0, key("validation.freq"), "> 0", c);
    require(v.steps == -1 || v.steps > 0, key("validation.steps"), "> 0, or -1 (the whole file once)", c);
    require(v.local_batch_size >= 0, key("validation.local_batch_size"),
            ">= 0 (0 = training.local_batch_size)", c);
    require(v.seq_len >= 0 && v.seq_len <= c.training.seq_len, key("validation.seq_len"),
            c10::str("in [0, training.seq_len = ", c.training.seq_len, "] (0 = training.seq_len)"), c);
    const int64_t seq = v.seq_len > 0 ? v.seq_len : c.training.seq_len;
    const int64_t cp = c.parallelism.context_parallel_degree;
    LOOM_REQUIRE_USAGE(cp == 1 || seq % (2 * cp) == 0, "validation.seq_len = ", seq,
                       " is not divisible by 2 x parallelism.context_parallel_degree = ", 2 * cp,
                       "; use a multiple of ", 2 * cp, " or 0 (training.seq_len)");
    const int64_t tp = c.parallelism.tensor_parallel_degree;
    LOOM_REQUIRE_USAGE(tp == 1 || c.parallelism.disable_sequence_parallel || (seq / cp) % tp == 0,
                       "validation.seq_len = ", seq, " is not divisible by context x tensor parallel "
                       "degrees = ", cp * tp, " (sequence parallel splits each row's tokens); use a "
                       "multiple of ", cp * tp, " or 0 (training.seq_len)");
  }
  require(c.comm.timeout_seconds > 0 && c.comm.timeout_seconds <= kMaxCommTimeoutSeconds,
          key("comm.timeout_seconds"),
          c10::str("in [1, ", kMaxCommTimeoutSeconds,
                   "] (at most one week: larger values overflow the millisecond timeouts)"),
          c);
  const ProfilingSection& prof = c.profiling;
  require(!prof.save_traces_folder.empty(), key("profiling.save_traces_folder"), "a non-empty path", c);
  require(!prof.save_memory_snapshot_folder.empty(), key("profiling.save_memory_snapshot_folder"),
          "a non-empty path", c);
  require(prof.profiler_active >= 1, key("profiling.profiler_active"), ">= 1", c);
  require(prof.profiler_warmup >= 0, key("profiling.profiler_warmup"), ">= 0", c);
  require(prof.profile_freq >= 1, key("profiling.profile_freq"), ">= 1", c);
  // The window's warm-up and recorded steps exist only when the profiler runs: a memory snapshot
  // alone (enable_memory_snapshot) uses profile_freq as its period and nothing else.
  LOOM_REQUIRE_USAGE(!prof.enable_profiling || prof.profile_freq >= prof.profiler_warmup + prof.profiler_active,
                     "profiling.profile_freq = ", prof.profile_freq, " is shorter than profiling.profiler_warmup + "
                     "profiling.profiler_active = ", prof.profiler_warmup, " + ", prof.profiler_active,
                     " (each window of profile_freq steps holds the warm-up and the recorded steps); set "
                     "profiling.profile_freq to at least ", prof.profiler_warmup + prof.profiler_active);
  // Settings that do not compose with each other: the table's rows that read only the config.
  check_compatibility(c, nullptr);
}

int64_t gradient_accumulation_steps(const JobConfig& config, int64_t data_parallel_degree) {
  LOOM_REQUIRE(data_parallel_degree >= 1, "data-parallel degree must be >= 1, got ",
               data_parallel_degree);
  const int64_t global = config.training.global_batch_size;
  if (global == -1) return 1;
  const int64_t per_step = config.training.local_batch_size * data_parallel_degree;
  LOOM_REQUIRE_USAGE(global > 0 && global % per_step == 0, "training.global_batch_size (", global,
                     ") is not a multiple of training.local_batch_size x data-parallel degree (",
                     config.training.local_batch_size, " x ", data_parallel_degree, " = ",
                     per_step, "); set it to a multiple of ", per_step, " or to -1");
  return global / per_step;
}

optim::AdamWOptions adamw_options(const JobConfig& config) {
  const OptimizerSection& o = config.optimizer;
  return optim::AdamWOptions{.lr = o.lr,
                             .beta1 = o.beta1,
                             .beta2 = o.beta2,
                             .eps = o.eps,
                             .implementation = optim::parse_adamw_implementation(o.implementation)};
}

optim::MuonOptions muon_options(const JobConfig& config) {
  const OptimizerSection& o = config.optimizer;
  return optim::MuonOptions{.momentum = o.muon_momentum,
                            .nesterov = o.muon_nesterov,
                            .ns_steps = o.muon_ns_steps,
                            .adjust_lr = optim::parse_muon_lr_adjust(o.muon_adjust_lr)};
}

parallel::OptimizerRequest optimizer_request(const JobConfig& config) {
  return parallel::OptimizerRequest{.adamw = adamw_options(config),
                                    .muon = muon_options(config),
                                    .weight_decay = config.optimizer.weight_decay,
                                    .block_size = config.optimizer.block_size};
}

optim::LRScheduleOptions lr_schedule_options(const JobConfig& config) {
  const LRSchedulerSection& s = config.lr_scheduler;
  return optim::LRScheduleOptions{.warmup_steps = s.warmup_steps,
                                  .decay_ratio = s.decay_ratio,
                                  .decay_type = optim::parse_decay_type(s.decay_type),
                                  .min_lr_factor = s.min_lr_factor};
}

}  // namespace loom::train
