#include "loom/parallel/config.h"

#include "loom/pipeline/generators.h"

namespace loom::parallel {

OptimizerRequest OptimizerConfig::request() const {
  return OptimizerRequest{.adamw = optim::AdamWOptions{.lr = lr,
                                                       .beta1 = beta1,
                                                       .beta2 = beta2,
                                                       .eps = eps,
                                                       .implementation = implementation},
                          .muon = optim::MuonOptions{.momentum = muon_momentum,
                                                     .nesterov = muon_nesterov,
                                                     .ns_steps = muon_ns_steps,
                                                     .adjust_lr = muon_adjust_lr},
                          .weight_decay = weight_decay,
                          .block_size = block_size};
}

namespace {

void check_optimizer(const OptimizerConfig& o) {
  const options::Section& s = optimizer_section();
  options::require(o.lr >= 0.0, s, "lr", ">= 0", &o);
  options::require(o.eps >= 0.0, s, "eps", ">= 0", &o);
  options::require(o.beta1 >= 0.0 && o.beta1 < 1.0, s, "beta1", "in [0, 1)", &o);
  options::require(o.beta2 >= 0.0 && o.beta2 < 1.0, s, "beta2", "in [0, 1)", &o);
  options::require(o.weight_decay >= 0.0, s, "weight_decay", ">= 0", &o);
  options::require(o.muon_momentum >= 0.0 && o.muon_momentum < 1.0, s, "muon_momentum", "in [0, 1)", &o);
  options::require(o.muon_ns_steps >= 1, s, "muon_ns_steps", ">= 1", &o);
}

void check_parallelism(const ParallelismConfig& p) {
  const options::Section& s = parallelism_section();
  options::require(p.data_parallel_replicate_degree >= 1, s, "data_parallel_replicate_degree", ">= 1", &p);
  options::require(p.data_parallel_shard_degree == -1 || p.data_parallel_shard_degree >= 1, s,
                   "data_parallel_shard_degree", "-1 or >= 1", &p);
  options::require(p.fsdp_bucket_mb == -1 || (p.fsdp_bucket_mb >= 0 && p.fsdp_bucket_mb < 1e9), s, "fsdp_bucket_mb",
                   "0 (one group per block), -1 (automatic) or a size in MB > 0", &p);
  options::require(p.fsdp_prefetch_depth >= 0 && p.fsdp_prefetch_depth <= 1024, s, "fsdp_prefetch_depth",
                   "in [0, 1024] (1 = the next group, 0 = no prefetch)", &p);
  options::require(p.tensor_parallel_degree >= 1, s, "tensor_parallel_degree", ">= 1", &p);
  options::require(p.context_parallel_degree >= 1, s, "context_parallel_degree", ">= 1", &p);
  options::require(p.pipeline_parallel_degree >= 1, s, "pipeline_parallel_degree", ">= 1", &p);
  options::require(p.expert_parallel_degree >= 1, s, "expert_parallel_degree", ">= 1", &p);
  options::require(p.pipeline_parallel_microbatch_size >= 1, s, "pipeline_parallel_microbatch_size", ">= 1", &p);
  options::require(p.pipeline_parallel_layers_per_stage >= 0, s, "pipeline_parallel_layers_per_stage",
                   ">= 0 (0 = not set)", &p);
}

std::vector<std::string_view> schedule_choices() {
  std::vector<std::string_view> names;
  for (const std::string& name : pipeline::schedule_names()) names.emplace_back(name);
  return names;
}

}  // namespace

const options::Section& optimizer_section() {
  using S = OptimizerConfig;
  static const options::Section section{
      "optimizer",
      {
          {LOOM_OPTION(S, name),
           "Optimizer. AdamW follows `torch.optim.AdamW` exactly (bias correction, decoupled weight "
           "decay). AdamW8bit: the same update with both moments stored in 8 bits (bitsandbytes' "
           "block-wise dynamic quantization, one float32 scale per `block_size` elements; parameters "
           "under 4096 elements or not whole blocks keep float32 moments): about 2 bytes of state per "
           "parameter instead of 8. CPU only, not with tensor parallelism. Muon: every 2-D weight "
           "matrix except the token embedding and output head is updated with momentum orthogonalised "
           "by Newton-Schulz iterations (Moonlight's RMS-matched scaling, so it shares AdamW's `lr` and "
           "`weight_decay`); every other parameter with AdamW. Under FSDP each matrix lives whole on "
           "one rank. Not with tensor parallelism (docs/muon.md).",
           optimizer_names()},
          {LOOM_OPTION(S, lr), "Peak learning rate, reached at the end of warmup."},
          {LOOM_OPTION(S, eps), "Added to the denominator `sqrt(v_hat)`."},
          {LOOM_OPTION(S, beta1), "First-moment decay, in [0, 1)."},
          {LOOM_OPTION(S, beta2), "Second-moment decay, in [0, 1)."},
          {LOOM_OPTION(S, weight_decay),
           "Decoupled weight decay for every matrix, including the token embedding and output "
           "projection; 1-D parameters (norm scales) and biases get 0."},
          {LOOM_OPTION(S, implementation),
           "`fused`: one vectorised kernel (`at::_fused_adamw_`) per parameter group and dtype, one "
           "pass over parameter, gradient and both moments (about 4x faster than foreach on CPU). "
           "`foreach`: the multi-tensor `at::_foreach_*` sequence of PyTorch's `foreach=True`. Both "
           "give the same result to float rounding."},
          {LOOM_OPTION(S, block_size),
           "AdamW8bit: elements per quantization block (one float32 scale per moment per block; "
           "bitsandbytes uses 256 for its CPU/paged and 2048 for its GPU optimizers). A multiple of the "
           "FSDP planner's alignment: 4 elements (16 bytes of float32), 8 under bfloat16 mixed "
           "precision. FSDP plans each quantized parameter in whole blocks, so no block is cut across "
           "ranks."},
          {LOOM_OPTION(S, muon_momentum), "Muon: momentum `mu` of the buffer `B = mu B + G`, in [0, 1)."},
          {LOOM_OPTION(S, muon_nesterov),
           "Muon: orthogonalise the Nesterov direction `G + mu B` (true) or the buffer `B` (false)."},
          {LOOM_OPTION(S, muon_ns_steps),
           "Muon: Newton-Schulz iterations (quintic coefficients 3.4445, -4.7750, 2.0315), >= 1."},
          {LOOM_OPTION(S, muon_adjust_lr),
           "Muon: the factor on the orthogonalised update of a rows x cols matrix. `match_rms_adamw`: "
           "`0.2 sqrt(max(rows, cols))` (Moonlight; the update's RMS matches AdamW's, so AdamW's lr "
           "and weight decay carry over). `original`: `sqrt(max(1, rows / cols))` (Keller Jordan's; "
           "needs a larger lr)."},
      },
      {},
      {},
      &options::validate_as<S, check_optimizer>};
  return section;
}

const options::Section& parallelism_section() {
  using S = ParallelismConfig;
  static const options::Section section{
      "parallelism",
      {
          {LOOM_OPTION(S, data_parallel_replicate_degree),
           "Replicated data-parallel ranks: DDP, or HSDP together with sharding."},
          {LOOM_OPTION(S, data_parallel_shard_degree),
           "Sharded data-parallel ranks (FSDP); `-1` = the ranks left over by the other degrees."},
          {LOOM_OPTION(S, fsdp_reshard_after_forward),
           "Whether FSDP frees gathered parameters after forward (re-gathering them in backward). "
           "`default`: all groups but the last (whose backward starts immediately); `always`; "
           "`never`; or a positive integer world size to reshard to (keeps a partially gathered "
           "copy). Inside pipeline stages, `default` and `never` hold each stage gathered from its "
           "UNSHARD to its RESHARD action (one all-gather per step, TorchTitan's default under PP); "
           "`always` or N re-gather it for every micro-batch (not with schedules that split the "
           "backward into I and W).",
           {"default", "always", "never"}, /*integer_allowed=*/true},
          {LOOM_OPTION(S, fsdp_bucket_mb),
           "FSDP buckets (SimpleFSDP's bucketing): consecutive transformer blocks are merged into one "
           "FSDP group until it holds about this many MB of parameters (a block joins while that leaves "
           "the bucket nearer the size than stopping would), so one all-gather and one reduce-scatter "
           "serve several blocks: fewer, larger collectives, and more compute behind each prefetch. "
           "`0` = one group per block; `-1` = automatic (25 MB, DDP's bucket size: blocks of that size or "
           "more stay alone, smaller ones are merged). Parameter names, and so checkpoints, do not depend "
           "on it. The last bucket is kept gathered after forward under `fsdp_reshard_after_forward = "
           "\"default\"`, like the last block."},
          {LOOM_OPTION(S, fsdp_prefetch_depth),
           "How many FSDP groups ahead the all-gathers run: when a group starts its forward (backward), the "
           "all-gathers of the next `depth` groups in forward (backward) order are issued, so a gather "
           "that takes longer than one group's compute still arrives in time. `1` = the next group "
           "(FSDP2's); `0` = none (each group gathers when it is reached). Up to depth + 1 groups are "
           "held gathered at once."},
          {LOOM_OPTION(S, fsdp_accumulate_unsharded),
           "Gradient accumulation under FSDP and HSDP (`training.global_batch_size` above "
           "`local_batch_size` x the data-parallel degree), as FSDP2's `set_reshard_after_forward(False)` "
           "with `set_reshard_after_backward` and `set_requires_gradient_sync` on the last micro-batch "
           "only: the parameters gathered by the step's first forward stay gathered through every "
           "micro-batch and are freed by the last backward, so each FSDP group is all-gathered once per "
           "step instead of once per forward and once per backward of every micro-batch. The gradients "
           "accumulate unsharded and are reduce-scattered (and all-reduced over HSDP replicas) once, "
           "after the last micro-batch, with or without this option. Cost: the whole model's gathered "
           "parameters (in `training.mixed_precision_param`) are held for the whole step, on top of the "
           "unsharded gradients accumulation already holds -- FSDP's parameter memory becomes DDP's "
           "for the step. Off by default for that reason: a layout that fits today could run out of "
           "memory. No effect without accumulation (one micro-batch keeps `fsdp_reshard_after_forward`) "
           "nor under pipeline parallelism, whose schedule already holds each stage gathered from its "
           "UNSHARD to its RESHARD action (`fsdp_reshard_after_forward`). See docs/fsdp.md."},
          {LOOM_OPTION(S, tensor_parallel_degree),
           "Tensor-parallel ranks (Megatron-LM's scheme, TorchTitan's plan: attention heads, FFN hidden "
           "units and the vocabulary split over `t` neighbouring ranks; see docs/tensor_parallel.md). It "
           "must divide n_heads, n_kv_heads, the FFN hidden size and the vocabulary, and with sequence "
           "parallelism `training.seq_len`; a degree that does not is a one-line error listing the ones "
           "that would."},
          {LOOM_OPTION(S, disable_sequence_parallel),
           "With tensor parallelism, keep the residual stream whole on every rank between blocks instead "
           "of splitting it along the sequence (norms then run on every token on every rank; the "
           "communication volume is the same)."},
          {LOOM_OPTION(S, disable_loss_parallel),
           "With tensor parallelism, gather the vocabulary-sharded logits for the loss instead of computing "
           "the cross-entropy on the shards (loss parallel, which never materializes the whole logits)."},
          {LOOM_OPTION(S, enable_async_tensor_parallel),
           "Overlap tensor parallelism's sequence all-gathers and reduce-scatters with the matmuls around "
           "them (collective matmuls: the transfer goes around the ring one sequence chunk at a time while "
           "the previous chunk's matmul runs). Needs sequence parallelism; same numerics as plain TP."},
          {LOOM_OPTION(S, context_parallel_degree),
           "Context-parallel ranks: each sequence is cut into 2 x degree chunks and rank i of the `cp` "
           "group holds chunks i and 2 x degree - 1 - i (equal causal work). Attention runs over every "
           "rank's keys (see context_parallel_rotate_method); FSDP shards parameters over dp_shard x cp. "
           "`training.seq_len` must be divisible by 2 x degree (x the TP degree with sequence parallel)."},
          {LOOM_OPTION(S, context_parallel_rotate_method),
           "How context-parallel attention reaches the other ranks' keys and values: `allgather` (one "
           "all-gather per layer, then local blocks) or `ring` (they travel around the ring, each "
           "transfer overlapped with the previous block's attention)."},
          {LOOM_OPTION(S, expert_parallel_degree),
           "Expert-parallel ranks (Mixture-of-Experts models only): each MoE layer's routed experts are split "
           "into `degree` equal groups over consecutive ranks of the dp_shard x cp x tp block, tokens travel to "
           "their experts' rank and back by all-to-all, and each expert is FSDP-sharded over the "
           "efsdp = dp_shard x cp x tp / degree ranks left (the mesh [pp, dp_replicate, efsdp, ep]). Must divide "
           "dp_shard x cp x tp and the number of routed experts; with tensor parallelism it needs sequence "
           "parallelism, and without FSDP (dp_shard = cp = 1) it must equal the TP degree. See docs/moe.md."},
          {LOOM_OPTION(S, pipeline_parallel_degree),
           "Pipeline ranks: the model's layers are split into stages (one per rank, or several with the "
           "multi-stage schedules) that pass activations forward and gradients back point to point; "
           "see docs/pipeline_parallel.md."},
          {LOOM_OPTION(S, pipeline_parallel_schedule),
           "The pipeline schedule (TorchTitan's and PyTorch's names). `GPipe` and `1F1B` put one stage "
           "on each rank; `Interleaved1F1B`, `LoopedBFS` and `InterleavedZeroBubble` loop over several "
           "stages per rank (2 unless `pipeline_parallel_layers_per_stage` or `split_points` say "
           "otherwise); `ZBVZeroBubble` and `DualPipeV` place two stages per rank in a V. The zero-bubble "
           "schedules split each backward into input and weight gradients. Each schedule needs enough "
           "micro-batches (a one-line error names the rule).",
           schedule_choices()},
          {LOOM_OPTION(S, pipeline_parallel_schedule_csv),
           "A hand-written schedule instead of `pipeline_parallel_schedule`: PyTorch's CSV format, one "
           "row per pipeline rank of actions such as `0F0,0B0` (`loom pipeline schedule --csv` writes "
           "one to start from). It is simulated at start-up: a schedule that would deadlock is a one-line "
           "error naming the action. Empty = none."},
          {LOOM_OPTION(S, pipeline_parallel_microbatch_size),
           "Rows per pipeline micro-batch: each loaded batch of `training.local_batch_size` rows is "
           "split into local_batch_size / microbatch_size micro-batches, which must divide."},
          {LOOM_OPTION(S, pipeline_parallel_layers_per_stage),
           "Transformer layers per pipeline stage; with it the number of stages is n_layers / "
           "layers_per_stage (a multiple of the degree). `0` = split the layers evenly over the "
           "schedule's stages."},
          {LOOM_OPTION(S, pipeline_parallel_split_points),
           "The first layer of every stage but the first, comma-separated (`\"layers.2,layers.5\"`, "
           "TorchTitan's spelling, or bare ids); the number of stages is one more than the points. "
           "Empty = not set."},
      },
      R"md(The degrees multiply to the number of ranks; `data_parallel_shard_degree = -1` takes whatever the
others leave.)md",
      {},
      &options::validate_as<S, check_parallelism>};
  return section;
}

distributed::ParallelDegrees parallel_degrees(const ParallelismConfig& p) {
  distributed::ParallelDegrees degrees;
  degrees.dp_replicate = static_cast<int>(p.data_parallel_replicate_degree);
  degrees.dp_shard = static_cast<int>(p.data_parallel_shard_degree);
  degrees.cp = static_cast<int>(p.context_parallel_degree);
  degrees.tp = static_cast<int>(p.tensor_parallel_degree);
  degrees.pp = static_cast<int>(p.pipeline_parallel_degree);
  degrees.ep = static_cast<int>(p.expert_parallel_degree);
  return degrees;
}

}  // namespace loom::parallel
