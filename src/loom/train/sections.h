// The Trainer's own sections of a job config: [job], [training], [metrics], [validation]. Every
// other section is declared by its feature's folder (models/config.h, parallel/config.h,
// optim/lr_scheduler.h, ac/, float8/, checkpoint/, distributed/, profiling/); train/config.h puts
// them together.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "loom/core/device.h"
#include "loom/core/dtype.h"
#include "loom/core/options.h"
#include "loom/data/sources.h"

namespace loom::train {

struct JobSection {
  std::string dump_folder = "outputs";
  std::string description = "default job";
  bool print_config = false;

  bool operator==(const JobSection&) const = default;
};
const options::Section& job_section();

// training.step_readback: when the host reads a step's loss and gradient norm.
enum class StepReadback {
  kAuto,       // kLogSteps on an accelerator with an optimizer that applies a StepGuard, else kEveryStep
  kEveryStep,  // after the backward, before the optimizer step
  kLogSteps,   // at log steps only; clipping and the non-finite guard on the device
};
const options::EnumNames<StepReadback>& option_names(StepReadback);

struct TrainingSection {
  std::string dataset_path = "data/default/corpus.jsonl";
  data::DatasetFormat dataset_format = data::DatasetFormat::kJsonl;
  std::string jsonl_field = "text";  // the JSONL field holding each document's text
  std::string text_column = "text";  // the Parquet/Arrow column holding each document's text
  std::vector<data::DatasetSource> datasets;  // a weighted mixture; replaces dataset_path when set
  int64_t data_workers = 0;  // threads tokenizing at load; 0 = the rank's intra-op threads
  bool token_cache = true;  // text/JSONL inputs tokenized once, kept in data::default_token_cache_dir()
  int64_t local_batch_size = 8;
  int64_t global_batch_size = -1;  // -1 = local_batch_size x data-parallel degree
  int64_t seq_len = 2048;
  double max_norm = 1.0;
  int64_t steps = 10000;
  int64_t seed = 0;
  bool deterministic = false;
  Precision mixed_precision_param = Precision::kFloat32;
  Precision mixed_precision_reduce = Precision::kFloat32;
  int64_t skip_nonfinite_steps = 0;  // NaN/inf loss or grad norm: steps skipped before stopping
  // The default stays the CPU so `make train` (2 FSDP ranks on the CPU) behaves the same on a
  // machine that has a GPU.
  DeviceRequest device = DeviceRequest::kCpu;
  bool allow_tf32 = false;  // TF32 tensor cores for float32 matmuls/convolutions on CUDA
  std::string cuda_kernels = "all";  // Loom's CUDA kernels in use: "all" | "none" | a list
  StepReadback step_readback = StepReadback::kAuto;

  bool operator==(const TrainingSection&) const = default;
};
const options::Section& training_section();

struct MetricsSection {
  int64_t log_freq = 10;
  bool enable_jsonl = true;
  bool enable_tensorboard = false;
  bool memory_breakdown = true;  // train/memory_accounting.h
  double peak_flops = 0.0;  // FLOP/s per rank for MFU; 0 = measure this machine's fp32 GEMM peak

  bool operator==(const MetricsSection&) const = default;
};
const options::Section& metrics_section();

// TorchTitan's [validation]: the loss on held-out data every `freq` steps and at the last step.
struct ValidationSection {
  bool enable = false;
  std::string dataset_path;  // held-out data, in any form training.dataset_path takes
  data::DatasetFormat dataset_format = data::DatasetFormat::kAuto;
  int64_t freq = 100;             // every this many steps, and at the last step
  int64_t steps = -1;             // batches per evaluation; -1 = the whole file once
  int64_t local_batch_size = 0;   // 0 = training.local_batch_size
  int64_t seq_len = 0;            // 0 = training.seq_len

  bool operator==(const ValidationSection&) const = default;
};
const options::Section& validation_section();

}  // namespace loom::train
