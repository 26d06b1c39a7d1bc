#include "loom/ddp/ddp.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "loom/core/error.h"

namespace loom::ddp {
namespace {

// Fires after AccumulateGrad has added this backward's gradient into param.grad (our bucket view).
class GradReadyHook : public torch::autograd::FunctionPostHook {
 public:
  GradReadyHook(std::function<void()> on_ready) : on_ready_(std::move(on_ready)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    on_ready_();
    return outputs;
  }

 private:
  std::function<void()> on_ready_;
};

}  // namespace

DataParallel::DataParallel(nn::Module& module, std::shared_ptr<distributed::Comm> comm, DDPOptions options)
    : comm_(std::move(comm)), options_(options) {
  LOOM_REQUIRE(comm_ != nullptr, "DDP needs a communication group");
  LOOM_REQUIRE(options_.bucket_cap_bytes > 0, "DDP bucket_cap_bytes must be positive, got ",
               options_.bucket_cap_bytes);
  for (const auto& p : module.named_parameters()) {
    if (!p.slot->requires_grad) continue;
    const auto& t = p.slot->tensor;
    LOOM_REQUIRE(t.is_leaf() && t.requires_grad(), "DDP parameter '", p.name,
                 "' is not a trainable leaf tensor; apply DDP before any other parameter wrapper");
    LOOM_REQUIRE(!t.is_meta(), "DDP parameter '", p.name,
                 "' is still on the meta device; materialize the model before applying DDP");
    // The buckets are allocated next to the parameters and all-reduced by the group's backend
    // for that device (NCCL for a CUDA rank's device): both must be the rank's device.
    LOOM_REQUIRE(comm_->size() == 1 || t.device() == comm_->device(), "DDP parameter '", p.name,
                 "' is on ", t.device(), " but group ", comm_->describe(), " serves ",
                 comm_->device(), "; move the model to the rank's device before applying DDP");
    params_.push_back({p.name, p.slot});
  }
  LOOM_REQUIRE(!params_.empty(), "DDP found no trainable parameters in the module");

  // Buckets in reverse registration order: the order in which backward produces gradients.
  // A bucket holds one dtype and at most bucket_cap_bytes (a larger parameter gets its own).
  int64_t bucket_bytes = 0;
  c10::ScalarType bucket_dtype = c10::ScalarType::Undefined;
  for (int i = static_cast<int>(params_.size()) - 1; i >= 0; --i) {
    const auto& t = params_[i].slot->tensor;
    const int64_t bytes = t.numel() * t.element_size();
    const bool start_new = buckets_.empty() || t.scalar_type() != bucket_dtype ||
                           bucket_bytes + bytes > options_.bucket_cap_bytes;
    if (start_new) {
      buckets_.emplace_back();
      bucket_bytes = 0;
      bucket_dtype = t.scalar_type();
    }
    buckets_.back().params.push_back(i);
    params_[i].bucket = static_cast<int>(buckets_.size()) - 1;
    bucket_bytes += bytes;
  }

  torch::NoGradGuard no_grad;
  for (auto& bucket : buckets_) {
    int64_t numel = 0;
    for (int i : bucket.params) numel += params_[i].slot->tensor.numel();
    const auto& first = params_[bucket.params.front()].slot->tensor;
    torch::Tensor flat = torch::zeros({numel}, first.options().requires_grad(false));
    int64_t offset = 0;
    for (int i : bucket.params) {
      torch::Tensor& param = params_[i].slot->tensor;
      const int64_t n = param.numel();
      param.mutable_grad() = flat.narrow(0, offset, n).view(param.sizes());
      offset += n;
    }
    bucket_buffers_.push_back(flat);
  }

  if (options_.broadcast_parameters && comm_->size() > 1) {
    // One coalesced broadcast per bucket layout instead of one per parameter.
    for (const auto& bucket : buckets_) {
      std::vector<torch::Tensor> flat_params;
      for (int i : bucket.params) flat_params.push_back(params_[i].slot->tensor.detach().reshape(-1));
      torch::Tensor flat = torch::cat(flat_params);
      comm_->broadcast(flat, 0);
      int64_t offset = 0;
      for (int i : bucket.params) {
        auto& param = params_[i].slot->tensor;
        param.detach().copy_(flat.narrow(0, offset, param.numel()).view(param.sizes()));
        offset += param.numel();
      }
    }
  }

  for (int i = 0; i < static_cast<int>(params_.size()); ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[i].slot->tensor);
    accumulator->add_post_hook(std::make_unique<GradReadyHook>([this, i] { on_grad_ready(i); }));
    grad_accumulators_.push_back(std::move(accumulator));
  }
  reset_for_next_backward();
}

DataParallel::~DataParallel() {
  // Outstanding work references our buffers; never leave it running behind a destroyed object.
  for (auto& bucket : buckets_) {
    if (bucket.work) {
      try {
        bucket.work->wait();
      } catch (...) {
      }
    }
  }
}

void DataParallel::reset_for_next_backward() {
  for (auto& p : params_) p.ready = false;
  for (auto& b : buckets_) {
    b.pending = static_cast<int>(b.params.size());
    b.issued = false;
    b.work.reset();
  }
  next_bucket_to_issue_ = 0;
  backward_started_ = false;
}

void DataParallel::on_grad_ready(int param_index) {
  if (!sync_enabled_ || comm_->size() == 1) return;
  backward_started_ = true;
  Param& p = params_[param_index];
  // A parameter used twice in one forward fires twice; count it once.
  if (p.ready) return;
  p.ready = true;
  --buckets_[p.bucket].pending;
  issue_ready_buckets();
}

void DataParallel::issue_ready_buckets() {
  while (next_bucket_to_issue_ < static_cast<int>(buckets_.size()) &&
         buckets_[next_bucket_to_issue_].pending == 0) {
    Bucket& b = buckets_[next_bucket_to_issue_];
    b.work = comm_->all_reduce_async(bucket_buffers_[next_bucket_to_issue_], distributed::ReduceOp::kAvg);
    b.issued = true;
    ++next_bucket_to_issue_;
  }
}

void DataParallel::finish_gradient_sync() {
  if (!sync_enabled_ || comm_->size() == 1) return;
  // Parameters that took no part in this forward never fired: their (zero or accumulated) gradient
  // is still reduced, in bucket order, so every rank issues the same collectives.
  for (auto& b : buckets_) b.pending = 0;
  issue_ready_buckets();
  for (auto& b : buckets_) {
    if (b.work) b.work->wait();
  }
  reset_for_next_backward();
}

void DataParallel::zero_grad() {
  for (auto& flat : bucket_buffers_) flat.zero_();
}

}  // namespace loom::ddp
