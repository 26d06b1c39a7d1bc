#include "loom/pipeline/generators.h"

#include <algorithm>
#include <cctype>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include "loom/core/error.h"

namespace loom::pipeline {

namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string joined_names() {
  std::string out;
  for (const std::string& n : schedule_names()) out += (out.empty() ? "" : ", ") + n;
  return out;
}

// Per-stage micro-batch counters: each stage runs its micro-batches in ascending order for every
// kind of action, so a generator only decides which stage comes next.
class Counter {
 public:
  int next(int stage) { return n_[stage]++; }

 private:
  std::map<int, int> n_;
};

std::vector<Action> gpipe_rank(int rank, int m) {
  std::vector<Action> out;
  for (int mb = 0; mb < m; ++mb) out.push_back(F(rank, mb));
  for (int mb = 0; mb < m; ++mb) out.push_back(B(rank, mb));
  return out;
}

// Warm-up forwards fill the pipeline below this rank (pp - 1 - rank of them), then one forward and
// one backward alternate, then the remaining backwards drain it.
std::vector<Action> one_f_one_b_rank(int pp, int rank, int m) {
  std::vector<Action> out;
  const int warmup = std::min(pp - 1 - rank, m);
  int f = 0, b = 0;
  while (f < warmup) out.push_back(F(rank, f++));
  while (f < m) {
    out.push_back(F(rank, f++));
    out.push_back(B(rank, b++));
  }
  while (b < m) out.push_back(B(rank, b++));
  return out;
}

// Breadth-first: every micro-batch through the rank's first stage, then its next stage, ...; the
// backwards in the reverse order (last stage first, latest micro-batch first), as PyTorch does.
std::vector<Action> looped_bfs_rank(int pp, int v, int rank, int m) {
  std::vector<Action> out;
  for (int local = 0; local < v; ++local) {
    for (int mb = 0; mb < m; ++mb) out.push_back(F(local * pp + rank, mb));
  }
  for (int local = v - 1; local >= 0; --local) {
    for (int mb = m - 1; mb >= 0; --mb) out.push_back(B(local * pp + rank, mb));
  }
  return out;
}

// Depth-first interleaving (Megatron-LM's interleaved 1F1B, PyTorch's flexible variant): the
// micro-batches go in rounds of `per_round`; forward k runs on local stage (k / per_round) % v and
// backward k on local stage v - 1 - (k / per_round) % v. Warm-up: enough forwards for the last
// rank's earlier local stages plus `hop` per rank to the end of the pipeline; then one forward and
// one backward alternate; then the remaining backwards. With `zero_bubble`, backwards are I and the
// W of the oldest outstanding I follows each backward once `rank` backwards are done (ZB1P), the
// rest at the end.
std::vector<Action> interleaved_rank(int pp, int v, int rank, int m, bool zero_bubble) {
  const int rounds = std::max(1, m / pp);
  const int per_round = m / rounds;
  const int total = m * v;
  const int hop = zero_bubble ? 1 : 2;
  const int warmup = std::min((v - 1) * per_round + hop * (pp - 1 - rank), total);
  auto fwd_stage = [&](int k) { return ((k / per_round) % v) * pp + rank; };
  auto bwd_stage = [&](int k) { return (v - 1 - (k / per_round) % v) * pp + rank; };
  Counter fwd, bwd, wgt;
  std::vector<Action> out;
  int weights = 0;  // W actions emitted, in the order of the backwards
  auto backward = [&](int k) {
    const int s = bwd_stage(k);
    out.push_back(zero_bubble ? I(s, bwd.next(s)) : B(s, bwd.next(s)));
    if (zero_bubble && k >= rank) {
      const int ws = bwd_stage(weights++);
      out.push_back(W(ws, wgt.next(ws)));
    }
  };
  for (int k = 0; k < warmup; ++k) out.push_back(F(fwd_stage(k), fwd.next(fwd_stage(k))));
  for (int k = warmup; k < total; ++k) {
    out.push_back(F(fwd_stage(k), fwd.next(fwd_stage(k))));
    backward(k - warmup);
  }
  for (int k = total - warmup; k < total; ++k) backward(k);
  while (zero_bubble && weights < total) {
    const int ws = bwd_stage(weights++);
    out.push_back(W(ws, wgt.next(ws)));
  }
  return out;
}

// ZB-V (Zero Bubble paper, section 6): rank r holds stage r (going down) and 2pp-1-r (coming back
// up). The schedule is built for max(m, 2pp - 1) micro-batches and the actions of micro-batches
// that do not exist are dropped, as PyTorch does.
std::vector<Action> zbv_rank(int pp, int rank, int m) {
  const int n = std::max(2 * pp - 1, m);
  const int s0 = rank, s1 = 2 * pp - 1 - rank;
  int f0 = 0, f1 = 0, b0 = 0, b1 = 0;
  std::vector<Action> out;
  for (int k = 0; k < 2 * (pp - rank) - 1; ++k) out.push_back(F(s0, f0++));
  for (int k = 0; k < rank; ++k) {
    out.push_back(F(s1, f1++));
    out.push_back(F(s0, f0++));
  }
  for (int k = 0; k < pp - rank; ++k) {
    out.push_back(F(s1, f1++));
    out.push_back(I(s1, b1));
    out.push_back(W(s1, b1++));
  }
  while (f1 < f0 || f0 < n) {
    if (f0 < n) out.push_back(F(s0, f0++));
    out.push_back(I(s0, b0));
    out.push_back(W(s0, b0++));
    out.push_back(F(s1, f1++));
    out.push_back(I(s1, b1));
    out.push_back(W(s1, b1++));
  }
  int w0 = b0, w1 = b1;
  for (int k = 0; k < rank; ++k) {
    out.push_back(I(s0, b0++));
    out.push_back(I(s1, b1++));
  }
  for (int k = 0; k < pp - rank; ++k) {
    out.push_back(I(s0, b0++));
    out.push_back(W(s0, w0++));
  }
  while (w1 < b1) out.push_back(W(s1, w1++));
  while (w0 < b0) out.push_back(W(s0, w0++));
  LOOM_REQUIRE(f0 == n && f1 == n && b0 == n && b1 == n && w0 == n && w1 == n, "ZBV generator: unbalanced counts");
  std::erase_if(out, [m](const Action& a) { return a.microbatch >= m; });
  return out;
}

// DualPipeV (DeepSeek-V3's DualPipe folded onto a V): warm-up forwards on both stages, then the
// steady state pairs the forward of one stage with the backward of the other (DualPipe overlaps
// each pair; here they are two consecutive actions), and the second half of the cool-down splits
// backwards into I and W to fill the drain.
std::vector<Action> dualpipev_rank(int pp, int rank, int m) {
  const int s0 = rank, s1 = 2 * pp - 1 - rank;
  Counter fwd, bwd;
  std::deque<Action> pending_w;
  std::vector<Action> out;
  auto f = [&](int s) { out.push_back(F(s, fwd.next(s))); };
  auto b = [&](int s) { out.push_back(B(s, bwd.next(s))); };
  auto i = [&](int s) {
    const Action a = I(s, bwd.next(s));
    out.push_back(a);
    pending_w.push_back(W(a.stage, a.microbatch));
  };
  auto w = [&] {
    if (pending_w.empty()) return;
    out.push_back(pending_w.front());
    pending_w.pop_front();
  };
  for (int k = 0; k < 2 * (pp - rank - 1); ++k) f(s0);
  for (int k = 0; k < rank + 1; ++k) {
    f(s0);
    f(s1);
  }
  for (int k = 0; k < pp - rank - 1; ++k) {
    i(s1);
    w();
    f(s1);
  }
  for (int k = 0; k < m - 2 * pp + rank + 1; ++k) {
    f(s0);
    b(s1);
    f(s1);
    b(s0);
  }
  for (int k = 0; k < pp - rank - 1; ++k) {
    b(s1);
    f(s1);
    b(s0);
  }
  bool split = false;
  const int half = (rank + 1) / 2;
  for (int k = 0; k < rank + 1; ++k) {
    if (k == half && rank % 2 == 1) split = true;
    split ? i(s1) : b(s1);
    if (k == half && rank % 2 == 0) split = true;
    split ? i(s0) : b(s0);
  }
  for (int k = 0; k < pp - rank - 1; ++k) {
    w();
    split ? i(s0) : b(s0);
  }
  while (!pending_w.empty()) w();
  return out;
}

}  // namespace

const std::vector<std::string>& schedule_names() {
  static const std::vector<std::string> names = {"GPipe",         "1F1B",          "Interleaved1F1B", "LoopedBFS",
                                                 "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"};
  return names;
}

std::string canonical_schedule_name(std::string_view name) {
  const std::string want = lower(name);
  std::string nearest;
  size_t best = static_cast<size_t>(-1);
  for (const std::string& n : schedule_names()) {
    if (lower(n) == want) return n;
    // An abbreviation ("zbv", "interleaved") names the schedule it starts.
    const size_t d = !want.empty() && lower(n).starts_with(want) ? 0 : edit_distance(want, lower(n));
    if (d < best) {
      best = d;
      nearest = n;
    }
  }
  fail_usage("unknown pipeline schedule '", name, "' (did you mean '", nearest, "'?); valid: ", joined_names());
}

bool is_multi_stage(const std::string& n) { return n != "GPipe" && n != "1F1B"; }

bool splits_backward(const std::string& n) {
  return n == "InterleavedZeroBubble" || n == "ZBVZeroBubble" || n == "DualPipeV";
}

Schedule generate_compute(const ScheduleSpec& spec) {
  const std::string name = canonical_schedule_name(spec.name);
  const int pp = spec.pp, m = spec.microbatches;
  LOOM_REQUIRE_USAGE(pp >= 1, name, ": the pipeline degree must be >= 1 (got ", pp, ")");
  LOOM_REQUIRE_USAGE(m >= 1, name, ": needs at least 1 micro-batch (got ", m, ")");
  LOOM_REQUIRE_USAGE(spec.stages_per_rank >= 0, name, ": stages per rank must be >= 1 (got ",
                     spec.stages_per_rank, ")");
  const int v = spec.stages_per_rank > 0 ? spec.stages_per_rank : (is_multi_stage(name) ? 2 : 1);
  const bool v_shape = name == "ZBVZeroBubble" || name == "DualPipeV";
  if (!is_multi_stage(name)) {
    LOOM_REQUIRE_USAGE(v == 1, name, " runs one stage per rank, not ", v,
                       "; use Interleaved1F1B or LoopedBFS for several stages per rank");
  }
  if (v_shape) {
    LOOM_REQUIRE_USAGE(v == 2, name, " needs exactly 2 stages per rank (a V: rank r holds stages r and 2pp-1-r), not ", v);
  }
  if (name == "1F1B") {
    LOOM_REQUIRE_USAGE(m >= pp, "1F1B needs at least as many micro-batches as stages (", m, " < ", pp,
                       "); raise the micro-batch count to ", pp, " or use GPipe");
  }
  if (name == "Interleaved1F1B" || name == "InterleavedZeroBubble") {
    const int rounds = std::max(1, m / pp);
    LOOM_REQUIRE_USAGE(m % rounds == 0, name, " needs the micro-batches to split into rounds of equal size: ", m,
                       " micro-batches at pp ", pp, " make ", rounds, " rounds (max(1, m / pp)), and ", m,
                       " is not a multiple of ", rounds, "; use ", (m / rounds) * rounds, " or ",
                       (m / rounds + 1) * rounds, " micro-batches (e.g. a multiple of pp)");
  }
  if (name == "DualPipeV") {
    LOOM_REQUIRE_USAGE(m >= 2 * pp, "DualPipeV needs at least as many micro-batches as stages (", m, " < ", 2 * pp,
                       " = 2 x pp ", pp, "); raise the micro-batch count to ", 2 * pp);
  }

  Schedule s;
  s.name = name;
  s.num_ranks = pp;
  s.stages_per_rank = v;
  s.num_microbatches = m;
  s.layout = v_shape ? StageLayout::kV : StageLayout::kLoop;
  s.stage_to_rank = stage_to_rank_map(pp, v, s.layout);
  for (int r = 0; r < pp; ++r) {
    if (name == "GPipe") {
      s.ranks.push_back(gpipe_rank(r, m));
    } else if (name == "1F1B") {
      s.ranks.push_back(one_f_one_b_rank(pp, r, m));
    } else if (name == "Interleaved1F1B") {
      s.ranks.push_back(interleaved_rank(pp, v, r, m, false));
    } else if (name == "LoopedBFS") {
      s.ranks.push_back(looped_bfs_rank(pp, v, r, m));
    } else if (name == "InterleavedZeroBubble") {
      s.ranks.push_back(interleaved_rank(pp, v, r, m, true));
    } else if (name == "ZBVZeroBubble") {
      s.ranks.push_back(zbv_rank(pp, r, m));
    } else {
      s.ranks.push_back(dualpipev_rank(pp, r, m));
    }
  }
  validate(s);
  return s;
}

Schedule add_communication(const Schedule& in) {
  LOOM_REQUIRE_USAGE(!in.has_communication(), in.name, " already has send/recv actions; add_communication ",
                     "lowers a compute-only schedule");
  validate(in);
  const int S = in.num_stages(), M = in.num_microbatches, R = in.num_ranks;
  auto idx = [M](int s, int mb) { return static_cast<size_t>(s * M + mb); };
  // What each rank has placed so far, per (stage, micro-batch).
  std::vector<char> forward_done(static_cast<size_t>(S * M)), backward_done(static_cast<size_t>(S * M));
  std::vector<char> recv_f(static_cast<size_t>(S * M)), recv_b(static_cast<size_t>(S * M));

  // What compute action `a` waits for, or nullopt when it can run now.
  auto waits_for = [&](const Action& a) -> std::optional<Action> {
    const int r = in.rank_of(a.stage);
    if (a.kind == ActionKind::kForward && a.stage > 0) {
      const bool local = in.rank_of(a.stage - 1) == r;
      if (!(local ? forward_done[idx(a.stage - 1, a.microbatch)] : recv_f[idx(a.stage, a.microbatch)])) {
        return F(a.stage - 1, a.microbatch);
      }
    }
    if ((a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) && a.stage + 1 < S) {
      const bool local = in.rank_of(a.stage + 1) == r;
      if (!(local ? backward_done[idx(a.stage + 1, a.microbatch)] : recv_b[idx(a.stage, a.microbatch)])) {
        return Action{ActionKind::kBackward, a.stage + 1, a.microbatch};
      }
    }
    return std::nullopt;
  };

  Schedule out = in;
  for (auto& r : out.ranks) r.clear();
  std::vector<size_t> next(static_cast<size_t>(R), 0);
  for (;;) {
    bool progress = false, finished = true;
    for (int r = 0; r < R; ++r) {
      const auto& list = in.ranks[static_cast<size_t>(r)];
      size_t& pos = next[static_cast<size_t>(r)];
      if (pos == list.size()) continue;
      finished = false;
      const Action& a = list[pos];
      if (is_compute(a.kind) && waits_for(a)) continue;
      out.ranks[static_cast<size_t>(r)].push_back(a);
      ++pos;
      progress = true;
      if (a.kind == ActionKind::kForward) {
        forward_done[idx(a.stage, a.microbatch)] = 1;
        if (a.stage + 1 < S && in.rank_of(a.stage + 1) != r) {
          out.ranks[static_cast<size_t>(r)].push_back({ActionKind::kSendF, a.stage, a.microbatch});
          out.ranks[static_cast<size_t>(in.rank_of(a.stage + 1))].push_back({ActionKind::kRecvF, a.stage + 1, a.microbatch});
          recv_f[idx(a.stage + 1, a.microbatch)] = 1;
        }
      } else if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) {
        backward_done[idx(a.stage, a.microbatch)] = 1;
        if (a.stage > 0 && in.rank_of(a.stage - 1) != r) {
          out.ranks[static_cast<size_t>(r)].push_back({ActionKind::kSendB, a.stage, a.microbatch});
          out.ranks[static_cast<size_t>(in.rank_of(a.stage - 1))].push_back({ActionKind::kRecvB, a.stage - 1, a.microbatch});
          recv_b[idx(a.stage - 1, a.microbatch)] = 1;
        }
      }
    }
    if (finished) break;
    if (!progress) {
      std::string stuck;
      for (int r = 0; r < R; ++r) {
        const auto& list = in.ranks[static_cast<size_t>(r)];
        const size_t pos = next[static_cast<size_t>(r)];
        if (pos == list.size()) continue;
        const Action& a = list[pos];
        const Action dep = *waits_for(a);
        // Name the backward the way the producing rank's schedule spells it (B or I).
        std::string dep_name = dep.str();
        if (dep.kind == ActionKind::kBackward) {
          for (const Action& x : in.ranks[static_cast<size_t>(in.rank_of(dep.stage))]) {
            if (x.stage == dep.stage && x.microbatch == dep.microbatch &&
                (x.kind == ActionKind::kBackward || x.kind == ActionKind::kBackwardInput)) {
              dep_name = x.str();
            }
          }
        }
        stuck += std::string(stuck.empty() ? "" : ", ") + "rank " + std::to_string(r) + " waits at " + a.str() +
                 " for " + dep_name + " (rank " + std::to_string(in.rank_of(dep.stage)) + ")";
      }
      fail_usage(in.name, ": schedule deadlocks: ", stuck);
    }
  }
  validate(out);
  return out;
}

Schedule add_fsdp_actions(const Schedule& in) {
  LOOM_REQUIRE_USAGE(!in.has_fsdp_actions(), in.name, ": the schedule already has FSDP actions");
  Schedule out = in;
  for (size_t r = 0; r < in.ranks.size(); ++r) {
    const auto& list = in.ranks[r];
    // Compute actions only: a lowered schedule's SEND/RECV are not uses of the parameters.
    std::map<int, size_t> first, last, last_backward;
    std::vector<size_t> computes;  // positions of the compute actions
    for (size_t i = 0; i < list.size(); ++i) {
      if (!is_compute(list[i].kind)) continue;
      computes.push_back(i);
      first.emplace(list[i].stage, i);
      last[list[i].stage] = i;
      if (list[i].kind != ActionKind::kForward) last_backward[list[i].stage] = i;
    }
    // UNSHARD before the compute action that precedes the stage's first use (prefetch: the
    // all-gather overlaps that compute); several may land on the same slot.
    std::multimap<size_t, int> unshard_at, reshard_after;
    for (const auto& [stage, i] : first) {
      const auto it = std::lower_bound(computes.begin(), computes.end(), i);
      unshard_at.emplace(it == computes.begin() ? computes.front() : *std::prev(it), stage);
    }
    // REDUCE_GRAD right after the stage's last backward (B or W), RESHARD after its last use.
    std::multimap<size_t, int> reduce_after;
    for (const auto& [stage, i] : last_backward) reduce_after.emplace(i, stage);
    for (const auto& [stage, i] : last) reshard_after.emplace(i, stage);
    std::vector<Action> rank_out;
    for (size_t i = 0; i < list.size(); ++i) {
      for (auto [it, end] = unshard_at.equal_range(i); it != end; ++it) {
        rank_out.push_back({ActionKind::kUnshard, it->second, -1});
      }
      rank_out.push_back(list[i]);
      for (auto [it, end] = reduce_after.equal_range(i); it != end; ++it) {
        rank_out.push_back({ActionKind::kReduceGrad, it->second, -1});
      }
      for (auto [it, end] = reshard_after.equal_range(i); it != end; ++it) {
        rank_out.push_back({ActionKind::kReshard, it->second, -1});
      }
    }
    out.ranks[r] = std::move(rank_out);
  }
  validate(out);
  return out;
}

Schedule build_schedule(const ScheduleSpec& spec, bool fsdp) {
  // A schedule is a pure function of its spec, and a layout check builds one only to know it can
  // run: `loom plan` checks thousands of layouts sharing a few (schedule, pp, micro-batches)
  // triples, so the results -- a schedule or the one-line refusal -- are kept (a few hundred at
  // most; the cache is cleared when full).
  using Key = std::tuple<std::string, int, int, int, bool>;
  struct Entry {
    std::optional<Schedule> schedule;
    std::string refusal;
  };
  static std::mutex mutex;
  static std::map<Key, Entry> cache;
  const Key key{spec.name, spec.pp, spec.microbatches, spec.stages_per_rank, fsdp};
  {
    const std::lock_guard<std::mutex> lock(mutex);
    if (const auto it = cache.find(key); it != cache.end()) {
      if (it->second.schedule) return *it->second.schedule;
      throw UsageError(it->second.refusal);
    }
  }
  Entry entry;
  try {
    Schedule s = generate_compute(spec);
    if (fsdp) s = add_fsdp_actions(s);
    entry.schedule = add_communication(s);
  } catch (const UsageError& e) {
    entry.refusal = e.what();
  }
  const std::lock_guard<std::mutex> lock(mutex);
  if (cache.size() >= 512) cache.clear();
  const Entry& kept = cache.emplace(key, std::move(entry)).first->second;
  if (!kept.schedule) throw UsageError(kept.refusal);
  return *kept.schedule;
}

}  // namespace loom::pipeline
