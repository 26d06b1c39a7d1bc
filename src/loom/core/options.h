// Options as data: a feature folder declares its options once, as a struct and a schema Section
// (one Key per field: name, help, the field it binds, allowed values), and everything else —
// reading TOML and command-line overrides (train/config.cpp), printing the resolved config,
// docs/config.md, range messages — is done from the schema. A folder's options never pass through
// a hand-written parser elsewhere.
//
// Enum-valued options are stored as their enum type in the struct, parsed once when the value is
// read. An option enum E declares its names next to it, found by argument-dependent lookup:
//
//   enum class Recipe { kRowwise, kTensorwise };
//   const options::EnumNames<Recipe>& option_names(Recipe);   // {{"rowwise", kRowwise}, ...}
//
// and options::enum_name / options::parse_enum turn values and names into each other.
#pragma once
#include <c10/util/StringUtil.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "loom/core/error.h"

namespace loom::options {

// The names an option enum is written with, in the order they are listed to users.
template <typename E>
using EnumNames = std::vector<std::pair<std::string_view, E>>;

template <typename E>
concept OptionEnum = std::is_enum_v<E> && requires(E e) {
  { option_names(e) } -> std::convertible_to<const EnumNames<E>&>;
};

// An enum field with its names, type-erased for the schema.
struct EnumCodec {
  std::vector<std::string_view> names;
  std::string_view (*get)(const void* field);
  bool (*set)(void* field, std::string_view name);  // false: no value has this name
};

struct EnumRef {
  void* field;
  const EnumCodec* codec;
};

struct Section;

// An array of tables (`[[training.datasets]]`): a std::vector<T> field whose element struct T
// declares its keys as a Section, found by argument-dependent lookup like an enum's names:
//   const options::Section& option_section(const DatasetSource*);
// In a config file it is written as [[section.key]] tables or an inline array of inline tables;
// on the command line as the inline array (`--training.datasets='[{path = "a", weight = 2}]'`).
struct TableArrayCodec {
  const Section& (*element)();
  size_t (*size)(const void* vector);
  void* (*at)(void* vector, size_t i);
  void (*resize)(void* vector, size_t n);
};
struct TableArrayRef {
  void* field;
  const TableArrayCodec* codec;
};

// A typed pointer to one field of an options struct.
using FieldRef =
    std::variant<bool*, int64_t*, double*, std::string*, std::optional<double>*, EnumRef, TableArrayRef>;

template <OptionEnum E>
std::string_view enum_name(E value) {
  for (const auto& [name, v] : option_names(value)) {
    if (v == value) return name;
  }
  TORCH_INTERNAL_ASSERT(false, "option enum value without a name: ", static_cast<int64_t>(value));
}

template <OptionEnum E>
std::optional<E> find_enum(std::string_view name) {
  for (const auto& [n, v] : option_names(E{})) {
    if (n == name) return v;
  }
  return std::nullopt;
}

// "a", "b" or "c" (quoted) — how messages list allowed values.
std::string join_choices(const std::vector<std::string_view>& choices, std::string_view last = {});
// The nearest of `candidates` to `name` by edit distance (for "did you mean" hints).
std::string nearest(std::string_view name, const std::vector<std::string_view>& candidates);

template <OptionEnum E>
std::vector<std::string_view> enum_names() {
  std::vector<std::string_view> names;
  for (const auto& [n, v] : option_names(E{})) names.push_back(n);
  return names;
}

// `name` as an E; a loom::UsageError naming `setting`, the accepted names and the nearest one.
template <OptionEnum E>
E parse_enum(std::string_view name, std::string_view setting) {
  if (auto value = find_enum<E>(name)) return *value;
  const std::vector<std::string_view> names = enum_names<E>();
  fail_usage(setting, " must be ", join_choices(names), ", got \"", name, "\" (did you mean \"",
             nearest(name, names), "\"?)");
}

template <OptionEnum E>
const EnumCodec& enum_codec() {
  static const EnumCodec codec{
      enum_names<E>(),
      [](const void* field) { return enum_name(*static_cast<const E*>(field)); },
      [](void* field, std::string_view name) {
        const std::optional<E> value = find_enum<E>(name);
        if (value) *static_cast<E*>(field) = *value;
        return value.has_value();
      }};
  return codec;
}

inline FieldRef field_ref(bool* f) { return f; }
inline FieldRef field_ref(int64_t* f) { return f; }
inline FieldRef field_ref(double* f) { return f; }
inline FieldRef field_ref(std::string* f) { return f; }
inline FieldRef field_ref(std::optional<double>* f) { return f; }
template <OptionEnum E>
FieldRef field_ref(E* f) {
  return EnumRef{f, &enum_codec<E>()};
}

template <typename T>
concept OptionTable = requires(const T* t) {
  { option_section(t) } -> std::convertible_to<const Section&>;
};
template <OptionTable T>
FieldRef field_ref(std::vector<T>* f) {
  static const TableArrayCodec codec{
      []() -> const Section& { return option_section(static_cast<const T*>(nullptr)); },
      [](const void* v) { return static_cast<const std::vector<T>*>(v)->size(); },
      [](void* v, size_t i) -> void* { return &(*static_cast<std::vector<T>*>(v))[i]; },
      [](void* v, size_t n) { static_cast<std::vector<T>*>(v)->resize(n); }};
  return TableArrayRef{f, &codec};
}

// One option: a field of a section's struct.
struct Key {
  std::string_view name;             // within its section ("recipe")
  FieldRef (*field)(void* object);   // binds the key to an object of the section's struct
  std::string_view help;             // one paragraph of docs/config.md
  // Allowed string values (string fields; an enum field's are its names); empty = any.
  std::vector<std::string_view> choices = {};
  bool integer_allowed = false;      // a string field that also takes a positive integer

  // The allowed values: the enum's names, or `choices`.
  std::vector<std::string_view> allowed() const;
  // "a boolean" / "an integer" / "a number" / "a string" / "a number or none" / ...
  std::string type_description() const;
  // The type column of docs/config.md: bool, int, float, string, or the allowed values.
  std::string doc_type() const;
};

// A TOML table of options: its keys in order, the prose docs/config.md shows around its table,
// and its own checks (ranges, cross-key rules within the section).
struct Section {
  std::string_view name;  // the TOML table ("float8")
  std::vector<Key> keys;
  std::string_view doc_before = {};  // between the heading and the table
  std::string_view doc_after = {};   // after the table
  void (*validate)(const void* object) = nullptr;

  const Key* find(std::string_view key) const;
};

// Binds a Key to Struct::member (the first two Key fields).
#define LOOM_OPTION(Struct, member) \
  #member, [](void* object) { return ::loom::options::field_ref(&static_cast<Struct*>(object)->member); }

// Wraps a section's checks taking its struct as a validate function.
template <typename Struct, void (*Check)(const Struct&)>
void validate_as(const void* object) {
  Check(*static_cast<const Struct*>(object));
}

// TOML spellings of values.
std::string toml_string(std::string_view s);   // a basic string, quoted and escaped
std::string format_double(double v);           // shortest round-tripping form ("0.0008", "3.0")
bool is_positive_integer(std::string_view s);

// The value `key` holds in `object`, as TOML ("none" for an unset optional).
std::string value_as_toml(const Key& key, const void* object);

// A range check inside a section's validate(): "config key '<section>.<key>' must be
// <requirement>, got <value>" as a loom::UsageError when `ok` is false.
void require(bool ok, const Section& section, std::string_view key, std::string_view requirement,
             const void* object);

}  // namespace loom::options
