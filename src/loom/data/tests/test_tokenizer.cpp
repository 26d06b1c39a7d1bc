// Tokenizer reader, pre-tokenizer matchers and BPE trainer. Parity with Hugging Face `tokenizers`
// on the whole default corpus is checked by tests/parity/test_tokenizer_parity.py.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "loom/testing/errors.h"
#include "loom/testing/files.h"
#include "loom/testing/run.h"
#include "loom/core/build_paths.h"
#include "loom/core/error.h"
#include "loom/data/bpe_trainer.h"
#include "loom/data/byte_level.h"
#include "loom/data/tokenizer.h"

namespace fs = std::filesystem;
using loom::data::BpeTrainer;
using loom::data::BpeTrainerOptions;
using loom::data::Tokenizer;
using nlohmann::json;

namespace {
using loom::testing::temp_dir;
using loom::testing::write;

// Expects `fn` to throw loom::Error whose message contains every one of `parts`.
using loom::testing::expect_error;

// A byte-level BPE tokenizer.json over a hand-made vocabulary: all 256 bytes (id = byte value)
// plus `extra` tokens (ids from 256 on), the given merges and added tokens.
json tiny_tokenizer_json(const std::vector<std::string>& extra, const std::vector<std::pair<std::string, std::string>>& merges,
                         const json& added = json::array()) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[loom::data::byte_level::to_alphabet(std::string(1, static_cast<char>(b)))] = b;
  for (size_t i = 0; i < extra.size(); ++i) vocab[loom::data::byte_level::to_alphabet(extra[i])] = 256 + i;
  json m = json::array();
  for (const auto& [a, b] : merges) {
    m.push_back(loom::data::byte_level::to_alphabet(a) + " " + loom::data::byte_level::to_alphabet(b));
  }
  return json{{"version", "1.0"},
              {"added_tokens", added},
              {"normalizer", nullptr},
              {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
              {"decoder", {{"type", "ByteLevel"}}},
              {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", m}}}};
}

Tokenizer tiny_tokenizer(const json& j) { return Tokenizer::from_json_string(j.dump(), "tiny"); }

// The textbook BPE: repeatedly find the lowest-ranked adjacent pair and merge all its
// occurrences left to right. Reference for Tokenizer's two merge loops.
std::vector<std::string> reference_bpe(const std::string& word, const std::vector<std::pair<std::string, std::string>>& merges) {
  std::vector<std::string> parts;
  for (char c : word) parts.emplace_back(1, c);
  std::map<std::pair<std::string, std::string>, size_t> rank;
  for (size_t i = 0; i < merges.size(); ++i) rank.emplace(merges[i], i);
  while (parts.size() > 1) {
    size_t best = SIZE_MAX;
    std::pair<std::string, std::string> best_pair;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      auto it = rank.find({parts[i], parts[i + 1]});
      if (it != rank.end() && it->second < best) best = it->second, best_pair = it->first;
    }
    if (best == SIZE_MAX) break;
    std::vector<std::string> next;
    for (size_t i = 0; i < parts.size(); ++i) {
      if (i + 1 < parts.size() && parts[i] == best_pair.first && parts[i + 1] == best_pair.second) {
        next.push_back(parts[i] + parts[i + 1]);
        ++i;
      } else {
        next.push_back(parts[i]);
      }
    }
    parts = std::move(next);
  }
  return parts;
}

std::vector<std::string> split(const std::string& text, loom::data::byte_level::SplitPattern p) {
  std::vector<std::string_view> pieces;
  loom::data::byte_level::split(text, p, pieces);
  return {pieces.begin(), pieces.end()};
}

const std::vector<std::string> kTrickyTexts = {
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\r\nCRLF line\r\nendings\n\n\nand blank lines\n",
    "numbers 1234567890 3.14159 -42 1,000,000 2024-01-01",
    "unicode: naïve café, Ünïcödé, Ελληνικά, русский, 日本語のテキスト, 한국어, العربية",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇩🇪🇯🇵 and ZWJ",
    "contractions: I'm, you're, we've, they'll, he'd, it's, don't, DON'T, 'S",
    "symbols <>&*^%$#@!~`|\\/{}[]()?;:'\" and ...ellipsis---dashes",
    "\u00a0non-breaking\u2003em space\u3000ideographic space",
    "                                                                         long run of spaces",
    "==========================================================================================",
    std::string("embedded\0nul and \x7f DEL", 22),
    "",
    " ",
    "\n",
};

}  // namespace

TEST(Tokenizer, HandCheckedMerges) {
  // Vocab: bytes, then ab=256, abc=257, " a"=258, bc=259. Merge ranks: ab < abc < " a" < bc.
  const std::vector<std::pair<std::string, std::string>> merges = {{"a", "b"}, {"ab", "c"}, {" ", "a"}, {"b", "c"}};
  const Tokenizer tok = tiny_tokenizer(tiny_tokenizer_json({"ab", "abc", " a", "bc"}, merges));
  // "abc" -> ab -> abc. " abcbc": ab first (rank 0) so " a" never applies, then abc, then bc.
  EXPECT_EQ(tok.encode("abc abcbc"), (std::vector<int64_t>{257, ' ', 257, 259}));
  EXPECT_EQ(tok.encode(" a"), (std::vector<int64_t>{258}));
  EXPECT_EQ(tok.encode("xyz"), (std::vector<int64_t>{'x', 'y', 'z'}));
  EXPECT_EQ(tok.decode({257, ' ', 257, 259}), "abc abcbc");
  EXPECT_EQ(tok.vocab_size(), 260);
  EXPECT_EQ(tok.token_to_id("Ġa"), 258);
  EXPECT_EQ(tok.id_to_token(258), "Ġa");
  EXPECT_EQ(tok.token_to_id("nope"), -1);
  EXPECT_EQ(tok.bos_id(), -1);
  expect_error([&] { tok.decode({260}); }, {"260", "vocabulary size 260"});
  expect_error([&] { tok.encode("a", /*add_bos=*/true); }, {"no BOS"});
}

TEST(Tokenizer, MergeLoopsMatchTextbookBpe) {
  // Words over {a, b, c} of every length through both merge loops (short scan, long heap).
  const std::vector<std::pair<std::string, std::string>> merges = {
      {"a", "b"}, {"b", "c"}, {"ab", "c"}, {"c", "a"}, {"a", "a"}, {"aa", "a"}, {"ab", "ab"}, {"c", "c"},
      {"bc", "a"}, {"abc", "abc"}, {"b", "b"}, {"ca", "b"}};
  std::vector<std::string> extra;
  std::map<std::string, int64_t> id_of;
  for (int b = 0; b < 256; ++b) id_of[std::string(1, static_cast<char>(b))] = b;
  for (const auto& [l, r] : merges) {
    if (!id_of.count(l + r)) id_of[l + r] = 256 + static_cast<int64_t>(extra.size()), extra.push_back(l + r);
  }
  const Tokenizer tok = tiny_tokenizer(tiny_tokenizer_json(extra, merges));
  std::mt19937 rng(7);
  for (int trial = 0; trial < 400; ++trial) {
    const size_t len = 1 + rng() % 150;
    std::string word;
    for (size_t i = 0; i < len; ++i) word += "abc"[rng() % 3];
    std::vector<int64_t> expected;
    for (const std::string& part : reference_bpe(word, merges)) expected.push_back(id_of.at(part));
    ASSERT_EQ(tok.encode(word), expected) << word;
  }
}

TEST(Tokenizer, Gpt2PreTokenizer) {
  using loom::data::byte_level::SplitPattern;
  EXPECT_EQ(split("Hello world's  12 cats!!\n\n  x", SplitPattern::kGpt2),
            (std::vector<std::string>{"Hello", " world", "'s", " ", " 12", " cats", "!!", "\n\n ", " x"}));
  EXPECT_EQ(split("I'M ok 'll", SplitPattern::kGpt2),
            (std::vector<std::string>{"I", "'", "M", " ok", " '", "ll"}));
  EXPECT_EQ(split("trailing   ", SplitPattern::kGpt2), (std::vector<std::string>{"trailing", "   "}));
  EXPECT_EQ(split("é1½", SplitPattern::kGpt2), (std::vector<std::string>{"é", "1½"}));
}

TEST(Tokenizer, Llama3PreTokenizer) {
  using loom::data::byte_level::SplitPattern;
  EXPECT_EQ(split("Hello world's  12345 cats!!\n\n  x", SplitPattern::kLlama3),
            (std::vector<std::string>{"Hello", " world", "'s", " ", " ", "123", "45", " cats", "!!\n\n", " ", " x"}));
  EXPECT_EQ(split("I'M (ok) \t\n\n end", SplitPattern::kLlama3),
            (std::vector<std::string>{"I", "'M", " (", "ok", ")", " \t\n\n", " end"}));
  EXPECT_EQ(split("x(ok\r\n", SplitPattern::kLlama3), (std::vector<std::string>{"x", "(ok", "\r\n"}));
  EXPECT_EQ(split("x'ſ", SplitPattern::kLlama3), (std::vector<std::string>{"x", "'ſ"}));
  EXPECT_EQ(loom::data::byte_level::pattern_from_regex(loom::data::byte_level::kLlama3Pattern),
            SplitPattern::kLlama3);
  EXPECT_FALSE(loom::data::byte_level::pattern_from_regex(R"(\w+|\s+)").has_value());
}

TEST(Tokenizer, AddedAndSpecialTokens) {
  const json added = json::array(
      {{{"id", 256}, {"content", "<|end_of_text|>"}, {"special", true}, {"normalized", false}},
       {{"id", 257}, {"content", "<|begin_of_text|>"}, {"special", true}, {"normalized", false}},
       {{"id", 258}, {"content", "<mask>"}, {"special", true}, {"lstrip", true}, {"rstrip", true}, {"normalized", false}},
       {{"id", 259}, {"content", "cat"}, {"special", false}, {"single_word", true}, {"normalized", true}},
       {{"id", 260}, {"content", "<|end"}, {"special", false}, {"normalized", false}}});
  const Tokenizer tok = tiny_tokenizer(tiny_tokenizer_json({}, {}, added));
  EXPECT_EQ(tok.bos_id(), 257);
  EXPECT_EQ(tok.eos_id(), 256);
  // Longest match wins over the "<|end" prefix token; specials are single ids.
  EXPECT_EQ(tok.encode("a<|end_of_text|>b<|end"), (std::vector<int64_t>{'a', 256, 'b', 260}));
  // lstrip/rstrip swallow the surrounding whitespace into the token.
  EXPECT_EQ(tok.encode("a  <mask>  b"), (std::vector<int64_t>{'a', 258, 'b'}));
  // single_word: only a standalone "cat" is the added token.
  EXPECT_EQ(tok.encode("cat concat cats"),
            (std::vector<int64_t>{259, ' ', 'c', 'o', 'n', 'c', 'a', 't', ' ', 'c', 'a', 't', 's'}));
  EXPECT_EQ(tok.encode("x", true, true), (std::vector<int64_t>{257, 'x', 256}));
  EXPECT_EQ(tok.decode({257, 'x', 256}), "<|begin_of_text|>x<|end_of_text|>");
  EXPECT_EQ(tok.decode({257, 'x', 256}, /*skip_special=*/true), "x");
  EXPECT_EQ(tok.token_to_id("<mask>"), 258);
}

TEST(Tokenizer, PrefixSpaceAndLlama3Sequence) {
  json j = tiny_tokenizer_json({" a"}, {{" ", "a"}});
  j["pre_tokenizer"]["add_prefix_space"] = true;
  EXPECT_EQ(tiny_tokenizer(j).encode("a a"), (std::vector<int64_t>{256, 256}));
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers",
                         {{{"type", "Split"}, {"pattern", {{"Regex", loom::data::byte_level::kLlama3Pattern}}},
                           {"behavior", "Isolated"}, {"invert", false}},
                          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
  j["model"]["ignore_merges"] = true;
  const Tokenizer llama = tiny_tokenizer(j);
  EXPECT_EQ(llama.encode("a a 1234"), (std::vector<int64_t>{'a', 256, ' ', '1', '2', '3', '4'}));
}

TEST(Tokenizer, RoundTripsTrickyText) {
  // A small tokenizer trained on the start of the default corpus and the tricky texts.
  BpeTrainerOptions options;
  options.vocab_size = 600;
  options.min_frequency = 1;
  BpeTrainer trainer(options);
  std::ifstream corpus(fs::path(loom::kSourceDir) / "data/default/corpus.txt", std::ios::binary);
  std::string head(200000, '\0');
  corpus.read(head.data(), static_cast<std::streamsize>(head.size()));
  head.resize(static_cast<size_t>(corpus.gcount()));
  ASSERT_GT(head.size(), 10000u) << "default corpus missing: run scripts/make_default_data.sh";
  trainer.add_text(head);
  for (const std::string& t : kTrickyTexts) trainer.add_text(t);
  const auto result = trainer.train();
  EXPECT_EQ(result.vocab_size, 600);
  json j = json::parse(trainer.to_json());
  const Tokenizer gpt2 = Tokenizer::from_json_string(j.dump(), "trained");
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers",
                         {{{"type", "Split"}, {"pattern", {{"Regex", loom::data::byte_level::kLlama3Pattern}}},
                           {"behavior", "Isolated"}, {"invert", false}},
                          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
  const Tokenizer llama = Tokenizer::from_json_string(j.dump(), "trained-llama3");
  std::vector<std::string> texts = kTrickyTexts;
  texts.push_back("special <|end_of_text|> inside <|pad|>text<|begin_of_text|>");
  texts.push_back("invalid utf-8: \xff\xfe \xc3( \xe2\x82 end");  // lossless for any bytes
  texts.push_back(head.substr(0, 5000));
  for (const Tokenizer* tok : {&gpt2, &llama}) {
    for (const std::string& text : texts) {
      const auto ids = tok->encode(text);
      EXPECT_EQ(tok->decode(ids), text) << tok->path();
      for (int64_t id : ids) ASSERT_TRUE(id >= 0 && id < tok->vocab_size());
    }
  }
  const auto ids = gpt2.encode("a<|end_of_text|>b");
  EXPECT_EQ(ids.size(), 3u);
  EXPECT_EQ(ids[1], gpt2.eos_id());
  EXPECT_EQ(gpt2.eos_id(), 598);
  EXPECT_EQ(gpt2.bos_id(), 597);
  EXPECT_EQ(gpt2.pad_id(), 599);
  // 341 merges already compress English text to under 2/3 of a token per byte.
  EXPECT_LT(gpt2.encode(head).size() * 3, head.size() * 2);
}

TEST(Tokenizer, EncodesConcurrently) {
  // encode() is const and shares its word cache between threads.
  BpeTrainerOptions options;
  options.vocab_size = 400;
  BpeTrainer trainer(options);
  std::string text;
  for (int i = 0; i < 2000; ++i) text += c10::str("word", i % 97, " ", i * 7919 % 1000, ", 'tis naïve; ");
  trainer.add_text(text);
  trainer.train();
  const Tokenizer tok = Tokenizer::from_json_string(trainer.to_json(), "threads");
  std::vector<std::string> chunks;
  for (size_t i = 0; i < text.size(); i += 997) chunks.push_back(text.substr(i, 997));
  std::vector<std::vector<int64_t>> expected;
  {
    const Tokenizer fresh = Tokenizer::from_json_string(trainer.to_json(), "fresh");
    for (const auto& c : chunks) expected.push_back(fresh.encode(c));
  }
  std::vector<std::vector<int64_t>> got(chunks.size());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (size_t i = t; i < chunks.size(); i += 4) got[i] = tok.encode(chunks[i]);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(got, expected);
}

TEST(Tokenizer, RejectsBadFiles) {
  const fs::path dir = temp_dir();
  const std::string missing = (dir / "missing.json").string();
  expect_error([&] { Tokenizer::from_file(missing); }, {missing, "No such file"});

  write(dir / "garbage.json", "this is not json {");
  expect_error([&] { Tokenizer::from_file((dir / "garbage.json").string()); }, {"garbage.json", "not valid JSON"});

  const json wordpiece = {{"model", {{"type", "WordPiece"}, {"vocab", {{"[UNK]", 0}}}, {"unk_token", "[UNK]"}}},
                          {"pre_tokenizer", {{"type", "BertPreTokenizer"}}}};
  write(dir / "bert.json", wordpiece.dump());
  expect_error([&] { Tokenizer::from_file((dir / "bert.json").string()); }, {"bert.json", "WordPiece model"});

  const json unigram = {{"model", {{"type", "Unigram"}, {"vocab", json::array()}}}};
  expect_error([&] { Tokenizer::from_json_string(unigram.dump(), "uni.json"); }, {"uni.json", "Unigram"});

  json sentencepiece = tiny_tokenizer_json({}, {});
  sentencepiece["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "▁"}};
  expect_error([&] { Tokenizer::from_json_string(sentencepiece.dump(), "sp.json"); },
               {"sp.json", "not byte-level BPE", "Metaspace"});

  json odd_regex = tiny_tokenizer_json({}, {});
  odd_regex["pre_tokenizer"] = {{"type", "Sequence"},
                                {"pretokenizers",
                                 {{{"type", "Split"}, {"pattern", {{"Regex", "\\w+"}}}, {"behavior", "Isolated"}},
                                  {{"type", "ByteLevel"}, {"use_regex", false}}}}};
  expect_error([&] { Tokenizer::from_json_string(odd_regex.dump(), "re.json"); }, {"re.json", "unsupported pre-tokenizer regex"});

  json normalizer = tiny_tokenizer_json({}, {});
  normalizer["normalizer"] = {{"type", "NFC"}};
  expect_error([&] { Tokenizer::from_json_string(normalizer.dump(), "nfc.json"); }, {"nfc.json", "NFC normalizer"});

  json bad_merge = tiny_tokenizer_json({}, {});
  bad_merge["model"]["merges"] = json::array({"a zz"});
  expect_error([&] { Tokenizer::from_json_string(bad_merge.dump(), "m.json"); }, {"m.json", "merge 0", "not all in the vocabulary"});
  fs::remove_all(dir);
}

// Textbook trainer: recount every pair before each merge. Reference for the incremental one.
std::vector<std::pair<int32_t, int32_t>> naive_merges(const std::map<std::string, int64_t>& words, size_t num_merges) {
  std::vector<std::pair<std::vector<int32_t>, int64_t>> seqs;
  for (const auto& [w, c] : words) {
    std::vector<int32_t> s;
    for (unsigned char ch : w) s.push_back(ch);
    seqs.emplace_back(s, c);
  }
  std::vector<std::string> bytes;
  for (int b = 0; b < 256; ++b) bytes.emplace_back(1, static_cast<char>(b));
  std::vector<std::pair<int32_t, int32_t>> merges;
  while (merges.size() < num_merges) {
    std::map<std::pair<int32_t, int32_t>, int64_t> counts;
    for (const auto& [s, c] : seqs) {
      for (size_t i = 0; i + 1 < s.size(); ++i) counts[{s[i], s[i + 1]}] += c;
    }
    std::pair<int32_t, int32_t> best{-1, -1};
    int64_t best_count = 0;
    for (const auto& [p, c] : counts) {
      if (c > best_count) best = p, best_count = c;  // map order: ties keep the smallest pair
    }
    if (best_count == 0) break;
    const std::string merged = bytes[best.first] + bytes[best.second];
    int32_t id = static_cast<int32_t>(std::find(bytes.begin(), bytes.end(), merged) - bytes.begin());
    if (id == static_cast<int32_t>(bytes.size())) bytes.push_back(merged);
    merges.push_back(best);
    for (auto& [s, c] : seqs) {
      std::vector<int32_t> out;
      for (size_t i = 0; i < s.size(); ++i) {
        if (i + 1 < s.size() && s[i] == best.first && s[i + 1] == best.second) {
          out.push_back(id);
          ++i;
        } else {
          out.push_back(s[i]);
        }
      }
      s = std::move(out);
    }
  }
  return merges;
}

TEST(BpeTrainer, HandCheckedTinyCorpus) {
  BpeTrainerOptions options;
  options.vocab_size = 300;
  options.min_frequency = 1;
  BpeTrainer trainer(options);
  trainer.add_text("ab ab ab abc");  // words: ab, " ab" x2, " abc"
  const auto result = trainer.train();
  // (a,b) x4 -> "ab"; (" ", ab) x3 -> " ab"; (" ab", c) x1 -> " abc"; then no pairs are left.
  EXPECT_EQ(result.num_merges, 3);
  EXPECT_EQ(result.vocab_size, 259 + 3);
  const json j = json::parse(trainer.to_json());
  EXPECT_EQ(j["model"]["merges"], json::parse(R"([["a","b"],["Ġ","ab"],["Ġab","c"]])"));
  const Tokenizer tok = Tokenizer::from_json_string(j.dump(), "tiny-trained");
  EXPECT_EQ(tok.encode("ab abc ab"), (std::vector<int64_t>{256, 258, 257}));
  EXPECT_EQ(tok.token_to_id("<|begin_of_text|>"), 259);
  EXPECT_EQ(tok.eos_id(), 260);
}

TEST(BpeTrainer, IncrementalCountsMatchFullRecount) {
  std::mt19937 rng(11);
  std::string text;
  const char* syllables[] = {"ka", "to", "ri", "a", "n", "ta", "ro", "ki", "aa", "ab"};
  for (int w = 0; w < 3000; ++w) {
    const int n = 1 + static_cast<int>(rng() % 5);
    text += ' ';
    for (int s = 0; s < n; ++s) text += syllables[rng() % 10];
  }
  BpeTrainerOptions options;
  options.vocab_size = 256 + 3 + 120;
  options.min_frequency = 1;
  BpeTrainer trainer(options);
  trainer.add_text(text);
  trainer.train();
  const json j = json::parse(trainer.to_json());

  std::map<std::string, int64_t> words;
  for (const std::string& w : split(text, loom::data::byte_level::SplitPattern::kGpt2)) ++words[w];
  const auto expected = naive_merges(words, j["model"]["merges"].size());
  ASSERT_EQ(expected.size(), j["model"]["merges"].size());
  const Tokenizer tok = Tokenizer::from_json_string(j.dump(), "trained");
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(j["model"]["merges"][i][0].get<std::string>(), tok.id_to_token(expected[i].first)) << "merge " << i;
    EXPECT_EQ(j["model"]["merges"][i][1].get<std::string>(), tok.id_to_token(expected[i].second)) << "merge " << i;
  }
  // Deterministic: the same text trains the same file.
  BpeTrainer again(options);
  again.add_text(text);
  again.train();
  EXPECT_EQ(again.to_json(), trainer.to_json());
}

TEST(BpeTrainer, RejectsTooSmallVocab) {
  BpeTrainerOptions options;
  options.vocab_size = 100;
  expect_error([&] { BpeTrainer{options}; }, {"vocab size 100", "at least 259"});
}

// Issue 8 J, through the `loom` binary: `tokenizer train` on empty input wrote a tokenizer "from 0
// documents" and exited 0; an --output directory failed after all the work and left
// "<output>.tmp" behind.
TEST(TokenizerCli, TrainRejectsEmptyInputAndDirectoryOutput) {
  using loom::testing::loom_bin;
  using loom::testing::run;
  const fs::path dir = temp_dir();
  write(dir / "empty.txt", "");
  write(dir / "text.txt", "the cat sat on the mat and the dog sat on the log");
  fs::create_directories(dir / "out");

  const auto empty = run(loom_bin() + " tokenizer train --input " + (dir / "empty.txt").string() +
                         " --vocab-size 260 --output " + (dir / "tok.json").string(), 60);
  EXPECT_EQ(empty.exit_code, 1) << empty.output;
  EXPECT_NE(empty.output.find("error: --input '" + (dir / "empty.txt").string() + "' holds no documents"),
            std::string::npos) << empty.output;
  EXPECT_EQ(loom::testing::count_occurrences(empty.output, "\n"), 1) << empty.output;  // one line
  EXPECT_FALSE(fs::exists(dir / "tok.json"));
  EXPECT_FALSE(fs::exists(dir / "tok.json.tmp"));

  const auto to_dir = run(loom_bin() + " tokenizer train --input " + (dir / "text.txt").string() +
                          " --vocab-size 260 --output " + (dir / "out").string(), 60);
  EXPECT_EQ(to_dir.exit_code, 2) << to_dir.output;
  EXPECT_NE(to_dir.output.find("error: --output '" + (dir / "out").string() + "' is a directory; pass a file "
                               "path such as " + (dir / "out/tokenizer.json").string()),
            std::string::npos) << to_dir.output;
  EXPECT_FALSE(fs::exists(dir / "out.tmp"));
  EXPECT_TRUE(fs::is_empty(dir / "out"));

  const auto pretokenize = run(loom_bin() + " tokenizer pretokenize --tokenizer " + loom::kSourceDir +
                               "/data/default/tokenizer.json --input " + (dir / "text.txt").string() +
                               " --output " + (dir / "out").string(), 60);
  EXPECT_EQ(pretokenize.exit_code, 2) << pretokenize.output;
  EXPECT_NE(pretokenize.output.find("is a directory"), std::string::npos) << pretokenize.output;
  for (const auto& entry : fs::directory_iterator(dir)) {  // the token writer's "out.tmp.<pid>" neither
    EXPECT_NE(entry.path().filename().string().rfind("out.tmp", 0), 0u) << entry.path();
  }

  // The writers themselves refuse a directory too and leave no temporary file, whoever calls them.
  BpeTrainerOptions options;
  options.vocab_size = 260;
  BpeTrainer trainer(options);
  trainer.add_text("the cat sat");
  trainer.train();
  expect_error([&] { trainer.save((dir / "out").string()); }, {"out", "is a directory"});
  EXPECT_FALSE(fs::exists(dir / "out.tmp"));
  fs::remove_all(dir);
}

// Issue 8 B: the JSONL-field error names the flag of the command that read the file.
TEST(TokenizerCli, MissingJsonlFieldNamesTheFlag) {
  using loom::testing::loom_bin;
  using loom::testing::run;
  const fs::path dir = temp_dir();
  write(dir / "a.jsonl", "{\"body\": \"the cat sat\"}\n");
  const auto r = run(loom_bin() + " tokenizer train --input " + (dir / "a.jsonl").string() +
                     " --vocab-size 260 --output " + (dir / "tok.json").string(), 60);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("no string field 'text'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("choose the field with --jsonl-field)"), std::string::npos) << r.output;
  const auto ok = run(loom_bin() + " tokenizer train --input " + (dir / "a.jsonl").string() +
                      " --jsonl-field body --vocab-size 260 --output " + (dir / "tok.json").string(), 60);
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  const auto encode = run(loom_bin() + " tokenizer encode --tokenizer " + (dir / "tok.json").string() +
                          " --jsonl " + (dir / "a.jsonl").string(), 60);
  EXPECT_EQ(encode.exit_code, 1) << encode.output;
  EXPECT_NE(encode.output.find("choose the field with --field)"), std::string::npos) << encode.output;
  fs::remove_all(dir);
}

// One parser for token ids on every command line (score --tokens, generate --prompt-tokens,
// tokenizer decode --ids and --ids-file lines): commas or whitespace, non-negative integers.
TEST(Tokenizer, TokenIdListsParseCommasAndSpacesAndNameTheBadEntry) {
  using loom::data::parse_token_ids;
  EXPECT_EQ(parse_token_ids("1,2,3", "--tokens"), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(parse_token_ids(" 4 5,\t6\n", "--ids"), (std::vector<int64_t>{4, 5, 6}));
  EXPECT_EQ(parse_token_ids("7, 8", "--prompt-tokens"), (std::vector<int64_t>{7, 8}));
  EXPECT_TRUE(parse_token_ids("", "--ids").empty());
  for (const char* bad : {"1,x,3", "1,-2", "3.5", "1,99999999999999999999"}) {
    SCOPED_TRACE(bad);
    loom::testing::expect_error<loom::UsageError>([&] { parse_token_ids(bad, "--tokens"); },
                                                  {"--tokens: '", "' is not a token id"});
  }
  // Issue 46 (11): an empty entry is an error, not a separator (it shifted every later id).
  for (const char* bad : {"1,,2", ",1", "1,2,", "1, ,2"}) {
    SCOPED_TRACE(bad);
    loom::testing::expect_error<loom::UsageError>([&] { parse_token_ids(bad, "--tokens"); },
                                                  {"--tokens: an empty entry"});
  }
}
