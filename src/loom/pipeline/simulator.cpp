#include "loom/pipeline/simulator.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "loom/core/error.h"

namespace loom::pipeline {

namespace {

std::string ordinal(size_t n) {
  const char* suffix = "th";
  if (n % 100 < 11 || n % 100 > 13) {
    if (n % 10 == 1) suffix = "st";
    if (n % 10 == 2) suffix = "nd";
    if (n % 10 == 3) suffix = "rd";
  }
  return std::to_string(n) + suffix;
}

std::string num(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

// Where a message goes: the rank of the stage on the other end.
int peer_rank(const Schedule& s, const Action& a) {
  switch (a.kind) {
    case ActionKind::kSendF: return s.rank_of(a.stage + 1);
    case ActionKind::kSendB: return s.rank_of(a.stage - 1);
    case ActionKind::kRecvF: return s.rank_of(a.stage - 1);
    case ActionKind::kRecvB: return s.rank_of(a.stage + 1);
    default: return -1;
  }
}

// The action on the other end of a send or receive.
Action partner(const Action& a) {
  switch (a.kind) {
    case ActionKind::kSendF: return {ActionKind::kRecvF, a.stage + 1, a.microbatch};
    case ActionKind::kSendB: return {ActionKind::kRecvB, a.stage - 1, a.microbatch};
    case ActionKind::kRecvF: return {ActionKind::kSendF, a.stage - 1, a.microbatch};
    case ActionKind::kRecvB: return {ActionKind::kSendB, a.stage + 1, a.microbatch};
    default: return a;
  }
}

struct Pos {
  int rank = -1;
  size_t index = 0;
};

}  // namespace

double Costs::of(ActionKind kind) const {
  switch (kind) {
    case ActionKind::kForward: return forward;
    case ActionKind::kBackward: return backward;
    case ActionKind::kBackwardInput: return backward_input;
    case ActionKind::kBackwardWeight: return backward_weight;
    case ActionKind::kSendF:
    case ActionKind::kSendB: return send;
    case ActionKind::kRecvF:
    case ActionKind::kRecvB: return recv;
    case ActionKind::kUnshard: return unshard;
    case ActionKind::kReshard: return reshard;
    case ActionKind::kReduceGrad: return reduce_grad;
  }
  return 0;
}

Costs Costs::parse(const std::string& text) {
  Costs c;
  std::istringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    LOOM_REQUIRE_USAGE(eq != std::string::npos, "cost '", item, "' is not KEY=VALUE (e.g. F=1,B=2,I=1,W=1,transfer=0.1)");
    std::string key = item.substr(0, eq);
    for (char& ch : key) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    double value = 0;
    size_t used = 0;
    try {
      value = std::stod(item.substr(eq + 1), &used);
    } catch (const std::exception&) {
      used = 0;
    }
    LOOM_REQUIRE_USAGE(used > 0 && used == item.size() - eq - 1 && value >= 0, "cost '", item,
                       "' needs a non-negative number after '='");
    double* slot = key == "f"          ? &c.forward
                   : key == "b"        ? &c.backward
                   : key == "i"        ? &c.backward_input
                   : key == "w"        ? &c.backward_weight
                   : key == "send"     ? &c.send
                   : key == "recv"     ? &c.recv
                   : key == "transfer" ? &c.transfer
                   : key == "unshard"  ? &c.unshard
                   : key == "reshard"  ? &c.reshard
                   : key == "reduce_grad" ? &c.reduce_grad
                                       : nullptr;
    LOOM_REQUIRE_USAGE(slot != nullptr, "unknown cost '", item.substr(0, eq),
                       "'; valid: F, B, I, W, send, recv, transfer, unshard, reshard, reduce_grad");
    *slot = value;
  }
  return c;
}

std::string Costs::str() const {
  return "F=" + num(forward) + ",B=" + num(backward) + ",I=" + num(backward_input) + ",W=" + num(backward_weight) +
         ",send=" + num(send) + ",recv=" + num(recv) + ",transfer=" + num(transfer) + ",unshard=" + num(unshard) +
         ",reshard=" + num(reshard) + ",reduce_grad=" + num(reduce_grad);
}

std::vector<int> peak_activations(const Schedule& s) {
  // A split backward frees the activation at W; a full one at B.
  std::vector<int> peaks;
  for (const auto& list : s.ranks) {
    int live = 0, peak = 0;
    for (const Action& a : list) {
      if (a.kind == ActionKind::kForward) peak = std::max(peak, ++live);
      if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardWeight) --live;
    }
    peaks.push_back(peak);
  }
  return peaks;
}

SimulationResult simulate(const Schedule& s, const SimulationOptions& options) {
  validate(s);
  const int R = s.num_ranks, S = s.num_stages(), M = s.num_microbatches;
  const std::string& name = s.name;
  bool crosses = false;
  for (int st = 0; st + 1 < S; ++st) crosses = crosses || s.rank_of(st) != s.rank_of(st + 1);
  LOOM_REQUIRE_USAGE(!crosses || s.has_communication(), name,
                     " has no send/recv actions but its stages span ranks; lower it first (add_communication)");

  // Static matching of every receive with its send, in posting order per pair of ranks.
  std::map<std::pair<int, int>, std::vector<Pos>> sends, recvs;  // (from, to) -> positions, in order
  std::map<std::tuple<int, int, int>, Pos> send_at;               // (kind, stage, mb) -> position
  for (int r = 0; r < R; ++r) {
    const auto& list = s.ranks[static_cast<size_t>(r)];
    for (size_t i = 0; i < list.size(); ++i) {
      const Action& a = list[i];
      if (is_send(a.kind)) {
        sends[{r, peer_rank(s, a)}].push_back({r, i});
        send_at[{static_cast<int>(a.kind), a.stage, a.microbatch}] = {r, i};
      }
      if (is_recv(a.kind)) recvs[{peer_rank(s, a), r}].push_back({r, i});
    }
  }
  auto at = [&](Pos p) -> const Action& { return s.ranks[static_cast<size_t>(p.rank)][p.index]; };
  std::vector<std::vector<Pos>> matched(static_cast<size_t>(R));  // per action: its partner
  for (int r = 0; r < R; ++r) matched[static_cast<size_t>(r)].resize(s.ranks[static_cast<size_t>(r)].size());
  for (const auto& [channel, list] : recvs) {
    const auto& sent = sends[channel];
    for (size_t k = 0; k < list.size(); ++k) {
      const Action& recv = at(list[k]);
      const Action want = partner(recv);
      LOOM_REQUIRE_USAGE(send_at.count({static_cast<int>(want.kind), want.stage, want.microbatch}), name,
                         ": schedule deadlocks: rank ", list[k].rank, " waits at ", recv.str(),
                         ", which no rank sends (rank ", channel.first, " needs a ", want.str(), ")");
      LOOM_REQUIRE_USAGE(k < sent.size() && at(sent[k]) == want, name, ": rank ", channel.second, "'s ",
                         ordinal(k + 1), " receive from rank ", channel.first, " is ", recv.str(), " but rank ",
                         channel.first, "'s ", ordinal(k + 1), " send to rank ", channel.second, " is ",
                         k < sent.size() ? at(sent[k]).str() : std::string("missing"),
                         " (messages between two ranks match in the order they are posted)");
      matched[static_cast<size_t>(list[k].rank)][list[k].index] = sent[k];
      matched[static_cast<size_t>(sent[k].rank)][sent[k].index] = list[k];
    }
  }
  for (const auto& [channel, list] : sends) {
    const size_t received = recvs.count(channel) ? recvs[channel].size() : 0;
    LOOM_REQUIRE_USAGE(list.size() == received, name, ": rank ", channel.first, "'s ", at(list[received]).str(),
                       " is never received (rank ", channel.second, " has no ", partner(at(list[received])).str(),
                       ")");
  }

  // Simulation: every action starts when its rank is free and its inputs are there.
  const Costs& c = options.costs;
  const bool rendezvous = options.send_mode == SendMode::kRendezvous;
  std::vector<std::vector<double>> end(static_cast<size_t>(R)), posted(static_cast<size_t>(R));
  for (int r = 0; r < R; ++r) {
    end[static_cast<size_t>(r)].assign(s.ranks[static_cast<size_t>(r)].size(), -1);
    posted[static_cast<size_t>(r)].assign(s.ranks[static_cast<size_t>(r)].size(), -1);
  }
  auto key = [M](int st, int mb) { return static_cast<size_t>(st * M + mb); };
  std::vector<double> f_end(static_cast<size_t>(S * M), -1), bwd_end(static_cast<size_t>(S * M), -1);
  std::vector<Pos> recv_f_at(static_cast<size_t>(S * M)), recv_b_at(static_cast<size_t>(S * M));
  for (int r = 0; r < R; ++r) {
    const auto& list = s.ranks[static_cast<size_t>(r)];
    for (size_t i = 0; i < list.size(); ++i) {
      if (list[i].kind == ActionKind::kRecvF) recv_f_at[key(list[i].stage, list[i].microbatch)] = {r, i};
      if (list[i].kind == ActionKind::kRecvB) recv_b_at[key(list[i].stage, list[i].microbatch)] = {r, i};
    }
  }
  std::vector<double> clock(static_cast<size_t>(R), 0);
  std::vector<size_t> next(static_cast<size_t>(R), 0);
  SimulationResult result;
  result.schedule_name = name;
  result.num_ranks = R;
  result.timeline.resize(static_cast<size_t>(R));

  // When the data of a receive is usable, or -1 while its send has not run.
  auto arrival = [&](Pos recv) {
    const Pos send = matched[static_cast<size_t>(recv.rank)][recv.index];
    const double e = end[static_cast<size_t>(send.rank)][send.index];
    return e < 0 ? -1.0 : e + c.transfer;
  };
  // The earliest start of compute action `a` on rank r, or -1 with `why` set when it must wait.
  auto compute_ready = [&](int r, const Action& a, std::string& why) -> double {
    double ready = clock[static_cast<size_t>(r)];
    auto input = [&](bool local, double local_end, const Action& local_dep, Pos recv) {
      if (local) {
        if (local_end < 0) {
          why = "for " + local_dep.str() + ", which comes later on rank " + std::to_string(r);
          return false;
        }
        ready = std::max(ready, local_end);
        return true;
      }
      const double t = arrival(recv);
      if (t < 0) {
        const Pos send = matched[static_cast<size_t>(recv.rank)][recv.index];
        why = "for " + at(send).str() + " (rank " + std::to_string(send.rank) + ")";
        return false;
      }
      ready = std::max(ready, t);
      return true;
    };
    const size_t k = key(a.stage, a.microbatch);
    if (a.kind == ActionKind::kForward && a.stage > 0) {
      const bool local = s.rank_of(a.stage - 1) == r;
      if (!input(local, f_end[key(a.stage - 1, a.microbatch)], F(a.stage - 1, a.microbatch), recv_f_at[k])) return -1;
    }
    if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) {
      ready = std::max(ready, f_end[k]);  // earlier on this rank (validated)
      if (a.stage + 1 < S) {
        const bool local = s.rank_of(a.stage + 1) == r;
        if (!input(local, bwd_end[key(a.stage + 1, a.microbatch)], B(a.stage + 1, a.microbatch), recv_b_at[k])) {
          return -1;
        }
      }
    }
    if (a.kind == ActionKind::kBackwardWeight) ready = std::max(ready, bwd_end[k]);
    return ready;
  };
  auto run = [&](int r, size_t i, double start) {
    const Action& a = s.ranks[static_cast<size_t>(r)][i];
    const double finish = start + c.of(a.kind);
    end[static_cast<size_t>(r)][i] = finish;
    clock[static_cast<size_t>(r)] = finish;
    result.timeline[static_cast<size_t>(r)].push_back({a, start, finish});
    if (a.kind == ActionKind::kForward) f_end[key(a.stage, a.microbatch)] = finish;
    if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) {
      bwd_end[key(a.stage, a.microbatch)] = finish;
    }
  };
  auto is_comm = [](const Action& a) { return is_send(a.kind) || is_recv(a.kind); };

  // Advances rank r as far as it can; returns whether it ran anything. `why` names what it waits for.
  auto advance = [&](int r, std::string& why) {
    const auto& list = s.ranks[static_cast<size_t>(r)];
    size_t& i = next[static_cast<size_t>(r)];
    bool ran = false;
    while (i < list.size()) {
      const Action& a = list[i];
      if (rendezvous && is_comm(a)) {
        size_t j = i;
        while (j < list.size() && is_comm(list[j])) ++j;
        const double t0 = clock[static_cast<size_t>(r)];
        for (size_t q = i; q < j; ++q) {
          if (posted[static_cast<size_t>(r)][q] < 0) posted[static_cast<size_t>(r)][q] = t0;
        }
        double start = t0;
        bool blocked = false;
        for (size_t q = i; q < j && !blocked; ++q) {
          if (!is_send(list[q].kind)) continue;
          const Pos recv = matched[static_cast<size_t>(r)][q];
          const double p = posted[static_cast<size_t>(recv.rank)][recv.index];
          if (p < 0) {
            why = "at " + list[q].str() + " for rank " + std::to_string(recv.rank) + " to post " + at(recv).str();
            blocked = true;
          }
          start = std::max(start, p);
        }
        if (blocked) {
          why = "rank " + std::to_string(r) + " waits " + why;
          return ran;
        }
        for (size_t q = i; q < j; ++q) {
          run(r, q, start);
          start = clock[static_cast<size_t>(r)];
        }
        i = j;
        ran = true;
        continue;
      }
      double start = clock[static_cast<size_t>(r)];
      if (is_compute(a.kind)) {
        std::string reason;
        start = compute_ready(r, a, reason);
        if (start < 0) {
          why = "rank " + std::to_string(r) + " waits at " + a.str() + " " + reason;
          return ran;
        }
      }
      if (is_recv(a.kind)) posted[static_cast<size_t>(r)][i] = start;
      run(r, i, start);
      ++i;
      ran = true;
    }
    return ran;
  };

  for (;;) {
    bool progress = false, finished = true;
    std::string stuck;
    for (int r = 0; r < R; ++r) {
      std::string why;
      progress = advance(r, why) || progress;
      if (next[static_cast<size_t>(r)] < s.ranks[static_cast<size_t>(r)].size()) {
        finished = false;
        stuck += (stuck.empty() ? "" : ", ") + why;
      }
    }
    if (finished) break;
    LOOM_REQUIRE_USAGE(progress, name, ": schedule deadlocks: ", stuck);
  }

  result.compute_time.assign(static_cast<size_t>(R), 0);
  for (int r = 0; r < R; ++r) {
    for (const TimedAction& t : result.timeline[static_cast<size_t>(r)]) {
      result.makespan = std::max(result.makespan, t.end);
      if (is_compute(t.action.kind)) result.compute_time[static_cast<size_t>(r)] += t.end - t.start;
    }
  }
  double busy = 0;
  for (int r = 0; r < R; ++r) {
    busy += result.compute_time[static_cast<size_t>(r)];
    result.idle_time.push_back(result.makespan - result.compute_time[static_cast<size_t>(r)]);
  }
  result.bubble_fraction = result.makespan > 0 ? 1.0 - busy / (R * result.makespan) : 0.0;
  result.peak_activations = peak_activations(s);
  return result;
}

std::string chrome_trace_json(const SimulationResult& result, double us_per_unit) {
  nlohmann::json events = nlohmann::json::array();
  for (int r = 0; r < result.num_ranks; ++r) {
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", 0},
                      {"tid", r},
                      {"args", {{"name", "rank " + std::to_string(r)}}}});
  }
  for (int r = 0; r < result.num_ranks; ++r) {
    for (const TimedAction& t : result.timeline[static_cast<size_t>(r)]) {
      const char* cat = is_compute(t.action.kind) ? "compute" : is_fsdp(t.action.kind) ? "fsdp" : "comm";
      events.push_back({{"name", t.action.str()},
                        {"cat", cat},
                        {"ph", "X"},
                        {"pid", 0},
                        {"tid", r},
                        {"ts", t.start * us_per_unit},
                        {"dur", (t.end - t.start) * us_per_unit}});
    }
  }
  nlohmann::json trace = {{"traceEvents", events}, {"displayTimeUnit", "ms"}};
  trace["otherData"] = {{"schedule", result.schedule_name},
                        {"makespan", result.makespan},
                        {"bubble_fraction", result.bubble_fraction}};
  return trace.dump();
}

void write_chrome_trace(const SimulationResult& result, const std::string& path, double us_per_unit) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  LOOM_REQUIRE_USAGE(out.good(), "cannot write the trace file '", path, "'");
  out << chrome_trace_json(result, us_per_unit) << "\n";
  out.close();
  LOOM_REQUIRE(out.good(), "writing the trace file '", path, "' failed");
}

std::string format_summary(const SimulationResult& r) {
  char line[256];
  std::string out;
  std::snprintf(line, sizeof line, "makespan %g, bubble fraction %.4f\n", r.makespan, r.bubble_fraction);
  out += line;
  out += "rank  compute  idle     peak activations\n";
  for (int k = 0; k < r.num_ranks; ++k) {
    std::snprintf(line, sizeof line, "%-4d  %-7g  %-7g  %d\n", k, r.compute_time[static_cast<size_t>(k)],
                  r.idle_time[static_cast<size_t>(k)], r.peak_activations[static_cast<size_t>(k)]);
    out += line;
  }
  return out;
}

}  // namespace loom::pipeline
