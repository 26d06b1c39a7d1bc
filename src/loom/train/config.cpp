#include "loom/train/config.h"

#include "loom/train/compatibility.h"

#include <toml++/toml.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <unordered_map>

#include "loom/core/error.h"

namespace loom::train {
namespace {

using options::format_double;
using options::is_positive_integer;
using options::join_choices;
using options::toml_string;

// A section of the job config: its schema (declared by its feature's folder) and where it lives
// in a JobConfig.
struct SectionBinding {
  const options::Section& (*schema)();
  void* (*of)(JobConfig&);
};

#define LOOM_CONFIG_SECTION(member, schema_fn) \
  SectionBinding { &schema_fn, [](JobConfig& c) -> void* { return &c.member; } }

// The sections in the order they are printed and documented (TorchTitan's job config order).
const std::vector<SectionBinding>& section_bindings() {
  static const std::vector<SectionBinding> sections = {
      LOOM_CONFIG_SECTION(job, job_section),
      LOOM_CONFIG_SECTION(model, models::model_section),
      LOOM_CONFIG_SECTION(optimizer, parallel::optimizer_section),
      LOOM_CONFIG_SECTION(lr_scheduler, optim::lr_scheduler_section),
      LOOM_CONFIG_SECTION(training, training_section),
      LOOM_CONFIG_SECTION(parallelism, parallel::parallelism_section),
      LOOM_CONFIG_SECTION(activation_checkpoint, ac::ac_section),
      LOOM_CONFIG_SECTION(float8, float8::float8_section),
      LOOM_CONFIG_SECTION(lora, lora::lora_section),
      LOOM_CONFIG_SECTION(sft, data::sft_section),
      LOOM_CONFIG_SECTION(metrics, metrics_section),
      LOOM_CONFIG_SECTION(checkpoint, checkpoint::checkpoint_section),
      LOOM_CONFIG_SECTION(validation, validation_section),
      LOOM_CONFIG_SECTION(comm, distributed::comm_section),
      LOOM_CONFIG_SECTION(fault_tolerance, elastic::fault_tolerance_section),
      LOOM_CONFIG_SECTION(profiling, profiling::profiling_section),
  };
  return sections;
}

#undef LOOM_CONFIG_SECTION

const std::vector<ConfigKey>& schema() {
  static const std::vector<ConfigKey> keys = [] {
    std::vector<ConfigKey> out;
    for (const SectionBinding& binding : section_bindings()) {
      const options::Section& section = binding.schema();
      for (const options::Key& key : section.keys) {
        out.push_back(ConfigKey{section.name, key.name, key.help, &key, binding.of});
      }
    }
    return out;
  }();
  return keys;
}

const std::unordered_map<std::string, const ConfigKey*>& schema_index() {
  static const auto index = [] {
    std::unordered_map<std::string, const ConfigKey*> m;
    for (const ConfigKey& k : schema()) m.emplace(k.name(), &k);
    return m;
  }();
  return index;
}

const ConfigKey* find_key(const std::string& name) {
  const auto& index = schema_index();
  auto it = index.find(name);
  return it == index.end() ? nullptr : it->second;
}

bool is_section(std::string_view name) {
  for (const ConfigKey& k : schema()) {
    if (k.section == name) return true;
  }
  return false;
}

std::vector<std::string_view> all_key_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const ConfigKey& k : schema()) out.push_back(k.name());
    return out;
  }();
  return {names.begin(), names.end()};
}

std::string nearest(std::string_view name, const std::vector<std::string_view>& candidates) {
  return options::nearest(name, candidates);
}

// The full "section.key" name nearest to `name`. A name without a section ("steps") is matched
// against the key part of every name, since comparing it with whole names favours short sections
// ("model.name") over the key the user meant ("training.steps").
std::string suggest_key(std::string_view name) {
  if (name.find('.') != std::string_view::npos) return nearest(name, all_key_names());
  std::string best;
  size_t best_distance = std::numeric_limits<size_t>::max();
  for (const ConfigKey& k : schema()) {
    const size_t d = edit_distance(name, k.key);
    if (d < best_distance) {
      best_distance = d;
      best = k.name();
    }
  }
  return best;
}

// Checks a string value against the key's allowed choices.
// A key as the setters see it: its full name ("training.datasets[0].format" inside an array of
// tables), its declaration, and the field it sets.
struct KeyTarget {
  std::string full_name;
  const options::Key* spec;
  options::FieldRef field;
  std::string name() const { return full_name; }
};

KeyTarget target(JobConfig& config, const ConfigKey& key) { return {key.name(), key.spec, key.field(config)}; }

void check_choice(const KeyTarget& key, const std::string& value, const std::string& where) {
  const std::vector<std::string_view> choices = key.spec->allowed();
  const bool integer_allowed = key.spec->integer_allowed;
  if (choices.empty()) return;
  for (std::string_view c : choices) {
    if (value == c) return;
  }
  if (integer_allowed && is_positive_integer(value)) return;
  // One rule for every enum-valued key: values are matched as written (a config file reads the
  // same everywhere, and the names are TorchTitan's own), and a value that differs only in case
  // gets a short error naming the exact spelling.
  auto folded = [](std::string_view text) {
    std::string out(text);
    for (char& ch : out) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    return out;
  };
  for (std::string_view c : choices) {
    if (folded(c) == folded(value)) {
      fail_usage("config key '", key.name(), "' is case-sensitive: got ", toml_string(value), " in ",
                 where, "; did you mean '", c, "'?");
    }
  }
  fail_usage("config key '", key.name(), "' must be ",
             join_choices(choices, integer_allowed ? "a positive integer" : ""), ", got ",
             toml_string(value), " in ",
             where, " (did you mean ", toml_string(nearest(value, choices)), "?)");
}

// ---- TOML file values ----

std::string location(const toml::source_region& source, const std::string& origin) {
  return c10::str(origin, ":", source.begin.line, ":", source.begin.column);
}

std::string describe_node(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::string: return "string " + toml_string(*node.value<std::string>());
    case toml::node_type::integer: return c10::str("integer ", *node.value<int64_t>());
    case toml::node_type::floating_point: return "float " + format_double(*node.value<double>());
    case toml::node_type::boolean: return *node.value<bool>() ? "boolean true" : "boolean false";
    case toml::node_type::array: return "an array";
    case toml::node_type::table: return "a table";
    case toml::node_type::date: return "a date";
    case toml::node_type::time: return "a time";
    case toml::node_type::date_time: return "a date-time";
    default: return "nothing";
  }
}

void set_node(const KeyTarget& key, const toml::node& node, const std::string& origin);

// The tables of an array of tables: each key found in the element's section, set in its element.
void set_table_array(const KeyTarget& key, options::TableArrayRef array, const toml::node& node,
                     const std::string& origin) {
  const std::string where = location(node.source(), origin);
  const toml::array* items = node.as_array();
  if (items == nullptr) {
    fail_usage("config key '", key.name(), "' expects an array of tables ([[", key.name(), "]] entries), got ",
               describe_node(node), " in ", where);
  }
  const options::Section& element = array.codec->element();
  array.codec->resize(array.field, 0);  // a later setting replaces the whole array
  array.codec->resize(array.field, items->size());
  for (size_t i = 0; i < items->size(); ++i) {
    const toml::node& item = *items->get(i);
    const std::string item_name = c10::str(key.name(), "[", i, "]");
    if (!item.is_table()) {
      fail_usage("config key '", item_name, "' must be a table, got ", describe_node(item), " in ",
                 location(item.source(), origin));
    }
    void* object = array.codec->at(array.field, i);
    for (auto&& [name, value] : *item.as_table()) {
      const options::Key* spec = element.find(name.str());
      if (spec == nullptr) {
        std::vector<std::string_view> names;
        for (const options::Key& k : element.keys) names.push_back(k.name);
        fail_usage("unknown config key '", item_name, ".", name.str(), "' in ", location(name.source(), origin),
                   " (did you mean '", nearest(name.str(), names), "'?)");
      }
      set_node(KeyTarget{c10::str(item_name, ".", spec->name), spec, spec->field(object)}, value, origin);
    }
  }
}

void set_node(const KeyTarget& key, const toml::node& node, const std::string& origin) {
  const std::string where = location(node.source(), origin);
  auto wrong_type = [&] {
    fail_usage("config key '", key.name(), "' expects ", key.spec->type_description(), ", got ",
               describe_node(node), " in ", where);
  };
  std::visit(
      [&](auto field) {
        using T = decltype(field);
        if constexpr (std::is_same_v<T, options::TableArrayRef>) {
          set_table_array(key, field, node, origin);
        } else if constexpr (std::is_same_v<T, bool*>) {
          if (!node.is_boolean()) wrong_type();
          *field = *node.value<bool>();
        } else if constexpr (std::is_same_v<T, int64_t*>) {
          if (!node.is_integer()) wrong_type();
          *field = *node.value<int64_t>();
        } else if constexpr (std::is_same_v<T, double*>) {
          if (!node.is_number()) wrong_type();
          *field = *node.value<double>();
        } else if constexpr (std::is_same_v<T, std::optional<double>*>) {
          if (!node.is_number()) wrong_type();
          const double v = *node.value<double>();
          // Negative means unset; -inf is kept so that validate() rejects it as non-finite.
          *field = v < 0.0 && std::isfinite(v) ? std::nullopt : std::optional<double>(v);
        } else if constexpr (std::is_same_v<T, options::EnumRef>) {
          if (!node.is_string()) wrong_type();
          const std::string value = *node.value<std::string>();
          check_choice(key, value, where);
          field.codec->set(field.field, value);
        } else {
          static_assert(std::is_same_v<T, std::string*>);
          if (node.is_string()) {
            *field = *node.value<std::string>();
          } else if (key.spec->integer_allowed && node.is_integer()) {
            *field = std::to_string(*node.value<int64_t>());
          } else {
            wrong_type();
          }
          check_choice(key, *field, where);
        }
      },
      key.field);
}

// ---- Command-line values ----

template <typename T>
bool parse_number(std::string_view s, T& out) {
  if (s.empty()) return false;
  const char* begin = s.data();
  if constexpr (std::is_floating_point_v<T>) {
    if (*begin == '+') ++begin;  // from_chars takes no leading '+'
  }
  const auto [ptr, ec] = std::from_chars(begin, s.data() + s.size(), out);
  return ec == std::errc() && ptr == s.data() + s.size();
}

void set_from_string(JobConfig& config, const ConfigKey& config_key, const std::string& value,
                     const std::string& where) {
  const KeyTarget key = target(config, config_key);
  auto wrong_type = [&] {
    fail_usage("config key '", key.name(), "' expects ", key.spec->type_description(), ", got ",
               toml_string(value), " in ", where);
  };
  std::visit(
      [&](auto field) {
        using T = decltype(field);
        if constexpr (std::is_same_v<T, bool*>) {
          if (value == "true") {
            *field = true;
          } else if (value == "false") {
            *field = false;
          } else {
            wrong_type();
          }
        } else if constexpr (std::is_same_v<T, int64_t*>) {
          if (!parse_number(value, *field)) wrong_type();
        } else if constexpr (std::is_same_v<T, double*>) {
          if (!parse_number(value, *field)) wrong_type();
        } else if constexpr (std::is_same_v<T, std::optional<double>*>) {
          double v = 0.0;
          if (value == "none" || value == "null") {
            *field = std::nullopt;
          } else if (parse_number(value, v)) {
            *field = v < 0.0 && std::isfinite(v) ? std::nullopt : std::optional<double>(v);
          } else {
            wrong_type();
          }
        } else if constexpr (std::is_same_v<T, options::EnumRef>) {
          check_choice(key, value, where);
          field.codec->set(field.field, value);
        } else if constexpr (std::is_same_v<T, options::TableArrayRef>) {
          // The inline TOML array of inline tables, parsed as the value of a one-line document.
          toml::table doc;
          try {
            doc = toml::parse(c10::str("value = ", value), where);
          } catch (const toml::parse_error& e) {
            std::string description(e.description());
            std::replace(description.begin(), description.end(), '\n', ' ');
            fail_usage("config key '", key.name(), "' expects an inline array of tables such as '[{ path = ",
                       "\"a.parquet\", weight = 2.0 }]', got ", toml_string(value), " in ", where, ": ", description);
          }
          set_node(key, *doc.get("value"), where);
        } else {
          static_assert(std::is_same_v<T, std::string*>);
          check_choice(key, value, where);
          *field = value;
        }
      },
      key.field);
}

void require(bool ok, const ConfigKey& key, std::string_view requirement, const JobConfig& config) {
  if (!ok) {
    fail_usage("config key '", key.name(), "' must be ", requirement, ", got ",
               key.value_as_toml(config));
  }
}

}  // namespace

// ---- ConfigKey ----

std::string ConfigKey::name() const { return c10::str(section, ".", key); }

std::string ConfigKey::value_as_toml(const JobConfig& config) const {
  return options::value_as_toml(*spec, section_of(const_cast<JobConfig&>(config)));  // only read
}

const std::vector<ConfigKey>& config_schema() { return schema(); }

std::string config_reference_markdown() {
  JobConfig defaults;  // an array of tables gets one default entry while its keys are listed
  // A '|' ends a table cell even inside a code span (GFM): help that quotes one (a chat template's
  // "<|eot_id|>") is escaped.
  const auto cell = [](std::string_view text) {
    std::string escaped;
    for (char ch : text) escaped += ch == '|' ? std::string("\\|") : std::string(1, ch);
    return escaped;
  };
  std::string out;
  for (const SectionBinding& binding : section_bindings()) {
    const options::Section& section = binding.schema();
    out += c10::str("## [", section.name, "]\n\n");
    if (!section.doc_before.empty()) out += c10::str(section.doc_before, "\n\n");
    out += "| key | type | default | meaning |\n| --- | --- | --- | --- |\n";
    for (const ConfigKey& k : schema()) {
      if (k.section != section.name) continue;
      const std::string value = k.value_as_toml(defaults);
      const std::string shown = value == "none" ? "unset" : c10::str("`", value, "`");
      out += c10::str("| `", k.name(), "` | ", k.spec->doc_type(), " | ", cell(shown), " | ", cell(k.help), " |\n");
    }
    // The keys of each entry of an array of tables, as a table of their own.
    for (const ConfigKey& k : schema()) {
      if (k.section != section.name) continue;
      const options::FieldRef field = k.field(const_cast<JobConfig&>(defaults));  // only read
      const auto* array = std::get_if<options::TableArrayRef>(&field);
      if (array == nullptr) continue;
      const options::Section& element = array->codec->element();
      array->codec->resize(array->field, 1);  // a default entry, to show its defaults
      const void* entry = array->codec->at(array->field, 0);
      out += c10::str("\nEach `[[", k.name(), "]]` entry:\n\n| key | type | default | meaning |\n| --- | --- | --- | --- |\n");
      for (const options::Key& e : element.keys) {
        const std::string value = options::value_as_toml(e, entry);
        const std::string shown = value == "none" ? "unset" : c10::str("`", value, "`");
        out += c10::str("| `", e.name, "` | ", e.doc_type(), " | ", cell(shown), " | ", cell(e.help), " |\n");
      }
      array->codec->resize(array->field, 0);
    }
    if (!section.doc_after.empty()) out += c10::str("\n", section.doc_after, "\n");
    out += "\n";
  }
  return out + compatibility_markdown();
}

std::vector<std::string_view> config_sections() {
  std::vector<std::string_view> sections;
  for (const ConfigKey& k : schema()) {
    if (sections.empty() || sections.back() != k.section) sections.push_back(k.section);
  }
  return sections;
}

// ---- JobConfig ----

std::string JobConfig::to_toml() const {
  std::ostringstream os;
  std::string_view section;
  for (const ConfigKey& k : schema()) {
    if (k.section != section) {
      os << (section.empty() ? "" : "\n") << "[" << k.section << "]\n";
      section = k.section;
    }
    const std::string value = k.value_as_toml(*this);
    if (value == "none") {
      // TOML has no null: an unset optional is written as a comment and read back as unset.
      os << "# " << k.key << " is unset\n";
    } else {
      os << k.key << " = " << value << "\n";
    }
  }
  return os.str();
}

// ---- Loading ----

JobConfig parse_config_toml(std::string_view toml_text, const std::string& origin) {
  toml::table root;
  try {
    root = toml::parse(toml_text, origin);
  } catch (const toml::parse_error& e) {
    std::string description(e.description());
    std::replace(description.begin(), description.end(), '\n', ' ');  // keep the error one line
    fail_usage("malformed TOML in ", location(e.source(), origin), ": ", description);
  }
  JobConfig config;
  for (auto&& [section_key, section_node] : root) {
    const std::string section(section_key.str());
    const std::string where = location(section_key.source(), origin);
    if (!section_node.is_table()) {
      // A bare key outside any [section]: point at the key of the nearest name.
      fail_usage("config key '", section, "' in ", where, " is outside any [section] (did you mean '",
                 suggest_key(section), "'?)");
    }
    if (!is_section(section)) {
      fail_usage("unknown config section '", section, "' in ", where, " (did you mean '",
                 nearest(section, config_sections()), "'?)");
    }
    for (auto&& [key, node] : *section_node.as_table()) {
      const std::string name = section + "." + std::string(key.str());
      const ConfigKey* spec = find_key(name);
      if (spec == nullptr) {
        fail_usage("unknown config key '", name, "' in ", location(key.source(), origin),
                   " (did you mean '", nearest(name, all_key_names()), "'?)");
      }
      set_node(target(config, *spec), node, origin);
    }
  }
  return config;
}

JobConfig load_config_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    fail_usage("config file '", path, "' is a directory; pass a TOML file, e.g. --config ",
               "configs/llama3_debug.toml");
  }
  if (!std::filesystem::is_regular_file(path, ec)) {
    fail_usage("config file '", path, "' not found; pass an existing TOML file, e.g. --config ",
               "configs/llama3_debug.toml");
  }
  std::ifstream in(path, std::ios::binary);
  LOOM_REQUIRE_USAGE(in.good(), "cannot read config file '", path, "'; check its permissions");
  std::stringstream text;
  text << in.rdbuf();
  return parse_config_toml(text.str(), path);
}

void apply_overrides(JobConfig& config, const std::vector<std::string>& args) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg.size() < 3 || arg.compare(0, 2, "--") != 0) {
      fail_usage("unexpected argument '", arg, "'; config overrides look like --section.key=value");
    }
    const std::string body = arg.substr(2);
    const size_t eq = body.find('=');
    const std::string name = body.substr(0, eq);
    const ConfigKey* spec = find_key(name);
    if (spec == nullptr) {
      fail_usage("unknown config key '", name, "' in command-line override '", arg,
                 "' (did you mean '", suggest_key(name), "'?)");
    }
    std::string value;
    std::string where;
    if (eq != std::string::npos) {
      value = body.substr(eq + 1);
      where = "command-line override '" + arg + "'";
    } else {
      const bool is_bool = std::holds_alternative<bool*>(spec->field(config));
      const bool has_next = i + 1 < args.size() && args[i + 1].compare(0, 2, "--") != 0;
      if (is_bool && !(has_next && (args[i + 1] == "true" || args[i + 1] == "false"))) {
        value = "true";  // a bare boolean flag
      } else if (!has_next) {
        fail_usage("config override '", arg, "' needs a value: --", name, "=VALUE or --", name,
                   " VALUE");
      } else {
        value = args[++i];
      }
      where = "command-line override '" + arg + " " + value + "'";
    }
    set_from_string(config, *spec, value, where);
  }
}

JobConfig load_job_config(const std::string& path, const std::vector<std::string>& overrides) {
  JobConfig config = path.empty() ? JobConfig{} : load_config_file(path);
  apply_overrides(config, overrides);
  validate(config);
  return config;
}

void validate(const JobConfig& c) {
  auto key = [](const char* name) -> const ConfigKey& {
    const ConfigKey* k = find_key(name);
    TORCH_INTERNAL_ASSERT(k != nullptr, "validate() names unknown config key ", name);
    return *k;
  };
  // Every number first, over the whole schema so a new key cannot be missed: inf and nan (which
  // TOML and the command line both accept) pass the range checks below (inf >= 0) or make their
  // messages confusing, and would reach the optimizer as a NaN loss much later.
  for (const ConfigKey& k : schema()) {
    std::visit(
        [&](auto field) {
          using T = decltype(field);
          bool finite = true;
          if constexpr (std::is_same_v<T, double*>) {
            finite = std::isfinite(*field);
          } else if constexpr (std::is_same_v<T, std::optional<double>*>) {
            finite = !field->has_value() || std::isfinite(**field);
          }
          require(finite, k, "a finite number", c);
        },
        k.field(const_cast<JobConfig&>(c)));  // only read
  }
  // Each section's own checks, declared with it.
  for (const SectionBinding& binding : section_bindings()) {
    const options::Section& section = binding.schema();
    if (section.validate != nullptr) section.validate(binding.of(const_cast<JobConfig&>(c)));
  }
  // Checks across sections.
  // The optimizer's own refusals (its registry entry), before any process group.
  const parallel::OptimizerSpec& optimizer = parallel::optimizer_spec(c.optimizer.name);
  if (optimizer.check_layout) {
    parallel::OptimizerLayout layout;
    layout.tensor_parallel_degree = c.parallelism.tensor_parallel_degree;
    layout.device = std::string(options::enum_name(c.training.device));
    layout.half_precision_shards = c.training.mixed_precision_param == Precision::kBFloat16 ||
                                   c.training.mixed_precision_reduce == Precision::kBFloat16;
    optimizer.check_layout(c.optimizer.request(), layout);
  }
  if (c.parallelism.pipeline_parallel_degree > 1) {
    const int64_t rows = c.training.local_batch_size, mb = c.parallelism.pipeline_parallel_microbatch_size;
    LOOM_REQUIRE_USAGE(rows % mb == 0, "parallelism.pipeline_parallel_microbatch_size = ", mb,
                       " does not divide training.local_batch_size = ", rows,
                       " (each loaded batch is cut into micro-batches of that many rows); use a divisor of ",
                       rows);
  }
  {
    const int64_t seq = c.training.seq_len, cp = c.parallelism.context_parallel_degree;
    LOOM_REQUIRE_USAGE(cp == 1 || seq % (2 * cp) == 0, "training.seq_len = ", seq,
                       " is not divisible by 2 x parallelism.context_parallel_degree = ", 2 * cp,
                       " (context parallel cuts each sequence into that many equal chunks); use a multiple of ",
                       2 * cp, ", e.g. ", (seq / (2 * cp) + 1) * 2 * cp);
  }
  if (c.validation.enable) {
    const ValidationSection& v = c.validation;
    require(v.seq_len <= c.training.seq_len, key("validation.seq_len"),
            c10::str("in [0, training.seq_len = ", c.training.seq_len, "] (0 = training.seq_len)"), c);
    const int64_t seq = v.seq_len > 0 ? v.seq_len : c.training.seq_len;
    const int64_t cp = c.parallelism.context_parallel_degree;
    LOOM_REQUIRE_USAGE(cp == 1 || seq % (2 * cp) == 0, "validation.seq_len = ", seq,
                       " is not divisible by 2 x parallelism.context_parallel_degree = ", 2 * cp,
                       "; use a multiple of ", 2 * cp, " or 0 (training.seq_len)");
    const int64_t tp = c.parallelism.tensor_parallel_degree;
    LOOM_REQUIRE_USAGE(tp == 1 || c.parallelism.disable_sequence_parallel || (seq / cp) % tp == 0,
                       "validation.seq_len = ", seq, " is not divisible by context x tensor parallel "
                       "degrees = ", cp * tp, " (sequence parallel splits each row's tokens); use a "
                       "multiple of ", cp * tp, " or 0 (training.seq_len)");
  }
  // Settings that do not compose with each other: the table's rows that read only the config.
  check_compatibility(c, nullptr);
}

int64_t gradient_accumulation_steps(const JobConfig& config, int64_t data_parallel_degree) {
  LOOM_REQUIRE(data_parallel_degree >= 1, "data-parallel degree must be >= 1, got ",
               data_parallel_degree);
  const int64_t global = config.training.global_batch_size;
  if (global == -1) return 1;
  const int64_t per_step = config.training.local_batch_size * data_parallel_degree;
  LOOM_REQUIRE_USAGE(global > 0 && global % per_step == 0, "training.global_batch_size (", global,
                     ") is not a multiple of training.local_batch_size x data-parallel degree (",
                     config.training.local_batch_size, " x ", data_parallel_degree, " = ",
                     per_step, "); set it to a multiple of ", per_step, " or to -1");
  return global / per_step;
}

}  // namespace loom::train
