// The rank side of `loom check-layouts`: the hidden command `loom check-layouts-rank`, which the
// driver starts under `loom launch` (or alone for one process). It builds the Trainer of the
// config and overrides (the layout, deterministic mode) and runs its steps one at a time:
//   - normally, after each step it saves under --out
//       steps.jsonl              {"step", "loss", "grad_norm"} per step (rank 0): the loss and
//                                gradient norm the Trainer reports, which metrics.jsonl logs
//       gradients/step-N         the step's gradients, unclipped (below), as a sharded checkpoint
//       checkpoint/step-N        the state after the step's update (Trainer::save_checkpoint_to)
//   - with --probe-step S, it runs steps 1..S and records step S's activations and their gradients
//     (layouts/activations.h) as probe/rank-R.safetensors, and saves nothing else.
// The gradients are saved unclipped: train_step scales them in place by
// min(1, max_norm / (norm + 1e-6)) with the step's norm (not at all when training.max_norm is 0);
// that coefficient is recomputed from the
// reported norm exactly as clipping computed it (float32) and divided out, which restores each
// gradient to within one rounding of its value before clipping. A layout whose norm is wrong
// clipped by a wrong coefficient; unclipped with its own norm, its gradients still equal the
// reference's, and the verdict is the norm's, not the gradients'.
#pragma once
#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace loom::layouts {

inline constexpr const char* kRankCommand = "check-layouts-rank";

struct RankRunOptions {
  std::string out;
  std::string config;
  int64_t steps = 1;
  int64_t probe_step = 0;  // > 0: record this step's activations instead of saving every step
};

void run_rank(const RankRunOptions& options, const std::vector<std::string>& overrides);

// Registers the hidden command (no help entry: users run `loom check-layouts`).
void register_rank_command(CLI::App& app);

}  // namespace loom::layouts
