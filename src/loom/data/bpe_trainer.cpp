#include "loom/data/bpe_trainer.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_set>

#include "loom/core/error.h"
#include "loom/core/timer.h"
#include "loom/data/byte_level.h"

namespace loom::data {

namespace {

int32_t left_of(uint64_t key) { return static_cast<int32_t>(key >> 32); }
int32_t right_of(uint64_t key) { return static_cast<int32_t>(key & 0xFFFFFFFFu); }

// Max-heap entry: the most frequent pair first, then the smaller (left, right).
struct Candidate {
  int64_t count;
  uint64_t pair;
  bool operator<(const Candidate& o) const { return count != o.count ? count < o.count : pair > o.pair; }
};

}  // namespace

BpeTrainer::BpeTrainer(BpeTrainerOptions options) : options_(std::move(options)) {
  const int64_t minimum = 256 + static_cast<int64_t>(options_.special_tokens.size());
  LOOM_REQUIRE_USAGE(options_.vocab_size >= minimum, "tokenizer vocab size ", options_.vocab_size,
                     " is too small: it needs 256 byte tokens and ", options_.special_tokens.size(),
                     " special tokens, so at least ", minimum);
  LOOM_REQUIRE_USAGE(options_.vocab_size <= (int64_t{1} << 30), "tokenizer vocab size ", options_.vocab_size,
                     " is too large (at most 2^30)");
  LOOM_REQUIRE_USAGE(options_.min_frequency >= 1, "min_frequency must be at least 1, got ",
                     options_.min_frequency);
}

void BpeTrainer::add_text(std::string_view text) {
  LOOM_REQUIRE(!trained_, "BpeTrainer::add_text after train()");
  std::vector<std::string_view> words;
  // Cut special tokens out of the text: they are whole tokens, never parts of merges.
  while (!text.empty()) {
    size_t cut = text.size(), cut_len = 0;
    for (const std::string& s : options_.special_tokens) {
      const size_t p = text.find(s);
      if (p != std::string_view::npos && (p < cut || (p == cut && s.size() > cut_len))) cut = p, cut_len = s.size();
    }
    words.clear();
    byte_level::split(text.substr(0, cut), byte_level::SplitPattern::kGpt2, words);
    for (std::string_view w : words) ++word_counts_[std::string(w)];
    text.remove_prefix(std::min(text.size(), cut + cut_len));
  }
}

BpeTrainingResult BpeTrainer::train() {
  LOOM_REQUIRE(!trained_, "BpeTrainer::train called twice");
  Timer timer;
  trained_ = true;

  // Distinct words in a fixed order (the result does not depend on it, the work order does).
  std::vector<std::pair<std::string, int64_t>> words(word_counts_.begin(), word_counts_.end());
  word_counts_.clear();
  std::sort(words.begin(), words.end());
  std::vector<std::vector<int32_t>> symbols(words.size());
  std::vector<int64_t> counts(words.size());

  std::unordered_map<uint64_t, int64_t> pair_count;
  std::unordered_map<uint64_t, std::vector<int32_t>> pair_words;  // may repeat a word; deduped on use
  for (size_t w = 0; w < words.size(); ++w) {
    const std::string& bytes = words[w].first;
    counts[w] = words[w].second;
    symbols[w].assign(bytes.begin(), bytes.end());
    for (int32_t& s : symbols[w]) s &= 0xFF;  // char may be signed
    for (size_t i = 0; i + 1 < symbols[w].size(); ++i) {
      const uint64_t key = pair_key(symbols[w][i], symbols[w][i + 1]);
      pair_count[key] += counts[w];
      pair_words[key].push_back(static_cast<int32_t>(w));
    }
  }
  std::priority_queue<Candidate> heap;
  for (const auto& [key, count] : pair_count) heap.push({count, key});

  token_bytes_.clear();
  for (int b = 0; b < 256; ++b) token_bytes_.emplace_back(1, static_cast<char>(b));
  std::unordered_map<std::string, int32_t> bytes_to_id;
  for (int b = 0; b < 256; ++b) bytes_to_id[token_bytes_[b]] = b;

  const auto target = static_cast<size_t>(options_.vocab_size - static_cast<int64_t>(options_.special_tokens.size()));
  std::vector<uint64_t> grown;  // pairs whose count rose during one merge
  auto add = [&](int32_t left, int32_t right, int64_t delta, int32_t word) {
    const uint64_t key = pair_key(left, right);
    pair_count[key] += delta;
    if (delta > 0) {
      pair_words[key].push_back(word);
      grown.push_back(key);
    }
  };

  while (token_bytes_.size() < target && !heap.empty()) {
    const Candidate top = heap.top();
    heap.pop();
    auto it = pair_count.find(top.pair);
    const int64_t current = it == pair_count.end() ? 0 : it->second;
    if (current != top.count) {  // stale entry: the count fell since it was pushed
      if (current > 0) heap.push({current, top.pair});
      continue;
    }
    if (current < options_.min_frequency) break;

    const int32_t a = left_of(top.pair), b = right_of(top.pair);
    std::string merged = token_bytes_[a] + token_bytes_[b];
    int32_t id;
    if (auto existing = bytes_to_id.find(merged); existing != bytes_to_id.end()) {
      id = existing->second;  // another split of the same bytes was merged earlier
    } else {
      id = static_cast<int32_t>(token_bytes_.size());
      bytes_to_id.emplace(merged, id);
      token_bytes_.push_back(std::move(merged));
    }
    merges_.emplace_back(a, b);

    std::vector<int32_t> affected = std::move(pair_words[top.pair]);
    pair_words.erase(top.pair);
    std::sort(affected.begin(), affected.end());
    affected.erase(std::unique(affected.begin(), affected.end()), affected.end());
    grown.clear();
    for (int32_t w : affected) {
      std::vector<int32_t>& s = symbols[w];
      const int64_t c = counts[w];
      for (size_t i = 0; i + 1 < s.size(); ++i) {
        if (s[i] != a || s[i + 1] != b) continue;
        if (i > 0) {
          add(s[i - 1], a, -c, w);
          add(s[i - 1], id, c, w);
        }
        s[i] = id;
        s.erase(s.begin() + static_cast<std::ptrdiff_t>(i) + 1);
        if (i + 1 < s.size()) {
          add(b, s[i + 1], -c, w);
          add(id, s[i + 1], c, w);
        }
        add(a, b, -c, w);
      }
    }
    pair_count.erase(top.pair);
    std::sort(grown.begin(), grown.end());
    grown.erase(std::unique(grown.begin(), grown.end()), grown.end());
    for (uint64_t key : grown) {
      if (const int64_t count = pair_count[key]; count > 0) heap.push({count, key});
    }
  }

  BpeTrainingResult result;
  result.vocab_size = static_cast<int64_t>(token_bytes_.size() + options_.special_tokens.size());
  result.num_merges = static_cast<int64_t>(merges_.size());
  result.num_words = static_cast<int64_t>(words.size());
  result.seconds = timer.seconds();
  return result;
}

std::string BpeTrainer::to_json() const {
  LOOM_REQUIRE(trained_, "BpeTrainer::to_json before train()");
  using ordered = nlohmann::ordered_json;
  std::vector<std::string> spelling;
  spelling.reserve(token_bytes_.size());
  for (const std::string& bytes : token_bytes_) spelling.push_back(byte_level::to_alphabet(bytes));

  ordered vocab = ordered::object();
  for (size_t id = 0; id < spelling.size(); ++id) vocab[spelling[id]] = id;
  ordered added = ordered::array();
  for (size_t i = 0; i < options_.special_tokens.size(); ++i) {
    const size_t id = token_bytes_.size() + i;
    vocab[options_.special_tokens[i]] = id;
    added.push_back(ordered{{"id", id}, {"content", options_.special_tokens[i]}, {"single_word", false},
                            {"lstrip", false}, {"rstrip", false}, {"normalized", false}, {"special", true}});
  }
  ordered merges = ordered::array();
  for (const auto& [a, b] : merges_) merges.push_back(ordered::array({spelling[a], spelling[b]}));

  auto byte_level = [](bool add_prefix_space, bool trim_offsets) {
    return ordered{{"type", "ByteLevel"}, {"add_prefix_space", add_prefix_space},
                   {"trim_offsets", trim_offsets}, {"use_regex", true}};
  };
  ordered root;
  root["version"] = "1.0";
  root["truncation"] = nullptr;
  root["padding"] = nullptr;
  root["added_tokens"] = std::move(added);
  root["normalizer"] = nullptr;
  root["pre_tokenizer"] = byte_level(false, true);
  root["post_processor"] = byte_level(false, false);  // adds no BOS/EOS: the loader does
  root["decoder"] = byte_level(true, true);
  root["model"] = ordered{{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr},
                          {"continuing_subword_prefix", nullptr}, {"end_of_word_suffix", nullptr},
                          {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
                          {"vocab", std::move(vocab)}, {"merges", std::move(merges)}};
  return root.dump(2);
}

void BpeTrainer::save(const std::string& path) const {
  const std::string text = to_json();
  const std::filesystem::path p(path);
  std::error_code dir_ec;
  LOOM_REQUIRE(!std::filesystem::is_directory(p, dir_ec), "cannot write tokenizer '", path,
               "': it is a directory; pass a file path such as ", (p / "tokenizer.json").string());
  if (p.has_parent_path()) {
    std::error_code ec;
    std::filesystem::create_directories(p.parent_path(), ec);
  }
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  LOOM_REQUIRE(f, "cannot write tokenizer '", path, "': ", std::strerror(errno));
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  const bool closed = std::fclose(f) == 0;
  if (!ok || !closed) {
    std::remove(tmp.c_str());
    fail("cannot write tokenizer '", path, "': ", std::strerror(errno));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, p, ec);
  if (ec) {
    std::remove(tmp.c_str());  // a failed save leaves nothing behind
    fail("cannot move tokenizer into place at '", path, "': ", ec.message());
  }
}

}  // namespace loom::data
