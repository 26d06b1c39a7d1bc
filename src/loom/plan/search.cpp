#include "loom/plan/search.h"

#include <c10/util/StringUtil.h>

#include <algorithm>

#include "loom/ac/activation_checkpoint.h"
#include "loom/core/error.h"
#include "loom/core/options.h"
#include "loom/core/timer.h"
#include "loom/models/spec.h"
#include "loom/train/layout_check.h"

namespace loom::plan {
namespace {

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t d = 1; d * d <= n; ++d) {
    if (n % d != 0) continue;
    out.push_back(d);
    if (d != n / d) out.push_back(n / d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

void Layout::apply_to(train::JobConfig& config) const {
  auto& p = config.parallelism;
  p.data_parallel_replicate_degree = dp_replicate;
  p.data_parallel_shard_degree = dp_shard;
  p.context_parallel_degree = cp;
  p.tensor_parallel_degree = tp;
  p.pipeline_parallel_degree = pp;
  p.expert_parallel_degree = ep;
  if (pp > 1) {
    p.pipeline_parallel_schedule = schedule;
    p.pipeline_parallel_microbatch_size = microbatch_size;
  }
  config.training.local_batch_size = local_batch_size;
  if (!ac_mode.empty()) {
    config.activation_checkpoint.mode = options::parse_enum<ac::Mode>(ac_mode, "activation_checkpoint.mode");
    if (ac_mode == "selective") config.activation_checkpoint.selective_ac_option = "op";
  }
  if (!reshard_after_forward.empty()) p.fsdp_reshard_after_forward = reshard_after_forward;
  if (!float8.empty()) config.float8.enable = float8 == "on";
}

std::vector<std::string> Layout::overrides() const {
  std::vector<std::string> out = {
      c10::str("--parallelism.data_parallel_replicate_degree=", dp_replicate),
      c10::str("--parallelism.data_parallel_shard_degree=", dp_shard),
      c10::str("--parallelism.context_parallel_degree=", cp),
      c10::str("--parallelism.tensor_parallel_degree=", tp),
      c10::str("--parallelism.pipeline_parallel_degree=", pp),
      c10::str("--parallelism.expert_parallel_degree=", ep)};
  if (pp > 1) {
    out.push_back("--parallelism.pipeline_parallel_schedule=" + schedule);
    out.push_back(c10::str("--parallelism.pipeline_parallel_microbatch_size=", microbatch_size));
  }
  out.push_back(c10::str("--training.local_batch_size=", local_batch_size));
  if (!ac_mode.empty()) {
    out.push_back("--activation_checkpoint.mode=" + ac_mode);
    if (ac_mode == "selective") out.push_back("--activation_checkpoint.selective_ac_option=op");
  }
  if (!reshard_after_forward.empty()) out.push_back("--parallelism.fsdp_reshard_after_forward=" + reshard_after_forward);
  if (!float8.empty()) out.push_back(c10::str("--float8.enable=", float8 == "on" ? "true" : "false"));
  return out;
}

std::string Layout::describe() const {
  std::string out;
  auto dim = [&](const char* name, int degree) {
    if (degree == 1) return;
    if (!out.empty()) out += " x ";
    out += c10::str(name, " ", degree);
  };
  dim("dp_replicate", dp_replicate);
  dim("dp_shard", dp_shard);
  dim("cp", cp);
  dim("tp", tp);
  dim("pp", pp);
  dim("ep", ep);
  if (out.empty()) out = "one device";
  if (pp > 1) out += c10::str(" (", schedule, ", micro-batch ", microbatch_size, ")");
  out += c10::str(", local batch ", local_batch_size);
  if (grad_accum_steps > 1) out += c10::str(" x ", grad_accum_steps, " accumulated");
  if (ac_mode == "none") out += ", no AC";
  if (ac_mode == "selective") out += ", selective AC (per op)";
  if (ac_mode == "full") out += ", full AC";
  if (!reshard_after_forward.empty()) out += ", reshard after forward: " + reshard_after_forward;
  if (float8 == "on") out += ", Float8";
  if (fsdp_accumulate == "on" && grad_accum_steps > 1) out += ", FSDP accumulates unsharded";
  return out;
}

SearchResult enumerate_layouts(const SearchRequest& request) {
  Timer timer;
  const int world = request.world_size;
  LOOM_REQUIRE_USAGE(world >= 1, "the world size must be at least 1 device, got ", world);
  LOOM_REQUIRE_USAGE(request.devices_per_node >= 1, "devices per node must be at least 1, got ",
                     request.devices_per_node);
  const int64_t global_rows = request.base.training.global_batch_size;
  LOOM_REQUIRE_USAGE(global_rows >= 1, "the global batch must be set (training.global_batch_size rows, ",
                     "or tokens / training.seq_len), got ", global_rows);
  const train::JobConfig& base = request.base;
  const models::ModelSpec& spec = models::get_spec(base.model.name);
  const int64_t vocab = request.vocab_size > 0 ? request.vocab_size : base.model.vocab_size;
  const auto args = spec.build_args(models::model_request(base.model, base.checkpoint.initial_load_path, vocab, base.training.seq_len));
  const models::ParameterCounts counts = spec.count_parameters(*args);
  // Expert parallelism only for models that route tokens (not every parameter active per token).
  const bool routed = counts.active < counts.total;

  SearchResult result;
  train::JobConfig config = base;
  auto try_layout = [&](const Layout& layout) {
    ++result.candidates;
    layout.apply_to(config);
    try {
      const train::CheckedLayout checked = train::check_layout(config, world, 0, spec, [&]() -> const models::ModelArgs& { return *args; });
      Layout accepted = layout;
      accepted.grad_accum_steps = checked.grad_accum_steps;
      result.layouts.push_back(std::move(accepted));
    } catch (const loom::UsageError&) {
      // Refused by the rules training applies: not a layout.
    }
  };

  for (const int64_t tp : divisors(world)) {
    if (request.devices_per_node % tp != 0) continue;  // TP inside a node
    for (const int64_t pp : divisors(world / tp)) {
      for (const int64_t cp : divisors(world / (tp * pp))) {
        const int64_t rest = world / (tp * pp * cp);
        for (const int64_t dp_replicate : divisors(rest)) {
          const int64_t dp_shard = rest / dp_replicate;
          const int64_t dp = dp_replicate * dp_shard;
          if (global_rows % dp != 0) continue;  // rows per data-parallel rank
          const int64_t rows = global_rows / dp;
          const std::vector<int64_t> eps = routed ? divisors(dp_shard * cp * tp) : std::vector<int64_t>{1};
          for (const int64_t accum : divisors(rows)) {
            if (accum > request.max_gradient_accumulation) break;
            const int64_t local = rows / accum;
            for (const int64_t ep : eps) {
              Layout layout;
              layout.dp_replicate = static_cast<int>(dp_replicate);
              layout.dp_shard = static_cast<int>(dp_shard);
              layout.cp = static_cast<int>(cp);
              layout.tp = static_cast<int>(tp);
              layout.pp = static_cast<int>(pp);
              layout.ep = static_cast<int>(ep);
              layout.local_batch_size = local;
              if (pp == 1) {
                try_layout(layout);
                continue;
              }
              for (const std::string& schedule : request.schedules) {
                layout.schedule = schedule;
                for (const int64_t mb : divisors(local)) {
                  layout.microbatch_size = mb;
                  try_layout(layout);
                }
              }
            }
          }
        }
      }
    }
  }
  result.seconds = timer.seconds();
  return result;
}

}  // namespace loom::plan
