// A reader for Hugging Face `tokenizer.json` files of the byte-level BPE kind (GPT-2, Llama 3,
// and what `loom tokenizer train` writes), encoding exactly like the `tokenizers` library:
//
//   added tokens  matched first on the raw text (leftmost-longest, honouring single_word / lstrip /
//                 rstrip), the text between them is pre-tokenized piece by piece;
//   pre-tokenizer ByteLevel (optionally with its GPT-2 regex and add_prefix_space), or a Sequence
//                 of Split(regex, Isolated) and ByteLevel(use_regex=false) as in Llama 3. The
//                 regex must be the GPT-2 or the Llama 3 pattern (see byte_level.h);
//   model         BPE over the bytes of each piece: the lowest-ranked merge first, leftmost on ties
//                 (ignore_merges: a piece that is itself in the vocabulary is one token);
//   decoder       ByteLevel: token bytes concatenated.
//
// Other tokenizers (WordPiece, Unigram, SentencePiece-style BPE with a Metaspace pre-tokenizer or
// byte fallback, any normalizer) are rejected with one line naming the file and what it has.
// Post-processors are not applied: BOS/EOS are added only when encode() is asked to.
//
// Encoding bytes that are not valid UTF-8 is lossless too (each invalid byte is its own character),
// so decode(encode(x)) == x for any byte string x.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "loom/data/byte_level.h"

namespace loom::data {

class Tokenizer {
 public:
  // Throws loom::Error naming the file when it is missing, not JSON, or not byte-level BPE.
  static Tokenizer from_file(const std::string& path);
  // Parses the contents of a tokenizer.json; `origin` names it in error messages.
  static Tokenizer from_json_string(const std::string& json_text, const std::string& origin);

  std::vector<int64_t> encode(std::string_view text, bool add_bos = false, bool add_eos = false) const;
  // Concatenates the tokens' bytes (added tokens as their text; with skip_special, special added
  // tokens are left out). Throws loom::Error for an id outside [0, vocab_size()).
  std::string decode(const std::vector<int64_t>& ids, bool skip_special = false) const;

  // One past the largest id (model vocabulary and added tokens): the embedding table's size.
  int64_t vocab_size() const { return vocab_size_; }
  // <|begin_of_text|> / <|end_of_text|> (Llama 3, loom), else <s> / </s>, else GPT-2's
  // <|endoftext|> for both; -1 if the vocabulary has none of them.
  int64_t bos_id() const { return bos_id_; }
  int64_t eos_id() const { return eos_id_; }
  int64_t pad_id() const { return pad_id_; }  // <|pad|> or <pad>, else -1
  // Id of a token as spelled in tokenizer.json ("Ġthe", "<|end_of_text|>"), or -1.
  int64_t token_to_id(const std::string& token) const;
  // The tokenizer.json spelling of an id; throws for an id that no token has.
  std::string id_to_token(int64_t id) const;
  const std::string& path() const { return origin_; }

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

 private:
  Tokenizer();

  struct AddedToken {
    std::string content;
    int32_t id;
    bool special, single_word, lstrip, rstrip, normalized;
  };
  // One step of the pre-tokenizer pipeline, applied to every piece in turn.
  struct PreTokenizeStep {
    bool byte_level;  // ByteLevel step (else a regex Split)
    bool add_prefix_space;
    bool use_regex;
    byte_level::SplitPattern pattern;
  };
  struct MergeResult {
    int32_t rank;
    int32_t id;
  };
  struct Segment {
    std::string_view text;
    int32_t added_id;  // -1: plain text to pre-tokenize
  };
  // Added tokens indexed by first byte, longest first, for leftmost-longest matching.
  struct AddedMatcher {
    std::array<std::vector<const AddedToken*>, 256> by_first_byte;
    bool empty = true;
    void add(const AddedToken* token);
  };
  struct WordCache;

  void split_added_tokens(std::string_view text, std::vector<Segment>& out) const;
  void split_with(const AddedMatcher& matcher, std::string_view text, std::vector<Segment>& out) const;
  void encode_plain(std::string_view text, std::vector<int64_t>& out) const;
  void encode_word(std::string_view word, std::vector<int64_t>& out) const;
  void bpe(std::string_view word, std::vector<int32_t>& ids) const;
  void bpe_long(std::vector<int32_t>& ids) const;
  const MergeResult* find_merge(int32_t left, int32_t right) const;

  std::string origin_;
  // Model vocabulary keyed by raw bytes (byte-level spelling undone); tokens whose spelling is
  // outside the byte alphabet cannot come out of BPE and are only reachable by token_to_id.
  std::unordered_map<std::string, int32_t> bytes_to_id_;
  std::unordered_map<std::string, int32_t> spelling_to_id_;  // tokenizer.json spelling -> id
  std::vector<std::string> id_to_spelling_;
  std::vector<std::string> id_to_bytes_;
  std::vector<uint8_t> id_is_special_;
  std::array<int32_t, 256> byte_id_{};  // single-byte token of each byte, or -1
  std::unordered_map<uint64_t, MergeResult> merges_;
  std::vector<AddedToken> added_;  // matched in the order: non-normalized first, then normalized
  AddedMatcher raw_added_, normalized_added_;
  std::vector<PreTokenizeStep> pre_tokenizer_;
  bool ignore_merges_ = false;
  int32_t unk_id_ = -1;
  bool fuse_unk_ = false;
  int64_t vocab_size_ = 0;
  int64_t bos_id_ = -1, eos_id_ = -1, pad_id_ = -1;
  std::unique_ptr<WordCache> cache_;
};

// Token ids as commands take them on the command line or in a file: non-negative integers
// separated by commas or whitespace ("1,2,3", "1 2 3", "1, 2"). Anything else is a one-line
// loom::UsageError naming `where` (the flag, or file:line) and the entry.
std::vector<int64_t> parse_token_ids(std::string_view text, std::string_view where);

}  // namespace loom::data
