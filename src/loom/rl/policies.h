// Many policies over one resident base (issue 51, MinT's multi-policy GRPO): P LoRA adapters train
// concurrently in one job over one loaded base. The model carries one adapter module per adapted
// linear (lora::apply_lora); each policy owns its own copy of every adapter tensor, and binding a
// policy points the adapter modules at its tensors (no copy), so an update, an export or the
// reference forward of policy k runs on the ordinary LoRA path. Rollouts of every policy are
// decoded in one batch: RowAdapters replaces each adapted linear's LoRA hook by one that adds, to
// each row, its own policy's adapter (the rows taken in runs of consecutive rows of one policy,
// each run through its policy's A and B), so the base runs once for all rows.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loom/models/common/decoder.h"
#include "loom/nn/module.h"

namespace loom::rl {

class PolicySet {
 public:
  // `model` has its LoRA adapters applied; their current tensors become policy 0's and every other
  // policy starts from a copy (fill them after bind(k), e.g. with init_adapters).
  PolicySet(models::Decoder& model, int64_t count);
  int64_t size() const { return static_cast<int64_t>(tensors_.size()); }
  // Points the model's adapters at policy k's tensors.
  void bind(int64_t k);
  int64_t bound() const { return bound_; }
  // Policy k's adapter tensors (leaves, requires_grad), in the model's parameter order: what its
  // optimizer steps.
  const std::vector<torch::Tensor>& parameters(int64_t k) const { return tensors_.at(static_cast<size_t>(k)); }
  // Bytes of one policy's adapter tensors.
  int64_t adapter_bytes() const;

  // While alive, each adapted linear computes base(x) + the adapter of the row's policy for every row
  // of x [rows, T, in] (or [rows * T, in], flattened row by row): row i of the batch uses policy policy_of_row[rows[i]] where `rows` is the
  // last set_rows (initially all). Inference only (rollouts); the LoRA hooks are put back after.
  class RowAdapters {
   public:
    RowAdapters(PolicySet& set, std::vector<int64_t> policy_of_row, double scaling);
    ~RowAdapters();
    RowAdapters(const RowAdapters&) = delete;
    RowAdapters& operator=(const RowAdapters&) = delete;
    void set_rows(const std::vector<int64_t>& rows);

   private:
    struct Rows;
    PolicySet& set_;
    std::vector<int64_t> policy_of_row_;
    std::shared_ptr<Rows> rows_;
    std::vector<std::pair<nn::Module*, nn::ForwardOverride>> saved_;
  };

 private:
  models::Decoder& model_;
  std::vector<nn::ParameterSlot*> slots_;           // the adapter modules' a and b, in parameter order
  std::vector<std::vector<torch::Tensor>> tensors_;  // [policy][slot]
  int64_t bound_ = 0;
};

// "a,b,c" -> {"a", "b", "c"} (blanks trimmed); "" -> {} (one unnamed policy).
std::vector<std::string> split_policy_names(const std::string& list);

}  // namespace loom::rl
