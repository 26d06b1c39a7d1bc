#include "loom/rl/revisions.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>

#include "loom/checkpoint/safetensors.h"
#include "loom/core/error.h"
#include "loom/core/logging.h"
#include "loom/models/common/adapter_dir.h"

namespace loom::rl {
namespace fs = std::filesystem;

namespace {
// "step-N" -> N; nullopt for any other name.
std::optional<int64_t> revision_step(const fs::path& dir) {
  const std::string name = dir.filename().string();
  if (name.rfind("step-", 0) != 0 || name.size() == 5) return std::nullopt;
  const std::string digits = name.substr(5);
  if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) return std::nullopt;
  return std::stoll(digits);
}
}  // namespace

void RewardStats::add(const std::vector<double>& rewards) {
  rewards_.insert(rewards_.end(), rewards.begin(), rewards.end());
}

nlohmann::json RewardStats::to_json() const {
  if (rewards_.empty()) return {{"mean", nullptr}, {"std", nullptr}, {"min", nullptr}, {"max", nullptr}, {"count", 0}};
  double sum = 0;
  for (double r : rewards_) sum += r;
  const double n = static_cast<double>(rewards_.size());
  const double mean = sum / n;
  double squares = 0;
  for (double r : rewards_) squares += (r - mean) * (r - mean);
  const auto [lo, hi] = std::minmax_element(rewards_.begin(), rewards_.end());
  return {{"mean", mean}, {"std", std::sqrt(squares / n)}, {"min", *lo}, {"max", *hi}, {"count", rewards_.size()}};
}

fs::path write_revision(const fs::path& adapters_dir, const models::ModelSpec& spec, models::Decoder& model,
                        const lora::LoRAOptions& options, const AdapterOptimizer& optimizer, const RevisionInfo& info) {
  const fs::path dir = adapters_dir / c10::str("step-", info.step);
  LOOM_REQUIRE(!fs::exists(dir), "loom rl: revision '", dir.string(), "' already exists; revisions are never overwritten");
  const fs::path partial = dir.string() + ".partial";
  fs::remove_all(partial);  // an earlier run's unfinished write: never a revision
  fs::create_directories(adapters_dir);
  models::export_peft_dir(spec, model, options, info.base.value("path", std::string()), partial);
  checkpoint::NamedTensors state;
  for (const auto& [name, tensor] : optimizer.state_dict()) {
    state.emplace_back(name, tensor.detach().to(torch::kCPU).contiguous());
  }
  checkpoint::save_safetensors(partial / kRlStateFile, state);
  const nlohmann::json json = {{"step", info.step},
                               {"prompt_cursor", info.prompt_cursor},
                               {"rewards", info.rewards},
                               {"base", info.base}};
  {
    std::ofstream out(partial / kRevisionFile);
    out << json.dump(2) << "\n";
    out.flush();
    LOOM_REQUIRE(out.good(), "loom rl: cannot write ", (partial / kRevisionFile).string());
  }
  fs::rename(partial, dir);
  return dir;
}

RevisionInfo read_revision(const fs::path& dir) {
  const fs::path file = dir / kRevisionFile;
  LOOM_REQUIRE_USAGE(fs::is_regular_file(file) && fs::is_regular_file(dir / kRlStateFile), "'", dir.string(),
                     "' is not a loom rl revision (it lacks ", kRevisionFile, " or ", kRlStateFile,
                     "); name a job.dump_folder/adapters/step-N directory a loom rl run wrote");
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(std::ifstream(file));
    RevisionInfo info;
    info.step = json.at("step").get<int64_t>();
    info.prompt_cursor = json.at("prompt_cursor").get<int64_t>();
    info.rewards = json.value("rewards", nlohmann::json());
    info.base = json.value("base", nlohmann::json());
    return info;
  } catch (const nlohmann::json::exception& e) {
    LOOM_REQUIRE_USAGE(false, "malformed ", file.string(), ": ", e.what());
  }
  return {};
}

std::vector<fs::path> list_revisions(const fs::path& adapters_dir) {
  std::vector<std::pair<int64_t, fs::path>> found;
  if (fs::is_directory(adapters_dir)) {
    for (const auto& entry : fs::directory_iterator(adapters_dir)) {
      const std::optional<int64_t> step = revision_step(entry.path());
      if (step && entry.is_directory() && fs::exists(entry.path() / kRevisionFile)) found.emplace_back(*step, entry.path());
    }
  }
  std::sort(found.begin(), found.end());
  std::vector<fs::path> out;
  for (auto& [step, path] : found) out.push_back(std::move(path));
  return out;
}

void load_revision_state(const fs::path& dir, AdapterOptimizer& optimizer) {
  const checkpoint::SafetensorsFile file(dir / kRlStateFile);
  optim::TensorDict state;
  for (const std::string& name : file.names()) state.emplace(name, file.tensor(name));
  optimizer.load_state_dict(state);
}

std::optional<fs::path> move_later_revisions_aside(const fs::path& adapters_dir, int64_t step) {
  std::vector<fs::path> later;
  for (const fs::path& dir : list_revisions(adapters_dir)) {
    if (*revision_step(dir) > step) later.push_back(dir);
  }
  if (later.empty()) return std::nullopt;
  const auto seconds =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  fs::path aside = adapters_dir / c10::str("rolled-back-", seconds);
  for (int i = 1; fs::exists(aside); ++i) aside = adapters_dir / c10::str("rolled-back-", seconds, "-", i);
  fs::create_directories(aside);
  for (const fs::path& dir : later) fs::rename(dir, aside / dir.filename());
  return aside;
}

std::optional<fs::path> revision_to_start_from(bool resume, const std::string& rollback, const fs::path& adapters_dir) {
  if (!rollback.empty()) {
    const RevisionInfo info = read_revision(rollback);
    if (const auto aside = move_later_revisions_aside(adapters_dir, info.step)) {
      log::info("rl: rolling back to ", rollback, " (step ", info.step, "); later revisions moved to ", aside->string());
    }
    return fs::path(rollback);
  }
  const std::vector<fs::path> revisions = list_revisions(adapters_dir);
  if (resume) {
    if (revisions.empty()) {
      log::info("rl: rl.resume = true but ", adapters_dir.string(), " holds no revision; starting at step 1");
      return std::nullopt;
    }
    return revisions.back();
  }
  LOOM_REQUIRE_USAGE(revisions.empty(), "'", adapters_dir.string(), "' already holds revisions (newest ",
                     revisions.empty() ? std::string() : revisions.back().filename().string(),
                     "); set rl.resume = true to continue from it, rl.rollback = \"DIR\" to restart from one, or "
                     "choose another job.dump_folder");
  return std::nullopt;
}

}  // namespace loom::rl
