#include "loom/data/loader.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <cmath>

#include "loom/core/error.h"
#include "loom/core/logging.h"
#include "loom/core/strings.h"
#include "loom/core/timer.h"
#include "loom/data/parallel_encoder.h"

namespace loom::data {
namespace {

namespace fs = std::filesystem;

// A 64-bit hash of bytes, 8 at a time (a cache key, not a checksum against an adversary: the
// length is mixed in too). Gigabytes of corpus hash in about a second.
class Hasher {
 public:
  explicit Hasher(uint64_t seed) : h_(seed) {}
  // Every chunk but the last must hold a multiple of 8 bytes.
  void update(std::string_view bytes) {
    size_t i = 0;
    for (; i + 8 <= bytes.size(); i += 8) {
      uint64_t word;
      std::memcpy(&word, bytes.data() + i, 8);
      mix(word);
    }
    if (i < bytes.size()) {
      uint64_t tail = 0;
      std::memcpy(&tail, bytes.data() + i, bytes.size() - i);
      mix(tail);
    }
    length_ += bytes.size();
  }
  uint64_t digest() const {
    uint64_t h = (h_ ^ (length_ * kMul)) * kMul;
    return h ^ (h >> 32);
  }

 private:
  static constexpr uint64_t kMul = 0x9E3779B97F4A7C15ull;
  void mix(uint64_t word) {
    h_ = (h_ ^ word) * kMul;
    h_ ^= h_ >> 29;
  }
  uint64_t h_;
  uint64_t length_ = 0;
};

uint64_t hash_file(const std::string& path, uint64_t seed) {
  Hasher hasher(seed);
  std::ifstream in(path, std::ios::binary);
  LOOM_REQUIRE(in.good(), "cannot read '", path, "' to hash it: ", errno_text());
  std::vector<char> buffer(size_t{1} << 20);
  while (in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    hasher.update(std::string_view(buffer.data(), static_cast<size_t>(in.gcount())));
  }
  return hasher.digest();
}

uint64_t hash_text(std::string_view text, uint64_t seed) {
  Hasher hasher(seed);
  hasher.update(text);
  return hasher.digest();
}

// The token cache entry of `path` read with `options` and tokenized by `tokenizer`: a name keyed by
// everything that decides its tokens (both files' contents, the format and how documents are cut).
std::optional<fs::path> token_cache_entry(const std::string& path, SourceFormat format, const Tokenizer& tokenizer,
                                          const SourceOptions& options) {
  std::error_code ec;
  if (!fs::is_regular_file(tokenizer.path(), ec)) return std::nullopt;  // a tokenizer not read from a file
  static std::mutex mutex;
  static std::map<std::string, uint64_t> tokenizer_hashes;  // by path: a run reads one or two
  uint64_t key = 0;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = tokenizer_hashes.find(tokenizer.path());
    if (it == tokenizer_hashes.end()) {
      it = tokenizer_hashes.emplace(tokenizer.path(), hash_file(tokenizer.path(), 1)).first;
    }
    key = it->second;
  }
  key = hash_file(path, key);
  const std::string how = c10::str(source_format_name(format), '\0', options.jsonl_field, '\0', options.text_column, '\0',
                                   options.text_separator, '\0', options.skip_empty, '\0', kTokenFileVersion);
  key = hash_text(how, key);
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(key));
  return fs::path(options.token_cache_dir) / c10::str(fs::path(path).filename().string(), ".", hex, ".tokens");
}

// An exclusive flock(2) on "<entry>.lock" for as long as it lives; none (no wait) when the folder
// cannot take the lock file. The kernel drops it when its holder exits, so a crashed process
// never blocks the next one. The holder removes the lock file when it is done, so a cache folder
// keeps no lock file per entry ever tried; a waiter that then finds its locked file unlinked (the
// path gone, or another file there) takes the lock again on what the path holds now.
class EntryLock {
 public:
  explicit EntryLock(const fs::path& entry) : path_(entry.string() + ".lock") {
    for (int attempt = 0; attempt < 100; ++attempt) {
      fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
      if (fd_ < 0) return;
      while (::flock(fd_, LOCK_EX) != 0 && errno == EINTR) {
      }
      struct stat held {}, now {};
      if (::fstat(fd_, &held) == 0 && ::stat(path_.c_str(), &now) == 0 && held.st_ino == now.st_ino &&
          held.st_dev == now.st_dev) {
        return;  // the lock on the file the path names
      }
      ::close(fd_);  // the previous holder removed it: lock the current one
      fd_ = -1;
    }
  }
  ~EntryLock() {
    if (fd_ < 0) return;
    ::unlink(path_.c_str());  // still ours: nobody else holds a lock on this inode
    ::close(fd_);             // releases the lock
  }
  EntryLock(const EntryLock&) = delete;
  EntryLock& operator=(const EntryLock&) = delete;

 private:
  std::string path_;
  int fd_ = -1;
};

// Removes "<entry>.tmp.<pid>" files left by writers that died mid-write (killed runs). Called
// under the entry's lock, which every writer of the entry holds while its temporary exists, so
// any such file another process left is stale.
void remove_stale_temporaries(const fs::path& entry) {
  std::error_code ec;
  const std::string prefix = entry.filename().string() + ".tmp.";
  for (const auto& e : fs::directory_iterator(entry.parent_path(), ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) != 0 || name == prefix + std::to_string(::getpid())) continue;
    std::error_code remove_ec;
    if (fs::remove(e.path(), remove_ec)) log::info("data: removed ", e.path().string(), ", left by a killed run");
  }
}

// "<entry>.sum": the hash of the entry's bytes, written once the entry is complete. An entry whose
// bytes no longer hash to it (a flipped bit, a truncated or overwritten file) is tokenized again.
fs::path checksum_path(const fs::path& entry) { return entry.string() + ".sum"; }

std::string entry_checksum(const fs::path& entry) {
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(hash_file(entry.string(), 7)));
  return hex;
}

// Records the checksum of the complete entry (through a temporary and a rename, so a reader sees
// the whole line or none).
void write_checksum(const fs::path& entry) {
  const fs::path sum = checksum_path(entry);
  const std::string tmp = c10::str(sum.string(), ".tmp.", ::getpid());
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << entry_checksum(entry) << "\n";
    LOOM_REQUIRE(out.good(), "cannot write '", tmp, "': ", errno_text());
  }
  fs::rename(tmp, sum);
}

// The cached tokens of the entry, when a complete, undamaged file written for this tokenizer is
// there; null otherwise (the caller tokenizes again and rewrites it). `say` logs why a file that
// is there cannot be used (once: the caller asks again under the entry's lock).
std::shared_ptr<const TokenFile> open_cached(const fs::path& entry, const Tokenizer& tokenizer, bool say) {
  std::error_code ec;
  if (!fs::is_regular_file(entry, ec)) return nullptr;
  try {
    std::string recorded;
    std::ifstream(checksum_path(entry)) >> recorded;
    if (recorded.empty()) {
      if (say) log::info("data: token cache entry ", entry.string(), " has no checksum (an unfinished write or an older Loom); tokenizing again");
      return nullptr;
    }
    if (recorded != entry_checksum(entry)) {
      if (say) log::warn("data: token cache entry ", entry.string(), " is damaged (its bytes no longer match the checksum written with it); tokenizing its source again");
      return nullptr;
    }
    auto file = std::make_shared<const TokenFile>(entry.string());
    const TokenFileHeader& h = file->header();
    if (h.vocab_size == tokenizer.vocab_size() && h.bos_id == tokenizer.bos_id() && h.eos_id == tokenizer.eos_id()) {
      return file;
    }
  } catch (const std::exception& e) {
    if (say) log::warn("data: token cache entry ", entry.string(), " is unusable (", e.what(), "); tokenizing again");
  }
  return nullptr;
}

}  // namespace

// ---- TokenCorpus ------------------------------------------------------------------------------

void TokenCorpus::add_memory_document(const std::vector<int64_t>& tokens, const std::vector<uint8_t>* trained) {
  if (tokens.empty()) return;
  const bool masked = trained != nullptr;
  TORCH_CHECK(!masked || trained->size() == tokens.size() + 1, "a masked document of ", tokens.size(),
              " tokens needs ", tokens.size() + 1, " flags (one per token and the EOS), got ", trained->size());
  // A shard is masked or not as a whole, so unmasked data carries no flags at all.
  if (shards_.empty() || shards_.back().file || shards_.back().masked != masked) {
    shards_.emplace_back();
    shards_.back().first_doc = num_documents();
    shards_.back().masked = masked;
  }
  Shard& shard = shards_.back();
  for (int64_t id : tokens) {
    TORCH_CHECK(id >= 0 && id <= UINT32_MAX, "token id ", id, " does not fit in uint32");
    shard.memory.push_back(static_cast<uint32_t>(id));
  }
  shard.memory.push_back(static_cast<uint32_t>(eos_id_));
  if (masked) {
    shard.trained.insert(shard.trained.end(), trained->begin(), trained->end());
    masked_ = true;
    trained_tokens_ += std::count(trained->begin(), trained->end(), 1);
  } else {
    trained_tokens_ += static_cast<int64_t>(tokens.size()) + 1;
  }
  doc_start_.push_back(doc_start_.back() + static_cast<int64_t>(tokens.size()) + 2);
}

void TokenCorpus::add_token_file(std::shared_ptr<const TokenFile> file, int64_t model_vocab_size) {
  if (file->size() == 0) return;
  Shard shard;
  shard.first_doc = num_documents();
  // Index the documents: each ends at an EOS; in the stream it gains a BOS in front. The same pass
  // checks every id against the model's vocabulary (ids are unsigned, so only the top can be off).
  const int64_t id_limit = model_vocab_size > 0 ? model_vocab_size : std::numeric_limits<int64_t>::max();
  int64_t doc_begin = 0;
  for (int64_t i = 0; i < file->size(); ++i) {
    const int64_t id = (*file)[i];
    if (id >= id_limit) {
      // Bad input, not a transient failure: exit 2, which `loom launch` never restarts.
      fail_usage("token file '", file->path(), "' has token id ", id, " at document ",
           num_documents() - shard.first_doc, ", offset ", i - doc_begin, " (token ", i,
           " of the file), outside the model's vocabulary of ", model_vocab_size,
           " ids; re-run 'loom tokenizer pretokenize' with the model's tokenizer (model.tokenizer_path)",
           " or raise model.vocab_size above ", id);
    }
    if (id == eos_id_) {
      doc_start_.push_back(doc_start_.back() + (i + 1 - doc_begin) + 1);
      doc_begin = i + 1;
    }
  }
  trained_tokens_ += file->size();  // every token and EOS of a token file is trained
  shard.file = std::move(file);
  shards_.push_back(std::move(shard));
}

std::shared_ptr<const TokenCorpus> TokenCorpus::from_documents(const std::vector<std::vector<int64_t>>& documents,
                                                               int64_t bos_id, int64_t eos_id) {
  LOOM_REQUIRE(bos_id >= 0 && eos_id >= 0, "packing needs BOS and EOS ids, got ", bos_id, " and ", eos_id);
  auto corpus = std::shared_ptr<TokenCorpus>(new TokenCorpus());
  corpus->bos_id_ = bos_id;
  corpus->eos_id_ = eos_id;
  for (const auto& doc : documents) corpus->add_memory_document(doc);
  return corpus;
}

std::shared_ptr<const TokenCorpus> TokenCorpus::from_examples(const std::vector<SftExample>& examples,
                                                              int64_t bos_id, int64_t eos_id) {
  LOOM_REQUIRE(bos_id >= 0 && eos_id >= 0, "packing needs BOS and EOS ids, got ", bos_id, " and ", eos_id);
  auto corpus = std::shared_ptr<TokenCorpus>(new TokenCorpus());
  corpus->bos_id_ = bos_id;
  corpus->eos_id_ = eos_id;
  for (const SftExample& e : examples) corpus->add_memory_document(e.tokens, &e.trained);
  return corpus;
}

std::shared_ptr<const TokenCorpus> TokenCorpus::load(const std::vector<std::string>& inputs,
                                                     const Tokenizer* tokenizer, const SourceOptions& options,
                                                     int64_t model_vocab_size) {
  Timer timer;
  const std::vector<std::string> files =
      resolve_inputs(inputs, options.inputs_setting, directory_extension(options.format));
  auto corpus = std::shared_ptr<TokenCorpus>(new TokenCorpus());
  std::string specs;
  for (const std::string& input : inputs) specs += (specs.empty() ? "" : ", ") + input;
  corpus->description_ = input_description(specs, options.inputs_setting);
  int64_t vocab_size = -1;
  std::string ids_from;  // what set vocab_size/BOS/EOS, for error messages
  std::optional<SftRenderer> renderer;  // made at the first sft file
  if (tokenizer) {
    LOOM_REQUIRE(tokenizer->bos_id() >= 0 && tokenizer->eos_id() >= 0, "tokenizer '", tokenizer->path(),
                 "' has no BOS/EOS tokens (<|begin_of_text|>/<|end_of_text|> or <s>/</s>); the loader marks ",
                 "document boundaries with them");
    corpus->bos_id_ = tokenizer->bos_id();
    corpus->eos_id_ = tokenizer->eos_id();
    vocab_size = tokenizer->vocab_size();
    ids_from = c10::str("tokenizer '", tokenizer->path(), "'");
  }
  for (const std::string& path : files) {
    const SourceFormat format = resolve_format(path, options);
    if (format == SourceFormat::kTokens) {
      auto file = std::make_shared<const TokenFile>(path);
      const TokenFileHeader& h = file->header();
      // The cheap check first; add_token_file still scans the ids, as the header can lie.
      LOOM_REQUIRE_USAGE(model_vocab_size <= 0 || h.vocab_size <= model_vocab_size, "token file '", path,
                   "' was written for vocab size ", h.vocab_size, ", more than the model's vocabulary of ",
                   model_vocab_size, " ids; re-run 'loom tokenizer pretokenize' with the model's tokenizer ",
                   "(model.tokenizer_path) or raise model.vocab_size to at least ", h.vocab_size);
      if (vocab_size < 0) {
        LOOM_REQUIRE(h.bos_id >= 0, "token file '", path, "' records no BOS id; pass the tokenizer too");
        corpus->bos_id_ = h.bos_id;
        corpus->eos_id_ = h.eos_id;
        vocab_size = h.vocab_size;
        ids_from = c10::str("token file '", path, "'");
      }
      LOOM_REQUIRE_USAGE(h.vocab_size == vocab_size && h.eos_id == corpus->eos_id_ &&
                       (h.bos_id == corpus->bos_id_ || h.bos_id < 0),
                   "token file '", path, "' was written for vocab size ", h.vocab_size, ", BOS ", h.bos_id,
                   ", EOS ", h.eos_id, " but ", ids_from, " has vocab size ", vocab_size, ", BOS ",
                   corpus->bos_id_, ", EOS ", corpus->eos_id_, "; re-run 'loom tokenizer pretokenize'");
      corpus->add_token_file(std::move(file), model_vocab_size);
    } else {
      LOOM_REQUIRE(tokenizer, source_format_name(format), " input '", path,
                   "' needs a tokenizer (or pre-tokenize it with 'loom tokenizer pretokenize')");
      if (format == SourceFormat::kSft) {
        // Rendered at every load: a token file has no room for the masks, and SFT sets are small.
        if (!renderer) renderer.emplace(*tokenizer, options.sft);
        for_each_sft_example(path, options, *renderer, [&](const SftExample& example) {
          corpus->add_memory_document(example.tokens, &example.trained);
        });
        continue;
      }
      const std::optional<fs::path> entry =
          options.token_cache_dir.empty() ? std::nullopt : token_cache_entry(path, format, *tokenizer, options);
      if (auto cached = entry ? open_cached(*entry, *tokenizer, false) : nullptr) {
        corpus->add_token_file(std::move(cached), model_vocab_size);
        continue;
      }
      // Tokenize into the cache, then map the file written: tokens never pile up in memory, so a
      // corpus larger than memory trains on its first run as on later ones. A document holding the
      // EOS id itself (its text spells the special token) would be cut in two when read back from
      // a token file, so such a file is not cached; nor is one the cache folder cannot take (full,
      // read-only): those are tokenized again into memory.
      if (entry) {
        try {
          std::error_code ec;
          fs::create_directories(entry->parent_path(), ec);
          // One process of a host tokenizes the entry while the others wait for it (the ranks of a
          // job load the same files at the same time), then they map what it wrote.
          const EntryLock lock(*entry);
          remove_stale_temporaries(*entry);
          remove_stale_temporaries(checksum_path(*entry));
          if (auto written = open_cached(*entry, *tokenizer, true)) {
            corpus->add_token_file(std::move(written), model_vocab_size);
            continue;
          }
          TokenFileWriter writer(entry->string(), tokenizer->vocab_size(), tokenizer->bos_id(), tokenizer->eos_id());
          ParallelEncoder encoder(*tokenizer, options.workers, [&](const std::vector<int64_t>& tokens) {
            LOOM_REQUIRE(std::find(tokens.begin(), tokens.end(), corpus->eos_id_) == tokens.end(),
                         "a document spells the EOS token, which would split it in a token file");
            writer.add_document(tokens);
          });
          for_each_text_document(path, options, [&](std::string_view text) { encoder.add(text); });
          encoder.finish();
          writer.close();
          write_checksum(*entry);
          if (auto written = open_cached(*entry, *tokenizer, true)) {
            corpus->add_token_file(std::move(written), model_vocab_size);
            continue;
          }
        } catch (const UsageError&) {
          throw;  // bad input (a missing column, a corrupt file): the same error uncached
        } catch (const std::exception& e) {
          log::debug("data: not caching the tokens of ", path, ": ", e.what());
        }
      }
      ParallelEncoder encoder(*tokenizer, options.workers,
                              [&](const std::vector<int64_t>& tokens) { corpus->add_memory_document(tokens); });
      for_each_text_document(path, options, [&](std::string_view text) { encoder.add(text); });
      encoder.finish();
    }
  }
  // Bad input, which no restart can fix: exit 2, naming the setting (training or validation data).
  LOOM_REQUIRE_USAGE(corpus->num_documents() > 0, corpus->description_, " holds no documents (",
                     files.size(), files.size() == 1 ? " file" : " files",
                     ", empty or blank); point it at data with text in it");
  log::debug("data: ", corpus->num_documents(), " documents, ", corpus->num_tokens(), " tokens from ",
            files.size(), files.size() == 1 ? " file" : " files", " (", timer.seconds(), " s)");
  return corpus;
}

// ---- Mixtures: stride scheduling -----------------------------------------------------------------
//
// Source j's k-th document (k counts on past the source's end: a source that repeats within the
// epoch restarts its own order) has the pass offset_j + k * stride_j; the mixture is every
// source's documents in order of the key (pass, j). stride_j = 2^40 / share_j, rounded, so passes
// advance at one per 2^40 per document on average over all sources; a source of weight 0 has none.
// Counting is exact integer arithmetic (128 bits: an epoch is at most 2^50 documents, so passes
// stay below 2^91), so every rank and every lookup agree on the order.
struct TokenCorpus::MixtureIndex {
  using Pass = unsigned __int128;
  struct Source {
    const TokenCorpus* corpus;
    bool weighted;
    Pass stride, offset;
    int64_t documents, length;  // of one pass through the source: documents and stream tokens
    // A masked source: trained tokens of its documents [0, i) (else empty).
    std::vector<int64_t> trained_before;
  };
  std::vector<Source> sources;
  Pass end_pass = 0;  // the key (end_pass, end_source) of the epoch's last document
  size_t end_source = 0;

  // Documents of source j whose pass is below `pass`.
  int64_t below(size_t j, Pass pass) const {
    const Source& s = sources[j];
    if (!s.weighted || pass <= s.offset) return 0;
    return static_cast<int64_t>((pass - s.offset - 1) / s.stride + 1);
  }
  // Documents of each source before the key (pass, source).
  std::vector<int64_t> before(Pass pass, size_t source) const {
    std::vector<int64_t> counts(sources.size());
    for (size_t j = 0; j < sources.size(); ++j) counts[j] = below(j, j < source ? pass + 1 : pass);
    return counts;
  }
  // Stream tokens of source j's first `count` documents (whole passes through it, then a prefix).
  int64_t tokens(size_t j, int64_t count) const {
    const Source& s = sources[j];
    return count / s.documents * s.length + s.corpus->doc_start_[count % s.documents];
  }
  int64_t trained(size_t j, int64_t count) const {
    const Source& s = sources[j];
    if (s.trained_before.empty()) return tokens(j, count) - count;  // every token and the EOS
    return count / s.documents * s.trained_before.back() + s.trained_before[count % s.documents];
  }
  static int64_t sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }
  int64_t sum_tokens(const std::vector<int64_t>& counts) const {
    int64_t t = 0;
    for (size_t j = 0; j < counts.size(); ++j) t += tokens(j, counts[j]);
    return t;
  }

  // A document of the mixture: its key, its index in the mixture, where its BOS sits in the
  // stream and which of its source's documents it is.
  struct Document {
    Pass pass;
    size_t source;
    int64_t index, start, source_document;
  };
  // The document holding the `target`-th unit, where `measure` counts the units (documents or
  // stream tokens) of the documents before a key: the smallest pass whose documents, with all
  // before them, exceed `target`, then the sources at that pass in order.
  template <typename Measure>
  Document find(int64_t target, Measure&& measure) const {
    Pass lo = 0, hi = end_pass;  // the answer's pass lies in [lo, hi]
    while (lo < hi) {
      const Pass mid = lo + (hi - lo) / 2;
      if (measure(before(mid + 1, 0)) > target) hi = mid; else lo = mid + 1;
    }
    std::vector<int64_t> counts = before(lo, 0);
    for (size_t j = 0; j < sources.size(); ++j) {
      if (below(j, lo + 1) == counts[j]) continue;  // no document of j at this pass
      ++counts[j];
      if (measure(counts) > target) {
        --counts[j];
        return {lo, j, sum(counts), sum_tokens(counts), counts[j] % sources[j].documents};
      }
    }
    TORCH_CHECK(false, "mixture index: unit ", target, " lies past the epoch");
  }
  Document document(int64_t index) const {
    return find(index, [](const std::vector<int64_t>& c) { return sum(c); });
  }
  Document document_at(int64_t position) const {
    return find(position, [this](const std::vector<int64_t>& c) { return sum_tokens(c); });
  }
  // The document after `d` in the mixture.
  Document next(const Document& d) const {
    Document best{0, sources.size(), d.index + 1, d.start + sources[d.source].corpus->doc_start_[d.source_document + 1] -
                                                     sources[d.source].corpus->doc_start_[d.source_document], 0};
    int64_t best_k = 0;
    for (size_t j = 0; j < sources.size(); ++j) {
      if (!sources[j].weighted) continue;
      // Later sources may share d's pass; earlier ones (and d's own) need a later one.
      const int64_t k = below(j, j > d.source ? d.pass : d.pass + 1);
      const Pass pass = sources[j].offset + static_cast<Pass>(k) * sources[j].stride;
      if (best.source == sources.size() || pass < best.pass) {
        best.pass = pass;
        best.source = j;
        best_k = k;
      }
    }
    best.source_document = best_k % sources[best.source].documents;
    return best;
  }
};

std::shared_ptr<const TokenCorpus> TokenCorpus::mix(std::vector<MixtureSource> sources, uint64_t seed) {
  using Pass = MixtureIndex::Pass;
  LOOM_REQUIRE_USAGE(!sources.empty(), "a data mixture needs at least one source");
  double total = 0.0;
  for (const MixtureSource& s : sources) {
    LOOM_REQUIRE_USAGE(std::isfinite(s.weight) && s.weight >= 0.0, s.name, ": weight ", s.weight,
                       " is not a finite number >= 0; give each source a weight >= 0 (its share is weight / sum)");
    total += s.weight;
  }
  LOOM_REQUIRE_USAGE(total > 0.0, "every data source's weight is 0 (", sources.front().name,
                     ", ...); give at least one source a weight above 0");
  auto corpus = std::shared_ptr<TokenCorpus>(new TokenCorpus());
  corpus->bos_id_ = sources.front().corpus->bos_id();
  corpus->eos_id_ = sources.front().corpus->eos_id();
  std::string names;
  for (const MixtureSource& s : sources) {
    LOOM_REQUIRE_USAGE(s.corpus->bos_id() == corpus->bos_id_ && s.corpus->eos_id() == corpus->eos_id_, s.name,
                       " has BOS/EOS ", s.corpus->bos_id(), "/", s.corpus->eos_id(), " but ", sources.front().name,
                       " has ", corpus->bos_id_, "/", corpus->eos_id_, "; every source needs the same tokenizer");
    LOOM_REQUIRE_USAGE(s.corpus->mixture().empty(), s.name, " is itself a data mixture; list its sources instead");
    names += (names.empty() ? "" : " + ") + s.name;
  }
  corpus->description_ = c10::str("the data mixture (", names, ")");
  // The epoch's length: until every weighted source is through once, about max(documents / share).
  double estimate = 0.0;
  for (const MixtureSource& s : sources) {
    if (s.weight > 0) estimate = std::max(estimate, static_cast<double>(s.corpus->num_documents()) * total / s.weight);
  }
  LOOM_REQUIRE_USAGE(estimate < 0x1p50, "the data mixture's epoch would hold ", estimate,
                     " documents (a source with a tiny weight and many documents must be read through once); ",
                     "raise that source's weight or give it fewer documents");
  auto index = std::make_shared<MixtureIndex>();
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  for (const MixtureSource& s : sources) {
    MixtureIndex::Source src{s.corpus.get(), s.weight > 0, 0, 0, s.corpus->num_documents(), s.corpus->stream_length(), {}};
    if (src.weighted) {
      // share >= documents / 2^50 > 2^-50 by the check above: a stride below 2^91.
      const long double exact = std::ldexp(static_cast<long double>(total) / s.weight, 40);
      src.stride = static_cast<Pass>(exact + 0.5L);
      src.offset = static_cast<Pass>(uniform(rng) * static_cast<long double>(src.stride));
    }
    if (s.corpus->masked()) {
      corpus->masked_ = true;
      const int64_t n = s.corpus->num_documents();
      src.trained_before.assign(static_cast<size_t>(n) + 1, 0);
      for (int64_t d = 0; d < n; ++d) {
        const int64_t from = s.corpus->doc_start_[d], length = s.corpus->doc_start_[d + 1] - from;
        std::vector<int64_t> t(length), p(length), doc(length);
        std::vector<uint8_t> flags(length);
        s.corpus->read_stream(from, length, t.data(), p.data(), doc.data(), flags.data());
        src.trained_before[d + 1] = src.trained_before[d] + std::count(flags.begin(), flags.end(), 1);
      }
    }
    index->sources.push_back(std::move(src));
  }
  // The epoch ends with the latest key among the weighted sources' last first-time documents.
  bool any = false;
  for (size_t j = 0; j < index->sources.size(); ++j) {
    const MixtureIndex::Source& s = index->sources[j];
    if (!s.weighted) continue;
    const Pass last = s.offset + static_cast<Pass>(s.documents - 1) * s.stride;
    if (!any || last >= index->end_pass) {
      index->end_pass = last;
      index->end_source = j;
      any = true;
    }
  }
  const std::vector<int64_t> epoch = index->before(index->end_pass, index->end_source + 1);
  long double stream = 0;
  for (size_t j = 0; j < epoch.size(); ++j) {
    stream += static_cast<long double>(epoch[j]) / index->sources[j].documents * index->sources[j].length;
  }
  LOOM_REQUIRE_USAGE(stream < 0x1p62L, "the data mixture's epoch would hold ", static_cast<double>(stream),
                     " tokens; raise the weight of the sources with many documents or give them fewer");
  corpus->mixed_documents_ = MixtureIndex::sum(epoch);
  corpus->mixed_stream_length_ = index->sum_tokens(epoch);
  for (size_t j = 0; j < epoch.size(); ++j) corpus->trained_tokens_ += index->trained(j, epoch[j]);
  corpus->mixture_index_ = std::move(index);
  corpus->mixture_ = std::move(sources);
  return corpus;
}

std::vector<int64_t> TokenCorpus::mixture_counts(int64_t documents) const {
  if (documents >= num_documents()) {
    return mixture_index_->before(mixture_index_->end_pass, mixture_index_->end_source + 1);
  }
  if (documents <= 0) return std::vector<int64_t>(mixture_.size(), 0);
  const MixtureIndex::Document d = mixture_index_->document(documents);
  return mixture_index_->before(d.pass, d.source);
}

int64_t TokenCorpus::document_at(int64_t position) const {
  TORCH_CHECK(position >= 0 && position < stream_length(), "stream position ", position, " outside [0, ",
              stream_length(), ")");
  if (mixture_index_) return mixture_index_->document_at(position).index;
  return std::upper_bound(doc_start_.begin(), doc_start_.end(), position) - doc_start_.begin() - 1;
}

void TokenCorpus::read_stream(int64_t start, int64_t count, int64_t* tokens, int64_t* positions,
                              int64_t* documents, uint8_t* trained) const {
  TORCH_CHECK(start >= 0 && count >= 0 && start + count <= stream_length(), "stream read [", start, ", ",
              start + count, ") outside [0, ", stream_length(), ")");
  if (mixture_index_) {
    // Each document is read from its source, then renumbered as this stream's document.
    if (count == 0) return;
    MixtureIndex::Document doc = mixture_index_->document_at(start);
    int64_t p = start, out = 0;
    const int64_t end = start + count;
    while (true) {
      const TokenCorpus& source = *mixture_index_->sources[doc.source].corpus;
      const int64_t length = source.doc_start_[doc.source_document + 1] - source.doc_start_[doc.source_document];
      const int64_t stop = std::min(end, doc.start + length);
      const int64_t from = source.doc_start_[doc.source_document] + (p - doc.start);
      source.read_stream(from, stop - p, tokens + out, positions + out, documents + out,
                         trained ? trained + out : nullptr);
      std::fill(documents + out, documents + out + (stop - p), doc.index);
      out += stop - p;
      p = stop;
      if (p == end) return;
      doc = mixture_index_->next(doc);
    }
  }
  int64_t doc = std::upper_bound(doc_start_.begin(), doc_start_.end(), start) - doc_start_.begin() - 1;
  auto shard_of = [&](int64_t d) {
    auto it = std::upper_bound(shards_.begin(), shards_.end(), d,
                               [](int64_t v, const Shard& s) { return v < s.first_doc; });
    return &*(it - 1);
  };
  int64_t p = start;
  const int64_t end = start + count;
  int64_t out = 0;
  while (p < end) {
    const Shard* shard = shard_of(doc);
    // The document's tokens sit in its shard right after those of the shard's earlier
    // documents, each of which occupies its stream length minus the BOS.
    const int64_t shard_offset = (doc_start_[doc] - doc_start_[shard->first_doc]) - (doc - shard->first_doc);
    const int64_t stop = std::min(end, doc_start_[doc + 1]);
    for (int64_t o = p - doc_start_[doc]; p < stop; ++p, ++o, ++out) {
      tokens[out] = o == 0 ? bos_id_ : shard->token(shard_offset + o - 1);
      positions[out] = o;
      documents[out] = doc;
      // A masked document's BOS is never a target: it would train the end of one example to
      // predict the start of an unrelated one.
      if (trained) trained[out] = !shard->masked ? 1 : o == 0 ? 0 : shard->trained[shard_offset + o - 1];
    }
    ++doc;
  }
}

// ---- SequencePacker ---------------------------------------------------------------------------

SequencePacker::SequencePacker(std::shared_ptr<const TokenCorpus> corpus, int64_t seq_len,
                               const std::string& seq_len_setting)
    : corpus_(std::move(corpus)), seq_len_(seq_len) {
  LOOM_REQUIRE_USAGE(seq_len_ >= 1, seq_len_setting, " must be at least 1, got ", seq_len_);
  rows_per_epoch_ = corpus_->stream_length() / (seq_len_ + 1);
  LOOM_REQUIRE_USAGE(rows_per_epoch_ > 0, corpus_->description(), " packs into ", corpus_->stream_length(),
                     " tokens, fewer than one row of ", seq_len_setting, " + 1 = ", seq_len_ + 1,
                     "; use more data or a shorter ", seq_len_setting);
  // Every rank packs the same rows, so one of them says it.
  if (!corpus_->masked() || log::rank() != 0) return;
  // A row whose every label is masked adds nothing to the loss; a micro-batch of only such rows
  // counts with zero weight (loss 0, no gradient: nn::fused_linear_cross_entropy). Say how many.
  const int64_t row_len = seq_len_ + 1;
  std::vector<int64_t> tokens(row_len), positions(row_len), documents(row_len);
  std::vector<uint8_t> trained(row_len);
  int64_t empty_rows = 0;
  for (int64_t row = 0; row < rows_per_epoch_; ++row) {
    read_row(row, tokens.data(), positions.data(), documents.data(), trained.data());
    if (std::find(trained.begin() + 1, trained.end(), 1) == trained.end()) ++empty_rows;
  }
  if (empty_rows > 0) {
    log::warn("data: ", empty_rows, " of the ", rows_per_epoch_, " rows of ", corpus_->description(),
              " have no trained label (prompts longer than a row); they train nothing, and a micro-batch made "
              "only of them counts with zero weight (loss 0): use a longer ", seq_len_setting, " or shorter prompts");
  }
}

void SequencePacker::read_row(int64_t row, int64_t* tokens, int64_t* positions, int64_t* document_ids,
                              uint8_t* trained) const {
  const int64_t row_len = seq_len_ + 1;
  corpus_->read_stream((row % rows_per_epoch_) * row_len, row_len, tokens, positions, document_ids, trained);
  const int64_t first = document_ids[0];
  for (int64_t i = 0; i < row_len; ++i) document_ids[i] -= first;
}

Batch SequencePacker::read_rows(int64_t first_row, int64_t count) const {
  const int64_t B = count, L = seq_len_;
  const auto opts = torch::TensorOptions().dtype(torch::kInt64);
  Batch batch{torch::empty({B, L}, opts), torch::empty({B, L}, opts), torch::empty({B, L}, opts),
              torch::empty({B, L}, opts)};
  std::vector<int64_t> tokens(L + 1), positions(L + 1), documents(L + 1);
  const bool masked = corpus_->masked();
  std::vector<uint8_t> trained(masked ? L + 1 : 0);
  for (int64_t b = 0; b < B; ++b) {
    read_row(first_row + b, tokens.data(), positions.data(), documents.data(), masked ? trained.data() : nullptr);
    const size_t bytes = static_cast<size_t>(L) * sizeof(int64_t);
    std::memcpy(batch.inputs.data_ptr<int64_t>() + b * L, tokens.data(), bytes);
    if (masked) {
      int64_t* labels = batch.labels.data_ptr<int64_t>() + b * L;
      for (int64_t i = 0; i < L; ++i) labels[i] = trained[i + 1] ? tokens[i + 1] : kIgnoreIndex;
    } else {
      std::memcpy(batch.labels.data_ptr<int64_t>() + b * L, tokens.data() + 1, bytes);
    }
    std::memcpy(batch.positions.data_ptr<int64_t>() + b * L, positions.data(), bytes);
    std::memcpy(batch.document_ids.data_ptr<int64_t>() + b * L, documents.data(), bytes);
  }
  return batch;
}

// ---- DataLoader -------------------------------------------------------------------------------

DataLoader::DataLoader(std::shared_ptr<const TokenCorpus> corpus, DataLoaderOptions options)
    : packer_(std::move(corpus), options.seq_len, options.seq_len_setting), options_(options) {
  LOOM_REQUIRE_USAGE(options_.local_batch_size >= 1, "local batch size must be at least 1, got ",
                     options_.local_batch_size);
  LOOM_REQUIRE_USAGE(options_.dp_world_size >= 1 && options_.dp_rank >= 0 &&
                         options_.dp_rank < options_.dp_world_size,
                     "data-parallel rank ", options_.dp_rank, " is not in [0, ", options_.dp_world_size, ")");
}

Batch DataLoader::next() {
  Batch batch = packer_.read_rows(rows_consumed_ + options_.dp_rank * options_.local_batch_size,
                                  options_.local_batch_size);
  // A small corpus repeats silently otherwise: say once when the global cursor enters a new epoch
  // (compared with the epoch of the last row already consumed, so a resumed run does not repeat it).
  const int64_t rows = packer_.rows_per_epoch();
  const int64_t last_epoch = rows_consumed_ == 0 ? 0 : (rows_consumed_ - 1) / rows;
  rows_consumed_ += global_batch_size();
  const int64_t epoch = (rows_consumed_ - 1) / rows;
  if (epoch > last_epoch) {
    log::info("data: starting epoch ", epoch + 1, " at row ", epoch * rows, ": the ", rows,
              " rows of the corpus repeat in the same order");
  }
  return batch;
}

nlohmann::json DataLoader::state_dict() const {
  nlohmann::json state = {{"rows_consumed", rows_consumed_},
                          {"seq_len", packer_.seq_len()},
                          {"stream_tokens", packer_.corpus().stream_length()}};
  const TokenCorpus& corpus = packer_.corpus();
  if (!corpus.mixture().empty()) {
    // Each source's position: the documents it has given, over whole epochs and into this one
    // (the document the cursor is inside counts as given). The row cursor alone decides where a
    // resumed run continues; these are checked against the resumed run's mixture and logged.
    const int64_t consumed = rows_consumed_ * (packer_.seq_len() + 1);
    const int64_t epochs = consumed / corpus.stream_length();
    const int64_t rest = consumed % corpus.stream_length();
    const std::vector<int64_t> per_epoch = corpus.mixture_counts(corpus.num_documents());
    const std::vector<int64_t> partial = corpus.mixture_counts(rest == 0 ? 0 : corpus.document_at(rest) + 1);
    nlohmann::json sources = nlohmann::json::array();
    for (size_t i = 0; i < corpus.mixture().size(); ++i) {
      const MixtureSource& s = corpus.mixture()[i];
      sources.push_back({{"name", s.name},
                         {"weight", s.weight},
                         {"documents", s.corpus->num_documents()},
                         {"documents_given", epochs * per_epoch[i] + partial[i]}});
    }
    state["sources"] = std::move(sources);
  }
  return state;
}

void DataLoader::load_state_dict(const nlohmann::json& state) {
  LOOM_REQUIRE(state.is_object() && state.contains("rows_consumed") && state.contains("seq_len") &&
                   state.contains("stream_tokens"),
               "data loader state ", state.dump(), " lacks rows_consumed / seq_len / stream_tokens");
  const auto seq_len = state.at("seq_len").get<int64_t>();
  const auto stream_tokens = state.at("stream_tokens").get<int64_t>();
  const auto rows = state.at("rows_consumed").get<int64_t>();
  // A run with another seq_len or corpus cannot continue this checkpoint's data order: exit 2 (a
  // restart would meet the same mismatch).
  LOOM_REQUIRE_COMPATIBLE(seq_len == packer_.seq_len(), "data loader state was saved with seq_len ", seq_len,
               " but this run uses ", packer_.seq_len(), "; rows would not line up");
  LOOM_REQUIRE(rows >= 0, "data loader state has negative rows_consumed ", rows);
  // A mixture is compared source by source first, so a mismatch is named in the sources' terms
  // rather than as a different count of packed tokens. What decides the interleave is each source's
  // share (weight / sum of weights, TokenCorpus::mix), so weights in proportion (7 and 3 after 0.7
  // and 0.3) resume: the same shares give the same stream.
  const auto& mixture = packer_.corpus().mixture();
  if (state.contains("sources")) {
    const auto& saved = state.at("sources");
    auto describe = [](const std::vector<std::string>& names, const std::vector<double>& weights,
                       const std::vector<int64_t>& documents) {
      double total = 0;
      for (double w : weights) total += w;
      std::string out;
      for (size_t i = 0; i < names.size(); ++i) {
        out += c10::str(i ? ", " : "", names[i], " (weight ", weights[i], ", share ",
                        total > 0 ? weights[i] / total : 0.0, ", ", documents[i], " documents)");
      }
      return out;
    };
    std::vector<std::string> saved_names, names;
    std::vector<double> saved_weights, weights;
    std::vector<int64_t> saved_documents, documents;
    if (saved.is_array()) {
      for (const auto& e : saved) {
        saved_names.push_back(e.value("name", std::string("?")));
        saved_weights.push_back(e.value("weight", -1.0));
        saved_documents.push_back(e.value("documents", int64_t{-1}));
      }
    }
    for (const MixtureSource& m : mixture) {
      names.push_back(m.name);
      weights.push_back(m.weight);
      documents.push_back(m.corpus->num_documents());
    }
    auto shares = [](const std::vector<double>& w) {
      double total = 0;
      for (double x : w) total += x;
      std::vector<double> out;
      for (double x : w) out.push_back(total > 0 ? x / total : -1.0);
      return out;
    };
    const bool same = saved.is_array() && saved_documents == documents && shares(saved_weights) == shares(weights);
    LOOM_REQUIRE_COMPATIBLE(same, "the checkpoint's data position is in the mixture ",
                            describe(saved_names, saved_weights, saved_documents), " but this run mixes ",
                            describe(names, weights, documents),
                            "; resume with the same sources in the same proportions ([[training.datasets]])");
  }
  LOOM_REQUIRE_COMPATIBLE(stream_tokens == packer_.corpus().stream_length(), "data loader state was saved for a corpus of ",
               stream_tokens, " packed tokens but this corpus has ", packer_.corpus().stream_length(),
               "; resume with the same data inputs and tokenizer");
  rows_consumed_ = rows;
}

}  // namespace loom::data
