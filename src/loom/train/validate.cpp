#include "loom/train/validate.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "loom/core/error.h"
#include "loom/core/logging.h"
#include "loom/core/timer.h"

namespace loom::train {

Validator::Validator(ValidatorOptions options, const data::Tokenizer& tokenizer, int64_t model_vocab_size,
                     parallel::ParallelizedModel& model, ToModelBatch to_model_batch)
    : options_(std::move(options)), model_(model), to_model_batch_(std::move(to_model_batch)) {
  const ValidationSection& v = options_.config;
  LOOM_REQUIRE(v.local_batch_size > 0 && v.seq_len > 0, "Validator needs a resolved batch size and seq_len");
  // Pipeline parallelism is refused by the config check (validation needs a forward-only loss,
  // which ParallelizedModel::forward_loss refuses under a pipeline too).
  Timer timer;
  data::SourceOptions source;
  source.format = data::source_format(v.dataset_format);
  source.format_setting = "validation.dataset_format";
  source.token_cache_dir = options_.token_cache_dir;
  // Every problem with the held-out data (missing, a FIFO, empty, shorter than a row) is then
  // named as validation.* with exit 2, not taken for the training data's.
  source.inputs_setting = "validation.dataset_path";
  source.sft = options_.sft;
  auto corpus = data::TokenCorpus::load({v.dataset_path}, &tokenizer, source, model_vocab_size);
  packer_ = std::make_unique<data::SequencePacker>(corpus, v.seq_len, "validation.seq_len");
  const int64_t global_batch = v.local_batch_size * options_.dp_degree;
  rows_ = packer_->rows_per_epoch();
  if (v.steps > 0) rows_ = std::min(rows_, v.steps * global_batch);
  const int64_t batches = (rows_ + global_batch - 1) / global_batch;
  log::info("validation: ", v.dataset_path, ": ", corpus->num_documents(), " documents, ",
            packer_->rows_per_epoch(), " rows of ", v.seq_len, "; each evaluation scores ", rows_,
            " rows in ", batches, " batch(es) of ", global_batch, " rows, every ", v.freq,
            " steps and at the last step (", timer.seconds(), " s)");
}

void Validator::maybe_validate(int64_t step, int64_t last_step, MetricsLogger& metrics) {
  if (step % options_.config.freq != 0 && step != last_step) return;
  // The forward's collectives (FSDP's all-gathers, TP's) would otherwise count in the next logged
  // step's comm_bytes.
  const distributed::CommSnapshot comm = distributed::comm_stats().snapshot();
  const ValidationResult r = validate(step);
  distributed::comm_stats().restore(comm);
  char line[160];
  std::snprintf(line, sizeof(line), "[validation] step %ld: loss %.4f  perplexity %.2f  (%ld tokens, %.2f s)",
                static_cast<long>(r.step), r.loss, r.perplexity, static_cast<long>(r.tokens), r.seconds);
  metrics.log_scalars(step,
                      {{"validation_loss", r.loss},
                       {"validation_perplexity", r.perplexity},
                       {"validation_tokens", static_cast<double>(r.tokens)}},
                      line);
}

ValidationResult Validator::validate(int64_t step) {
  Timer timer;
  const int64_t B = options_.config.local_batch_size;
  const int64_t global_batch = B * options_.dp_degree;
  // Forward only: no graph is kept and no gradient touched (the model has no dropout, so the
  // forward is the training one).
  torch::NoGradGuard no_grad;
  torch::Tensor loss_sum, token_sum;  // on the device, read back once at the end
  for (int64_t first = 0; first < rows_; first += global_batch) {
    const int64_t mine = first + options_.dp_rank * B;
    const int64_t count = std::clamp<int64_t>(rows_ - mine, 0, B);
    // No rows left for this rank: row 0 keeps it in the forward's collectives and counts nothing.
    const parallel::ModelBatch batch = to_model_batch_(packer_->read_rows(count > 0 ? mine : 0, std::max<int64_t>(count, 1)));
    const torch::Tensor mean = model_.forward_loss(batch).to(torch::kFloat64);
    if (count == 0) continue;
    // Tokens this rank scored (its context-parallel chunks of the rows): the labelled ones (all of
    // them but sft data's masked tokens). A batch with none has a NaN mean and adds nothing.
    const torch::Tensor tokens = batch.labels.ne(data::kIgnoreIndex).sum().to(torch::kFloat64);
    const torch::Tensor sum = torch::where(tokens > 0, mean * tokens, torch::zeros_like(mean));
    loss_sum = loss_sum.defined() ? loss_sum + sum : sum;
    token_sum = token_sum.defined() ? token_sum + tokens : tokens;
  }
  torch::Tensor totals = torch::tensor({loss_sum.defined() ? loss_sum.item<double>() : 0.0,
                                        token_sum.defined() ? token_sum.item<double>() : 0.0},
                                       torch::kFloat64);
  if (options_.dp_cp) options_.dp_cp->all_reduce(totals, distributed::ReduceOp::kSum);
  ValidationResult r;
  r.step = step;
  r.tokens = static_cast<int64_t>(totals[1].item<double>());
  r.loss = totals[0].item<double>() / totals[1].item<double>();
  r.perplexity = std::exp(r.loss);
  r.seconds = timer.seconds();
  return r;
}

}  // namespace loom::train
