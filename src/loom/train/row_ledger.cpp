#include "loom/train/row_ledger.h"

#include <c10/util/StringUtil.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <map>

#include "loom/core/error.h"

namespace loom::train {

std::string RowLedger::describe() const {
  if (!ok()) return problem;
  return c10::str("rows [0, ", rows, ") trained exactly once over ", steps, " step(s); ", memberships,
                  " membership(s); ", superseded, " ledger line(s) superseded by re-run steps");
}

RowLedger check_row_ledger(const std::filesystem::path& given) {
  const std::filesystem::path path = std::filesystem::is_directory(given) ? given / "metrics.jsonl" : given;
  std::ifstream in(path);
  LOOM_REQUIRE(in.good(), "cannot read '", path.string(), "'");
  RowLedger ledger;
  std::map<int64_t, std::pair<int64_t, int64_t>> rows;  // step -> [begin, end)
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const std::exception&) {
      continue;  // a cut last line (see repair_cut_last_line) holds nothing of the ledger
    }
    if (!j.is_object() || !j.contains("event")) continue;
    const std::string event = j.at("event").get<std::string>();
    if (event == "membership") ++ledger.memberships;
    if (event == "resume") {
      const int64_t step = j.at("step").get<int64_t>();
      for (auto it = rows.upper_bound(step); it != rows.end();) {
        it = rows.erase(it);
        ++ledger.superseded;
      }
    }
    if (event == "rows") {
      const int64_t step = j.at("step").get<int64_t>();
      const auto r = j.at("rows").get<std::vector<int64_t>>();
      if (rows.count(step) != 0) {
        ledger.problem = c10::str("step ", step, " has two ledger lines with no resume between them: its rows [",
                                  r.at(0), ", ", r.at(1), ") were trained twice");
        return ledger;
      }
      rows[step] = {r.at(0), r.at(1)};
    }
  }
  int64_t expected_step = 1;
  int64_t cursor = 0;
  for (const auto& [step, range] : rows) {
    if (step != expected_step) {
      ledger.problem = c10::str("step ", expected_step, " has no ledger line (the next is step ", step, ")");
      return ledger;
    }
    if (range.first != cursor) {
      ledger.problem = range.first > cursor
                           ? c10::str("rows [", cursor, ", ", range.first, ") were never trained (step ", step,
                                      " starts at row ", range.first, ")")
                           : c10::str("rows [", range.first, ", ", cursor, ") were trained twice (step ", step,
                                      " starts at row ", range.first, ")");
      return ledger;
    }
    cursor = range.second;
    ++expected_step;
  }
  ledger.steps = expected_step - 1;
  ledger.rows = cursor;
  return ledger;
}

void register_ledger_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "ledger", "Check an elastic run's rows ledger (metrics.jsonl): every row trained exactly once");
  auto run = std::make_shared<std::string>();
  cmd->add_option("run", *run, "Run folder (job.dump_folder) or its metrics.jsonl")->required();
  cmd->callback([run] {
    const RowLedger ledger = check_row_ledger(*run);
    std::printf("%s\n", ledger.describe().c_str());
    if (!ledger.ok()) throw Error(ledger.problem);
  });
}

}  // namespace loom::train
