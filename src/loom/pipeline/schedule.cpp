#include "loom/pipeline/schedule.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "loom/core/error.h"

namespace loom::pipeline {

namespace {

struct KindName {
  ActionKind kind;
  const char* name;
};
// Longest names first so that parsing "1SEND_F2" does not stop at a shorter prefix.
constexpr KindName kKindNames[] = {
    {ActionKind::kReduceGrad, "REDUCE_GRAD"}, {ActionKind::kUnshard, "UNSHARD"}, {ActionKind::kReshard, "RESHARD"},
    {ActionKind::kSendF, "SEND_F"},
    {ActionKind::kRecvF, "RECV_F"},    {ActionKind::kSendB, "SEND_B"},    {ActionKind::kRecvB, "RECV_B"},
    {ActionKind::kForward, "F"},       {ActionKind::kBackward, "B"},      {ActionKind::kBackwardInput, "I"},
    {ActionKind::kBackwardWeight, "W"},
};

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

}  // namespace

const char* kind_name(ActionKind kind) {
  for (const KindName& k : kKindNames) {
    if (k.kind == kind) return k.name;
  }
  return "?";
}

bool is_compute(ActionKind k) {
  return k == ActionKind::kForward || k == ActionKind::kBackward || k == ActionKind::kBackwardInput ||
         k == ActionKind::kBackwardWeight;
}
bool is_send(ActionKind k) { return k == ActionKind::kSendF || k == ActionKind::kSendB; }
bool is_recv(ActionKind k) { return k == ActionKind::kRecvF || k == ActionKind::kRecvB; }
bool is_fsdp(ActionKind k) {
  return k == ActionKind::kUnshard || k == ActionKind::kReshard || k == ActionKind::kReduceGrad;
}

std::string Action::str() const {
  std::string s = std::to_string(stage) + kind_name(kind);
  if (microbatch >= 0) s += std::to_string(microbatch);
  return s;
}

Action Action::parse(std::string_view raw) {
  const std::string text = trim(raw);
  const char* expected =
      "; expected <stage><kind><microbatch> such as 0F3, 1B2, 2I0, 2W0, 0SEND_F3, 1RECV_B2 or 1UNSHARD";
  size_t pos = 0;
  while (pos < text.size() && std::isdigit(static_cast<unsigned char>(text[pos]))) ++pos;
  LOOM_REQUIRE_USAGE(pos > 0 && pos <= 9, "'", text, "' is not a pipeline action", expected);
  Action a;
  a.stage = std::stoi(text.substr(0, pos));
  const std::string_view rest = std::string_view(text).substr(pos);
  const KindName* found = nullptr;
  for (const KindName& k : kKindNames) {
    if (rest.starts_with(k.name)) {
      found = &k;
      break;
    }
  }
  if (found == nullptr && rest.starts_with("OVERLAP_F_B")) {
    fail_usage("'", text, "': OVERLAP_F_B actions are not part of Loom's schedule IR (write overlapped ",
               "forward/backward pairs as two actions)");
  }
  LOOM_REQUIRE_USAGE(found != nullptr, "'", text, "' is not a pipeline action", expected);
  a.kind = found->kind;
  const std::string mb(rest.substr(std::string_view(found->name).size()));
  const bool digits = !mb.empty() && mb.size() <= 9 &&
                      std::all_of(mb.begin(), mb.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
  if (is_fsdp(a.kind)) {
    LOOM_REQUIRE_USAGE(mb.empty(), "'", text, "': ", found->name, " takes no micro-batch (write ", a.stage,
                       found->name, ")");
    a.microbatch = -1;
  } else {
    LOOM_REQUIRE_USAGE(digits, "'", text, "' is not a pipeline action (", found->name,
                       " needs a micro-batch index after it)", expected);
    a.microbatch = std::stoi(mb);
  }
  return a;
}

Action F(int stage, int mb) { return {ActionKind::kForward, stage, mb}; }
Action B(int stage, int mb) { return {ActionKind::kBackward, stage, mb}; }
Action I(int stage, int mb) { return {ActionKind::kBackwardInput, stage, mb}; }
Action W(int stage, int mb) { return {ActionKind::kBackwardWeight, stage, mb}; }

std::vector<int> stage_to_rank_map(int num_ranks, int stages_per_rank, StageLayout layout) {
  LOOM_REQUIRE(num_ranks >= 1 && stages_per_rank >= 1, "stage_to_rank_map needs pp >= 1 and v >= 1");
  std::vector<int> map(static_cast<size_t>(num_ranks * stages_per_rank));
  for (int s = 0; s < num_ranks * stages_per_rank; ++s) {
    const int round = s / num_ranks, offset = s % num_ranks;
    // V-shape: even rounds go down the ranks, odd rounds come back up.
    map[static_cast<size_t>(s)] = layout == StageLayout::kV && round % 2 == 1 ? num_ranks - 1 - offset : offset;
  }
  return map;
}

std::vector<int> Schedule::stages_of(int rank) const {
  std::vector<int> out;
  for (int s = 0; s < num_stages(); ++s) {
    if (stage_to_rank[static_cast<size_t>(s)] == rank) out.push_back(s);
  }
  return out;
}

bool Schedule::has_communication() const {
  for (const auto& r : ranks) {
    for (const Action& a : r) {
      if (is_send(a.kind) || is_recv(a.kind)) return true;
    }
  }
  return false;
}

bool Schedule::has_fsdp_actions() const {
  for (const auto& r : ranks) {
    for (const Action& a : r) {
      if (is_fsdp(a.kind)) return true;
    }
  }
  return false;
}

size_t Schedule::num_actions() const {
  size_t n = 0;
  for (const auto& r : ranks) n += r.size();
  return n;
}

std::string format_actions(const Schedule& schedule) {
  std::string out;
  for (size_t r = 0; r < schedule.ranks.size(); ++r) {
    out += "rank " + std::to_string(r) + ":";
    for (const Action& a : schedule.ranks[r]) out += " " + a.str();
    out += "\n";
  }
  return out;
}

std::string format_table(const Schedule& schedule) {
  size_t rows = 0, width = 6;
  for (const auto& r : schedule.ranks) {
    rows = std::max(rows, r.size());
    for (const Action& a : r) width = std::max(width, a.str().size());
  }
  const size_t step_width = std::max<size_t>(4, std::to_string(rows).size());
  auto pad = [](std::string s, size_t w) {
    if (s.size() < w) s.append(w - s.size(), ' ');
    return s;
  };
  std::string out = pad("step", step_width);
  for (size_t r = 0; r < schedule.ranks.size(); ++r) out += "  " + pad("rank " + std::to_string(r), width);
  while (!out.empty() && out.back() == ' ') out.pop_back();
  out += "\n";
  for (size_t i = 0; i < rows; ++i) {
    out += pad(std::to_string(i), step_width);
    for (const auto& r : schedule.ranks) out += "  " + pad(i < r.size() ? r[i].str() : "", width);
    while (!out.empty() && out.back() == ' ') out.pop_back();
    out += "\n";
  }
  return out;
}

std::string to_csv(const Schedule& schedule) {
  std::string out;
  for (const auto& r : schedule.ranks) {
    for (size_t i = 0; i < r.size(); ++i) out += (i ? "," : "") + r[i].str();
    out += "\n";
  }
  return out;
}

// Far above any real pipeline (TorchTitan's largest runs use a few hundred stages and micro-batches).
constexpr int kMaxCsvStages = 4096;
constexpr int kMaxCsvMicrobatches = 1 << 16;

Schedule schedule_from_csv_text(std::string_view text, const std::string& name) {
  Schedule s;
  s.name = name;
  s.layout = StageLayout::kCustom;
  std::istringstream in{std::string(text)};
  std::string line;
  int line_no = 0, max_stage = -1, max_mb = -1;
  std::map<int, int> owner;  // stage -> rank (first row that uses it)
  while (std::getline(in, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const int rank = static_cast<int>(s.ranks.size());
    std::vector<Action> row;
    std::string cell;
    std::istringstream cells(line);
    while (std::getline(cells, cell, ',')) {
      if (trim(cell).empty()) continue;
      Action a;
      try {
        a = Action::parse(cell);
      } catch (const UsageError& e) {
        fail_usage(name, " line ", line_no, " (rank ", rank, "): ", e.what());
      }
      // Indices size the schedule's tables (stages, and every micro-batch's state): a typo such as
      // 0F1000000 is an error here, not gigabytes allocated or std::bad_alloc.
      LOOM_REQUIRE_USAGE(a.stage >= 0 && a.stage < kMaxCsvStages, name, " line ", line_no, " (rank ",
                         rank, "): ", a.str(), " names stage ", a.stage, "; stages are numbered 0 to ",
                         kMaxCsvStages - 1, " at most");
      LOOM_REQUIRE_USAGE(a.microbatch < kMaxCsvMicrobatches, name, " line ", line_no, " (rank ",
                         rank, "): ", a.str(), " names micro-batch ", a.microbatch,
                         "; micro-batches are numbered 0 to ", kMaxCsvMicrobatches - 1, " at most");
      const auto [it, inserted] = owner.emplace(a.stage, rank);
      LOOM_REQUIRE_USAGE(inserted || it->second == rank, name, " line ", line_no, " (rank ", rank, "): ",
                         a.str(), " is on stage ", a.stage, ", which rank ", it->second,
                         " already runs; each stage belongs to one rank (one row)");
      max_stage = std::max(max_stage, a.stage);
      max_mb = std::max(max_mb, a.microbatch);
      row.push_back(a);
    }
    s.ranks.push_back(std::move(row));
  }
  // Trailing empty rows (a final newline) are no ranks; an empty row in the middle is a rank with
  // no work, which the stage check below refuses.
  while (!s.ranks.empty() && s.ranks.back().empty()) s.ranks.pop_back();
  LOOM_REQUIRE_USAGE(!s.ranks.empty() && max_stage >= 0, name, " holds no actions; write one row per pipeline ",
                     "rank of comma-separated actions such as 0F0,0F1,0B0,0B1");
  LOOM_REQUIRE_USAGE(max_mb >= 0, name, " has no forward or backward actions");
  s.num_ranks = static_cast<int>(s.ranks.size());
  s.num_microbatches = max_mb + 1;
  const int num_stages = max_stage + 1;
  s.stage_to_rank.assign(static_cast<size_t>(num_stages), -1);
  for (int st = 0; st < num_stages; ++st) {
    const auto it = owner.find(st);
    LOOM_REQUIRE_USAGE(it != owner.end(), name, " never runs stage ", st, " (stages 0..", max_stage,
                       " must all appear)");
    s.stage_to_rank[static_cast<size_t>(st)] = it->second;
  }
  LOOM_REQUIRE_USAGE(num_stages % s.num_ranks == 0, name, " has ", num_stages, " stages on ", s.num_ranks,
                     " ranks; every rank must hold the same number of stages");
  s.stages_per_rank = num_stages / s.num_ranks;
  if (s.stage_to_rank == stage_to_rank_map(s.num_ranks, s.stages_per_rank, StageLayout::kLoop)) {
    s.layout = StageLayout::kLoop;
  } else if (s.stage_to_rank == stage_to_rank_map(s.num_ranks, s.stages_per_rank, StageLayout::kV)) {
    s.layout = StageLayout::kV;
  }
  validate(s);
  return s;
}

Schedule load_csv(const std::string& path) {
  // A directory opens "fine" and reads as empty, a FIFO blocks the open forever: only a regular
  // file of a sensible size is read.
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  LOOM_REQUIRE_USAGE(!ec && std::filesystem::exists(status), "cannot read the pipeline schedule CSV '",
                     path, "': ", ec ? ec.message() : std::string("no such file"),
                     "; set parallelism.pipeline_parallel_schedule_csv to an existing file");
  LOOM_REQUIRE_USAGE(std::filesystem::is_regular_file(status), "the pipeline schedule CSV '", path,
                     "' is ", std::filesystem::is_directory(status) ? "a directory" : "not a regular file",
                     "; set parallelism.pipeline_parallel_schedule_csv to a CSV file");
  constexpr std::uintmax_t kMaxBytes = 64ull << 20;
  const std::uintmax_t bytes = std::filesystem::file_size(path, ec);
  LOOM_REQUIRE_USAGE(!ec && bytes <= kMaxBytes, "the pipeline schedule CSV '", path, "' is ", bytes,
                     " bytes, over the ", kMaxBytes, " a schedule can need");
  std::ifstream in(path, std::ios::binary);
  LOOM_REQUIRE_USAGE(in.good(), "cannot read the pipeline schedule CSV '", path, "'");
  std::stringstream buf;
  buf << in.rdbuf();
  return schedule_from_csv_text(buf.str(), path);
}

void validate(const Schedule& s) {
  const std::string& n = s.name;
  LOOM_REQUIRE_USAGE(s.num_ranks >= 1 && static_cast<int>(s.ranks.size()) == s.num_ranks, n, ": ",
                     s.ranks.size(), " rows of actions for ", s.num_ranks, " ranks");
  LOOM_REQUIRE_USAGE(s.num_stages() == s.num_ranks * s.stages_per_rank, n, ": ", s.num_stages(),
                     " stages is not ", s.num_ranks, " ranks x ", s.stages_per_rank, " stages per rank");
  for (int r = 0; r < s.num_ranks; ++r) {
    const int held = static_cast<int>(s.stages_of(r).size());
    LOOM_REQUIRE_USAGE(held == s.stages_per_rank, n, ": rank ", r, " holds ", held, " stages, expected ",
                       s.stages_per_rank, " (every rank holds the same number of stages)");
  }
  LOOM_REQUIRE_USAGE(s.num_microbatches >= 1, n, ": needs at least one micro-batch");

  const int S = s.num_stages(), M = s.num_microbatches;
  const bool lowered = s.has_communication();
  auto idx = [M](int stage, int mb) { return static_cast<size_t>(stage) * static_cast<size_t>(M) + static_cast<size_t>(mb); };
  // Per (stage, mb): how many of each kind, and each kind's position on its rank.
  struct Seen {
    int f = 0, b = 0, i = 0, w = 0, send_f = 0, recv_f = 0, send_b = 0, recv_b = 0;
  };
  std::vector<Seen> seen(static_cast<size_t>(S * M));
  for (int r = 0; r < s.num_ranks; ++r) {
    std::set<int> unsharded;
    std::map<int, int> unshard_count;
    std::map<int, int> reduce_count;  // REDUCE_GRAD per stage
    const bool fsdp = std::any_of(s.ranks[r].begin(), s.ranks[r].end(), [](const Action& a) { return is_fsdp(a.kind); });
    for (size_t pos = 0; pos < s.ranks[r].size(); ++pos) {
      const Action& a = s.ranks[r][pos];
      // Built only when a check fails: validation runs for every layout `loom plan` considers.
      const auto at = [&] {
        return n + ": rank " + std::to_string(r) + ", action " + std::to_string(pos) + " (" + a.str() + ")";
      };
      LOOM_REQUIRE_USAGE(a.stage >= 0 && a.stage < S, at(), ": stage ", a.stage, " is out of range [0, ", S, ")");
      LOOM_REQUIRE_USAGE(s.rank_of(a.stage) == r, at(), ": stage ", a.stage, " belongs to rank ", s.rank_of(a.stage));
      if (a.kind == ActionKind::kReduceGrad) {
        LOOM_REQUIRE_USAGE(++reduce_count[a.stage] == 1, at(), ": stage ", a.stage, " reduces its gradients twice");
        continue;
      }
      if (is_fsdp(a.kind)) {
        if (a.kind == ActionKind::kUnshard) {
          LOOM_REQUIRE_USAGE(unsharded.insert(a.stage).second, at(), ": stage ", a.stage, " is already unsharded");
          ++unshard_count[a.stage];
        } else {
          LOOM_REQUIRE_USAGE(unsharded.erase(a.stage) == 1, at(), ": stage ", a.stage, " is not unsharded");
        }
        continue;
      }
      LOOM_REQUIRE_USAGE(a.microbatch >= 0 && a.microbatch < M, at(), ": micro-batch ", a.microbatch,
                         " is out of range [0, ", M, ")");
      LOOM_REQUIRE_USAGE(!fsdp || !is_compute(a.kind) || unsharded.count(a.stage), at(), ": stage ", a.stage,
                         " computes while sharded (no UNSHARD before it)");
      LOOM_REQUIRE_USAGE(!is_compute(a.kind) || a.kind == ActionKind::kForward || reduce_count[a.stage] == 0, at(),
                         ": backward of stage ", a.stage, " after its REDUCE_GRAD (the reduction must follow the ",
                         "stage's last backward of the step)");
      Seen& c = seen[idx(a.stage, a.microbatch)];
      const std::string sm = std::to_string(a.stage) + "/" + std::to_string(a.microbatch);
      switch (a.kind) {
        case ActionKind::kForward:
          LOOM_REQUIRE_USAGE(++c.f == 1, at(), ": a second forward of stage/micro-batch ", sm);
          break;
        case ActionKind::kBackward:
        case ActionKind::kBackwardInput:
          LOOM_REQUIRE_USAGE(c.f == 1, at(), ": backward before the forward ", F(a.stage, a.microbatch).str());
          LOOM_REQUIRE_USAGE(c.b + c.i == 0, at(), ": a second backward of stage/micro-batch ", sm);
          (a.kind == ActionKind::kBackward ? c.b : c.i) = 1;
          break;
        case ActionKind::kBackwardWeight:
          LOOM_REQUIRE_USAGE(c.i == 1, at(), ": weight gradient before its input gradient ", I(a.stage, a.microbatch).str());
          LOOM_REQUIRE_USAGE(++c.w == 1, at(), ": a second weight gradient of stage/micro-batch ", sm);
          break;
        case ActionKind::kSendF:
          LOOM_REQUIRE_USAGE(a.stage + 1 < S && s.rank_of(a.stage + 1) != r, at(),
                             ": the next stage is not on another rank, nothing to send");
          LOOM_REQUIRE_USAGE(c.f == 1, at(), ": sent before the forward ", F(a.stage, a.microbatch).str());
          LOOM_REQUIRE_USAGE(++c.send_f == 1, at(), ": sent twice");
          break;
        case ActionKind::kSendB:
          LOOM_REQUIRE_USAGE(a.stage > 0 && s.rank_of(a.stage - 1) != r, at(),
                             ": the previous stage is not on another rank, nothing to send");
          LOOM_REQUIRE_USAGE(c.b + c.i == 1, at(), ": sent before the backward of stage/micro-batch ", sm);
          LOOM_REQUIRE_USAGE(++c.send_b == 1, at(), ": sent twice");
          break;
        case ActionKind::kRecvF:
          LOOM_REQUIRE_USAGE(a.stage > 0 && s.rank_of(a.stage - 1) != r, at(),
                             ": the previous stage is not on another rank, nothing to receive");
          LOOM_REQUIRE_USAGE(c.f == 0, at(), ": received after the forward that needs it");
          LOOM_REQUIRE_USAGE(++c.recv_f == 1, at(), ": received twice");
          break;
        case ActionKind::kRecvB:
          LOOM_REQUIRE_USAGE(a.stage + 1 < S && s.rank_of(a.stage + 1) != r, at(),
                             ": the next stage is not on another rank, nothing to receive");
          LOOM_REQUIRE_USAGE(c.b + c.i == 0, at(), ": received after the backward that needs it");
          LOOM_REQUIRE_USAGE(++c.recv_b == 1, at(), ": received twice");
          break;
        default:
          break;
      }
      if (lowered && is_compute(a.kind)) {
        if (a.kind == ActionKind::kForward && a.stage > 0 && s.rank_of(a.stage - 1) != r) {
          LOOM_REQUIRE_USAGE(c.recv_f == 1, at(), ": no ", Action{ActionKind::kRecvF, a.stage, a.microbatch}.str(),
                             " before it (its input comes from rank ", s.rank_of(a.stage - 1), ")");
        }
        if ((a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) && a.stage + 1 < S &&
            s.rank_of(a.stage + 1) != r) {
          LOOM_REQUIRE_USAGE(c.recv_b == 1, at(), ": no ", Action{ActionKind::kRecvB, a.stage, a.microbatch}.str(),
                             " before it (its output gradient comes from rank ", s.rank_of(a.stage + 1), ")");
        }
      }
    }
    if (fsdp) {
      LOOM_REQUIRE_USAGE(unsharded.empty(), n, ": rank ", r, " leaves stage ", *unsharded.begin(),
                         " unsharded at the end (no RESHARD after its last use)");
      for (int stage : s.stages_of(r)) {
        LOOM_REQUIRE_USAGE(reduce_count[stage] == 1, n, ": rank ", r, " never reduces stage ", stage,
                           "'s gradients (add ", stage, "REDUCE_GRAD after its last backward)");
      }
    }
  }
  for (int st = 0; st < S; ++st) {
    for (int mb = 0; mb < M; ++mb) {
      const Seen& c = seen[idx(st, mb)];
      const std::string where = n + ": stage " + std::to_string(st) + ", micro-batch " + std::to_string(mb);
      LOOM_REQUIRE_USAGE(c.f == 1, where, " has no forward (", F(st, mb).str(), " is missing from rank ",
                         s.rank_of(st), ")");
      LOOM_REQUIRE_USAGE(c.b == 1 || (c.i == 1 && c.w == 1), where, " has no complete backward (rank ",
                         s.rank_of(st), " needs ", B(st, mb).str(), ", or ", I(st, mb).str(), " and ",
                         W(st, mb).str(), ")");
      if (!lowered) continue;
      // Every consumer on another rank has its RECV (checked above), so a missing send leaves
      // that receive waiting forever.
      if (st + 1 < S && s.rank_of(st + 1) != s.rank_of(st)) {
        LOOM_REQUIRE_USAGE(c.send_f == 1, n, ": schedule deadlocks: rank ", s.rank_of(st + 1), " waits at ",
                           Action{ActionKind::kRecvF, st + 1, mb}.str(), ", which no rank sends (rank ",
                           s.rank_of(st), " has no ", Action{ActionKind::kSendF, st, mb}.str(), ")");
      }
      if (st > 0 && s.rank_of(st - 1) != s.rank_of(st)) {
        LOOM_REQUIRE_USAGE(c.send_b == 1, n, ": schedule deadlocks: rank ", s.rank_of(st - 1), " waits at ",
                           Action{ActionKind::kRecvB, st - 1, mb}.str(), ", which no rank sends (rank ",
                           s.rank_of(st), " has no ", Action{ActionKind::kSendB, st, mb}.str(), ")");
      }
    }
  }
}

}  // namespace loom::pipeline
