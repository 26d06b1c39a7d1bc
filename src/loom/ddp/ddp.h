// Data parallelism by replication (DDP) — the dp_replicate dimension when FSDP is not used.
//
// Applied from outside the model: every trainable parameter's gradient becomes a view into a flat
// per-bucket buffer (gradient-as-bucket-view), so autograd accumulates straight into the buffer and
// the all-reduce needs no copy in or out. Buckets hold parameters in reverse registration order
// (the order backward produces gradients) up to `bucket_cap_bytes`. A post-accumulate-grad hook on
// each parameter counts down its bucket; when a bucket is complete its all-reduce (average) is issued
// asynchronously, so communication of late layers overlaps the backward of earlier ones. Buckets
// are issued strictly in index order on every rank (c10d requires the same collective order), and
// finish_gradient_sync() waits for all of them before the optimizer step.
//
// Gradient accumulation: with set_gradient_sync(false) backward only accumulates locally (no
// communication); the last micro-batch of a step runs with sync on and reduces the accumulated sum.
#pragma once
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "loom/core/torch_compat.h"
#include "loom/distributed/comm.h"
#include "loom/nn/module.h"

namespace torch::autograd {
struct Node;
}

namespace loom::ddp {

struct DDPOptions {
  int64_t bucket_cap_bytes = 25 * 1024 * 1024;  // PyTorch DDP's default
  // Make every replica start from rank 0's parameters (they are already equal when every rank
  // initializes from the same seed; this makes it a guarantee, e.g. after a partial load).
  bool broadcast_parameters = true;
};

class DataParallel {
 public:
  // `module`'s trainable parameters are replicated over `comm` (the dp_replicate group).
  DataParallel(nn::Module& module, std::shared_ptr<distributed::Comm> comm, DDPOptions options = {});
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  // Off: backward accumulates locally only (gradient accumulation micro-batches).
  void set_gradient_sync(bool enabled) { sync_enabled_ = enabled; }
  bool gradient_sync() const { return sync_enabled_; }

  // Issues any bucket not yet issued (parameters unused by this forward), then waits for every
  // all-reduce of this backward. Call after backward, before clipping and the optimizer.
  void finish_gradient_sync();

  // Zeroes the flat gradient buffers in place (gradients stay views into them).
  void zero_grad();

  int num_buckets() const { return static_cast<int>(buckets_.size()); }
  const std::vector<torch::Tensor>& bucket_buffers() const { return bucket_buffers_; }

 private:
  struct Bucket {
    std::vector<int> params;  // indices into params_
    int pending = 0;          // gradients still to arrive in this backward
    bool issued = false;
    distributed::WorkHandle work;
  };
  struct Param {
    std::string name;
    nn::ParameterSlot* slot;
    int bucket = -1;
    bool ready = false;
  };

  void on_grad_ready(int param_index);
  void issue_ready_buckets();
  void reset_for_next_backward();

  std::shared_ptr<distributed::Comm> comm_;
  DDPOptions options_;
  std::vector<Param> params_;
  std::vector<Bucket> buckets_;
  std::vector<torch::Tensor> bucket_buffers_;
  // Autograd holds grad accumulators weakly; keeping them here keeps our hooks alive.
  std::vector<compat::GradAccumulatorPtr> grad_accumulators_;
  int next_bucket_to_issue_ = 0;
  bool sync_enabled_ = true;
  bool backward_started_ = false;
};

}  // namespace loom::ddp
