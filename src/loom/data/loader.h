// Packing documents into fixed-length training rows and handing each data-parallel rank its rows.
//
// The packed stream is every document as BOS + tokens + EOS, concatenated in input order:
//   BOS d0 ... EOS BOS d1 ... EOS ...
// It is cut into consecutive, non-overlapping rows of seq_len + 1 tokens; a row gives
// inputs = row[:-1] and labels = row[1:]. The tail shorter than a row is dropped, every epoch
// repeats the same rows in the same order. With each input token come its position inside its
// document (BOS is 0; a document continued from the previous row keeps counting) and a row-local
// document index (0 for the document the row starts in, +1 at every BOS), which is what a
// document-masked attention needs.
//
// Data parallelism: the rows are one global sequence. With DP world size W and local batch B,
// global step g takes rows [g*B*W, (g+1)*B*W) and rank r gets the slice [g*B*W + r*B,
// g*B*W + (r+1)*B). So W ranks with batch B see exactly the rows of one process with batch W*B,
// in the same order, and the global batch is layout-independent.
//
// State: the loader's whole position is the global row cursor (rows consumed by all ranks
// together), saved by state_dict(). It does not depend on W or B, so a checkpoint taken with one
// layout resumes under another: every rank loads the same cursor and continues from row
// `cursor + rank * B'`. Resuming with the same global batch (W'*B' == W*B) continues the exact
// row sequence; with a different global batch the same rows still come in the same order, only
// grouped into steps differently. The state also records seq_len and the stream length, and
// loading it into a loader over different data or a different seq_len is an error.
//
// Memory: text and JSONL inputs are tokenized once when the corpus is loaded and kept as uint32
// ids (4 bytes per token); token files (sources.h) are memory-mapped and only indexed (8 bytes
// per document), so pre-tokenize large corpora with `loom tokenizer pretokenize`.
#pragma once
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "loom/data/sources.h"
#include "loom/data/tokenizer.h"

namespace loom::data {

// int64 tensors of shape [local_batch, seq_len].
struct Batch {
  torch::Tensor inputs;
  torch::Tensor labels;
  torch::Tensor positions;     // position of each input token inside its document
  torch::Tensor document_ids;  // row-local index of each input token's document
};

// The documents of a training run as token ids, in one or more shards (in memory or
// memory-mapped token files), addressed as the packed stream described above.
class TokenCorpus {
 public:
  // Resolves the inputs (files, directories, globs; see sources.h) and reads each in
  // options.format (or its guessed format when unset). Text and JSONL files are tokenized with
  // `tokenizer` (required for them); token files are mapped and must carry the tokenizer's vocab
  // size, BOS and EOS. Without a tokenizer, BOS/EOS come from the token files.
  // `model_vocab_size` > 0 is the model's embedding rows: a token file with a larger vocabulary,
  // or with any id at or above it, is rejected here, naming the document and id, instead of
  // failing inside the embedding lookup mid-training. Every id is checked, not just the header's
  // vocab size, because a hand-made or damaged file's header can understate its ids.
  static std::shared_ptr<const TokenCorpus> load(const std::vector<std::string>& inputs,
                                                 const Tokenizer* tokenizer,
                                                 const SourceOptions& options = {},
                                                 int64_t model_vocab_size = 0);
  // Documents given as ids (without BOS/EOS), e.g. for tests or programmatic data.
  static std::shared_ptr<const TokenCorpus> from_documents(const std::vector<std::vector<int64_t>>& documents,
                                                           int64_t bos_id, int64_t eos_id);

  int64_t num_documents() const { return static_cast<int64_t>(doc_start_.size()) - 1; }
  int64_t num_tokens() const { return stream_length() - 2 * num_documents(); }  // without BOS/EOS
  int64_t stream_length() const { return doc_start_.back(); }
  int64_t bos_id() const { return bos_id_; }
  int64_t eos_id() const { return eos_id_; }
  // How errors name this corpus: "validation.dataset_path = \"x\"" (SourceOptions::inputs_setting
  // and the inputs), "data input 'x'" without a setting, "the corpus" for from_documents().
  const std::string& description() const { return description_; }

  // Stream tokens [start, start + count): the token, its position in its document and the
  // document's global index.
  void read_stream(int64_t start, int64_t count, int64_t* tokens, int64_t* positions,
                   int64_t* documents) const;

 private:
  struct Shard {
    std::shared_ptr<const TokenFile> file;  // or, when null:
    std::vector<uint32_t> memory;           // each document's tokens followed by EOS
    int64_t first_doc = 0;
    int64_t token(int64_t i) const { return file ? (*file)[i] : static_cast<int64_t>(memory[i]); }
  };
  void add_memory_document(const std::vector<int64_t>& tokens);
  void add_token_file(std::shared_ptr<const TokenFile> file, int64_t model_vocab_size);

  std::vector<Shard> shards_;
  std::vector<int64_t> doc_start_{0};  // stream offset of each document's BOS, then the end
  int64_t bos_id_ = -1, eos_id_ = -1;
  std::string description_ = "the corpus";
};

// Cuts the packed stream into rows of seq_len + 1 tokens.
class SequencePacker {
 public:
  // loom::UsageError, naming the corpus (TokenCorpus::description) and `seq_len_setting`, when
  // the corpus is shorter than one row.
  SequencePacker(std::shared_ptr<const TokenCorpus> corpus, int64_t seq_len,
                 const std::string& seq_len_setting = "seq_len");
  int64_t seq_len() const { return seq_len_; }
  int64_t rows_per_epoch() const { return rows_per_epoch_; }
  const TokenCorpus& corpus() const { return *corpus_; }
  // Global row `row` (epochs repeat: row % rows_per_epoch), seq_len + 1 entries per array;
  // document ids are row-local.
  void read_row(int64_t row, int64_t* tokens, int64_t* positions, int64_t* document_ids) const;
  // Global rows [first_row, first_row + count) as a batch of `count` rows.
  Batch read_rows(int64_t first_row, int64_t count) const;

 private:
  std::shared_ptr<const TokenCorpus> corpus_;
  int64_t seq_len_;
  int64_t rows_per_epoch_;
};

struct DataLoaderOptions {
  int64_t seq_len = 0;
  int64_t local_batch_size = 0;
  int64_t dp_rank = 0;
  int64_t dp_world_size = 1;
  std::string seq_len_setting = "seq_len";  // how errors name seq_len (e.g. "training.seq_len")
};

class DataLoader {
 public:
  DataLoader(std::shared_ptr<const TokenCorpus> corpus, DataLoaderOptions options);

  // This rank's next local batch; advances the global cursor by one global batch. Logs one line
  // when the cursor enters a new epoch (the corpus starts repeating).
  Batch next();

  int64_t rows_consumed() const { return rows_consumed_; }  // by all ranks together
  int64_t epoch() const { return rows_consumed_ / packer_.rows_per_epoch(); }
  int64_t global_batch_size() const { return options_.local_batch_size * options_.dp_world_size; }
  const SequencePacker& packer() const { return packer_; }
  const DataLoaderOptions& options() const { return options_; }

  // {"rows_consumed", "seq_len", "stream_tokens"}: identical on every rank.
  nlohmann::json state_dict() const;
  void load_state_dict(const nlohmann::json& state);

 private:
  SequencePacker packer_;
  DataLoaderOptions options_;
  int64_t rows_consumed_ = 0;
};

}  // namespace loom::data
