#include "loom/ac/activation_checkpoint.h"

#include <ATen/autocast_mode.h>

#include <charconv>
#include <utility>

#include "loom/core/autocast.h"
#include "loom/core/error.h"
#include "loom/core/strings.h"

namespace loom::ac {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ---- Options ------------------------------------------------------------------------------------

namespace {

std::string nearest_of(const std::string& value, const std::vector<std::string>& choices) {
  std::string best = choices.front();
  size_t best_distance = edit_distance(value, best);
  for (const auto& c : choices) {
    const size_t d = edit_distance(value, c);
    if (d < best_distance) {
      best = c;
      best_distance = d;
    }
  }
  return best;
}

bool parse_positive(const std::string& text, int64_t& out) {
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  return ec == std::errc() && ptr == text.data() + text.size() && out > 0;
}

}  // namespace

const options::EnumNames<Mode>& option_names(Mode) {
  static const options::EnumNames<Mode> names = {
      {"none", Mode::kNone}, {"full", Mode::kFull}, {"selective", Mode::kSelective}};
  return names;
}

const options::Section& ac_section() {
  static const options::Section section{
      "activation_checkpoint",
      {
          {LOOM_OPTION(ACConfig, mode),
           "Recompute activations in backward instead of keeping them from forward (see "
           "docs/activation_checkpointing.md). `none`; `full`: every transformer block keeps only its "
           "input and is re-run in backward; `selective`: as `selective_ac_option` says. Same losses as "
           "`none` (bitwise in deterministic mode), less memory, more compute."},
          {LOOM_OPTION(ACConfig, selective_ac_option),
           "With `mode = \"selective\"`: a positive integer N checkpoints every N-th block (layer ids "
           "N-1, 2N-1, ...; `1` = every block, as `full`), or `op`: every block keeps the outputs of "
           "its matmuls and attention and recomputes only norms, RoPE, SiLU x mul and residual adds.",
           {"op"}, /*integer_allowed=*/true},
      }};
  return section;
}

ACOptions ACOptions::from(const ACConfig& config) {
  ACOptions o;
  o.mode = config.mode;
  if (o.mode != Mode::kSelective) return o;
  const std::string& selective_option = config.selective_ac_option;
  if (selective_option == "op") {
    o.per_op = true;
    return o;
  }
  const bool digits = !selective_option.empty() &&
                      selective_option.find_first_not_of("0123456789") == std::string::npos;
  LOOM_REQUIRE_USAGE(digits ? parse_positive(selective_option, o.every) : false,
                     "activation_checkpoint.selective_ac_option '", selective_option,
                     "' is not \"op\" or a positive integer (did you mean '",
                     digits ? std::string("1") : nearest_of(selective_option, {"op", "1", "2"}), "'?)");
  return o;
}

bool ACOptions::wraps(int64_t layer_id) const {
  switch (mode) {
    case Mode::kNone: return false;
    case Mode::kFull: return true;
    case Mode::kSelective: return per_op || (layer_id + 1) % every == 0;
  }
  return false;
}

std::string ACOptions::describe() const {
  switch (mode) {
    case Mode::kNone: return "none";
    case Mode::kFull: return "full";
    case Mode::kSelective:
      if (per_op) return "selective per op";
      return every == 1 ? std::string("selective, every block") : c10::str("selective, every ", every, "-th block");
  }
  return "?";
}

// ---- OpCache ------------------------------------------------------------------------------------

OpCache::Scope::Scope(OpCache* cache, Phase phase, Entries* entries) : cache_(cache) {
  if (cache_ == nullptr) return;
  prev_phase_ = cache_->phase_;
  prev_entries_ = cache_->entries_;
  prev_next_ = cache_->next_;
  cache_->phase_ = phase;
  cache_->entries_ = entries;
  cache_->next_ = 0;
}

OpCache::Scope::~Scope() {
  if (cache_ == nullptr) return;
  cache_->phase_ = prev_phase_;
  cache_->entries_ = prev_entries_;
  cache_->next_ = prev_next_;
}

void OpCache::record(Entry entry) {
  TORCH_INTERNAL_ASSERT(phase_ == Phase::kRecord && entries_ != nullptr);
  entries_->push_back(std::move(entry));
}

OpCache::Entry OpCache::take(const nn::Module& op) {
  TORCH_INTERNAL_ASSERT(phase_ == Phase::kReplay && entries_ != nullptr);
  LOOM_REQUIRE(next_ < entries_->size(), "activation checkpointing: the recompute ran more ops (",
               op.type_name(), ") than the forward recorded (", entries_->size(),
               "); the checkpointed forward must run the same ops when re-run");
  Entry& e = (*entries_)[next_++];
  LOOM_REQUIRE(e.op == &op, "activation checkpointing: op ", next_ - 1, " of the recompute (",
               op.type_name(), ") is not the one the forward recorded (",
               e.op ? e.op->type_name() : std::string("?"),
               "); the checkpointed forward must run the same ops when re-run");
  // A copy: the entries live as long as the checkpoint node, so a retained graph can be backed
  // through again (a pipeline stage's I then W).
  return e;
}

// ---- The checkpoint function --------------------------------------------------------------------

namespace {

// What one checkpointed call keeps for its backward besides the input: the forward to re-run, the
// autocast state to re-run it under, and (op policy) the outputs recorded by the ops' hooks.
struct CallState : torch::CustomClassHolder {
  nn::ForwardFn forward;
  std::shared_ptr<OpCache> cache;
  OpCache::Entries entries;
  c10::Device device = c10::kCPU;
  std::optional<c10::ScalarType> autocast_dtype;
  bool input_requires_grad = false;
  // The trainable parameters the forward reads (the function's inputs besides `input`), kept as
  // plain handles: FSDP refills the buffers they alias in place between forward and backward,
  // which a saved variable's version check would reject.
  std::vector<torch::Tensor> params;
};

// The parameters are inputs of the function, so their gradients are its outputs and the *outer*
// backward accumulates them (through their grad accumulators and hooks, FSDP's and DDP's
// included). A nested backward that accumulated into them itself would be wrong whenever the outer
// one does not accumulate, or runs this node twice: torch::autograd::grad on the input only (a
// pipeline stage's I), or a retained graph backed through again with inputs = parameters (its W).
struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input, torch::TensorList params,
                               c10::intrusive_ptr<CallState> state) {
    (void)params;
    // Autograd is off here (a custom function's forward): nothing inside is saved. The op policy's
    // hooks keep their outputs in state->entries.
    torch::Tensor output;
    {
      OpCache::Scope scope(state->cache.get(), OpCache::Phase::kRecord, &state->entries);
      output = state->forward(input);
    }
    ctx->save_for_backward({input});
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return output;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const torch::Tensor input = ctx->get_saved_variables()[0];
    auto state = c10::static_intrusive_pointer_cast<CallState>(ctx->saved_data["state"].toCapsule());
    // A fresh leaf: the recomputed graph ends here, and its gradient is this function's result.
    torch::Tensor x = input.detach();
    x.requires_grad_(state->input_requires_grad);
    torch::Tensor output;
    {
      torch::AutoGradMode grad_mode(true);
      AutocastScope autocast(state->device, state->autocast_dtype);
      OpCache::Scope scope(state->cache.get(), OpCache::Phase::kReplay, &state->entries);
      output = state->forward(x);
      LOOM_REQUIRE(state->cache == nullptr || state->cache->all_taken(),
                   "activation checkpointing: the recompute ran fewer ops than the forward recorded; "
                   "the checkpointed forward must run the same ops when re-run");
    }
    // The nested pass computes the gradients of the input and the parameters without
    // accumulating them anywhere; they are this function's results.
    std::vector<torch::Tensor> wanted;
    if (state->input_requires_grad) wanted.push_back(x);
    for (const auto& p : state->params) wanted.push_back(p);
    variable_list grads;
    if (!wanted.empty() && output.requires_grad()) {
      grads = torch::autograd::grad({output}, wanted, {grad_outputs[0]}, /*retain_graph=*/false,
                                    /*create_graph=*/false, /*allow_unused=*/true);
    } else {
      grads.resize(wanted.size());
    }
    variable_list result;
    size_t k = 0;
    result.push_back(state->input_requires_grad ? grads[k++] : torch::Tensor());
    for (size_t i = 0; i < state->params.size(); ++i) result.push_back(grads[k++]);
    result.push_back(torch::Tensor());  // state
    return result;
  }
};

}  // namespace

torch::Tensor checkpoint(const nn::ForwardFn& forward, const torch::Tensor& input,
                         const std::vector<torch::Tensor>& params, const std::shared_ptr<OpCache>& cache) {
  if (!torch::GradMode::is_enabled()) return forward(input);  // no backward: nothing to save
  auto state = c10::make_intrusive<CallState>();
  state->forward = forward;
  state->cache = cache;
  state->device = input.device();
  const c10::DeviceType type = input.device().type();
  if (at::autocast::is_autocast_enabled(type)) state->autocast_dtype = at::autocast::get_autocast_dtype(type);
  state->input_requires_grad = input.requires_grad();
  for (const auto& p : params) {
    LOOM_REQUIRE(p.is_leaf() && p.requires_grad(), "activation checkpointing: the parameters passed to "
                 "checkpoint must be trainable leaves");
  }
  state->params = params;
  return CheckpointFunction::apply(input, torch::TensorList(state->params), state);
}

// ---- Op-level replays ---------------------------------------------------------------------------

bool replayable_linear(const torch::Tensor& x, const torch::Tensor& weight) {
  // at::linear without a bias is matmul(x, weight^T); with x contiguous (or 2-D) that is one mm of
  // x viewed as [N, in], whose backward linear_replay repeats. Under autocast the matmul runs on
  // casts of x and weight: not replayed (recomputed instead).
  return x.layout() == c10::kStrided && weight.layout() == c10::kStrided && weight.dim() == 2 &&
         x.dim() >= 2 && (x.dim() == 2 || x.is_contiguous()) && x.is_floating_point() &&
         x.scalar_type() == weight.scalar_type() && !at::autocast::is_autocast_enabled(x.device().type());
}

namespace {

struct LinearReplay : torch::autograd::Function<LinearReplay> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& weight,
                               const torch::Tensor& y) {
    ctx->save_for_backward({x, weight});
    // A new tensor object sharing y's storage: this function's history goes on it, not on the
    // cached tensor.
    return y.detach();
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& x = saved[0];
    const torch::Tensor& weight = saved[1];
    const int64_t in = weight.size(1), out = weight.size(0);
    // at::linear(x, W) = mm(x2, W^T) with x2 = x viewed as [N, in] (matmul folds the leading
    // dims). mm's backward (FunctionsManual.cpp mm_mat1_backward / mm_mat2_backward) for
    // self = x2 and mat2 = W^T, written out so the same matmuls run on the same layouts and the
    // gradients are bitwise those of at::linear's autograd (tested against it).
    const torch::Tensor g = grad_outputs[0].reshape({-1, out});
    const torch::Tensor x2 = x.reshape({-1, in});
    const torch::Tensor mat2 = weight.t();
    torch::Tensor grad_x, grad_w;
    if (ctx->needs_input_grad(0)) {
      const bool x_column_major = x2.stride(0) == 1 && x2.stride(1) == x2.size(0);
      grad_x = x_column_major ? mat2.mm(g.t()).t() : g.mm(mat2.t());
      grad_x = grad_x.reshape(x.sizes());
    }
    if (ctx->needs_input_grad(1)) {
      const bool w_t_column_major = mat2.stride(0) == 1 && mat2.stride(1) == mat2.size(0);
      const torch::Tensor grad_mat2 = w_t_column_major ? g.t().mm(x2).t() : x2.t().mm(g);
      grad_w = grad_mat2.t();
    }
    return {grad_x, grad_w, torch::Tensor()};
  }
};

// The attention core's replay: the output values saved in forward, with a backward through the
// core's own graph, kept from the checkpointed forward (entry.inputs are the detached q, k, v it
// ran on). Whatever the core is (SDPA's flash kernel with its log-sum-exp, context parallel's ring
// attention with its collectives) its backward is its own, so the gradients are bitwise those
// without checkpointing and no attention forward is recomputed. The price: the core's saved
// tensors (q, k, v after RoPE, the output, the log-sum-exp) stay alive instead of only the output.
struct SavedCore : torch::CustomClassHolder {
  OpCache::Entry entry;
};

struct AttentionReplay : torch::autograd::Function<AttentionReplay> {
  // `sinks`: the layer's attention sinks (empty without), the core's fourth differentiable input.
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& sinks, c10::intrusive_ptr<SavedCore> core) {
    (void)q, (void)k, (void)v, (void)sinks;
    ctx->saved_data["core"] = c10::IValue::make_capsule(core);
    return core->entry.output.detach();
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto core = c10::static_intrusive_pointer_cast<SavedCore>(ctx->saved_data["core"].toCapsule());
    OpCache::Entry& e = core->entry;
    // Retained: the checkpoint node may run twice (a retained outer graph); the core's graph is
    // freed with the entry, when the checkpoint node goes.
    variable_list grads = torch::autograd::grad({e.output}, e.inputs, {grad_outputs[0]},
                                                /*retain_graph=*/true, /*create_graph=*/false,
                                                /*allow_unused=*/true);
    return {grads[0], grads[1], grads[2], grads.size() > 3 ? grads[3] : torch::Tensor(), torch::Tensor()};
  }
};

void hook_linear(nn::Linear& linear, const std::shared_ptr<OpCache>& cache) {
  linear.set_forward_override([cache](nn::Module& m, const torch::Tensor& x, const nn::ForwardFn& forward) {
    const torch::Tensor& weight = static_cast<nn::Linear&>(m).weight();
    switch (cache->phase()) {
      case OpCache::Phase::kOff:
        return forward(x);
      case OpCache::Phase::kRecord: {
        torch::Tensor y = forward(x);
        cache->record({&m, replayable_linear(x, weight) ? y : torch::Tensor(), {}});
        return y;
      }
      case OpCache::Phase::kReplay: {
        OpCache::Entry e = cache->take(m);
        if (!e.output.defined()) return forward(x);
        return linear_replay(x, weight, e.output);
      }
    }
    return forward(x);
  });
}

void hook_attention(nn::SelfAttention& attention, const std::shared_ptr<OpCache>& cache) {
  nn::SelfAttention* self = &attention;
  nn::SelfAttention::AttendFn core = attention.attend_fn();
  attention.set_attend([cache, self, core](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                           const nn::TokenLayout& layout, const nn::AttendFeatures& features) {
    auto run = [&](const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& c,
                   const nn::AttendFeatures& f) {
      return core ? core(a, b, c, layout, f) : self->sdpa_attend(a, b, c, layout, f);
    };
    switch (cache->phase()) {
      case OpCache::Phase::kOff:
        return run(q, k, v, features);
      case OpCache::Phase::kRecord: {
        // The core with autograd on, on leaves cut from q, k, v (and the sinks, a parameter the
        // core reads): its graph (and only its) is kept for the replay's backward.
        std::vector<torch::Tensor> leaves = {q.detach().requires_grad_(true), k.detach().requires_grad_(true),
                                             v.detach().requires_grad_(true)};
        nn::AttendFeatures cut = features;
        if (features.sinks.defined()) {
          // A frozen one (LoRA) stays out of the leaves: it has no gradient to replay.
          cut.sinks = features.sinks.detach().requires_grad_(features.sinks.requires_grad());
          if (cut.sinks.requires_grad()) leaves.push_back(cut.sinks);
        }
        torch::Tensor out;
        {
          torch::AutoGradMode grad_mode(true);
          out = run(leaves[0], leaves[1], leaves[2], cut);
        }
        cache->record({self, out, std::move(leaves)});
        return out.detach();
      }
      case OpCache::Phase::kReplay: {
        auto saved = c10::make_intrusive<SavedCore>();
        saved->entry = cache->take(*self);
        // Without sinks an empty tensor stands in (an autograd input must be defined).
        return AttentionReplay::apply(q, k, v,
                                      features.sinks.defined() ? features.sinks : torch::empty({0}, q.options()),
                                      saved);
      }
    }
    return run(q, k, v, features);
  });
}

}  // namespace

torch::Tensor linear_replay(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& y) {
  LOOM_REQUIRE(replayable_linear(x, weight), "linear_replay: x ", x.sizes(), " (", x.scalar_type(),
               ") and weight ", weight.sizes(), " are not a plain matmul");
  std::vector<int64_t> want = x.sizes().vec();
  want.back() = weight.size(0);
  LOOM_REQUIRE(y.sizes().vec() == want, "activation checkpointing: the saved output ", y.sizes(),
               " does not match the recomputed linear's ", c10::IntArrayRef(want));
  return LinearReplay::apply(x, weight, y);
}

void checkpoint_module(nn::Module& module, bool per_op) {
  std::shared_ptr<OpCache> cache;
  if (per_op) {
    cache = std::make_shared<OpCache>();
    for (const auto& [name, m] : module.named_modules()) {
      if (auto* linear = dynamic_cast<nn::Linear*>(m)) {
        // A biased linear is at::linear's addmm, and a linear with an around-hook computes
        // something else (async TP's collective matmul): both are recomputed.
        if (!linear->has_bias() && !linear->forward_override()) hook_linear(*linear, cache);
      } else if (auto* attention = dynamic_cast<nn::SelfAttention*>(m)) {
        hook_attention(*attention, cache);
      }
    }
  }
  nn::ForwardOverride previous = module.forward_override();
  module.set_forward_override([previous, cache](nn::Module& m, const torch::Tensor& input,
                                                const nn::ForwardFn& forward) {
    // The trainable parameters as the forward reads them now (FSDP's pre-hook has pointed the
    // slots at its unsharded leaves, the same tensors it points them at again for backward).
    std::vector<torch::Tensor> params;
    for (const auto& p : m.named_parameters()) {
      if (p.tensor().requires_grad() && p.tensor().is_leaf()) params.push_back(p.tensor());
    }
    if (!previous) return checkpoint(forward, input, params, cache);
    // Chained: the checkpointed (and re-run) forward is the previous override around the module's.
    nn::Module* self = &m;
    return checkpoint([previous, self, forward](const torch::Tensor& x) { return previous(*self, x, forward); },
                      input, params, cache);
  });
}

}  // namespace loom::ac
