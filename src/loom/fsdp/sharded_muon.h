// Muon (optim/muon.h) on FSDP shards, with no communication in the optimizer step.
//
// Newton-Schulz needs a whole matrix. Instead of gathering each matrix for the step, the FSDP
// planner is asked (muon_granularity, through FSDPPolicy::parameter_granularity) to place every
// Muon matrix whole on one rank (tensor::Granularity::whole()); every other parameter is planned
// in elements. The owning rank orthogonalises its matrices in place in its shard; the other ranks
// hold an empty piece of them and do nothing. The rest (embedding, head, norm scales) is updated
// piece by piece by an optim::AdamW over views of the shard, which is element-wise and so equal to
// the unsharded update.
//
// State dict, under the unsharded optim::Muon's names: per Muon matrix "<fqn>.momentum_buffer"
// (the parameter's shape on its owner, an empty piece elsewhere) and "<fqn>.step" (replicated);
// per other parameter AdamW's "<fqn>.step", "<fqn>.exp_avg", "<fqn>.exp_avg_sq", each this rank's
// piece. sharded_state_dict() adds global shapes and offsets, so checkpoints reshard.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "loom/fsdp/fully_shard.h"
#include "loom/fsdp/sharded_optimizer.h"
#include "loom/optim/adamw.h"
#include "loom/optim/muon.h"
#include "loom/optim/optimizer.h"

namespace loom::fsdp {

// The planner granularity Muon needs: whole() for every parameter optim::is_muon_parameter picks
// (by its name relative to the group's module and its full shape), element() otherwise.
ParameterGranularity muon_granularity();

class ShardedMuon : public ShardedOptimizer {
 public:
  // Throws loom::Error when a Muon matrix is cut across ranks (the groups were not planned with
  // muon_granularity()), loom::UsageError for a bad option.
  ShardedMuon(FSDPRoots fsdp, optim::AdamWOptions adamw_options,
              optim::MuonOptions muon_options, double weight_decay);

  // Finalizes the backward, then updates every group whose gradient shard holds a reduction.
  void step() override;
  void zero_grad(bool set_to_none = true) override;
  void set_lr(double lr) override;
  double lr() const override { return adamw_options_.lr; }

  optim::TensorDict state_dict() const override;
  void load_state_dict(const optim::TensorDict& state) override;
  // Momentum buffers and AdamW moments with their global shapes and offsets (the step counts are
  // replicated scalars and are in state_dict()).
  std::vector<ShardedTensor> sharded_state_dict() const override;

  // This rank's Muon matrices (fully qualified names) and the number of its Muon elements.
  std::vector<std::string> owned_muon_parameters() const;
  int64_t owned_muon_numel() const;

 private:
  struct MuonPiece {
    std::string fqn;
    FSDPParamGroup* group = nullptr;
    tensor::FlatRange local;       // in the group's shard: empty, or the whole matrix
    std::vector<int64_t> shape;    // the matrix's full shape
    int64_t global_offset = 0;
    torch::Tensor momentum_buffer;  // shaped `shape` on the owner, [0] elsewhere
    torch::Tensor step;
    double weight_decay = 0.0;
  };
  // One AdamW piece: parameter `param` of FSDP group `group` (its gradient is read from there).
  struct AdamWSlot {
    FSDPParamGroup* group = nullptr;
    size_t param = 0;
    std::vector<int64_t> shape;  // full shape
    int64_t global_offset = 0;
  };

  FSDPRoots fsdp_;
  optim::AdamWOptions adamw_options_;
  optim::MuonOptions muon_options_;
  std::vector<MuonPiece> muon_;
  std::unique_ptr<optim::AdamW> adamw_;
  std::vector<std::vector<AdamWSlot>> adamw_slots_;  // parallel to adamw_->param_groups()
};

}  // namespace loom::fsdp
