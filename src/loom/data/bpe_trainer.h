// Trains a byte-level BPE tokenizer and writes it as a Hugging Face tokenizer.json that both
// loom::data::Tokenizer and the `tokenizers` library load and encode identically.
//
// Layout of the vocabulary: ids 0..255 are the single bytes (id b is byte b), then one id per
// new token in merge order, then the special tokens <|begin_of_text|>, <|end_of_text|>,
// <|pad|> as the last three ids. Pre-tokenization is GPT-2's (ByteLevel, use_regex, no prefix
// space); special tokens occurring in the training text are cut out before counting.
//
// Training counts every adjacent pair of the distinct words once, then keeps the counts up to
// date incrementally: a merge only touches the words that contain the merged pair. The most
// frequent pair is merged next; ties go to the smaller (left id, right id), so a run is
// deterministic.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace loom::data {

struct BpeTrainerOptions {
  int64_t vocab_size = 2048;  // including the 256 byte tokens and the special tokens
  int64_t min_frequency = 2;  // stop when the most frequent pair occurs fewer times
  std::vector<std::string> special_tokens = {"<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"};
};

struct BpeTrainingResult {
  int64_t vocab_size = 0;  // may be below the requested size when the text runs out of pairs
  int64_t num_merges = 0;
  int64_t num_words = 0;  // distinct pre-tokenized words counted
  double seconds = 0;
};

class BpeTrainer {
 public:
  explicit BpeTrainer(BpeTrainerOptions options);

  // Adds a document's words to the counts (may be called any number of times before train()).
  void add_text(std::string_view text);
  // Learns the merges; then to_json() / save() give the tokenizer.
  BpeTrainingResult train();
  std::string to_json() const;  // tokenizer.json contents
  void save(const std::string& path) const;

 private:
  BpeTrainerOptions options_;
  std::unordered_map<std::string, int64_t> word_counts_;  // pre-tokenized word -> occurrences
  std::vector<std::string> token_bytes_;  // id -> raw bytes, for the ids below the special tokens
  std::vector<std::pair<int32_t, int32_t>> merges_;
  bool trained_ = false;
};

}  // namespace loom::data
