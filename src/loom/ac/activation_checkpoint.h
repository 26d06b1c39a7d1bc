// Activation checkpointing (TorchTitan's `activation_checkpoint`), applied to a model's blocks from
// outside, like the other parallelisms: the block's forward hook (nn::Module's around-hook) runs the
// block without keeping its intermediate activations and re-runs it in backward.
//
//   mode "full"                   every wrapped block keeps only its input; backward recomputes it.
//   mode "selective", option N    the same for every N-th block (by layer id), the rest untouched.
//   mode "selective", option "op" every block keeps its input plus the outputs of its expensive
//                                 ops (every bias-free nn::Linear's matmul and the attention core);
//                                 backward recomputes only the cheap ones (norms, RoPE, SiLU * mul,
//                                 residual adds) and replays the saved outputs.
//
// Mechanism (PyTorch's reentrant checkpoint, written for nn::Module, with the parameters as
// explicit inputs): checkpoint_module() installs an around-hook that calls a custom autograd
// function of the block's input and trainable parameters. Its forward runs the block's forward
// with autograd off (nothing is saved but the input), its backward runs the same forward again
// with autograd on and takes the gradients of the input and the parameters through that fresh
// graph (a nested torch::autograd::grad); they are returned, and the outer backward accumulates
// the parameters' as without checkpointing (so torch::autograd::grad on the input alone, or a
// second pass over a retained graph, accumulates nothing twice). The around-hook sits inside the module's pre- and post-hooks, so the hooks of the
// block itself (FSDP's all-gather / reshard / pre-backward) run once per forward and are not re-run
// by the recompute; hooks of modules inside the block (tensor parallel's sequence collectives,
// context parallel's ring attention, async TP's collective matmuls) are part of the recomputed
// forward and run again, as in Megatron-LM and TorchTitan.
//
// Requirements on the wrapped module: its forward, as handed to the around-hook, must own its
// per-call arguments (it is run again in backward, after the original call returned; llama3's
// TransformerBlock captures them by value), and must compute the same values when re-run. No
// random numbers are drawn in a Llama block (no dropout), so no RNG state is stashed: a block with
// dropout would need the generator states saved in forward and restored around the recompute.
// The autocast state (dtype, on/off) of the forward is restored around the recompute.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loom/core/options.h"
#include "loom/nn/attention.h"
#include "loom/nn/layers.h"
#include "loom/nn/module.h"

namespace loom::ac {

enum class Mode { kNone, kFull, kSelective };

// activation_checkpoint.mode: "none" | "full" | "selective" (core/options.h's enum protocol).
const options::EnumNames<Mode>& option_names(Mode);

// The [activation_checkpoint] section of a job config, as written (ac_section() is its schema).
struct ACConfig {
  Mode mode = Mode::kNone;
  // With kSelective: "op" or every N-th block (TorchTitan's default 2).
  std::string selective_ac_option = "2";

  bool operator==(const ACConfig&) const = default;
};
const options::Section& ac_section();

// What apply_ac applies: the [activation_checkpoint] section, parsed.
struct ACOptions {
  Mode mode = Mode::kNone;
  // Selective: checkpoint every `every`-th block (1 = all); or, with per_op, every block with the
  // op-level policy.
  int64_t every = 1;
  bool per_op = false;

  // selective_ac_option (read with kSelective only): a positive integer N or "op". A bad value is
  // a loom::UsageError naming the nearest valid one.
  static ACOptions from(const ACConfig& config);
  // Whether the block with this layer id (0-based, as the model numbers its layers; a pipeline
  // stage keeps the whole model's ids, so every stage checkpoints the same blocks) is wrapped:
  // full and op: all; selective N: ids N-1, 2N-1, ... (TorchTitan wraps the N-th, 2N-th, ...).
  bool wraps(int64_t layer_id) const;
  std::string describe() const;  // "none", "full", "selective, every 2-th block", "selective per op"
};

// The op-level policy's state for one wrapped module (shared by the hooks on its ops). During the
// checkpointed forward it records, in call order, each hooked op's output; during the recompute it
// hands them back in the same order.
class OpCache {
 public:
  enum class Phase { kOff, kRecord, kReplay };
  struct Entry {
    const nn::Module* op = nullptr;   // which module recorded it (checked on replay)
    torch::Tensor output;             // the op's output values; undefined: not saved (recompute)
    // Attention only: the core's own graph from the checkpointed forward, run on detached copies
    // of q, k, v (`inputs`); replaying back-propagates through it (see attention_hook).
    std::vector<torch::Tensor> inputs;
  };
  using Entries = std::vector<Entry>;

  Phase phase() const { return phase_; }
  // The recording of one forward call, as a scope: entries go to `into` until it ends.
  class Scope {
   public:
    Scope(OpCache* cache, Phase phase, Entries* entries);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    OpCache* cache_;
    Phase prev_phase_;
    Entries* prev_entries_;
    size_t prev_next_;
  };

  void record(Entry entry);
  // The next recorded entry (a copy: the recording lives as long as its checkpoint node), which
  // `op` must have recorded. Throws loom::Error when the recompute does not follow the forward (a
  // different op, or more ops than were recorded).
  Entry take(const nn::Module& op);
  // Whether every recorded entry was replayed (checked after each recompute).
  bool all_taken() const { return entries_ == nullptr || next_ == entries_->size(); }

 private:
  Phase phase_ = Phase::kOff;
  Entries* entries_ = nullptr;
  size_t next_ = 0;
};

// Runs `forward(input)` checkpointed: returns the same values with an autograd history that
// recomputes the forward in backward and gives `input` and `params` (the trainable leaves the
// forward reads; their gradients flow through this function like any op's) their gradients.
// `cache` (optional) is the op-level policy of the module. Without grad mode this is just
// forward(input).
torch::Tensor checkpoint(const nn::ForwardFn& forward, const torch::Tensor& input,
                         const std::vector<torch::Tensor>& params, const std::shared_ptr<OpCache>& cache = nullptr);

// Checkpoints every forward of `module` (see the top of this file): an around-hook chained to any
// the module already has. With `per_op`, also hooks the module's ops: every nn::Linear below it
// without a bias and without an around-hook of its own (async TP's collective matmuls have one:
// those are recomputed), and every attention's core (nn::SelfAttention). Call once per module.
void checkpoint_module(nn::Module& module, bool per_op = false);

// The replays the op-level policy builds the recomputed graph with, public for their tests.
// linear_replay(x, weight, y): y's values (a saved x W^T) with the autograd history of
// at::linear(x, weight): gradients reach x and weight exactly as at::linear's backward computes
// them (the same matmuls, so bitwise). `replayable_linear` says whether at::linear(x, weight) has
// that backward (float dtypes, x contiguous or 2-D).
bool replayable_linear(const torch::Tensor& x, const torch::Tensor& weight);
torch::Tensor linear_replay(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& y);

}  // namespace loom::ac
