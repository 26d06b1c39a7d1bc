// The activations of one training step, recorded on each rank through forward hooks put on the
// model from outside (the model and the Trainer know nothing of them) and gathered whole in one
// process: how `loom check-layouts` names the first module whose output or gradient differs.
//
// Recorded modules: tok_embeddings, every block (layers.N: the residual stream after it), each
// block's children other than its norms (layers.N.attention, layers.N.feed_forward or .moe: their
// outputs have the residual stream's layout) and the final norm. The blocks' own norms are left out:
// a hooked RMSNorm::add_and_forward leaves its fused kernel, which would change the arithmetic
// being compared. The output head fuses with the loss (no logits exist), so the gradient reaching
// the final norm's output stands for it.
//
// Each recorded tensor is [rows, seq, ...] on the rank; where it sits in the step's global
// [rows, seq] grid follows from the layout (ActivationGeometry):
//   rows     the loader gives data-parallel rank r of W rows [r B, (r+1) B) of each W B; a pipeline
//            runs each loaded batch as micro-batches of consecutive rows, each stage's forwards in
//            micro-batch order; gradient accumulation repeats that per loaded batch;
//   sequence context parallelism holds chunks i and 2c-1-i of the 2c chunks of each row (cp/);
//            sequence parallelism then splits that local sequence into tp contiguous pieces; a
//            tensor of the whole local sequence is replicated over tp (rank 0's is kept).
// The gradients are recorded as d(loss)/d(activation) of the rank's own loss, the mean over its
// tokens; they are scaled by 1 / (dp x cp) to the global mean's, the reference's.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "loom/layouts/compare.h"
#include "loom/nn/module.h"

namespace loom::layouts {

struct ActivationGeometry {
  int64_t local_batch = 1;   // rows per loaded batch on this rank
  int64_t microbatches = 1;  // per loaded batch (a pipeline's), 1 without
  int64_t seq_len = 1;       // the global sequence length
  int dp_degree = 1, dp_rank = 0;
  int cp_degree = 1, cp_rank = 0;
  int tp_degree = 1, tp_rank = 0;
};

// Global sequence positions [start, start + length) that a piece's local sequence holds, in order.
using Segments = std::vector<std::pair<int64_t, int64_t>>;

// The first global row of a module's call `call` (its forwards counted from 0 in the step) of
// `rows` rows.
int64_t row_start(const ActivationGeometry& g, int64_t call, int64_t rows);
// The global positions of a local sequence of `local_len` tokens: nullopt when the length is
// neither the context-parallel piece nor its sequence-parallel part. `replicated`: the tensor is
// the same on every tp rank.
std::optional<Segments> sequence_segments(const ActivationGeometry& g, int64_t local_len, bool& replicated);

// One recorded tensor with its place in the global grid.
struct ActivationPiece {
  std::string module;
  std::string kind;  // "output" or "grad"
  int64_t order = 0;  // the module's index in its model part's named_modules() (registration order)
  int64_t row = 0;
  Segments segments;
  torch::Tensor data;  // [rows, sum of segment lengths, ...], float32 on the CPU
};

// Whether `name` (a module path from a model part's root) is one the recorder hooks.
bool recorded_module(const std::string& name);

// Hooks the recorded modules of `parts` (this rank's model or pipeline stages) while alive; only
// forwards that build a graph are recorded (not activation checkpointing's no-grad first pass: its
// recompute, which has the same values, is), so each module's calls count its micro-batches.
class ActivationRecorder {
 public:
  ActivationRecorder(const std::vector<std::shared_ptr<nn::Module>>& parts, ActivationGeometry geometry);
  ~ActivationRecorder();
  ActivationRecorder(const ActivationRecorder&) = delete;
  ActivationRecorder& operator=(const ActivationRecorder&) = delete;

  void remove_hooks();
  const std::vector<ActivationPiece>& pieces() const { return *pieces_; }
  // Modules whose tensors had a layout the geometry does not place (not recorded).
  const std::vector<std::string>& unplaced() const { return *unplaced_; }
  // Writes the pieces as one safetensors file with their places in its metadata.
  void write(const std::filesystem::path& file) const;

 private:
  ActivationGeometry geometry_;
  std::vector<nn::HookHandle> handles_;
  std::shared_ptr<std::vector<ActivationPiece>> pieces_;
  std::shared_ptr<std::vector<std::string>> unplaced_;
  std::shared_ptr<std::map<std::string, int64_t>> calls_;
};

// Every piece of the files in `dir` (rank-*.safetensors, as ActivationRecorder::write wrote them).
std::vector<ActivationPiece> read_pieces(const std::filesystem::path& dir);

// The pieces placed into whole [rows, seq_len, ...] tensors. A module whose pieces do not cover
// every position of the grid (a layout the recorder could not place everywhere) is left out and
// named in `incomplete`.
StepActivations assemble(const std::vector<ActivationPiece>& pieces, int64_t rows, int64_t seq_len,
                         std::vector<std::string>* incomplete = nullptr);

}  // namespace loom::layouts
