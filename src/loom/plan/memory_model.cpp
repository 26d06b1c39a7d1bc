#include "loom/plan/memory_model.h"

#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "loom/core/error.h"
#include "loom/fsdp/planner.h"
#include "loom/models/common/decoder.h"
#include "loom/models/common/pipeline.h"
#include "loom/moe/moe.h"
#include "loom/pipeline/generators.h"
#include "loom/train/layout_check.h"

namespace loom::plan {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The dim TP splits, from the TP plan Loom applies to a decoder (models/common/tp_plan.h):
// column-wise projections on their output rows, row-wise ones on their input columns, the
// vocabulary-parallel embedding and head on the vocabulary.
int tp_split_of(const std::string& name, int64_t dims) {
  if (dims != 2) return -1;
  for (const char* col : {"attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
                          "feed_forward.w1.weight", "feed_forward.w3.weight"}) {
    if (ends_with(name, col)) return 0;
  }
  for (const char* row : {"attention.wo.weight", "feed_forward.w2.weight"}) {
    if (ends_with(name, row)) return 1;
  }
  if (name == "tok_embeddings.weight" || name == "output.weight") return 0;
  return -1;
}

int64_t element_bytes(Precision p) { return p == Precision::kBFloat16 ? 2 : 4; }

double gib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0); }

}  // namespace

ModelShape ModelShape::of(const models::ModelSpec& spec, const models::ModelArgs& args) {
  const auto& a = dynamic_cast<const models::DecoderArgs&>(args);
  ModelShape shape;
  shape.dim = a.dim;
  shape.n_layers = a.n_layers;
  shape.n_heads = a.n_heads;
  shape.kv_dim = a.attention_kv_heads() * a.v_head_dim();
  shape.ffn = a.ffn_hidden_dim();
  shape.vocab = a.vocab_size;
  const auto model = spec.build_model(args, torch::TensorOptions().device(torch::kMeta));
  std::map<std::string, size_t> index;
  auto group_of = [&](const std::string& name, int64_t layer) -> Group& {
    const auto it = index.find(name);
    if (it != index.end()) return shape.groups[it->second];
    index[name] = shape.groups.size();
    shape.groups.push_back({name, layer, {}});
    return shape.groups.back();
  };
  group_of("tok_embeddings", -1);
  for (const auto& [name, p] : model->named_parameters()) {
    Tensor t{name, p->tensor.numel(), tp_split_of(name, p->tensor.dim()), name.find(".experts.") != std::string::npos};
    if (name.rfind("layers.", 0) == 0) {
      const size_t dot = name.find('.', 7);
      const int64_t layer = std::stoll(name.substr(7, dot - 7));
      group_of(name.substr(0, dot), layer).tensors.push_back(t);
    } else if (name.rfind("tok_embeddings.", 0) == 0) {
      group_of("tok_embeddings", -1).tensors.push_back(t);
    } else {
      group_of("head", -1).tensors.push_back(t);
    }
  }
  // Each MoE block's routed part, from its MoE module (whatever the family names it).
  for (const auto& [path, module] : model->named_modules()) {
    const auto* moe_module = dynamic_cast<const moe::MoE*>(module);
    if (moe_module == nullptr || path.rfind("layers.", 0) != 0) continue;
    const size_t dot = path.find('.', 7);
    Group& g = group_of(path.substr(0, dot), std::stoll(path.substr(7, dot - 7)));
    const moe::MoEOptions& o = moe_module->options();
    g.moe = {o.router.n_experts, o.router.top_k, o.hidden_dim, o.shared_hidden_dim, std::max<int64_t>(1, o.router.n_groups),
             std::max<int64_t>(1, o.router.topk_groups)};
  }
  // Embedding first, blocks in layer order, head last.
  std::stable_sort(shape.groups.begin(), shape.groups.end(), [](const Group& x, const Group& y) {
    auto key = [](const Group& g) { return g.name == "tok_embeddings" ? -2 : g.name == "head" ? INT64_MAX : g.layer; };
    return key(x) < key(y);
  });
  // Ids of the distinct group shapes.
  std::map<std::vector<std::tuple<int64_t, int, bool>>, int> ids;
  for (auto& g : shape.groups) {
    std::vector<std::tuple<int64_t, int, bool>> key;
    for (const auto& x : g.tensors) key.emplace_back(x.numel, x.tp_split, x.expert);
    g.shape_id = ids.emplace(std::move(key), static_cast<int>(ids.size())).first->second;
  }
  shape.num_group_shapes = static_cast<int>(ids.size());
  for (const auto& g : shape.groups) {
    for (const auto& x : g.tensors) {
      const double n = static_cast<double>(x.numel);
      (x.tp_split >= 0 ? (x.expert ? shape.elems_tp_expert : shape.elems_tp)
                       : (x.expert ? shape.elems_expert : shape.elems_plain)) += n;
      // A norm's scale has at most dim elements; routed experts are grouped GEMMs, not converted;
      // the embedding and the head stay in high precision.
      if (g.layer >= 0 && !x.expert && x.numel > shape.dim) shape.linear_elems += n;
    }
    if (g.moe.experts > 0) {
      if (shape.moe_layers == 0) shape.moe_groups = g.moe.groups, shape.moe_topk_groups = g.moe.topk_groups;
      ++shape.moe_layers;
      shape.moe_top_k_sum += g.moe.top_k;
    }
  }
  return shape;
}

std::string MemoryEstimate::describe() const {
  char text[256];
  std::snprintf(text, sizeof(text),
                "parameters %.3f GiB, gradients %.3f GiB, optimizer state %.3f GiB, activations %.3f GiB, "
                "buffers in flight %.3f GiB = peak %.3f GiB",
                gib(parameters), gib(gradients), gib(optimizer_state), gib(activations), gib(buffers_in_flight),
                gib(peak));
  return text;
}

MemoryEstimate estimate_memory(const ModelShape& shape, const models::ModelArgs& args,
                               const train::JobConfig& config, const Layout& layout) {
  const auto& a = dynamic_cast<const models::DecoderArgs&>(args);
  const auto& t = config.training;
  const auto& p = config.parallelism;
  const int64_t tp = layout.tp, cp = layout.cp, pp = layout.pp, ep = layout.ep;
  const int64_t fsdp_ranks = static_cast<int64_t>(layout.dp_shard) * cp;  // FSDP shards over dp_shard x cp
  const int64_t expert_fsdp_ranks = std::max<int64_t>(1, fsdp_ranks * tp / ep);
  const bool fsdp = fsdp_ranks > 1;
  const bool sp = tp > 1 && !p.disable_sequence_parallel;
  const int64_t s = sp ? tp : 1;
  // Dtypes: FSDP gathers in mixed_precision_param; without FSDP a bf16 run autocasts (fp32 master,
  // bf16 compute, fp32 residual stream).
  const bool bf16 = t.mixed_precision_param == Precision::kBFloat16;
  const int64_t c = bf16 ? 2 : 4;
  const int64_t r = bf16 && fsdp ? 2 : 4;
  const int64_t param_gather_bytes = element_bytes(t.mixed_precision_param);
  const int64_t reduce_bytes = element_bytes(t.mixed_precision_reduce);

  // This rank's elements of each tensor before FSDP: TP and EP splits (rounded up).
  auto local_numel = [&](const ModelShape::Tensor& x) {
    int64_t n = x.numel;
    if (x.tp_split >= 0) n = (n + tp - 1) / tp;
    if (x.expert) n = (n + ep - 1) / ep;
    return n;
  };
  // FSDP shard elements of a group on one rank: the planner's shard size (its padding included),
  // computed once per distinct group shape and rank count for the whole process (a search over
  // thousands of layouts meets the same few shapes again and again).
  static std::mutex shard_mutex;
  static std::map<std::pair<std::vector<int64_t>, int64_t>, int64_t> shard_cache;
  auto shard_elems = [&](const ModelShape::Group& g, bool experts, int64_t ranks) {
    std::vector<int64_t> key;
    for (const auto& x : g.tensors) {
      if (x.expert == experts) key.push_back(local_numel(x));
    }
    if (key.empty()) return int64_t{0};
    if (ranks <= 1) {
      int64_t total = 0;
      for (int64_t n : key) total += n;
      return total;
    }
    auto cache_key = std::make_pair(std::move(key), ranks);
    {
      std::lock_guard<std::mutex> lock(shard_mutex);
      if (const auto it = shard_cache.find(cache_key); it != shard_cache.end()) return it->second;
    }
    fsdp::GroupSpec spec_group;
    spec_group.name = g.name;
    size_t i = 0;
    for (const auto& x : g.tensors) {
      if (x.expert != experts) continue;
      spec_group.tensors.push_back({x.name, {cache_key.first[i++]}, 4, tensor::Granularity::element()});
    }
    const int64_t elems = fsdp::plan_group(spec_group, ranks).shard_elems;
    std::lock_guard<std::mutex> lock(shard_mutex);
    shard_cache[cache_key] = elems;
    return elems;
  };

  // Which groups each pipeline rank holds, and their micro-batches in flight.
  std::vector<std::vector<int64_t>> rank_layers(static_cast<size_t>(pp));  // block ids per rank
  std::vector<int64_t> in_flight(static_cast<size_t>(pp), 1);               // micro-batches alive at once
  int first_stage_rank = 0, last_stage_rank = 0;
  int64_t tokens = t.local_batch_size * t.seq_len / cp;  // per forward on this rank
  int64_t stages_per_rank = 1;
  if (pp > 1) {
    const models::PipelineOptions po = train::pipeline_options(config);
    // What the schedule decides (which layers each rank holds, its micro-batches in flight) is the
    // same for every layout with the same schedule, degree, micro-batches and split: walked once.
    struct Walk {
      std::vector<std::vector<int64_t>> rank_layers;
      std::vector<int64_t> in_flight;
      int first_stage_rank = 0, last_stage_rank = 0;
      int64_t stages_per_rank = 1;
    };
    static std::mutex walk_mutex;
    static std::map<std::string, std::shared_ptr<const Walk>> walks;
    std::string walk_key = c10::str(po.schedule, '|', pp, '|', po.microbatches, '|', po.layers_per_stage, '|',
                                    a.n_layers, '|');
    for (const auto& point : po.split_points) walk_key += c10::str(point, ',');
    std::shared_ptr<const Walk> cached;
    {
      std::lock_guard<std::mutex> lock(walk_mutex);
      if (const auto it = walks.find(walk_key); it != walks.end()) cached = it->second;
    }
    if (cached) {
      rank_layers = cached->rank_layers;
      in_flight = cached->in_flight;
      first_stage_rank = cached->first_stage_rank;
      last_stage_rank = cached->last_stage_rank;
      stages_per_rank = cached->stages_per_rank;
    } else {
    // The split and schedule training makes (stages per rank from layers_per_stage or the split
    // points when set, else the schedule's default).
    const models::PipelinePlan plan = models::plan_pipeline(a, static_cast<int>(pp), po);
    const pipeline::Schedule& schedule = plan.schedule;
    const std::vector<int64_t>& bounds = plan.layer_bounds;
    const int stages = schedule.num_ranks * schedule.stages_per_rank;
    stages_per_rank = schedule.stages_per_rank;
    for (int st = 0; st < stages; ++st) {
      const int rk = schedule.rank_of(st);
      for (int64_t l = bounds[static_cast<size_t>(st)]; l < bounds[static_cast<size_t>(st) + 1]; ++l) {
        rank_layers[static_cast<size_t>(rk)].push_back(l);
      }
    }
    first_stage_rank = schedule.rank_of(0);
    last_stage_rank = schedule.rank_of(stages - 1);
    // The most forward micro-batches any of a rank's stages hold before their backward frees
    // them (B, or I under a zero-bubble split): counted per rank over its whole action list.
    for (int rk = 0; rk < schedule.num_ranks; ++rk) {
      std::map<int, int64_t> alive;
      int64_t alive_total = 0, most = 1;
      for (const auto& action : schedule.ranks[static_cast<size_t>(rk)]) {
        if (action.kind == pipeline::ActionKind::kForward) {
          ++alive[action.stage];
          ++alive_total;
        } else if (action.kind == pipeline::ActionKind::kBackward ||
                   action.kind == pipeline::ActionKind::kBackwardInput) {
          --alive[action.stage];
          --alive_total;
        }
        most = std::max(most, alive_total);
      }
      // Per stage of the rank the count is of micro-batches of one stage's layers: a rank with v
      // stages holds, at its worst, `most` stage-micro-batches of 1/v of its layers each.
      in_flight[static_cast<size_t>(rk)] = most;
    }
    auto walk = std::make_shared<Walk>();
    walk->rank_layers = rank_layers;
    walk->in_flight = in_flight;
    walk->first_stage_rank = first_stage_rank;
    walk->last_stage_rank = last_stage_rank;
    walk->stages_per_rank = stages_per_rank;
    std::lock_guard<std::mutex> lock(walk_mutex);
    walks.emplace(walk_key, std::move(walk));
    }
    tokens = po.microbatch_size * t.seq_len / cp;
  } else {
    for (int64_t l = 0; l < shape.n_layers; ++l) rank_layers[0].push_back(l);
  }

  // Activation bytes per token of one block and what a checkpointed one keeps.
  const int64_t dim = shape.dim, kv = shape.kv_dim, heads = shape.n_heads, ffn = shape.ffn;
  std::map<int64_t, ModelShape::Group::Moe> moe_of;  // layer -> its routed part
  for (const auto& g : shape.groups) {
    if (g.layer >= 0 && g.moe.experts > 0) moe_of[g.layer] = g.moe;
  }
  // The feed-forward's saved tensors per token: all of them, and those the op-level AC policy
  // keeps (the matmuls' outputs).
  auto ffn_saved = [&](int64_t layer, bool op_level) {
    const auto it = moe_of.find(layer);
    if (it == moe_of.end()) return (op_level ? 2 : 3) * c * ffn / tp;
    const auto& m = it->second;
    // Without the op-level policy, what Loom's MoE::forward leaves to autograd per routed row: the
    // permuted input (the grouped GEMMs' input), gate, up and the SwiGLU output, and the fp32
    // expert output the routing-weight product keeps (4 dim); the index_selects keep only their
    // indices and the casts nothing. The op-level policy keeps the GEMMs' outputs and the input.
    const int64_t routed = op_level ? m.top_k * (2 * c * dim + 2 * c * m.hidden)
                                    : m.top_k * (c * dim + 3 * c * m.hidden + 4 * dim + 4);
    return (routed + (op_level ? 2 : 3) * c * m.shared_hidden + 8 * m.experts) / s;
  };
  const int64_t attention_saved = r * dim / s + 4 + c * dim + c * (2 * dim + 2 * kv) / tp + 4 * heads / tp +
                                  c * dim / tp + r * dim / s + 4 + c * dim;
  auto block_saved = [&](int64_t layer) { return attention_saved + ffn_saved(layer, false); };
  const int64_t block_input = r * dim / s;
  const ac::ACOptions ac = ac::ACOptions::from(config.activation_checkpoint);
  const bool per_op = ac.mode == ac::Mode::kSelective && ac.per_op;
  // The op-level policy keeps the outputs of the matmuls and attention (q, k, v, attention out,
  // the projections' outputs), recomputing norms and element-wise ops.
  auto op_saved = [&](int64_t layer) {
    return block_input + c * (2 * dim + 2 * kv) / tp + 4 * heads / tp + c * dim / tp + ffn_saved(layer, true) +
           r * dim / s;
  };
  auto kept = [&](int64_t layer) {
    if (ac.mode == ac::Mode::kNone || !ac.wraps(layer)) return block_saved(layer);
    return per_op ? op_saved(layer) : block_input;
  };
  // The output head: the final norm's input and output, the fused loss's hidden gradient (fp32)
  // and its fp32 weight gradient, computed in the forward.
  const int64_t vocab_local = (shape.vocab + tp - 1) / tp;
  const int64_t head_act_per_token = r * dim / s + c * dim + 4 * dim;
  const int64_t head_weight_grad = vocab_local * dim * 4;

  MemoryEstimate worst;
  worst.peak = -1;
  std::vector<int64_t> peaks;
  // Each distinct group shape's shards (dense, experts) and unsharded elements on this layout.
  struct GroupElems {
    int64_t dense = -1, experts = 0, unsharded = 0;
  };
  std::vector<GroupElems> by_shape(static_cast<size_t>(std::max(1, shape.num_group_shapes)));
  auto elems_of = [&](const ModelShape::Group& g) -> const GroupElems& {
    GroupElems& e = by_shape[static_cast<size_t>(g.shape_id)];
    if (e.dense < 0) {
      e.dense = shard_elems(g, false, fsdp ? fsdp_ranks : 1);
      e.experts = shard_elems(g, true, fsdp ? expert_fsdp_ranks : 1);
      e.unsharded = 0;
      for (const auto& x : g.tensors) e.unsharded += local_numel(x);
    }
    return e;
  };
  for (int rk = 0; rk < static_cast<int>(pp); ++rk) {
    MemoryEstimate m;
    m.pipeline_rank = rk;
    // Parameters, gradients and optimizer state: this rank's groups, sharded by FSDP.
    int64_t param_elems = 0, largest_group = 0, gathered_total = 0;
    std::vector<const ModelShape::Group*> groups;
    for (const auto& g : shape.groups) {
      const bool mine = g.layer >= 0 ? std::find(rank_layers[static_cast<size_t>(rk)].begin(),
                                                 rank_layers[static_cast<size_t>(rk)].end(), g.layer) !=
                                           rank_layers[static_cast<size_t>(rk)].end()
                                     : (g.name == "tok_embeddings" ? rk == first_stage_rank : rk == last_stage_rank);
      if (!mine) continue;
      groups.push_back(&g);
      const GroupElems& e = elems_of(g);
      param_elems += e.dense + e.experts;
      const int64_t unsharded = e.unsharded;
      largest_group = std::max(largest_group, unsharded);
      gathered_total += unsharded;
    }
    m.parameters = param_elems * 4;
    const std::string& opt = config.optimizer.name;
    const int64_t state_per_elem = opt == "AdamW8bit" ? 2 : opt == "Muon" ? 4 : 8;
    m.optimizer_state = param_elems * state_per_elem;
    // Gradients persist as FSDP's sharded fp32 gradients; without FSDP they are created during the
    // backward (set to None between steps), so they join the peak as the backward makes them.
    // Under PP the first micro-batch's backward creates the stage's gradients, which the later
    // micro-batches accumulate into while others' activations are still alive: they are all there
    // at the steady state's peak.
    const bool grads_persist = fsdp || pp > 1;
    const int64_t grad_bytes = param_elems * 4;
    if (fsdp) {
      // The gathered group being computed plus the prefetched ones, and a gradient being reduced.
      const int64_t depth = std::max<int64_t>(1, p.fsdp_prefetch_depth);
      m.buffers_in_flight = (1 + depth) * largest_group * param_gather_bytes + largest_group * reduce_bytes;
      // Not resharded after forward: every group's gathered copy lives from its forward to its
      // backward, so all of them at the backward's start. Inside pipeline stages "default" does
      // the same: each stage stays gathered from its UNSHARD to its RESHARD action.
      const std::string& reshard = p.fsdp_reshard_after_forward;
      if (reshard == "never" || (pp > 1 && reshard == "default")) {
        m.buffers_in_flight = gathered_total * param_gather_bytes + largest_group * reduce_bytes;
      }
      // Accumulating unsharded across the step's micro-batches (Layout::fsdp_accumulate): every
      // group stays gathered and holds its unsharded gradient (reduce dtype) until the last.
      if (layout.fsdp_accumulate == "on" && layout.grad_accum_steps > 1) {
        m.buffers_in_flight = gathered_total * (param_gather_bytes + reduce_bytes);
      }
    }
    // Activations: the peak of what the forward left alive and the backward's gradients. Under
    // PP a rank holds `in_flight` stage-micro-batches at once, each of one stage's layers (1/v of
    // the rank's).
    const std::vector<int64_t>& layers = rank_layers[static_cast<size_t>(rk)];
    int64_t saved_per_token = 0;
    for (int64_t l : layers) saved_per_token += kept(l);
    const bool has_head = rk == last_stage_rank;
    const int64_t act = pp > 1 ? in_flight[static_cast<size_t>(rk)] * tokens * saved_per_token / stages_per_rank
                               : tokens * saved_per_token;
    const int64_t head_act = has_head ? tokens * head_act_per_token + head_weight_grad : 0;
    // Backward, block by block from the last: the blocks' activations free as it goes, the
    // gradients (when they do not persist) grow; a checkpointed block first recomputes the rest.
    int64_t alive = act + head_act;
    int64_t grads = grads_persist ? 0 : (has_head ? head_weight_grad : 0);
    int64_t peak_dynamic = alive + grads, grads_at_peak = grads;
    const int64_t per_group_grad = groups.empty() ? 0 : grad_bytes / static_cast<int64_t>(groups.size());
    for (auto it = layers.rbegin(); it != layers.rend(); ++it) {
      const int64_t recompute = tokens * (block_saved(*it) - kept(*it));
      const int64_t during = grads_persist ? grads : grads + per_group_grad;
      if (alive + recompute + during > peak_dynamic) {
        peak_dynamic = alive + recompute + during;
        grads_at_peak = during;
      }
      alive -= tokens * kept(*it);
      if (!grads_persist) grads += per_group_grad;
    }
    m.gradients = grads_persist ? grad_bytes : grads_at_peak;
    m.activations = peak_dynamic - (grads_persist ? 0 : grads_at_peak);
    m.peak = m.parameters + m.optimizer_state + m.gradients + m.activations + m.buffers_in_flight;
    peaks.push_back(m.peak);
    if (m.peak > worst.peak) worst = m;
  }
  worst.rank_peaks = std::move(peaks);
  return worst;
}

}  // namespace loom::plan
