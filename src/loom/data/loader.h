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
// Masks (SFT data, sft.h): a document may carry a "trained" flag per token (and its EOS). A label
// whose token is not trained is kIgnoreIndex, which the loss skips; so is the label that predicts
// the BOS of a masked document, so one SFT example never trains on the next. Documents without a
// mask (every pretraining format) have every label, the next document's BOS included, exactly as
// before masks existed.
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
// Mixtures (TokenCorpus::mix, `[[training.datasets]]`): several sources, each a corpus of its own,
// interleaved document by document by weight. The interleave is deterministic stride scheduling:
// source j's k-th document gets the pass offset_j + k * stride_j, with stride_j inversely
// proportional to its share (weight / total) and offset_j in [0, stride_j) drawn from the seed; the
// mixture takes every source's documents in order of (pass, source). Every prefix of the mixture
// then holds each source within about one document of its share, the order depends only on the
// shares and the seed, and the mixture is again one packed stream, so the row cursor, resharding
// and resumption work as for one source. A mixture's epoch lasts until every source with a weight
// above 0 has given all its documents at least once (a source with more weight than documents
// repeats within the epoch, in its own order, which is what up-weighting a small source means).
// Nothing per mixed document is stored: how many documents (and stream tokens) each source has
// given before any pass is a division per source, so finding the document at a stream position
// is a binary search over passes, and a mixture's index takes a few words per source however long
// its epoch (a small weight on a large source makes an epoch of billions of documents).
//
// Memory: token files (sources.h) are memory-mapped and only indexed (8 bytes per document). Text,
// JSONL, Parquet and Arrow inputs are tokenized when the corpus is loaded; with a token cache
// (SourceOptions::token_cache_dir, training.token_cache) the tokens go straight into the cache's
// token file, which is then mapped like any other, so even the first load holds no more than the
// tokenizer's batches in flight; without one (or where the cache cannot take a file) they are kept
// as uint32 ids, 4 bytes per token. SFT documents are rendered and tokenized at every load (the
// token cache does not keep masks) and take one more byte per token for the flag.
#pragma once
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "loom/data/sft.h"
#include "loom/data/sources.h"
#include "loom/data/tokenizer.h"

namespace loom::data {

// The label of a token the loss skips (nn::fused_linear_cross_entropy's and PyTorch's default).
inline constexpr int64_t kIgnoreIndex = -100;

// int64 tensors of shape [local_batch, seq_len].
struct Batch {
  torch::Tensor inputs;
  torch::Tensor labels;        // the next token, or kIgnoreIndex where it is not trained
  torch::Tensor positions;     // position of each input token inside its document
  torch::Tensor document_ids;  // row-local index of each input token's document
};

class TokenCorpus;

// One source of a mixture: its documents, its weight (>= 0) and how messages name it.
struct MixtureSource {
  std::shared_ptr<const TokenCorpus> corpus;
  double weight = 1.0;
  std::string name;
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
  // SFT examples (sft.h: ids without BOS/EOS, a flag per token and one for the EOS), e.g. for tests.
  static std::shared_ptr<const TokenCorpus> from_examples(const std::vector<SftExample>& examples, int64_t bos_id,
                                                          int64_t eos_id);

  // The sources interleaved by weight (see the top of this file), starting credits drawn from
  // `seed`. loom::UsageError for no sources, a negative or non-finite weight, weights that are all
  // zero, sources with different BOS/EOS ids, a source that is itself a mixture, or an epoch over
  // 2^50 documents.
  static std::shared_ptr<const TokenCorpus> mix(std::vector<MixtureSource> sources, uint64_t seed);
  // A mixture's sources (empty for a plain corpus), and how many documents each gave to the
  // stream's documents [0, documents) (documents up to one epoch).
  const std::vector<MixtureSource>& mixture() const { return mixture_; }
  std::vector<int64_t> mixture_counts(int64_t documents) const;
  // The document holding stream position `position` (0 <= position < stream_length()).
  int64_t document_at(int64_t position) const;

  int64_t num_documents() const {
    return mixture_index_ ? mixed_documents_ : static_cast<int64_t>(doc_start_.size()) - 1;
  }
  int64_t num_tokens() const { return stream_length() - 2 * num_documents(); }  // without BOS/EOS
  int64_t stream_length() const { return mixture_index_ ? mixed_stream_length_ : doc_start_.back(); }
  int64_t bos_id() const { return bos_id_; }
  int64_t eos_id() const { return eos_id_; }
  // How errors name this corpus: "validation.dataset_path = \"x\"" (SourceOptions::inputs_setting
  // and the inputs), "data input 'x'" without a setting, "the corpus" for from_documents().
  const std::string& description() const { return description_; }

  // Whether some document carries a mask (SFT data): some labels are then kIgnoreIndex.
  bool masked() const { return masked_; }
  // Tokens (EOS included, BOS not) whose loss counts: num_tokens() + num_documents() unmasked.
  int64_t num_trained_tokens() const { return trained_tokens_; }

  // Stream tokens [start, start + count): the token, its position in its document and the
  // document's global index; with `trained`, whether each token's loss counts (1 for every token
  // of an unmasked document; a masked document's BOS is 0).
  void read_stream(int64_t start, int64_t count, int64_t* tokens, int64_t* positions, int64_t* documents,
                   uint8_t* trained = nullptr) const;

 private:
  struct Shard {
    std::shared_ptr<const TokenFile> file;  // or, when null:
    std::vector<uint32_t> memory;           // each document's tokens followed by EOS
    std::vector<uint8_t> trained;           // a masked shard's flag of each entry of `memory`
    bool masked = false;
    int64_t first_doc = 0;
    int64_t token(int64_t i) const { return file ? (*file)[i] : static_cast<int64_t>(memory[i]); }
  };
  // `trained`: null, or one flag per token and one for the EOS (SftExample::trained).
  void add_memory_document(const std::vector<int64_t>& tokens, const std::vector<uint8_t>* trained = nullptr);
  void add_token_file(std::shared_ptr<const TokenFile> file, int64_t model_vocab_size);

  std::vector<Shard> shards_;
  // A mixture: its sources and the stride schedule that interleaves them (no shards of its own).
  struct MixtureIndex;
  std::vector<MixtureSource> mixture_;
  std::shared_ptr<const MixtureIndex> mixture_index_;
  int64_t mixed_documents_ = 0, mixed_stream_length_ = 0;
  std::vector<int64_t> doc_start_{0};  // stream offset of each document's BOS, then the end
  int64_t bos_id_ = -1, eos_id_ = -1;
  bool masked_ = false;
  int64_t trained_tokens_ = 0;
  std::string description_ = "the corpus";
};

// Cuts the packed stream into rows of seq_len + 1 tokens.
class SequencePacker {
 public:
  // loom::UsageError, naming the corpus (TokenCorpus::description) and `seq_len_setting`, when
  // the corpus is shorter than one row. A masked corpus is scanned once for rows with no trained
  // label (prompts longer than a row): a batch of only such rows has no loss to average (NaN), so
  // they are counted in a warning that names `seq_len_setting`.
  SequencePacker(std::shared_ptr<const TokenCorpus> corpus, int64_t seq_len,
                 const std::string& seq_len_setting = "seq_len");
  int64_t seq_len() const { return seq_len_; }
  int64_t rows_per_epoch() const { return rows_per_epoch_; }
  const TokenCorpus& corpus() const { return *corpus_; }
  // Global row `row` (epochs repeat: row % rows_per_epoch), seq_len + 1 entries per array;
  // document ids are row-local; `trained` as TokenCorpus::read_stream's.
  void read_row(int64_t row, int64_t* tokens, int64_t* positions, int64_t* document_ids,
                uint8_t* trained = nullptr) const;
  // Global rows [first_row, first_row + count) as a batch of `count` rows; labels are
  // kIgnoreIndex where the corpus masks the target token.
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
