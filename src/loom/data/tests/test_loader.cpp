// Document sources, token files, packing and the data-parallel loader.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "loom/testing/errors.h"
#include "loom/testing/files.h"
#include "loom/testing/run.h"
#include "loom/core/error.h"
#include "loom/data/bpe_trainer.h"
#include "loom/data/loader.h"
#include "loom/data/sources.h"
#include "loom/data/tokenizer.h"

namespace fs = std::filesystem;
using namespace loom::data;

namespace {
using loom::testing::temp_dir;
using loom::testing::write;
using loom::testing::file_bytes;

using loom::testing::expect_error;

constexpr int64_t kBos = 1000, kEos = 1001;

// Documents of random lengths 1..max_len with ids in [0, 1000).
std::vector<std::vector<int64_t>> random_documents(int count, int max_len, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<int64_t>> docs(count);
  for (auto& d : docs) {
    d.resize(1 + rng() % max_len);
    for (auto& t : d) t = rng() % 1000;
  }
  return docs;
}

std::vector<int64_t> packed_stream(const std::vector<std::vector<int64_t>>& docs) {
  std::vector<int64_t> s;
  for (const auto& d : docs) {
    s.push_back(kBos);
    s.insert(s.end(), d.begin(), d.end());
    s.push_back(kEos);
  }
  return s;
}

// Runs `steps` steps of `world` ranks, each with local batch `batch`, and returns the global
// batch of each step: the ranks' rows concatenated in rank order, [world*batch, seq_len].
std::vector<torch::Tensor> global_batches(const std::shared_ptr<const TokenCorpus>& corpus, int64_t seq_len,
                                          int64_t world, int64_t batch, int steps,
                                          const nlohmann::json* resume = nullptr) {
  std::vector<DataLoader> ranks;
  for (int64_t r = 0; r < world; ++r) {
    ranks.emplace_back(corpus, DataLoaderOptions{seq_len, batch, r, world});
    if (resume) ranks.back().load_state_dict(*resume);
  }
  std::vector<torch::Tensor> out;
  for (int s = 0; s < steps; ++s) {
    std::vector<torch::Tensor> parts;
    for (auto& loader : ranks) {
      const Batch b = loader.next();
      parts.push_back(torch::stack({b.inputs, b.labels, b.positions, b.document_ids}));
    }
    out.push_back(torch::cat(parts, 1));
  }
  return out;
}

}  // namespace

TEST(Packing, RowsFollowTheDocumentStream) {
  const auto docs = random_documents(30, 40, 1);
  const auto stream = packed_stream(docs);
  const auto corpus = TokenCorpus::from_documents(docs, kBos, kEos);
  EXPECT_EQ(corpus->num_documents(), 30);
  EXPECT_EQ(corpus->stream_length(), static_cast<int64_t>(stream.size()));
  const int64_t seq_len = 16;
  DataLoader loader(corpus, {seq_len, 3, 0, 1});
  const int64_t rows = static_cast<int64_t>(stream.size()) / (seq_len + 1);
  EXPECT_EQ(loader.packer().rows_per_epoch(), rows);
  // Position of every stream token in its document, to check the positions.
  std::vector<int64_t> position;
  for (const auto& d : docs) {
    for (size_t i = 0; i < d.size() + 2; ++i) position.push_back(static_cast<int64_t>(i));
  }
  int64_t row = 0;
  while (row + 3 <= rows) {
    const Batch b = loader.next();
    ASSERT_EQ(b.inputs.sizes(), (std::vector<int64_t>{3, seq_len}));
    ASSERT_EQ(b.inputs.scalar_type(), torch::kInt64);
    for (int64_t i = 0; i < 3; ++i, ++row) {
      const int64_t base = row * (seq_len + 1);
      int64_t doc = 0;
      for (int64_t t = 0; t < seq_len; ++t) {
        EXPECT_EQ(b.inputs[i][t].item<int64_t>(), stream[base + t]);
        EXPECT_EQ(b.labels[i][t].item<int64_t>(), stream[base + t + 1]);
        EXPECT_EQ(b.positions[i][t].item<int64_t>(), position[base + t]);
        if (t > 0 && stream[base + t] == kBos) ++doc;
        EXPECT_EQ(b.document_ids[i][t].item<int64_t>(), doc);
      }
    }
  }
}

TEST(Loader, DataParallelSlicesEqualOneProcess) {
  const auto corpus = TokenCorpus::from_documents(random_documents(200, 60, 2), kBos, kEos);
  // 2 ranks x batch 3 == 1 rank x batch 6, row for row, over more than one epoch.
  const int steps = static_cast<int>(corpus->stream_length() / (33 * 6)) + 5;
  const auto one = global_batches(corpus, 32, 1, 6, steps);
  const auto two = global_batches(corpus, 32, 2, 3, steps);
  const auto three = global_batches(corpus, 32, 3, 2, steps);
  for (int s = 0; s < steps; ++s) {
    ASSERT_TRUE(torch::equal(one[s], two[s])) << "step " << s;
    ASSERT_TRUE(torch::equal(one[s], three[s])) << "step " << s;
  }
}

TEST(Loader, EpochsRepeatTheRows) {
  const auto corpus = TokenCorpus::from_documents(random_documents(10, 20, 3), kBos, kEos);
  DataLoader loader(corpus, {8, 1, 0, 1});
  const int64_t rows = loader.packer().rows_per_epoch();
  std::vector<torch::Tensor> first;
  for (int64_t r = 0; r < rows; ++r) first.push_back(loader.next().inputs);
  EXPECT_EQ(loader.epoch(), 1);
  for (int64_t r = 0; r < rows; ++r) ASSERT_TRUE(torch::equal(loader.next().inputs, first[r])) << r;
  EXPECT_EQ(loader.epoch(), 2);
  EXPECT_EQ(loader.rows_consumed(), 2 * rows);
}

TEST(Loader, ResumesExactlyAndAcrossLayouts) {
  const auto corpus = TokenCorpus::from_documents(random_documents(100, 50, 4), kBos, kEos);
  const auto reference = global_batches(corpus, 24, 1, 4, 12);
  // Save after 5 steps with 2 ranks x 2.
  std::vector<DataLoader> ranks;
  for (int64_t r = 0; r < 2; ++r) ranks.emplace_back(corpus, DataLoaderOptions{24, 2, r, 2});
  for (int s = 0; s < 5; ++s) {
    for (auto& l : ranks) l.next();
  }
  const nlohmann::json state = ranks[0].state_dict();
  EXPECT_EQ(state, ranks[1].state_dict());
  EXPECT_EQ(state.at("rows_consumed").get<int64_t>(), 20);
  // The state goes through its text form, as in a checkpoint.
  const nlohmann::json restored = nlohmann::json::parse(state.dump());
  for (auto [world, batch] : {std::pair<int64_t, int64_t>{2, 2}, {1, 4}, {4, 1}}) {
    const auto resumed = global_batches(corpus, 24, world, batch, 7, &restored);
    for (int s = 0; s < 7; ++s) ASSERT_TRUE(torch::equal(resumed[s], reference[5 + s])) << world << "x" << batch;
  }
  DataLoader other_len(corpus, {16, 2, 0, 1});
  expect_error([&] { other_len.load_state_dict(restored); }, {"seq_len 24", "16"});
  const auto other_data = TokenCorpus::from_documents(random_documents(10, 50, 5), kBos, kEos);
  DataLoader other(other_data, {24, 2, 0, 1});
  expect_error([&] { other.load_state_dict(restored); }, {"corpus of", "same data"});
}

TEST(Loader, RejectsBadOptions) {
  const auto corpus = TokenCorpus::from_documents({{1, 2, 3}}, kBos, kEos);
  expect_error([&] { DataLoader(corpus, {64, 1, 0, 1}); }, {"fewer than one row", "65"});
  expect_error([&] { DataLoader(corpus, {2, 1, 2, 2}); }, {"rank 2", "[0, 2)"});
  expect_error([&] { DataLoader(corpus, {2, 0, 0, 1}); }, {"batch size"});
}

TEST(TokenFile, RoundTripsBothWidths) {
  const fs::path dir = temp_dir();
  for (int64_t vocab : {int64_t{1002}, int64_t{100000}}) {
    auto docs = random_documents(50, 30, 6);
    if (vocab > 65536) docs[0].push_back(99999);  // needs 32 bits
    const std::string path = (dir / c10::str("tokens_", vocab, ".bin")).string();
    {
      TokenFileWriter writer(path, vocab, kBos, kEos);
      for (const auto& d : docs) writer.add_document(d);
      writer.add_document({});  // skipped
      writer.close();
    }
    TokenFile file(path);
    EXPECT_EQ(file.header().bytes_per_token, vocab > 65536 ? 4u : 2u);
    EXPECT_EQ(file.header().num_documents, 50);
    EXPECT_EQ(file.header().bos_id, kBos);
    EXPECT_EQ(file.header().eos_id, kEos);
    EXPECT_EQ(file.documents(), docs);
    EXPECT_EQ(fs::file_size(path), static_cast<uintmax_t>(64 + file.size() * file.header().bytes_per_token));
    // A corpus over the mapped file packs exactly like the same documents in memory.
    const auto mapped = TokenCorpus::load({path}, nullptr);
    const auto memory = TokenCorpus::from_documents(docs, kBos, kEos);
    ASSERT_EQ(mapped->stream_length(), memory->stream_length());
    DataLoader a(mapped, {20, 4, 0, 1}), b(memory, {20, 4, 0, 1});
    for (int s = 0; s < 10; ++s) {
      const Batch x = a.next(), y = b.next();
      ASSERT_TRUE(torch::equal(x.inputs, y.inputs) && torch::equal(x.positions, y.positions) &&
                  torch::equal(x.document_ids, y.document_ids));
    }
  }
  {
    TokenFileWriter writer((dir / "bad.bin").string(), 1002, kBos, kEos);
    expect_error([&] { writer.add_document({5, 2000}); }, {"token id 2000", "[0, 1002)"});
  }
  EXPECT_FALSE(fs::exists(dir / "bad.bin"));  // never closed: nothing left behind
  for (const auto& entry : fs::directory_iterator(dir)) {  // nor its temporary file ("bad.bin.tmp.<pid>")
    EXPECT_NE(entry.path().filename().string().rfind("bad.bin", 0), 0u) << entry.path();
  }
  fs::remove_all(dir);
}

TEST(TokenFile, RejectsCorruptFiles) {
  const fs::path dir = temp_dir();
  const std::string good = (dir / "good.bin").string();
  {
    TokenFileWriter writer(good, 1002, kBos, kEos);
    writer.add_document({1, 2, 3});
    writer.close();
  }
  std::string bytes;
  {
    std::ifstream in(good, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  write(dir / "truncated.bin", bytes.substr(0, bytes.size() - 2));
  expect_error([&] { TokenFile((dir / "truncated.bin").string()); }, {"truncated.bin", "truncated or corrupt"});
  std::string wrong_magic = bytes;
  wrong_magic[0] = 'X';
  write(dir / "magic.bin", wrong_magic);
  expect_error([&] { TokenFile((dir / "magic.bin").string()); }, {"magic.bin", "no LOOMTOK magic"});
  std::string newer = bytes;
  newer[8] = 9;
  write(dir / "newer.bin", newer);
  expect_error([&] { TokenFile((dir / "newer.bin").string()); }, {"newer.bin", "version 9"});
  write(dir / "short.bin", "LOOM");
  expect_error([&] { TokenFile((dir / "short.bin").string()); }, {"short.bin", "shorter than the header"});
  fs::remove_all(dir);
}

TEST(Sources, TextJsonlAndInputSpecs) {
  const fs::path dir = temp_dir();
  fs::create_directories(dir / "sub");
  write(dir / "a.txt", "first doc\n\nsecond doc\n\n");
  write(dir / "sub/b.jsonl", "{\"content\": \"x\\ny\", \"id\": 1}\n\n{\"content\": \"z\"}\n");
  write(dir / "sub/.hidden", "ignored");
  auto documents = [](const std::string& path, const SourceOptions& o) {
    std::vector<std::string> docs;
    for_each_text_document(path, o, [&](std::string_view d) { docs.emplace_back(d); });
    return docs;
  };
  EXPECT_EQ(documents((dir / "a.txt").string(), {}), (std::vector<std::string>{"first doc\n\nsecond doc\n\n"}));
  EXPECT_EQ(documents((dir / "a.txt").string(), {"\n\n", "text"}),
            (std::vector<std::string>{"first doc", "second doc"}));
  EXPECT_EQ(documents((dir / "sub/b.jsonl").string(), {"", "content"}), (std::vector<std::string>{"x\ny", "z"}));
  expect_error([&] { documents((dir / "sub/b.jsonl").string(), {}); }, {"b.jsonl:1", "no string field 'text'"});
  write(dir / "bad.jsonl", "{\"text\": \"ok\"}\n{\"text\": \"ok\"}\n{\"txt\": \"oops\"}\n");
  expect_error([&] { documents((dir / "bad.jsonl").string(), {}); }, {"bad.jsonl:3", "no string field 'text'"});
  write(dir / "broken.jsonl", "{\"text\": \"ok\"}\n{\"text\": \n");
  expect_error([&] { documents((dir / "broken.jsonl").string(), {}); }, {"broken.jsonl:2", "not valid JSON"});

  const auto all = resolve_inputs({dir.string()});
  EXPECT_EQ(all, (std::vector<std::string>{(dir / "a.txt").string(), (dir / "bad.jsonl").string(),
                                           (dir / "broken.jsonl").string(), (dir / "sub/b.jsonl").string()}));
  EXPECT_EQ(resolve_inputs({(dir / "*.txt").string(), (dir / "a.txt").string()}),
            (std::vector<std::string>{(dir / "a.txt").string()}));
  expect_error([&] { resolve_inputs({(dir / "nope.txt").string()}); }, {"nope.txt", "does not exist"});
  expect_error([&] { resolve_inputs({(dir / "*.parquet").string()}); }, {"*.parquet", "names no file"});
  EXPECT_EQ(detect_format((dir / "a.txt").string()), SourceFormat::kText);
  EXPECT_EQ(detect_format((dir / "sub/b.jsonl").string()), SourceFormat::kJsonl);
  fs::remove_all(dir);
}

TEST(Sources, CorpusFromTextJsonlAndTokenFiles) {
  const fs::path dir = temp_dir();
  BpeTrainerOptions options;
  options.vocab_size = 300;
  BpeTrainer trainer(options);
  const std::vector<std::string> texts = {"the cat sat on the mat", "the dog sat on the log", "a cat and a dog"};
  for (const auto& t : texts) trainer.add_text(t);
  trainer.train();
  trainer.save((dir / "tokenizer.json").string());
  const Tokenizer tok = Tokenizer::from_file((dir / "tokenizer.json").string());

  write(dir / "0.jsonl", "{\"text\": \"" + texts[0] + "\"}\n{\"text\": \"" + texts[1] + "\"}\n");
  {
    TokenFileWriter writer((dir / "1.bin").string(), tok.vocab_size(), tok.bos_id(), tok.eos_id());
    writer.add_document(tok.encode(texts[2]));
    writer.close();
  }
  const auto corpus = TokenCorpus::load({dir.string() + "/*.jsonl", (dir / "1.bin").string()}, &tok);
  ASSERT_EQ(corpus->num_documents(), 3);
  std::vector<int64_t> expected;
  for (const auto& t : texts) {
    const auto ids = tok.encode(t, true, true);
    expected.insert(expected.end(), ids.begin(), ids.end());
  }
  std::vector<int64_t> tokens(expected.size()), positions(expected.size()), docs(expected.size());
  corpus->read_stream(0, static_cast<int64_t>(expected.size()), tokens.data(), positions.data(), docs.data());
  EXPECT_EQ(tokens, expected);
  EXPECT_EQ(docs.back(), 2);

  expect_error([&] { TokenCorpus::load({(dir / "0.jsonl").string()}, nullptr); }, {"0.jsonl", "needs a tokenizer"});
  {
    TokenFileWriter writer((dir / "other.bin").string(), 5000, 1, 2);
    writer.add_document({7});
    writer.close();
  }
  expect_error([&] { TokenCorpus::load({(dir / "other.bin").string()}, &tok); },
               {"other.bin", "vocab size 5000", "pretokenize"});
  fs::remove_all(dir);
}

namespace {

// A one-line loom::UsageError (exit code 2) whose message contains every part.
template <typename Fn>
void expect_usage_error(Fn&& fn, const std::vector<std::string>& parts) {
  loom::testing::expect_error<loom::UsageError>(std::forward<Fn>(fn), parts);
}

std::vector<std::string> text_documents(const std::string& path, const SourceOptions& o) {
  std::vector<std::string> docs;
  for_each_text_document(path, o, [&](std::string_view d) { docs.emplace_back(d); });
  return docs;
}

SourceOptions with_format(std::optional<SourceFormat> format) {
  SourceOptions o;
  o.format = format;
  o.format_setting = "training.dataset_format";
  o.jsonl_field_setting = "training.jsonl_field";
  return o;
}

}  // namespace

// Issue 8 A: the format was guessed from the file name even when one was configured, so JSONL
// named .json/.txt trained as one raw-text document and a JSONL file given as "tokens" was
// tokenized anyway.
TEST(Sources, ConfiguredFormatIsHonoured) {
  const fs::path dir = temp_dir();
  const std::string jsonl_lines = "{\"text\": \"first\"}\n{\"text\": \"second\"}\n";
  write(dir / "data.json", jsonl_lines);
  write(dir / "data.txt", jsonl_lines);
  write(dir / "notes.jsonl", "just prose\n");
  {
    TokenFileWriter writer((dir / "ids.jsonl").string(), 1002, kBos, kEos);  // a token file, misnamed
    writer.add_document({1, 2});
    writer.close();
  }
  const std::vector<std::string> two{"first", "second"};
  for (const char* name : {"data.json", "data.txt"}) {
    SCOPED_TRACE(name);
    const std::string path = (dir / name).string();
    EXPECT_EQ(text_documents(path, with_format(SourceFormat::kJsonl)), two);
    EXPECT_EQ(text_documents(path, with_format(std::nullopt)), std::vector<std::string>{jsonl_lines});  // auto
    EXPECT_EQ(resolve_format(path, with_format(SourceFormat::kJsonl)), SourceFormat::kJsonl);
  }
  // Text under "jsonl" fails at its first line and says which setting chose JSONL.
  expect_error([&] { text_documents((dir / "notes.jsonl").string(), with_format(SourceFormat::kJsonl)); },
               {"notes.jsonl:1", "not valid JSON", "training.dataset_format is \"jsonl\"", "\"text\""});
  EXPECT_EQ(text_documents((dir / "notes.jsonl").string(), with_format(SourceFormat::kText)),
            std::vector<std::string>{"just prose\n"});
  // Mismatches with the token magic are one usage error naming the file, the format and the fix.
  expect_usage_error([&] { resolve_format((dir / "data.txt").string(), with_format(SourceFormat::kTokens)); },
                     {"data.txt", "not a loom token file", "training.dataset_format is \"tokens\"", "pretokenize"});
  expect_usage_error([&] { resolve_format((dir / "ids.jsonl").string(), with_format(SourceFormat::kJsonl)); },
                     {"ids.jsonl", "is a loom token file", "training.dataset_format is \"jsonl\"", "\"tokens\""});
  expect_usage_error([&] { resolve_format((dir / "ids.jsonl").string(), with_format(SourceFormat::kText)); },
                     {"ids.jsonl", "training.dataset_format is \"text\""});
  EXPECT_EQ(resolve_format((dir / "ids.jsonl").string(), with_format(SourceFormat::kTokens)), SourceFormat::kTokens);
  EXPECT_EQ(resolve_format((dir / "ids.jsonl").string(), with_format(std::nullopt)), SourceFormat::kTokens);

  // The corpus follows the configured format too.
  BpeTrainerOptions options;
  options.vocab_size = 280;
  BpeTrainer trainer(options);
  trainer.add_text("first second");
  trainer.train();
  trainer.save((dir / "tokenizer.json").string());
  const Tokenizer tok = Tokenizer::from_file((dir / "tokenizer.json").string());
  EXPECT_EQ(TokenCorpus::load({(dir / "data.json").string()}, &tok, with_format(SourceFormat::kJsonl))->num_documents(), 2);
  EXPECT_EQ(TokenCorpus::load({(dir / "data.json").string()}, &tok, with_format(std::nullopt))->num_documents(), 1);
  expect_usage_error([&] { TokenCorpus::load({(dir / "data.json").string()}, &tok, with_format(SourceFormat::kTokens)); },
                     {"data.json", "not a loom token file"});

  EXPECT_EQ(parse_source_format("tokens"), SourceFormat::kTokens);
  EXPECT_EQ(parse_source_format("parquet"), SourceFormat::kParquet);
  EXPECT_EQ(parse_source_format("arrow"), SourceFormat::kArrow);
  expect_usage_error([] { parse_source_format("orc"); }, {"orc", "\"jsonl\"", "\"parquet\"", "\"arrow\""});
  fs::remove_all(dir);
}

// Issue 30: Parquet and Arrow files are known by their magic bytes, whatever their names; a file
// read as one without its magic is refused before reading; a directory read as "parquet" or
// "arrow" contributes only those files (a `datasets` folder also holds JSON). Reading the files
// themselves is tested against pyarrow + tokenizers in tests/parity/test_arrow_parquet_parity.py.
TEST(Sources, ParquetAndArrowByMagicAndDirectoriesByExtension) {
  const fs::path dir = temp_dir();
  fs::create_directories(dir / "cache");
  write(dir / "shard.bin", std::string("PAR1") + std::string(16, '\0') + "PAR1");
  write(dir / "cache" / "data-00000-of-00001.arrow", std::string("\xff\xff\xff\xff", 4) + std::string(12, '\0'));
  write(dir / "cache" / "dataset_info.json", "{}");
  write(dir / "cache" / "state.json", "{}");
  write(dir / "notes.parquet", "plain text\n");
  EXPECT_EQ(detect_format((dir / "shard.bin").string()), SourceFormat::kParquet);
  EXPECT_EQ(detect_format((dir / "cache" / "data-00000-of-00001.arrow").string()), SourceFormat::kArrow);
  EXPECT_EQ(detect_format((dir / "notes.parquet").string()), SourceFormat::kText);
  // Issue 46 (5): under "auto" a name that says Parquet or Arrow with other content is refused (a
  // clone without git-lfs holds pointer files), and a git-lfs pointer is named as one.
  expect_usage_error([&] { resolve_format((dir / "notes.parquet").string(), with_format(std::nullopt)); },
                     {"notes.parquet", "named like a Parquet file but has no PAR1 magic", "training.dataset_format",
                      "\"text\""});
  write(dir / "train-00000.parquet",
        "version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 123456\n");
  expect_usage_error([&] { resolve_format((dir / "train-00000.parquet").string(), with_format(std::nullopt)); },
                     {"train-00000.parquet", "git-lfs pointer", "git lfs pull"});
  write(dir / "cache" / "other.arrow", "{}\n");
  expect_usage_error([&] { resolve_format((dir / "cache" / "other.arrow").string(), with_format(std::nullopt)); },
                     {"other.arrow", "named like an Arrow file but has no Arrow magic"});
  fs::remove(dir / "cache" / "other.arrow");
  // Read as text on purpose: the format says so.
  EXPECT_EQ(resolve_format((dir / "notes.parquet").string(), with_format(SourceFormat::kText)), SourceFormat::kText);
  expect_usage_error([&] { resolve_format((dir / "notes.parquet").string(), with_format(SourceFormat::kParquet)); },
                     {"notes.parquet", "not a Parquet file (no PAR1 magic)", "training.dataset_format is \"parquet\""});
  expect_usage_error([&] { resolve_format((dir / "shard.bin").string(), with_format(SourceFormat::kArrow)); },
                     {"shard.bin", "not an Arrow IPC file"});
  EXPECT_EQ(resolve_inputs({(dir / "cache").string()}, "x", directory_extension(SourceFormat::kArrow)),
            std::vector<std::string>{(dir / "cache" / "data-00000-of-00001.arrow").string()});
  EXPECT_EQ(resolve_inputs({(dir / "cache").string()}, "x").size(), 3u);  // other formats: every file
  EXPECT_EQ(directory_extension(SourceFormat::kParquet), ".parquet");
  EXPECT_EQ(directory_extension(std::nullopt), "");
  fs::remove_all(dir);
}

// Issue 8 B: the missing-field message named a "jsonl_field option" that `loom train` lacked; it
// now names the caller's setting.
TEST(Sources, MissingJsonlFieldNamesTheSetting) {
  const fs::path dir = temp_dir();
  write(dir / "a.jsonl", "{\"body\": \"x\"}\n");
  expect_error([&] { text_documents((dir / "a.jsonl").string(), with_format(SourceFormat::kJsonl)); },
               {"a.jsonl:1", "no string field 'text'", "choose the field with training.jsonl_field"});
  SourceOptions body = with_format(SourceFormat::kJsonl);
  body.jsonl_field = "body";
  EXPECT_EQ(text_documents((dir / "a.jsonl").string(), body), std::vector<std::string>{"x"});
  fs::remove_all(dir);
}

// Issue 8 C: ids beyond the model's vocabulary were found only by the embedding ("index out of
// range in self"); they are now rejected at load, by the header and by a scan of every id.
TEST(Sources, TokenIdsAreCheckedAgainstTheModelVocabulary) {
  const fs::path dir = temp_dir();
  const std::string big = (dir / "big.bin").string(), lying = (dir / "lying.bin").string();
  for (const std::string& path : {big, lying}) {
    TokenFileWriter writer(path, 5000, kBos, kEos);
    writer.add_document({1, 2});
    writer.add_document({3, 4000, 5});
    writer.close();
  }
  // The header check: a file written for 5000 ids cannot feed a 1002-row embedding.
  expect_error([&] { TokenCorpus::load({big}, nullptr, {}, 1002); },
               {"big.bin", "vocab size 5000", "model's vocabulary of 1002", "model.vocab_size"});
  EXPECT_EQ(TokenCorpus::load({big}, nullptr, {}, 5000)->num_documents(), 2);
  // The scan: the header claims 1002 ids but document 1 holds id 4000 at offset 1.
  {
    std::fstream f(lying, std::ios::in | std::ios::out | std::ios::binary);
    const int64_t claimed = 1002;
    f.seekp(32);
    f.write(reinterpret_cast<const char*>(&claimed), sizeof(claimed));
  }
  ASSERT_EQ(TokenFile(lying).header().vocab_size, 1002);
  expect_error([&] { TokenCorpus::load({lying}, nullptr, {}, 1002); },
               {"lying.bin", "token id 4000", "document 1, offset 1", "vocabulary of 1002", "pretokenize"});
  EXPECT_EQ(TokenCorpus::load({lying}, nullptr)->num_documents(), 2);  // no limit: no check
  fs::remove_all(dir);
}

// Issue 8 D: a corpus smaller than the run repeated without a word; the loader now says when each
// new epoch starts, once, and not again after a resume inside an epoch.
TEST(Loader, LogsEachNewEpochOnce) {
  // 3 documents of 5 tokens: a stream of 21 tokens, 3 rows of seq_len 6 (+1) per epoch.
  const auto corpus = TokenCorpus::from_documents({{1, 2, 3, 4, 5}, {6, 7, 8, 9, 10}, {11, 12, 13, 14, 15}}, kBos, kEos);
  DataLoader loader(corpus, {6, 1, 0, 1});
  ASSERT_EQ(loader.packer().rows_per_epoch(), 3);
  ::testing::internal::CaptureStdout();
  for (int i = 0; i < 8; ++i) loader.next();  // rows 0..7: epochs 1, 2 and the start of 3
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_EQ(loom::testing::count_occurrences(out, "starting epoch"), 2) << out;
  EXPECT_NE(out.find("data: starting epoch 2 at row 3: the 3 rows of the corpus repeat"), std::string::npos) << out;
  EXPECT_NE(out.find("starting epoch 3 at row 6"), std::string::npos) << out;

  DataLoader resumed(corpus, {6, 1, 0, 1});
  resumed.load_state_dict({{"rows_consumed", 4}, {"seq_len", 6}, {"stream_tokens", corpus->stream_length()}});
  ::testing::internal::CaptureStdout();
  resumed.next();  // row 4: still epoch 2, already announced before the checkpoint
  resumed.next();  // row 5
  EXPECT_EQ(::testing::internal::GetCapturedStdout(), "");
  ::testing::internal::CaptureStdout();
  resumed.next();  // row 6: epoch 3
  EXPECT_NE(::testing::internal::GetCapturedStdout().find("starting epoch 3"), std::string::npos);
}

namespace {

// Every token, position and document id of a corpus, in stream order.
std::vector<int64_t> whole_stream(const TokenCorpus& corpus) {
  const int64_t n = corpus.num_tokens();
  std::vector<int64_t> tokens(n), positions(n), docs(n);
  corpus.read_stream(0, n, tokens.data(), positions.data(), docs.data());
  tokens.insert(tokens.end(), positions.begin(), positions.end());
  tokens.insert(tokens.end(), docs.begin(), docs.end());
  return tokens;
}

std::vector<fs::path> cache_entries(const fs::path& dir) {
  std::vector<fs::path> out;
  if (!fs::exists(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() == ".tokens") out.push_back(e.path());  // not the entries' .lock files
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

// training.token_cache: a text or JSONL file is tokenized once; later loads memory-map the cached
// token file and see exactly the same stream. The key covers the file's and the tokenizer's bytes
// and the reading options; a document spelling the EOS token is never cached (a token file would
// cut it in two); a folder that cannot be written only costs the cache.
TEST(Sources, TokenCacheServesTheSameStreamAndFollowsTheContents) {
  const fs::path dir = temp_dir();
  BpeTrainerOptions options;
  options.vocab_size = 300;
  BpeTrainer trainer(options);
  for (const char* t : {"the cat sat on the mat", "the dog sat on the log", "a cat and a dog"}) trainer.add_text(t);
  trainer.train();
  trainer.save((dir / "tokenizer.json").string());
  const Tokenizer tok = Tokenizer::from_file((dir / "tokenizer.json").string());
  write(dir / "data.jsonl", "{\"text\": \"the cat sat on the mat\"}\n{\"text\": \"a dog\"}\n");

  SourceOptions uncached;
  SourceOptions cached;
  cached.token_cache_dir = (dir / "cache").string();
  const std::vector<int64_t> want = whole_stream(*TokenCorpus::load({(dir / "data.jsonl").string()}, &tok, uncached));
  EXPECT_TRUE(cache_entries(dir / "cache").empty());  // nothing cached without a folder

  // First load: tokenized (same stream) and cached; second: read from the cache file.
  EXPECT_EQ(whole_stream(*TokenCorpus::load({(dir / "data.jsonl").string()}, &tok, cached)), want);
  const std::vector<fs::path> entries = cache_entries(dir / "cache");
  ASSERT_EQ(entries.size(), 1u);
  EXPECT_EQ(entries[0].filename().string().rfind("data.jsonl.", 0), 0u) << entries[0];
  const auto first_write = fs::last_write_time(entries[0]);
  EXPECT_EQ(whole_stream(*TokenCorpus::load({(dir / "data.jsonl").string()}, &tok, cached)), want);
  EXPECT_EQ(cache_entries(dir / "cache"), entries);
  EXPECT_EQ(fs::last_write_time(entries[0]), first_write);  // read, not rewritten
  // The cached stream is what the loader would read from the entry as a token file.
  EXPECT_EQ(whole_stream(*TokenCorpus::load({entries[0].string()}, &tok, uncached)), want);

  // Another text, or another JSONL field: new entries, each with its own stream.
  write(dir / "data.jsonl", "{\"text\": \"the dog sat on the log\", \"body\": \"a cat\"}\n");
  const std::vector<int64_t> changed = whole_stream(*TokenCorpus::load({(dir / "data.jsonl").string()}, &tok, uncached));
  EXPECT_EQ(whole_stream(*TokenCorpus::load({(dir / "data.jsonl").string()}, &tok, cached)), changed);
  EXPECT_EQ(cache_entries(dir / "cache").size(), 2u);
  SourceOptions body = cached;
  body.jsonl_field = "body";
  EXPECT_EQ(whole_stream(*TokenCorpus::load({(dir / "data.jsonl").string()}, &tok, body)),
            whole_stream(*TokenCorpus::load({(dir / "data.jsonl").string()}, &tok, [] {
              SourceOptions o;
              o.jsonl_field = "body";
              return o;
            }())));
  EXPECT_EQ(cache_entries(dir / "cache").size(), 3u);

  // A document whose text is the EOS token's: loaded, not cached.
  const std::string eos_text = tok.decode({tok.eos_id()}, false);
  write(dir / "eos.txt", "before " + eos_text + " after");
  EXPECT_EQ(whole_stream(*TokenCorpus::load({(dir / "eos.txt").string()}, &tok, cached)),
            whole_stream(*TokenCorpus::load({(dir / "eos.txt").string()}, &tok, uncached)));
  EXPECT_EQ(cache_entries(dir / "cache").size(), 3u);

  // Loads racing for one entry (the ranks of a host): one tokenizes under the entry's lock, the
  // others wait and map its file; every stream is the same and nothing is left half-written.
  write(dir / "race.jsonl", "{\"text\": \"the cat sat\"}\n{\"text\": \"on the mat\"}\n");
  const std::vector<int64_t> race_want = whole_stream(*TokenCorpus::load({(dir / "race.jsonl").string()}, &tok, uncached));
  std::vector<std::vector<int64_t>> race_got(4);
  {
    std::vector<std::thread> loaders;
    for (size_t i = 0; i < race_got.size(); ++i) {
      loaders.emplace_back([&, i] { race_got[i] = whole_stream(*TokenCorpus::load({(dir / "race.jsonl").string()}, &tok, cached)); });
    }
    for (auto& t : loaders) t.join();
  }
  for (const auto& got : race_got) EXPECT_EQ(got, race_want);
  size_t race_entries = 0, temporaries = 0;
  for (const auto& e : fs::directory_iterator(dir / "cache")) {
    const std::string name = e.path().filename().string();
    race_entries += name.rfind("race.jsonl.", 0) == 0 && e.path().extension() == ".tokens";
    temporaries += name.find(".tmp.") != std::string::npos;
  }
  EXPECT_EQ(race_entries, 1u);
  EXPECT_EQ(temporaries, 0u);
  // Issue 46 (11): no lock file is left per entry ever tried (each holder removes its own), and a
  // temporary a killed run left ("<entry>.tmp.<pid>") is removed when the entry is next written.
  size_t locks = 0;
  for (const auto& e : fs::directory_iterator(dir / "cache")) locks += e.path().extension() == ".lock";
  EXPECT_EQ(locks, 0u);
  fs::path race_entry;
  for (const auto& e : cache_entries(dir / "cache")) {
    if (e.filename().string().rfind("race.jsonl.", 0) == 0) race_entry = e;
  }
  ASSERT_FALSE(race_entry.empty());
  const fs::path stale = race_entry.string() + ".tmp.999999999";
  write(stale, "half a token file");
  fs::remove(race_entry);
  EXPECT_EQ(whole_stream(*TokenCorpus::load({(dir / "race.jsonl").string()}, &tok, cached)), race_want);
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::exists(race_entry));

  // Issue 46 (11): a damaged entry (a byte changed in its tokens, one that still reads as a token
  // file with in-range ids) or one without its checksum is tokenized again and rewritten, not
  // reported or trained on.
  const std::string original = file_bytes(race_entry);
  {
    std::fstream f(race_entry, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(original.size() - 6));  // inside the last document's tokens
    const char c = original[original.size() - 6];
    f.put(static_cast<char>(c ^ 1));
  }
  ASSERT_NE(file_bytes(race_entry), original);
  EXPECT_EQ(whole_stream(*TokenCorpus::load({(dir / "race.jsonl").string()}, &tok, cached)), race_want);
  EXPECT_EQ(file_bytes(race_entry), original);
  fs::remove(race_entry.string() + ".sum");
  EXPECT_EQ(whole_stream(*TokenCorpus::load({(dir / "race.jsonl").string()}, &tok, cached)), race_want);
  EXPECT_TRUE(fs::exists(race_entry.string() + ".sum"));
  EXPECT_EQ(file_bytes(race_entry), original);

  // A cache "folder" that is a file: the load works, uncached.
  write(dir / "not_a_folder", "x");
  SourceOptions broken;
  broken.token_cache_dir = (dir / "not_a_folder").string();
  EXPECT_EQ(whole_stream(*TokenCorpus::load({(dir / "data.jsonl").string()}, &tok, broken)), changed);
  fs::remove_all(dir);
}
