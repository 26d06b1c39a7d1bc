#include "loom/rl/policies.h"

#include <sstream>

#include "loom/core/error.h"
#include "loom/lora/lora.h"

namespace loom::rl {
namespace {
bool is_adapter_tensor(const std::string& name) {
  const std::string tag = std::string(".") + lora::kAdapterName + ".";
  return name.find(tag) != std::string::npos;
}
}  // namespace

PolicySet::PolicySet(models::Decoder& model, int64_t count) : model_(model) {
  LOOM_REQUIRE(count >= 1, "PolicySet needs at least one policy, got ", count);
  std::vector<torch::Tensor> first;
  for (const auto& p : model.named_parameters()) {
    if (!is_adapter_tensor(p.name)) continue;
    slots_.push_back(p.slot);
    first.push_back(p.slot->tensor);
  }
  LOOM_REQUIRE(!slots_.empty(), "PolicySet: the model has no LoRA adapters");
  tensors_.push_back(std::move(first));
  for (int64_t k = 1; k < count; ++k) {
    std::vector<torch::Tensor> copy;
    for (const torch::Tensor& t : tensors_.front()) copy.push_back(t.detach().clone().requires_grad_(true));
    tensors_.push_back(std::move(copy));
  }
}

void PolicySet::bind(int64_t k) {
  LOOM_REQUIRE(k >= 0 && k < size(), "no policy ", k, " of ", size());
  for (size_t i = 0; i < slots_.size(); ++i) slots_[i]->tensor = tensors_[static_cast<size_t>(k)][i];
  bound_ = k;
}

int64_t PolicySet::adapter_bytes() const {
  int64_t bytes = 0;
  for (const torch::Tensor& t : tensors_.front()) bytes += t.numel() * static_cast<int64_t>(t.element_size());
  return bytes;
}

// The rows the next forward computes, as runs of consecutive rows of one policy (a step's rows are
// grouped by policy, and dropping finished rows keeps them grouped: one run per policy).
struct PolicySet::RowAdapters::Rows {
  struct Run {
    int64_t policy, start, count;
  };
  std::vector<Run> runs;
  int64_t count = 0;
};

PolicySet::RowAdapters::RowAdapters(PolicySet& set, std::vector<int64_t> policy_of_row, double scaling)
    : set_(set), policy_of_row_(std::move(policy_of_row)), rows_(std::make_shared<Rows>()) {
  for (int64_t p : policy_of_row_) LOOM_REQUIRE(p >= 0 && p < set.size(), "RowAdapters: no policy ", p);
  std::vector<int64_t> all(policy_of_row_.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
  set_rows(all);
  for (const auto& [path, module] : set.model_.named_modules()) {
    auto* adapter = dynamic_cast<lora::Adapter*>(module->find_submodule(lora::kAdapterName));
    if (adapter == nullptr) continue;
    // The adapter's tensors of every policy: a [r, in], b [out, r] each.
    std::vector<torch::Tensor> as, bs;
    for (const auto& tensors : set.tensors_) {
      for (size_t i = 0; i < set.slots_.size(); ++i) {
        if (set.slots_[i]->owner != adapter) continue;
        (set.slots_[i]->name == "a" ? as : bs).push_back(tensors[i].detach());
      }
    }
    LOOM_REQUIRE(as.size() == set.tensors_.size() && bs.size() == as.size(), "RowAdapters: adapter of '", path,
                 "' has no a/b pair per policy");
    const nn::ForwardOverride previous = adapter->previous_override();
    const std::shared_ptr<Rows> rows = rows_;
    saved_.emplace_back(module, module->forward_override());
    module->set_forward_override([previous, as, bs, rows, scaling](nn::Module& m, const torch::Tensor& x,
                                                                   const nn::ForwardFn& forward) {
      const torch::Tensor base = previous ? previous(m, x, forward) : forward(x);
      // x [rows, T, in], or its tokens flattened row by row ([rows * T, in]: an MoE's shared experts).
      const int64_t n_rows = rows->count, tokens = x.numel() / x.size(-1);
      LOOM_REQUIRE(n_rows > 0 && tokens % n_rows == 0, "per-row adapters: ", tokens, " tokens are not ", n_rows,
                   " rows of equal length (x ", x.sizes(), ")");
      const torch::Tensor by_row = x.reshape({n_rows, tokens / n_rows, x.size(-1)});
      // Each run of rows through its policy's adapter: one pair of GEMMs per policy, no gathered copies.
      std::vector<torch::Tensor> parts;
      for (const Rows::Run& run : rows->runs) {
        const auto k = static_cast<size_t>(run.policy);
        parts.push_back(at::linear(at::linear(by_row.narrow(0, run.start, run.count), as[k]), bs[k]));
      }
      const torch::Tensor delta = parts.size() == 1 ? parts.front() : torch::cat(parts, 0);
      return base + (delta * scaling).reshape(base.sizes()).to(base.scalar_type());
    });
  }
  LOOM_REQUIRE(!saved_.empty(), "RowAdapters: the model has no LoRA adapters");
}

PolicySet::RowAdapters::~RowAdapters() {
  for (auto& [module, hook] : saved_) module->set_forward_override(hook);
}

void PolicySet::RowAdapters::set_rows(const std::vector<int64_t>& rows) {
  rows_->runs.clear();
  for (size_t i = 0; i < rows.size(); ++i) {
    const int64_t policy = policy_of_row_.at(static_cast<size_t>(rows[i]));
    if (rows_->runs.empty() || rows_->runs.back().policy != policy) {
      rows_->runs.push_back({policy, static_cast<int64_t>(i), 0});
    }
    ++rows_->runs.back().count;
  }
  rows_->count = static_cast<int64_t>(rows.size());
}

std::vector<std::string> split_policy_names(const std::string& list) {
  std::vector<std::string> out;
  if (list.find_first_not_of(" \t") == std::string::npos) return out;
  std::stringstream in(list);
  std::string item;
  while (std::getline(in, item, ',')) {
    const size_t first = item.find_first_not_of(" \t"), last = item.find_last_not_of(" \t");
    out.push_back(first == std::string::npos ? std::string() : item.substr(first, last - first + 1));
  }
  return out;
}

}  // namespace loom::rl
