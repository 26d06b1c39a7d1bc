// The policy `loom rl` trains, under any data-parallel and tensor-parallel layout (issue 51): the
// job's model built by the Trainer's composition (models::ModelSpec::parallelize with
// train::parallelize_options: LoRA adapters on the frozen base of checkpoint.initial_load_path,
// TP over parallelism.tensor_parallel_degree, FSDP over dp_shard or DDP over dp_replicate), the
// base loaded as the Trainer loads it (train::load_initial_weights: each rank only its pieces) and
// never copied, and the optimizer over this rank's pieces of the adapters.
//
// How one GRPO step splits so that it equals the single-process one:
//   rollouts    the step's P prompts are cut into dp contiguous blocks of P / dp, each prompt's G
//               samples on one data-parallel rank (its group statistics stay local); each
//               completion samples from its own stream, completion_seed(seed, step, p * G + g)
//               with the global index, so the tokens are those of one process. The tensor-parallel
//               ranks of a replica sample the same rows (each token is tp rank 0's, broadcast, so
//               they never part); under FSDP every forward gathers the parameters, so the
//               data-parallel ranks decode in lockstep (a rank whose completion has ended repeats
//               a forward until every rank's has).
//   rewards     each data-parallel rank scores its rows; of a replica's tensor-parallel ranks only
//               the first (a reward command runs once per row), which broadcasts them.
//   update      the GRPO loss of this rank's rows, normalised by the global batch (every row,
//               every token, or rows x widest row, of all ranks: global_loss_scale), times dp
//               because the composition averages gradients over the data-parallel ranks; the
//               gradient norm and clipping are the composition's (global over every group), then
//               the optimizer step. The KL term's reference is the base: the adapters switched off.
//   metrics     sums over the data-parallel ranks (sum_over_replicas): the same figures as one
//               process.
// Refused before rendezvous, in one line: pipeline, context and expert parallelism, TP with
// sequence or loss parallelism (decoding feeds one token at a time, and the log-probabilities need
// whole logits), and P not a multiple of the data-parallel degree.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "loom/distributed/device_mesh.h"
#include "loom/distributed/parallel_dims.h"
#include "loom/distributed/process_group.h"
#include "loom/models/common/decoder.h"
#include "loom/models/common/generate.h"
#include "loom/models/spec.h"
#include "loom/optim/lr_scheduler.h"
#include "loom/optim/optimizer.h"
#include "loom/parallel/parallelized_model.h"
#include "loom/rl/config.h"
#include "loom/rl/grpo.h"
#include "loom/rl/rollout.h"
#include "loom/train/config.h"

namespace loom::rl {

// The factor that turns the GRPO loss of one rank's rows (grpo_loss over them) into its share of
// the loss over the global batch, so that the shares sum to the single-process loss:
//   kSequenceMean  local rows / global rows
//   kTokenMean     local completion tokens / global completion tokens
//   kDrGrpo        (local rows x local width) / (global rows x global width), the width being the
//                  longest row's completion positions (the T - 1 of token_logprobs)
double global_loss_scale(LossAggregation aggregation, double local_rows, double local_tokens, double local_width,
                         double global_rows, double global_tokens, double global_width);

class ParallelPolicy {
 public:
  // Checks the layout (train::check_layout, then rl's refusals above) before any process group,
  // then forms the world, builds and parallelizes the model, loads the base and builds the
  // optimizer. `vocab_size`: the model's embedding rows (model.vocab_size, else the tokenizer's).
  ParallelPolicy(const train::JobConfig& job, const RlConfig& rl, int64_t vocab_size);
  // A normal end waits for every rank; unwinding from an error does not.
  ~ParallelPolicy();
  ParallelPolicy(const ParallelPolicy&) = delete;
  ParallelPolicy& operator=(const ParallelPolicy&) = delete;

  models::Decoder& decoder() { return *decoder_; }
  const models::ModelSpec& spec() const { return *spec_; }
  parallel::ParallelizedModel& parallel_model() { return *parallel_model_; }
  optim::Optimizer& optimizer() { return *optimizer_; }
  const distributed::ParallelDims& dims() const { return *dims_; }
  int rank() const;
  int world_size() const;
  // Whether this rank writes the run's metrics and prints (world rank 0).
  bool main_rank() const { return rank() == 0; }
  int64_t max_seq_len() const { return decoder_->decoder_args().max_seq_len; }

  // [first, end) of the step's prompts 0 .. prompts_per_step - 1 this rank samples (whole groups).
  std::pair<int64_t, int64_t> prompt_range(int64_t prompts_per_step) const;

  // One completion of `prompt` sampled from `generator`'s stream (a fresh cache of prompt +
  // max_new_tokens positions), in lockstep with the other ranks (see above). Every rank calls it
  // the same number of times per step.
  Completion sample(const std::vector<int64_t>& prompt, const models::SamplingOptions& options,
                    at::Generator& generator);

  // Whether this rank scores its rows: the tensor-parallel ranks of a replica hold the same rows,
  // and only the first runs the reward (a command, a judge) for them.
  bool scores_rewards() const { return !tp_ || tp_->rank() == 0; }
  // The `count` rewards the replica's scoring rank computed (`rewards` there, ignored elsewhere),
  // on every rank of the replica.
  std::vector<double> replica_rewards(std::vector<double> rewards, size_t count);

  // Element-wise sums over the data-parallel ranks (float64; the values themselves with dp = 1).
  std::vector<double> sum_over_replicas(std::vector<double> values);
  double max_over_replicas(double value);

  struct Update {
    torch::Tensor loss;  // this rank's share of the global loss (detached), or the global one when summed
    double grad_norm = 0;  // before clipping
    double lr = 0;         // the step's learning rate
  };
  // One optimizer step: zero the gradients, run `objective` (the forward and this rank's share of
  // the global loss) forward and backward with gradients reduced over the data-parallel ranks
  // as the composition does, clip to max_norm (0: no clipping) by the global norm, step the
  // optimizer and the [lr_scheduler] schedule (over training.steps x rl.updates_per_rollout
  // optimizer steps, as the single-process AdapterOptimizer). A non-finite loss or norm stops the
  // run in one line before the adapters change.
  Update update(const std::function<torch::Tensor()>& objective, double max_norm);
  // Runs `forward` under the autocast the composition chose (mixed precision without FSDP).
  torch::Tensor autocast(const std::function<torch::Tensor()>& forward);

  // The adapters after `step` into `dir`: one process writes a PEFT directory (adapter_config.json
  // + adapter_model.safetensors); several write a Loom adapter checkpoint <dir's parent>/step-N
  // (each rank its pieces; `loom score --adapter` and `loom generate --adapter` read it whole).
  // Collective.
  void save_adapters(const std::filesystem::path& dir, int64_t step);

 private:
  train::JobConfig job_;
  const models::ModelSpec* spec_ = nullptr;
  std::unique_ptr<models::ModelArgs> args_;
  std::unique_ptr<distributed::ParallelDims> dims_;
  c10::Device device_{c10::kCPU};
  std::shared_ptr<distributed::Distributed> dist_;
  std::unique_ptr<distributed::DeviceMesh> mesh_;
  std::shared_ptr<models::Decoder> decoder_;
  std::unique_ptr<parallel::ParallelizedModel> parallel_model_;
  std::unique_ptr<optim::Optimizer> optimizer_;
  std::unique_ptr<optim::LRScheduler> schedule_;
  std::optional<c10::ScalarType> autocast_dtype_;
  std::shared_ptr<distributed::Comm> dp_;  // null: one data-parallel rank
  std::shared_ptr<distributed::Comm> tp_;  // null: no tensor parallelism
};

}  // namespace loom::rl
