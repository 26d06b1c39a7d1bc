#include "loom/core/options.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "loom/core/strings.h"

namespace loom::options {

std::string nearest(std::string_view name, const std::vector<std::string_view>& candidates) {
  std::string best;
  size_t best_distance = std::numeric_limits<size_t>::max();
  for (std::string_view candidate : candidates) {
    const size_t d = edit_distance(name, candidate);
    if (d < best_distance) {
      best_distance = d;
      best = std::string(candidate);
    }
  }
  return best;
}

std::string toml_string(std::string_view s) {
  std::string out = "\"";
  for (const char ch : s) {
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\t': out += "\\t"; break;
      case '\n': out += "\\n"; break;
      case '\f': out += "\\f"; break;
      case '\r': out += "\\r"; break;
      default:
        if (static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04X", static_cast<unsigned>(static_cast<unsigned char>(ch)));
          out += buf;
        } else {
          out += ch;
        }
    }
  }
  return out + "\"";
}

std::string format_double(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::string s(buf);
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

bool is_positive_integer(std::string_view s) {
  int64_t v = 0;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  return ec == std::errc() && ptr == s.data() + s.size() && v > 0;
}

std::string join_choices(const std::vector<std::string_view>& choices, std::string_view last) {
  std::vector<std::string> items;
  for (std::string_view c : choices) items.push_back(toml_string(c));
  if (!last.empty()) items.emplace_back(last);
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += i + 1 == items.size() ? " or " : ", ";
    out += items[i];
  }
  return out;
}

namespace {

// Which alternative a key's FieldRef holds depends only on the field's type, so the type is read
// by binding the key to scratch storage (the binding only takes a member's address in it).
FieldRef probe(const Key& key) {
  alignas(std::max_align_t) static unsigned char scratch[1 << 12];
  return key.field(scratch);
}

}  // namespace

std::vector<std::string_view> Key::allowed() const {
  const FieldRef f = probe(*this);
  if (const auto* e = std::get_if<EnumRef>(&f)) return e->codec->names;
  return choices;
}

std::string Key::type_description() const {
  return std::visit(
      [&](auto field) -> std::string {
        using T = decltype(field);
        if constexpr (std::is_same_v<T, bool*>) {
          return "a boolean";
        } else if constexpr (std::is_same_v<T, int64_t*>) {
          return "an integer";
        } else if constexpr (std::is_same_v<T, double*>) {
          return "a number";
        } else if constexpr (std::is_same_v<T, std::optional<double>*>) {
          return "a number or none";
        } else if constexpr (std::is_same_v<T, TableArrayRef>) {
          return "an array of tables";
        } else {
          return integer_allowed ? "a string or an integer" : "a string";
        }
      },
      probe(*this));
}

std::string Key::doc_type() const {
  std::string choice_list;
  for (std::string_view c : allowed()) {
    choice_list += c10::str(choice_list.empty() ? "" : " \\| ", "`\"", c, "\"`");
  }
  return std::visit(
      [&](auto field) -> std::string {
        using T = decltype(field);
        if constexpr (std::is_same_v<T, bool*>) {
          return "bool";
        } else if constexpr (std::is_same_v<T, int64_t*>) {
          return "int";
        } else if constexpr (std::is_same_v<T, double*>) {
          return "float";
        } else if constexpr (std::is_same_v<T, std::optional<double>*>) {
          return "float or unset";
        } else if constexpr (std::is_same_v<T, TableArrayRef>) {
          return "array of tables";
        } else {
          if (choice_list.empty()) return "string";
          return integer_allowed ? choice_list + " \\| int" : choice_list;
        }
      },
      probe(*this));
}

const Key* Section::find(std::string_view key) const {
  for (const Key& k : keys) {
    if (k.name == key) return &k;
  }
  return nullptr;
}

std::string value_as_toml(const Key& key, const void* object) {
  // Reading through the non-const binding is safe: nothing is written.
  return std::visit(
      [&](auto value) -> std::string {
        using T = decltype(value);
        if constexpr (std::is_same_v<T, bool*>) {
          return *value ? "true" : "false";
        } else if constexpr (std::is_same_v<T, int64_t*>) {
          return std::to_string(*value);
        } else if constexpr (std::is_same_v<T, double*>) {
          return format_double(*value);
        } else if constexpr (std::is_same_v<T, std::optional<double>*>) {
          return value->has_value() ? format_double(**value) : "none";
        } else if constexpr (std::is_same_v<T, EnumRef>) {
          return toml_string(value.codec->get(value.field));
        } else if constexpr (std::is_same_v<T, TableArrayRef>) {
          // An inline array of inline tables: one line, and TOML reads it back as [[...]] tables.
          const Section& element = value.codec->element();
          std::string out = "[";
          for (size_t i = 0; i < value.codec->size(value.field); ++i) {
            const void* e = value.codec->at(value.field, i);
            out += i ? ", {" : "{";
            bool first = true;
            for (const Key& key : element.keys) {
              const std::string v = value_as_toml(key, e);
              if (v == "none") continue;  // TOML has no null: an unset optional is left out
              out += c10::str(first ? " " : ", ", key.name, " = ", v);
              first = false;
            }
            out += " }";
          }
          return out + "]";
        } else {
          return key.integer_allowed && is_positive_integer(*value) ? *value : toml_string(*value);
        }
      },
      key.field(const_cast<void*>(object)));
}

void require(bool ok, const Section& section, std::string_view key, std::string_view requirement,
             const void* object) {
  if (ok) return;
  const Key* k = section.find(key);
  TORCH_INTERNAL_ASSERT(k != nullptr, "section ", section.name, " has no key ", key);
  fail_usage("config key '", section.name, ".", key, "' must be ", requirement, ", got ",
             value_as_toml(*k, object));
}

}  // namespace loom::options
