// Validation (TorchTitan's Validator): every validation.freq steps and at the last step, the model's
// loss on held-out data, run forward only (no gradients, weights untouched).
//
// The held-out file is packed into rows of seq_len + 1 tokens exactly as training data is
// (data/loader.h). An evaluation always starts at the first row and covers validation.steps global
// batches (local_batch_size rows per data-parallel rank), capped at one pass over the file; -1 is
// the whole file once. Global batch i gives data-parallel rank r the rows [i G + r B, i G + (r+1) B)
// (G = B x DP degree), as the training loader does, so every row is scored exactly once whatever the
// layout. A rank whose slice of the last batch is short scores the rows it has; one with none still
// runs the forward of one row and counts nothing, because FSDP's all-gathers in the forward need
// every rank.
//
// loss = mean token cross-entropy over all held-out tokens scored (the definition `loom score`
// prints as "mean NLL"): each rank sums mean-loss x tokens of its batches in float64, and the sums
// and token counts are added over the data-parallel and context-parallel ranks (tensor-parallel
// ranks of a group compute the same loss on the same rows). perplexity = exp(loss). With sft data
// only the trained tokens (labels not data::kIgnoreIndex) are scored and counted.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>

#include "loom/data/loader.h"
#include "loom/data/tokenizer.h"
#include "loom/distributed/comm.h"
#include "loom/parallel/parallelized_model.h"
#include "loom/train/config.h"
#include "loom/train/metrics.h"

namespace loom::train {

struct ValidationResult {
  int64_t step = 0;
  double loss = 0.0;        // mean token cross-entropy over `tokens`
  double perplexity = 0.0;  // exp(loss)
  int64_t tokens = 0;       // held-out tokens scored, over all ranks
  double seconds = 0.0;
};

// The loaded rows as this rank's model takes them (the Trainer's: documents, context-parallel
// chunks, on the device).
using ToModelBatch = std::function<parallel::ModelBatch(const data::Batch&)>;

struct ValidatorOptions {
  ValidationSection config;       // local_batch_size and seq_len resolved (not 0)
  int64_t dp_rank = 0;
  int64_t dp_degree = 1;
  // The data- and context-parallel ranks whose token sums add up (the mesh's "dp_cp"); null: one.
  std::shared_ptr<distributed::Comm> dp_cp;
  std::string token_cache_dir;  // data::SourceOptions::token_cache_dir (training.token_cache)
  data::SftConfig sft;          // how sft data is rendered ([sft])
};

class Validator {
 public:
  // Loads and packs the held-out data (text and JSONL tokenized with `tokenizer`; token ids checked
  // against `model_vocab_size`).
  Validator(ValidatorOptions options, const data::Tokenizer& tokenizer, int64_t model_vocab_size,
            parallel::ParallelizedModel& model, ToModelBatch to_model_batch);

  // When `step` is due (every freq steps, and `last_step`): evaluates, prints the result on rank 0
  // and records it in `metrics` (metrics.jsonl and TensorBoard: validation_loss,
  // validation_perplexity, validation_tokens). Collective: every rank calls it at every step. Its
  // communication is left out of the comm_bytes of the training steps around it.
  void maybe_validate(int64_t step, int64_t last_step, MetricsLogger& metrics);
  // One evaluation now (collective); the same result on every rank.
  ValidationResult validate(int64_t step);

  int64_t rows() const { return rows_; }  // held-out rows one evaluation scores

 private:
  ValidatorOptions options_;
  std::unique_ptr<data::SequencePacker> packer_;
  parallel::ParallelizedModel& model_;
  ToModelBatch to_model_batch_;
  int64_t rows_ = 0;
};

}  // namespace loom::train
