#include "loom/data/tokenizer.h"

#include <array>

#include <c10/util/StringUtil.h>

#include <algorithm>
#include <climits>
#include <deque>
#include <nlohmann/json.hpp>
#include <queue>

#include "loom/core/error.h"
#include "loom/data/sources.h"

#include <charconv>

namespace loom::data {

using nlohmann::json;

// Words (pre-tokenized pieces) repeat heavily in natural text, so each distinct word is run
// through BPE once. Bounded: a corpus of unbounded vocabulary cannot grow it without limit.
// Sharded by the word's hash, each shard with its own lock: tokenizer threads (ParallelEncoder)
// look words up millions of times a second, and one lock serialised them (2 threads ran at half
// the speed of one).
struct Tokenizer::WordCache {
  static constexpr size_t kShards = 64;
  static constexpr size_t kMaxEntriesPerShard = (size_t{1} << 19) / kShards;
  static constexpr size_t kMaxWordBytes = 64;
  struct Shard {
    std::mutex mutex;
    std::unordered_map<std::string, std::vector<int32_t>> words;
  };
  std::array<Shard, kShards> shards;
  Shard& shard_of(std::string_view word) { return shards[std::hash<std::string_view>{}(word) % kShards]; }
};

namespace {

// Word pieces up to this many bytes use the quadratic scan; longer ones a heap.
constexpr size_t kShortWordSymbols = 48;

// nlohmann's messages start with "[json.exception.parse_error.101] "; the tag helps nobody.
std::string json_message(const json::exception& e) {
  std::string m = e.what();
  if (!m.empty() && m[0] == '[') {
    const size_t close = m.find("] ");
    if (close != std::string::npos) m = m.substr(close + 2);
  }
  return m;
}

bool flag(const json& obj, const char* key, bool fallback) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return fallback;
  return it->get<bool>();
}

std::string type_of(const json& obj) {
  if (!obj.is_object()) return obj.is_null() ? "none" : "malformed";
  auto it = obj.find("type");
  return it != obj.end() && it->is_string() ? it->get<std::string>() : "untyped";
}

}  // namespace

Tokenizer::Tokenizer() : cache_(std::make_unique<WordCache>()) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_file(const std::string& path) {
  return from_json_string(read_file(path, "tokenizer"), path);
}

Tokenizer Tokenizer::from_json_string(const std::string& json_text, const std::string& origin) {
  const std::string where = c10::str("tokenizer '", origin, "'");
  const std::string supported = "; loom reads byte-level BPE tokenizers (GPT-2, Llama 3, 'loom tokenizer train')";
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::parse_error& e) {
    fail(where, " is not valid JSON: ", json_message(e));
  }
  LOOM_REQUIRE(root.is_object() && root.contains("model"), where,
               " is not a Hugging Face tokenizer.json (no \"model\" object)", supported);

  Tokenizer t;
  t.origin_ = origin;
  try {
    const json& model = root.at("model");
    const std::string model_type = model.is_object() && !model.contains("type") && model.contains("merges")
                                       ? "BPE"  // files from tokenizers < 0.10 leave the type out
                                       : type_of(model);
    LOOM_REQUIRE(model_type == "BPE", where, " has a ", model_type, " model", supported);
    LOOM_REQUIRE(!flag(model, "byte_fallback", false), where,
                 " is a SentencePiece-style BPE with byte_fallback, not byte-level BPE", supported);
    for (const char* affix : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      auto it = model.find(affix);
      LOOM_REQUIRE(it == model.end() || it->is_null() || it->get<std::string>().empty(), where,
                   " sets the BPE ", affix, " '", it->get<std::string>(), "'", supported);
    }
    if (auto it = model.find("dropout"); it != model.end() && !it->is_null()) {
      LOOM_REQUIRE(it->get<double>() == 0.0, where, " enables BPE dropout (", it->get<double>(),
                   "), which makes encoding random; set \"dropout\": null");
    }

    const json& normalizer = root.value("normalizer", json());
    const bool no_normalizer = normalizer.is_null() ||
        (type_of(normalizer) == "Sequence" && normalizer.value("normalizers", json::array()).empty());
    LOOM_REQUIRE(no_normalizer, where, " has a ", type_of(normalizer),
                 " normalizer; byte-level BPE tokenizers have none", supported);

    // Pre-tokenizer: ByteLevel, or a Sequence of regex Splits ending in ByteLevel.
    const json& pre = root.value("pre_tokenizer", json());
    std::vector<const json*> steps;
    if (type_of(pre) == "Sequence") {
      for (const json& s : pre.at("pretokenizers")) steps.push_back(&s);
    } else if (!pre.is_null()) {
      steps.push_back(&pre);
    }
    LOOM_REQUIRE(!steps.empty() && type_of(*steps.back()) == "ByteLevel", where,
                 " is not byte-level BPE (its pre-tokenizer is ", type_of(pre),
                 " without a final ByteLevel step)", supported);
    for (const json* s : steps) {
      const std::string type = type_of(*s);
      PreTokenizeStep step{};
      if (type == "ByteLevel") {
        LOOM_REQUIRE(s == steps.back(), where, " has a ByteLevel pre-tokenizer before other steps",
                     supported);
        step.byte_level = true;
        step.add_prefix_space = flag(*s, "add_prefix_space", true);
        step.use_regex = flag(*s, "use_regex", true);
        step.pattern = byte_level::SplitPattern::kGpt2;
      } else if (type == "Split") {
        const json& pattern = s->at("pattern");
        LOOM_REQUIRE(pattern.contains("Regex"), where, " splits on a plain string pattern ",
                     pattern.dump(), "; only the GPT-2 and Llama 3 regexes are supported");
        const std::string regex = pattern.at("Regex").get<std::string>();
        const auto known = byte_level::pattern_from_regex(regex);
        LOOM_REQUIRE(known.has_value(), where, " uses an unsupported pre-tokenizer regex ", json(regex).dump(),
                     "; supported: the GPT-2 and Llama 3 patterns");
        LOOM_REQUIRE(s->value("behavior", std::string("Isolated")) == "Isolated" && !flag(*s, "invert", false),
                     where, " has a Split pre-tokenizer with behavior '", s->value("behavior", std::string()),
                     "'", flag(*s, "invert", false) ? " inverted" : "", "; only Isolated, not inverted, is supported");
        step.byte_level = false;
        step.pattern = *known;
      } else {
        fail(where, " has a ", type, " pre-tokenizer step", supported);
      }
      t.pre_tokenizer_.push_back(step);
    }

    const json& decoder = root.value("decoder", json());
    LOOM_REQUIRE(decoder.is_null() || type_of(decoder) == "ByteLevel", where, " has a ", type_of(decoder),
                 " decoder, not ByteLevel", supported);

    // Vocabulary. Spellings are in the byte alphabet; BPE works on the raw bytes they stand for.
    const json& vocab = model.at("vocab");
    LOOM_REQUIRE(vocab.is_object() && !vocab.empty(), where, " has an empty or malformed BPE vocabulary");
    int64_t max_id = -1;
    for (const auto& [spelling, id_json] : vocab.items()) {
      const int64_t id = id_json.get<int64_t>();
      LOOM_REQUIRE(id >= 0 && id < INT32_MAX, where, " gives token ", json(spelling).dump(), " the id ", id);
      max_id = std::max(max_id, id);
    }
    for (const json& added : root.value("added_tokens", json::array())) {
      max_id = std::max(max_id, added.at("id").get<int64_t>());
    }
    t.vocab_size_ = max_id + 1;
    t.id_to_spelling_.resize(t.vocab_size_);
    t.id_to_bytes_.resize(t.vocab_size_);
    t.id_is_special_.assign(t.vocab_size_, 0);
    std::vector<uint8_t> present(t.vocab_size_, 0);
    t.byte_id_.fill(-1);
    t.bytes_to_id_.reserve(vocab.size());
    t.spelling_to_id_.reserve(vocab.size());
    for (const auto& [spelling, id_json] : vocab.items()) {
      const auto id = id_json.get<int32_t>();
      t.spelling_to_id_[spelling] = id;
      t.id_to_spelling_[id] = spelling;
      present[id] = 1;
      if (auto bytes = byte_level::from_alphabet(spelling)) {
        if (bytes->size() == 1) t.byte_id_[static_cast<unsigned char>((*bytes)[0])] = id;
        t.id_to_bytes_[id] = *bytes;
        t.bytes_to_id_[*bytes] = id;
      } else {
        t.id_to_bytes_[id] = spelling;  // not producible by BPE; decodes as its own text
      }
    }

    // Merges: "left right" strings (tokenizers < 0.20) or ["left", "right"] pairs. A later
    // duplicate of a pair overrides the earlier one, as in `tokenizers`.
    const json& merges = model.at("merges");
    t.merges_.reserve(merges.size() * 2);
    int32_t rank = 0;
    for (const json& m : merges) {
      std::string left, right;
      if (m.is_string()) {
        const std::string s = m.get<std::string>();
        const size_t space = s.find(' ');
        LOOM_REQUIRE(space != std::string::npos && s.find(' ', space + 1) == std::string::npos, where,
                     " has merge ", rank, " ", json(s).dump(), ", which is not two tokens separated by one space");
        left = s.substr(0, space);
        right = s.substr(space + 1);
      } else {
        LOOM_REQUIRE(m.is_array() && m.size() == 2, where, " has merge ", rank, " ", m.dump(),
                     ", which is not a pair of tokens");
        left = m[0].get<std::string>();
        right = m[1].get<std::string>();
      }
      auto l = t.spelling_to_id_.find(left), r = t.spelling_to_id_.find(right),
           merged = t.spelling_to_id_.find(left + right);
      LOOM_REQUIRE(l != t.spelling_to_id_.end() && r != t.spelling_to_id_.end() &&
                       merged != t.spelling_to_id_.end(),
                   where, " has merge ", rank, " (", json(left).dump(), ", ", json(right).dump(),
                   ") whose tokens are not all in the vocabulary");
      t.merges_[pair_key(l->second, r->second)] = MergeResult{rank, merged->second};
      ++rank;
    }
    t.ignore_merges_ = flag(model, "ignore_merges", false);
    t.fuse_unk_ = flag(model, "fuse_unk", false);
    if (auto it = model.find("unk_token"); it != model.end() && !it->is_null()) {
      auto unk = t.spelling_to_id_.find(it->get<std::string>());
      LOOM_REQUIRE(unk != t.spelling_to_id_.end(), where, " names unk_token ", it->dump(),
                   ", which is not in the vocabulary");
      t.unk_id_ = unk->second;
    }

    // Added tokens override model spellings and decode as their own text.
    for (const json& a : root.value("added_tokens", json::array())) {
      AddedToken token;
      token.content = a.at("content").get<std::string>();
      token.id = a.at("id").get<int32_t>();
      LOOM_REQUIRE(token.id >= 0, where, " gives added token ", json(token.content).dump(), " the id ", token.id);
      token.special = flag(a, "special", false);
      token.single_word = flag(a, "single_word", false);
      token.lstrip = flag(a, "lstrip", false);
      token.rstrip = flag(a, "rstrip", false);
      token.normalized = flag(a, "normalized", !token.special);
      if (token.content.empty()) continue;
      t.added_.push_back(token);
      t.spelling_to_id_[token.content] = token.id;
      t.id_to_spelling_[token.id] = token.content;
      t.id_to_bytes_[token.id] = token.content;
      t.id_is_special_[token.id] = token.special ? 1 : 0;
      present[token.id] = 1;
    }
    for (const AddedToken& a : t.added_) (a.normalized ? t.normalized_added_ : t.raw_added_).add(&a);
    for (int64_t id = 0; id < t.vocab_size_; ++id) {
      if (!present[id]) t.id_to_bytes_[id].clear(), t.id_to_spelling_[id].clear();
    }
  } catch (const json::exception& e) {
    fail(where, " is malformed: ", json_message(e));
  }

  auto first_of = [&t](std::initializer_list<const char*> names) -> int64_t {
    for (const char* n : names) {
      if (int64_t id = t.token_to_id(n); id >= 0) return id;
    }
    return -1;
  };
  t.bos_id_ = first_of({"<|begin_of_text|>", "<s>", "<|endoftext|>"});
  t.eos_id_ = first_of({"<|end_of_text|>", "</s>", "<|endoftext|>"});
  t.pad_id_ = first_of({"<|pad|>", "<pad>"});
  return t;
}

int64_t Tokenizer::token_to_id(const std::string& token) const {
  auto it = spelling_to_id_.find(token);
  return it == spelling_to_id_.end() ? -1 : it->second;
}

std::string Tokenizer::id_to_token(int64_t id) const {
  LOOM_REQUIRE(id >= 0 && id < vocab_size_ && !id_to_spelling_[id].empty(), "token id ", id,
               " is not in tokenizer '", origin_, "' (vocabulary size ", vocab_size_, ")");
  return id_to_spelling_[id];
}

// ---- encoding -------------------------------------------------------------------------------

void Tokenizer::AddedMatcher::add(const AddedToken* token) {
  auto& list = by_first_byte[static_cast<unsigned char>(token->content[0])];
  list.push_back(token);
  std::stable_sort(list.begin(), list.end(), [](const AddedToken* a, const AddedToken* b) {
    return a->content.size() > b->content.size();
  });
  empty = false;
}

void Tokenizer::split_with(const AddedMatcher& matcher, std::string_view text, std::vector<Segment>& out) const {
  if (matcher.empty) {
    out.push_back({text, -1});
    return;
  }
  auto ends_with_word = [&](size_t end) {  // \w$ on text[..end]
    size_t p = end;
    while (p > 0 && (static_cast<unsigned char>(text[p - 1]) & 0xC0) == 0x80) --p;
    if (p == 0) return false;
    size_t len;
    return unicode::is_word(unicode::decode_utf8(text, p - 1, &len));
  };
  auto starts_with_word = [&](size_t begin) {
    size_t len;
    return begin < text.size() && unicode::is_word(unicode::decode_utf8(text, begin, &len));
  };
  size_t emitted = 0;  // text[..emitted] is already in `out`
  size_t pos = 0;
  while (pos < text.size()) {
    // Leftmost-longest: the first position where a token starts, the longest token there.
    const AddedToken* match = nullptr;
    for (; pos < text.size(); ++pos) {
      for (const AddedToken* a : matcher.by_first_byte[static_cast<unsigned char>(text[pos])]) {
        if (text.compare(pos, a->content.size(), a->content) == 0) {
          match = a;
          break;
        }
      }
      if (match) break;
    }
    if (!match) break;
    size_t start = pos;
    size_t stop = start + match->content.size();
    pos = stop;
    if (match->single_word && ((start > 0 && ends_with_word(start)) || starts_with_word(stop))) continue;
    if (match->lstrip) {
      size_t s = start;
      while (s > emitted) {
        size_t p = s - 1;
        while (p > 0 && (static_cast<unsigned char>(text[p]) & 0xC0) == 0x80) --p;
        size_t len;
        if (!unicode::is_whitespace(unicode::decode_utf8(text, p, &len))) break;
        s = p;
      }
      start = s;
    }
    if (match->rstrip) {
      size_t len;
      while (stop < text.size() && unicode::is_whitespace(unicode::decode_utf8(text, stop, &len))) stop += len;
      pos = stop;
    }
    if (emitted < start) out.push_back({text.substr(emitted, start - emitted), -1});
    out.push_back({text.substr(start, stop - start), match->id});
    emitted = stop;
  }
  if (emitted < text.size()) out.push_back({text.substr(emitted), -1});
}

void Tokenizer::split_added_tokens(std::string_view text, std::vector<Segment>& out) const {
  // Tokens that are matched on the raw text first, then (as `tokenizers` does after normalizing,
  // which is the identity here) the normalized ones within the remaining plain segments.
  if (normalized_added_.empty) {
    split_with(raw_added_, text, out);
    return;
  }
  std::vector<Segment> first;
  split_with(raw_added_, text, first);
  for (const Segment& s : first) {
    if (s.added_id >= 0) {
      out.push_back(s);
    } else {
      split_with(normalized_added_, s.text, out);
    }
  }
}

const Tokenizer::MergeResult* Tokenizer::find_merge(int32_t left, int32_t right) const {
  auto it = merges_.find(pair_key(left, right));
  return it == merges_.end() ? nullptr : &it->second;
}

void Tokenizer::bpe(std::string_view word, std::vector<int32_t>& ids) const {
  ids.clear();
  bool last_was_unk = false;
  for (unsigned char b : word) {
    const int32_t id = byte_id_[b];
    if (id >= 0) {
      ids.push_back(id);
      last_was_unk = false;
    } else if (unk_id_ >= 0 && !(fuse_unk_ && last_was_unk)) {
      ids.push_back(unk_id_);  // a byte missing from the vocabulary (only in partial alphabets)
      last_was_unk = true;
    }
  }
  if (ids.size() > kShortWordSymbols) {
    bpe_long(ids);
    return;
  }
  // Apply the lowest-ranked merge among adjacent pairs, leftmost first, until none applies.
  while (ids.size() >= 2) {
    int32_t best_rank = INT32_MAX;
    size_t best = 0;
    int32_t best_id = -1;
    for (size_t i = 0; i + 1 < ids.size(); ++i) {
      const MergeResult* m = find_merge(ids[i], ids[i + 1]);
      if (m && m->rank < best_rank) best_rank = m->rank, best = i, best_id = m->id;
    }
    if (best_id < 0) break;
    ids[best] = best_id;
    ids.erase(ids.begin() + static_cast<std::ptrdiff_t>(best) + 1);
  }
}

// The same merge order for long pieces (long runs of spaces or symbols) in O(n log n): a heap of
// candidate merges keyed (rank, position) over a linked list of symbols. An entry is stale when its
// symbols changed since it was pushed; then the pair it names no longer produces the same token.
void Tokenizer::bpe_long(std::vector<int32_t>& ids) const {
  const int32_t n = static_cast<int32_t>(ids.size());
  std::vector<int32_t> prev(n), next(n);
  std::vector<uint8_t> alive(n, 1);
  for (int32_t i = 0; i < n; ++i) prev[i] = i - 1, next[i] = i + 1 < n ? i + 1 : -1;
  struct Candidate {
    int32_t rank, pos, id;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto push = [&](int32_t pos) {
    if (pos < 0 || next[pos] < 0) return;
    if (const MergeResult* m = find_merge(ids[pos], ids[next[pos]])) heap.push({m->rank, pos, m->id});
  };
  for (int32_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    if (!alive[c.pos] || next[c.pos] < 0) continue;
    const MergeResult* m = find_merge(ids[c.pos], ids[next[c.pos]]);
    if (!m || m->id != c.id) continue;
    const int32_t right = next[c.pos];
    ids[c.pos] = c.id;
    alive[right] = 0;
    next[c.pos] = next[right];
    if (next[right] >= 0) prev[next[right]] = c.pos;
    push(prev[c.pos]);
    push(c.pos);
  }
  size_t out = 0;
  for (int32_t i = 0; i >= 0 && i < n; i = next[i]) ids[out++] = ids[i];
  ids.resize(out);
}

void Tokenizer::encode_word(std::string_view word, std::vector<int64_t>& out) const {
  if (ignore_merges_) {
    auto it = bytes_to_id_.find(std::string(word));
    if (it != bytes_to_id_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  const bool cacheable = word.size() <= WordCache::kMaxWordBytes;
  thread_local std::string key;
  WordCache::Shard* shard = nullptr;
  if (cacheable) {
    key.assign(word);
    shard = &cache_->shard_of(word);
    std::lock_guard<std::mutex> lock(shard->mutex);
    auto it = shard->words.find(key);
    if (it != shard->words.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  thread_local std::vector<int32_t> ids;
  bpe(word, ids);
  out.insert(out.end(), ids.begin(), ids.end());
  if (cacheable) {
    std::lock_guard<std::mutex> lock(shard->mutex);
    if (shard->words.size() >= WordCache::kMaxEntriesPerShard) shard->words.clear();
    shard->words.emplace(key, ids);
  }
}

void Tokenizer::encode_plain(std::string_view text, std::vector<int64_t>& out) const {
  // Runs the pre-tokenizer steps over the pieces; a ByteLevel step with add_prefix_space needs a
  // new string per piece, kept in `owned` (a deque never moves its elements).
  std::deque<std::string> owned;
  std::vector<std::string_view> pieces{text}, next;
  for (const PreTokenizeStep& step : pre_tokenizer_) {
    next.clear();
    for (std::string_view piece : pieces) {
      if (step.byte_level && step.add_prefix_space && piece.front() != ' ') {
        owned.push_back(" ");
        owned.back().append(piece);
        piece = owned.back();
      }
      if (!step.byte_level || step.use_regex) {
        byte_level::split(piece, step.pattern, next);
      } else {
        next.push_back(piece);
      }
    }
    pieces.swap(next);
  }
  for (std::string_view piece : pieces) encode_word(piece, out);
}

std::vector<int64_t> Tokenizer::encode(std::string_view text, bool add_bos, bool add_eos) const {
  std::vector<int64_t> out;
  out.reserve(text.size() / 3 + 2);
  if (add_bos) {
    LOOM_REQUIRE(bos_id_ >= 0, "tokenizer '", origin_,
                 "' has no BOS token (<|begin_of_text|>, <s> or <|endoftext|>) to add");
    out.push_back(bos_id_);
  }
  std::vector<Segment> segments;
  split_added_tokens(text, segments);
  for (const Segment& s : segments) {
    if (s.added_id >= 0) {
      out.push_back(s.added_id);
    } else if (!s.text.empty()) {
      encode_plain(s.text, out);
    }
  }
  if (add_eos) {
    LOOM_REQUIRE(eos_id_ >= 0, "tokenizer '", origin_,
                 "' has no EOS token (<|end_of_text|>, </s> or <|endoftext|>) to add");
    out.push_back(eos_id_);
  }
  return out;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids, bool skip_special) const {
  std::string out;
  out.reserve(ids.size() * 4);
  for (int64_t id : ids) {
    LOOM_REQUIRE(id >= 0 && id < vocab_size_ && !id_to_spelling_[id].empty(), "cannot decode token id ", id,
                 ": not in tokenizer '", origin_, "' (vocabulary size ", vocab_size_, ")");
    if (skip_special && id_is_special_[id]) continue;
    out += id_to_bytes_[id];
  }
  return out;
}

std::vector<int64_t> parse_token_ids(std::string_view text, std::string_view where) {
  std::vector<int64_t> ids;
  std::string item;
  auto flush = [&] {
    if (item.empty()) return;
    int64_t id = -1;
    const auto [ptr, ec] = std::from_chars(item.data(), item.data() + item.size(), id);
    LOOM_REQUIRE_USAGE(ec == std::errc() && ptr == item.data() + item.size() && id >= 0, where, ": '", item,
                       "' is not a token id (expected non-negative integers separated by commas or spaces, "
                       "like 1,2,3)");
    ids.push_back(id);
    item.clear();
  };
  // An empty entry between two commas ("1,,2", a trailing or leading comma) is a mistake, not a
  // separator: it was silently dropped, shifting every later id.
  bool entry_since_comma = false;
  for (const char c : text) {
    if (c == ',') {
      LOOM_REQUIRE_USAGE(entry_since_comma || !item.empty(), where, ": an empty entry before comma ",
                         "(expected non-negative integers separated by commas or spaces, like 1,2,3)");
      flush();
      entry_since_comma = false;
    } else if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
      entry_since_comma = entry_since_comma || !item.empty();
      flush();
    } else {
      item += c;
    }
  }
  LOOM_REQUIRE_USAGE(entry_since_comma || !item.empty() || ids.empty(), where,
                     ": an empty entry after the last comma (expected non-negative integers separated by commas "
                     "or spaces, like 1,2,3)");
  flush();
  return ids;
}

}  // namespace loom::data
