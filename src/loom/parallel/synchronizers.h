// The Synchronizer of each parallelism Loom composes (synchronizer.h), made by the composition
// (models/common/parallelize.cpp, pipeline.cpp) next to the parallelism it applies.
#pragma once
#include <memory>
#include <string>

#include "loom/ddp/ddp.h"
#include "loom/ep/expert_parallel.h"
#include "loom/fsdp/fully_shard.h"
#include "loom/parallel/synchronizer.h"
#include "loom/pipeline/executor.h"
#include "loom/tp/tensor_parallel.h"

namespace loom::parallel {

// Tensor parallelism: after the data-parallel reductions, the gradients of replicated parameters
// each rank computed only partly (SP norms, QK-norms) are summed over tp; its shards' squares
// are summed over tp for the norm.
class TensorParallelSync : public Synchronizer {
 public:
  explicit TensorParallelSync(std::shared_ptr<tp::TensorParallel> tp) : tp_(std::move(tp)) {}
  std::string describe() const override;
  void finish(ParameterStorage& storage) override;
  tensor::CommPtr norm_comm(const std::string& param) const override;
  std::vector<tensor::CommPtr> norm_comms() const override { return {tp_->comm()}; }
  void describe_layout(OptimizerLayout& layout) const override { layout.tensor_parallel_degree = tp_->degree(); }

 private:
  std::shared_ptr<tp::TensorParallel> tp_;
};

// Expert parallelism: the routed experts' pieces live on the ep ranks, so their squares are
// summed over ep for the norm. Their gradients need no step of their own: the dispatch's backward
// brings each expert every rank's contribution, and the experts' FSDP (efsdp) averages them.
class ExpertParallelSync : public Synchronizer {
 public:
  explicit ExpertParallelSync(std::shared_ptr<ep::ExpertParallel> ep) : ep_(std::move(ep)) {}
  std::string describe() const override { return c10::str("EP ", ep_->degree()); }
  tensor::CommPtr norm_comm(const std::string& param) const override {
    return ep_->is_sharded(param) ? ep_->comm() : nullptr;
  }
  std::vector<tensor::CommPtr> norm_comms() const override { return {ep_->comm()}; }

 private:
  std::shared_ptr<ep::ExpertParallel> ep_;
};

// Context parallelism: each loaded row becomes this rank's head-tail chunks, with their positions
// and documents (its gradients are averaged by FSDP over dp_shard x cp).
class ContextParallelSync : public Synchronizer {
 public:
  explicit ContextParallelSync(tensor::CommPtr cp) : cp_(std::move(cp)) {}
  std::string describe() const override;
  void prepare_batch(ModelBatch& batch) const override;

 private:
  tensor::CommPtr cp_;
};

// FSDP (and HSDP): gradients accumulate unsharded over micro-batches and are reduce-scattered (and
// all-reduced over replicas) by the last one's backward. Inside pipeline stages the schedule drives
// it instead (each stage its own FSDP root; UNSHARD / REDUCE_GRAD / RESHARD actions, see
// models/common/pipeline.cpp), and the hooks never reduce.
//
// With `accumulate_unsharded` (parallelism.fsdp_accumulate_unsharded) a step of several
// micro-batches also keeps the parameters gathered: every micro-batch runs without reshard after
// forward, and all but the last without reshard after backward (FSDP2's set_reshard_after_forward /
// set_reshard_after_backward), so each group is all-gathered by the step's first forward only and
// freed by its last backward. finish() puts the policy's resharding back (validation forwards, and
// a step of one micro-batch, reshard as the policy says).
class FsdpSync : public Synchronizer {
 public:
  explicit FsdpSync(fsdp::FSDPRoots fsdp, bool accumulate_unsharded = false)
      : fsdp_(std::move(fsdp)), accumulate_unsharded_(accumulate_unsharded) {}
  std::string describe() const override;
  // Called by LossStep only (a pipeline's micro-batches are the schedule's).
  void begin_micro_batch(bool last) override {
    // Held from the first of several micro-batches through the last: a step of one micro-batch
    // (last from the start) keeps the policy's resharding.
    const bool hold = accumulate_unsharded_ && (!last || holding_);
    for (const auto& root : fsdp_.roots()) {
      root->set_requires_gradient_sync(last);
      if (hold) {
        root->set_reshard_after_forward(false);
        root->set_reshard_after_backward(last);
      }
    }
    holding_ = hold;
  }
  void finish(ParameterStorage& /*storage*/) override {
    fsdp_.finalize_backward();
    if (!holding_) return;
    for (const auto& root : fsdp_.roots()) {
      root->set_reshard_after_forward(true);
      root->set_reshard_after_backward(true);
      root->reshard();  // normally a no-op: the last backward freed every group
    }
    holding_ = false;
  }

 private:
  fsdp::FSDPRoots fsdp_;
  bool accumulate_unsharded_ = false;
  bool holding_ = false;  // this step's micro-batches hold the parameters gathered
};

// DDP: its buckets all-reduce in the last micro-batch's backward; the gradients are views of the
// buckets, so zeroing keeps them.
class DdpSync : public Synchronizer {
 public:
  explicit DdpSync(std::unique_ptr<ddp::DataParallel> ddp) : ddp_(std::move(ddp)) {}
  std::string describe() const override { return "DDP"; }
  void begin_micro_batch(bool last) override { ddp_->set_gradient_sync(last); }
  void finish(ParameterStorage& /*storage*/) override { ddp_->finish_gradient_sync(); }
  bool zero_grad() override {
    ddp_->zero_grad();
    return true;
  }
  bool owns_gradients() const override { return true; }

 private:
  std::unique_ptr<ddp::DataParallel> ddp_;
};

// Replicas of pipeline stages (dp_replicate x pp without FSDP): a stage's weight gradients come
// from several actions per micro-batch, so there is no single last hook to overlap with; once the
// schedule is done, one flat buffer of every gradient is averaged in one all-reduce.
class ReplicaAverageSync : public Synchronizer {
 public:
  explicit ReplicaAverageSync(tensor::CommPtr replicas) : replicas_(std::move(replicas)) {}
  std::string describe() const override;
  void finish(ParameterStorage& storage) override;

 private:
  tensor::CommPtr replicas_;
};

// Pipeline parallelism: each parameter lives on one pp rank, so the norm sums the pp ranks'
// squares.
class PipelineSync : public Synchronizer {
 public:
  PipelineSync(std::shared_ptr<pipeline::PipelineExecutor> executor, tensor::CommPtr pp, int64_t microbatch_size)
      : executor_(std::move(executor)), pp_(std::move(pp)), microbatch_size_(microbatch_size) {}
  std::string describe() const override;
  const char* separator() const override { return " x "; }
  tensor::CommPtr norm_comm(const std::string& /*param*/) const override { return pp_; }
  std::vector<tensor::CommPtr> norm_comms() const override { return {pp_}; }

 private:
  std::shared_ptr<pipeline::PipelineExecutor> executor_;
  tensor::CommPtr pp_;
  int64_t microbatch_size_;
};

}  // namespace loom::parallel
