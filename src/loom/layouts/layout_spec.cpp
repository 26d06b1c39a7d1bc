#include "loom/layouts/layout_spec.h"

#include <algorithm>
#include <cctype>
#include <set>
#include <sstream>

#include "loom/core/error.h"

namespace loom::layouts {
namespace {

std::string trim(std::string s) {
  s.erase(0, s.find_first_not_of(" \t"));
  s.erase(s.find_last_not_of(" \t") + 1);
  return s;
}

int positive_int(const std::string& layout, const std::string& key, const std::string& value) {
  size_t used = 0;
  long n = 0;
  try {
    n = std::stol(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  LOOM_REQUIRE_USAGE(used == value.size() && !value.empty() && n >= 1 && n <= 1 << 20, "layout '", layout, "': ",
                     key, " must be a positive integer, got '", value, "'");
  return static_cast<int>(n);
}

bool parse_bool(const std::string& layout, const std::string& key, const std::string& value) {
  std::string v = value;
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
  if (v == "true" || v == "1" || v == "on") return true;
  if (v == "false" || v == "0" || v == "off") return false;
  throw UsageError(c10::str("layout '", layout, "': ", key, " must be true or false, got '", value, "'"));
}

constexpr const char* kKnownKeys =
    "fsdp, hsdp (or dp, replicate), tp, async_tp, cp, pp, pp_schedule, microbatch, ep, or section.key";

// Keys a layout or check-layouts sets: the degrees (each layout's own) and the local batch (from the
// reference's global batch).
bool is_degree_key(const std::string& key) {
  return key.rfind("parallelism.", 0) == 0 && key.size() > 7 && key.compare(key.size() - 7, 7, "_degree") == 0;
}

}  // namespace

LayoutSpec parse_layout(const std::string& text) {
  LayoutSpec spec;
  spec.text = trim(text);
  LOOM_REQUIRE_USAGE(!spec.text.empty(), "--layout is empty; give degrees such as --layout \"pp=2,tp=2\"");
  std::set<std::string> seen;
  std::stringstream items(spec.text);
  for (std::string item; std::getline(items, item, ',');) {
    item = trim(item);
    LOOM_REQUIRE_USAGE(!item.empty(), "layout '", spec.text, "': an empty item between commas");
    const size_t eq = item.find('=');
    LOOM_REQUIRE_USAGE(eq != std::string::npos && eq > 0, "layout '", spec.text, "': '", item,
                       "' is not key=value (keys: ", kKnownKeys, ")");
    std::string key = trim(item.substr(0, eq));
    const std::string value = trim(item.substr(eq + 1));
    if (key == "dp" || key == "replicate") key = "hsdp";  // one key, however it is spelled
    LOOM_REQUIRE_USAGE(seen.insert(key).second, "layout '", spec.text, "': ", key, " given twice");
    if (key == "fsdp") {
      spec.dp_shard = positive_int(spec.text, key, value);
    } else if (key == "hsdp") {
      spec.dp_replicate = positive_int(spec.text, key, value);
    } else if (key == "tp") {
      spec.tp = positive_int(spec.text, key, value);
    } else if (key == "cp") {
      spec.cp = positive_int(spec.text, key, value);
    } else if (key == "pp") {
      spec.pp = positive_int(spec.text, key, value);
    } else if (key == "ep") {
      spec.ep = positive_int(spec.text, key, value);
    } else if (key == "async_tp") {
      spec.settings.push_back(c10::str("--parallelism.enable_async_tensor_parallel=",
                                       parse_bool(spec.text, key, value) ? "true" : "false"));
    } else if (key == "pp_schedule") {
      LOOM_REQUIRE_USAGE(!value.empty(), "layout '", spec.text, "': pp_schedule needs a schedule name");
      spec.settings.push_back("--parallelism.pipeline_parallel_schedule=" + value);
    } else if (key == "microbatch") {
      spec.settings.push_back(c10::str("--parallelism.pipeline_parallel_microbatch_size=",
                                       positive_int(spec.text, key, value)));
    } else if (key.find('.') != std::string::npos && key.front() != '.' && key.back() != '.') {
      LOOM_REQUIRE_USAGE(!is_degree_key(key), "layout '", spec.text, "': give the degree ", key,
                         " with its short key (", kKnownKeys, ")");
      LOOM_REQUIRE_USAGE(key != "training.local_batch_size", "layout '", spec.text,
                         "': training.local_batch_size follows the reference's global batch (set it "
                         "for the reference, after --)");
      spec.settings.push_back("--" + key + "=" + value);
    } else {
      throw UsageError(c10::str("layout '", spec.text, "': unknown key '", key, "' (keys: ", kKnownKeys, ")"));
    }
  }
  return spec;
}

std::vector<std::string> LayoutSpec::overrides(int64_t local_batch_size) const {
  std::vector<std::string> out = {
      c10::str("--parallelism.data_parallel_replicate_degree=", dp_replicate),
      c10::str("--parallelism.data_parallel_shard_degree=", dp_shard),
      c10::str("--parallelism.tensor_parallel_degree=", tp),
      c10::str("--parallelism.context_parallel_degree=", cp),
      c10::str("--parallelism.pipeline_parallel_degree=", pp),
      c10::str("--parallelism.expert_parallel_degree=", ep)};
  out.insert(out.end(), settings.begin(), settings.end());
  out.push_back(c10::str("--training.local_batch_size=", local_batch_size));
  return out;
}

int64_t local_batch_for(const LayoutSpec& layout, int64_t global_rows) {
  const int dp = layout.dp_degree();
  LOOM_REQUIRE_USAGE(global_rows % dp == 0, "layout '", layout.text, "': the reference's ", global_rows,
                     " rows per batch do not split over its ", dp, " data-parallel ranks; set "
                     "--training.local_batch_size (after --) to a multiple of ", dp);
  return global_rows / dp;
}

void check_extra_overrides(const std::vector<std::string>& overrides) {
  for (const std::string& o : overrides) {
    const std::string item = o.rfind("--", 0) == 0 ? o.substr(2) : o;
    const std::string key = item.substr(0, item.find('='));
    LOOM_REQUIRE_USAGE(!is_degree_key(key), "the degrees come from --layout and --reference, not from ", o,
                       " (e.g. --layout \"tp=2\")");
    if (key == "training.deterministic") {
      const std::string value = item.find('=') == std::string::npos ? "true" : item.substr(item.find('=') + 1);
      LOOM_REQUIRE_USAGE(value == "true" || value == "1", "loom check-layouts runs every layout with "
                         "training.deterministic = true; drop ", o);
    }
  }
}

}  // namespace loom::layouts
