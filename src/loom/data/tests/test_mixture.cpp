// Weighted mixtures (TokenCorpus::mix), a loader state that reshards across data-parallel degrees,
// and tokenizing on worker threads (ParallelEncoder).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "loom/core/build_paths.h"
#include "loom/core/error.h"
#include "loom/data/loader.h"
#include "loom/data/parallel_encoder.h"
#include "loom/data/sources.h"
#include "loom/data/tokenizer.h"
#include "loom/testing/errors.h"

using namespace loom::data;

// A named namespace: the folder's tests compile in unity batches, where test_loader.cpp's
// anonymous-namespace helpers would collide with these.
namespace mixture_tests {

template <typename Fn>
void expect_mixture_usage_error(Fn&& fn, const std::string& part) {
  loom::testing::expect_error<loom::UsageError>(std::forward<Fn>(fn), {part});
}

constexpr int64_t kBos = 1000, kEos = 1001;

// `count` documents whose first token names them: source * 100000 + index, then `length` - 1
// filler ids.
std::shared_ptr<const TokenCorpus> named_documents(int64_t source, int64_t count, int64_t length) {
  std::vector<std::vector<int64_t>> docs;
  for (int64_t i = 0; i < count; ++i) {
    std::vector<int64_t> d(static_cast<size_t>(length), 7);
    d[0] = source * 100000 + i;
    docs.push_back(std::move(d));
  }
  return TokenCorpus::from_documents(docs, kBos, kEos);
}

// The name (first token) of each document of the stream, in order.
std::vector<int64_t> document_names(const TokenCorpus& corpus) {
  std::vector<int64_t> names;
  const int64_t n = corpus.stream_length();
  std::vector<int64_t> tokens(n), positions(n), documents(n);
  corpus.read_stream(0, n, tokens.data(), positions.data(), documents.data());
  for (int64_t i = 0; i < n; ++i) {
    if (positions[i] == 1) names.push_back(tokens[i]);
  }
  return names;
}

std::vector<MixtureSource> three_sources() {
  return {{named_documents(0, 6000, 5), 0.5, "a"}, {named_documents(1, 1000, 9), 0.3, "b"},
          {named_documents(2, 300, 3), 0.2, "c"}};
}

TEST(DataMixture, SharesFollowTheWeightsWithinOnePercentOverTenThousandDocuments) {
  auto mixed = TokenCorpus::mix(three_sources(), 7);
  const std::vector<int64_t> names = document_names(*mixed);
  ASSERT_GE(names.size(), 10000u);
  // Every prefix, and the 10,000-document one the issue names in particular.
  for (size_t prefix : {size_t{100}, size_t{1000}, size_t{10000}, names.size()}) {
    std::map<int64_t, int64_t> count;
    for (size_t i = 0; i < prefix; ++i) ++count[names[i] / 100000];
    const double n = static_cast<double>(prefix);
    EXPECT_NEAR(count[0] / n, 0.5, 0.01) << prefix;
    EXPECT_NEAR(count[1] / n, 0.3, 0.01) << prefix;
    EXPECT_NEAR(count[2] / n, 0.2, 0.01) << prefix;
  }
  EXPECT_EQ(mixed->mixture_counts(10000), (std::vector<int64_t>{5000, 3000, 2000}));
}

TEST(DataMixture, TheSameSeedGivesTheSameOrderAndAnotherSeedAnother) {
  const auto a = document_names(*TokenCorpus::mix(three_sources(), 7));
  const auto b = document_names(*TokenCorpus::mix(three_sources(), 7));
  const auto c = document_names(*TokenCorpus::mix(three_sources(), 8));
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
}

TEST(DataMixture, AnEpochGivesEveryDocumentOfEverySourceAndKeepsEachSourcesOrder) {
  auto mixed = TokenCorpus::mix(three_sources(), 3);
  const auto names = document_names(*mixed);
  // Source a (6000 documents at 0.5) sets the epoch: 12000 documents; b and c repeat in order.
  EXPECT_EQ(mixed->num_documents(), static_cast<int64_t>(names.size()));
  std::map<int64_t, std::vector<int64_t>> per_source;
  for (int64_t name : names) per_source[name / 100000].push_back(name % 100000);
  EXPECT_EQ(per_source[0].size(), 6000u);
  for (int64_t s = 0; s < 3; ++s) {
    const int64_t size = s == 0 ? 6000 : s == 1 ? 1000 : 300;
    for (size_t i = 0; i < per_source[s].size(); ++i) ASSERT_EQ(per_source[s][i], static_cast<int64_t>(i) % size);
    EXPECT_GE(static_cast<int64_t>(per_source[s].size()), size);
  }
  // The mixed stream's tokens are the sources' documents: lengths follow the source.
  const int64_t n = mixed->stream_length();
  std::vector<int64_t> tokens(n), positions(n), documents(n);
  mixed->read_stream(0, n, tokens.data(), positions.data(), documents.data());
  for (int64_t i = 0; i + 1 < n; ++i) {
    if (positions[i] != 1) continue;
    const int64_t s = tokens[i] / 100000;
    const int64_t length = s == 0 ? 5 : s == 1 ? 9 : 3;
    ASSERT_EQ(tokens[i - 1], kBos);
    ASSERT_EQ(tokens[i + length], kEos) << i;
    ASSERT_EQ(documents[i], documents[i - 1]);
  }
  EXPECT_EQ(mixed->num_tokens(), 6000 * 5 + static_cast<int64_t>(per_source[1].size()) * 9 +
                                     static_cast<int64_t>(per_source[2].size()) * 3);
}

TEST(DataMixture, ASourceOfWeightZeroIsNeverReadAndBadWeightsAreUsageErrors) {
  auto mixed = TokenCorpus::mix({{named_documents(0, 50, 4), 1.0, "a"}, {named_documents(1, 50, 4), 0.0, "b"}}, 1);
  for (int64_t name : document_names(*mixed)) EXPECT_EQ(name / 100000, 0);
  expect_mixture_usage_error([] { TokenCorpus::mix({{named_documents(0, 5, 4), -1.0, "neg"}}, 1); },
                     "neg: weight -1 is not a finite number >= 0");
  expect_mixture_usage_error(
      [] { TokenCorpus::mix({{named_documents(0, 5, 4), 0.0, "a"}, {named_documents(1, 5, 4), 0.0, "b"}}, 1); },
      "every data source's weight is 0");
  expect_mixture_usage_error([] { TokenCorpus::mix({}, 1); }, "at least one source");
  auto other_ids = TokenCorpus::from_documents({{1, 2}}, 5, 6);
  expect_mixture_usage_error([&] { TokenCorpus::mix({{named_documents(0, 5, 4), 1.0, "a"}, {other_ids, 1.0, "b"}}, 1); },
                     "every source needs the same tokenizer");
}

// Rows read by `world` ranks of local batch `batch` for `steps` steps, starting from `state`:
// appended to `rows` (global row order), returns the state after.
nlohmann::json read_steps(const std::shared_ptr<const TokenCorpus>& corpus, int64_t seq_len, int64_t world,
                          int64_t batch, int64_t steps, const nlohmann::json& state,
                          std::vector<std::vector<int64_t>>& rows) {
  std::vector<DataLoader> ranks;
  for (int64_t r = 0; r < world; ++r) {
    ranks.emplace_back(corpus, DataLoaderOptions{seq_len, batch, r, world});
    if (!state.is_null()) ranks.back().load_state_dict(state);
  }
  for (int64_t s = 0; s < steps; ++s) {
    for (DataLoader& rank : ranks) {
      const Batch b = rank.next();
      for (int64_t i = 0; i < batch; ++i) {
        const auto row = b.inputs[i].contiguous();
        rows.emplace_back(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + seq_len);
      }
    }
  }
  const nlohmann::json after = ranks[0].state_dict();
  for (const DataLoader& rank : ranks) EXPECT_EQ(rank.state_dict(), after);  // every rank agrees
  return after;
}

// One epoch, saved at DP 4 after k steps and resumed at DP 2 (the acceptance): every
// document of the epoch appears exactly once, and the rows are those of one process.
void expect_resharded_epoch_reads_every_document_once(const std::shared_ptr<const TokenCorpus>& corpus) {
  const int64_t seq_len = 16, batch = 2;
  SequencePacker packer(corpus, seq_len);
  const int64_t rows_per_epoch = packer.rows_per_epoch();
  ASSERT_EQ(rows_per_epoch % 8, 0) << "pick a corpus whose epoch is whole DP 4 and DP 2 steps";
  std::vector<std::vector<int64_t>> rows;
  const int64_t k = 3;
  const nlohmann::json saved = read_steps(corpus, seq_len, 4, batch, k, nullptr, rows);
  EXPECT_EQ(saved.at("rows_consumed"), k * 4 * batch);
  read_steps(corpus, seq_len, 2, batch, (rows_per_epoch - k * 4 * batch) / (2 * batch), saved, rows);
  ASSERT_EQ(static_cast<int64_t>(rows.size()), rows_per_epoch);
  // The same rows as one process reading the epoch in order.
  for (int64_t r = 0; r < rows_per_epoch; ++r) {
    std::vector<int64_t> tokens(seq_len + 1), positions(seq_len + 1), documents(seq_len + 1);
    packer.read_row(r, tokens.data(), positions.data(), documents.data());
    ASSERT_EQ(rows[r], std::vector<int64_t>(tokens.begin(), tokens.begin() + seq_len)) << r;
  }
  // Each document's first token (its name) once, over the rows' inputs and each row's last label.
  std::multiset<int64_t> seen;
  for (int64_t r = 0; r < rows_per_epoch; ++r) {
    std::vector<int64_t> tokens(seq_len + 1), positions(seq_len + 1), documents(seq_len + 1);
    packer.read_row(r, tokens.data(), positions.data(), documents.data());
    for (int64_t i = 0; i < seq_len; ++i) {
      if (positions[i] == 1) seen.insert(tokens[i]);
    }
  }
  std::multiset<int64_t> expected;
  const auto names = document_names(*corpus);
  // Documents whose name lies inside the epoch's rows (the tail shorter than a row is dropped).
  std::vector<int64_t> t(corpus->stream_length()), p(corpus->stream_length()), d(corpus->stream_length());
  corpus->read_stream(0, corpus->stream_length(), t.data(), p.data(), d.data());
  for (int64_t i = 0; i < rows_per_epoch * (seq_len + 1); ++i) {
    if (p[i] == 1 && (i + 1) % (seq_len + 1) != 0) expected.insert(t[i]);
  }
  EXPECT_EQ(seen, expected);
  for (int64_t name : seen) EXPECT_LE(seen.count(name), corpus->mixture().empty() ? 1u : 1000u);
}

TEST(DataReshard, AnEpochSavedAtDp4AndResumedAtDp2ReadsEveryDocumentExactlyOnce) {
  // 136 documents of 7 tokens + BOS/EOS = 9 stream tokens each, 1224 = 72 rows of 17.
  auto corpus = named_documents(0, 136, 7);
  expect_resharded_epoch_reads_every_document_once(corpus);
}

TEST(DataReshard, AMixtureResumesAtAnotherDegreeWithItsSourcesPositions) {
  auto mixed = TokenCorpus::mix({{named_documents(0, 60, 7), 2.0, "a"}, {named_documents(1, 16, 7), 1.0, "b"}}, 5);
  // 60 / (2/3) = 90 documents of 9 stream tokens = 810 tokens: 47 rows; keep whole steps.
  SequencePacker packer(mixed, 16);
  std::vector<std::vector<int64_t>> rows;
  const nlohmann::json saved = read_steps(mixed, 16, 4, 2, 3, nullptr, rows);
  ASSERT_TRUE(saved.contains("sources"));
  const auto& sources = saved.at("sources");
  ASSERT_EQ(sources.size(), 2u);
  EXPECT_EQ(sources[0].at("weight"), 2.0);
  EXPECT_EQ(sources[1].at("documents"), 16);
  // 24 rows of 17 tokens = 408 stream tokens, inside document 45: 46 documents given.
  const int64_t given = sources[0].at("documents_given").get<int64_t>() + sources[1].at("documents_given").get<int64_t>();
  EXPECT_EQ(given, mixed->document_at(24 * 17) + 1);
  read_steps(mixed, 16, 2, 2, 2, saved, rows);
  for (size_t r = 0; r < rows.size(); ++r) {
    std::vector<int64_t> tokens(17), positions(17), documents(17);
    packer.read_row(static_cast<int64_t>(r), tokens.data(), positions.data(), documents.data());
    ASSERT_EQ(rows[r], std::vector<int64_t>(tokens.begin(), tokens.begin() + 16)) << r;
  }
  // A run with other weights cannot continue this state.
  auto reweighted = TokenCorpus::mix({{named_documents(0, 60, 7), 1.0, "a"}, {named_documents(1, 16, 7), 2.0, "b"}}, 5);
  DataLoader loader(reweighted, DataLoaderOptions{16, 2, 0, 2});
  nlohmann::json same_length = saved;
  same_length["stream_tokens"] = reweighted->stream_length();
  loom::testing::expect_error([&] { loader.load_state_dict(same_length); },
                              {"in the mixture a (weight 2, share 0.666667, 60 documents), b (weight 1",
                               "but this run mixes a (weight 1, share 0.333333", "same proportions"});
  // Issue 46 (11): the checks speak of the sources, not of packed tokens, even when the stream's
  // length differs too; and weights in proportion (4 and 2 after 2 and 1: the same shares, so the
  // same stream) resume.
  loom::testing::expect_error([&] { loader.load_state_dict(saved); }, {"in the mixture a (weight 2"});
  auto proportional = TokenCorpus::mix({{named_documents(0, 60, 7), 4.0, "a"}, {named_documents(1, 16, 7), 2.0, "b"}}, 5);
  EXPECT_EQ(proportional->stream_length(), mixed->stream_length());
  DataLoader scaled(proportional, DataLoaderOptions{16, 2, 0, 2});
  EXPECT_NO_THROW(scaled.load_state_dict(saved));
}

TEST(ParallelEncoder, WorkersGiveTheSerialTokensInInputOrder) {
  const Tokenizer tok = Tokenizer::from_file(loom::kSourceDir + std::string("/data/default/tokenizer.json"));
  std::vector<std::string> docs;
  std::ifstream in(loom::kSourceDir + std::string("/data/default/corpus.jsonl"));
  std::string line;
  while (std::getline(in, line) && docs.size() < 6000) docs.push_back(nlohmann::json::parse(line).at("text"));
  std::vector<std::vector<int64_t>> serial;
  for (const auto& d : docs) serial.push_back(tok.encode(d));
  for (int64_t workers : {1, 2, 3, 4}) {
    std::vector<std::vector<int64_t>> out;
    ParallelEncoder encoder(tok, workers, [&](const std::vector<int64_t>& t) { out.push_back(t); });
    for (const auto& d : docs) encoder.add(d);
    encoder.finish();
    EXPECT_EQ(out, serial) << workers << " workers";
  }
  // Dropped unfinished: destroying an encoder with queued work neither hangs nor delivers.
  int delivered = 0;
  {
    ParallelEncoder encoder(tok, 2, [&](const std::vector<int64_t>&) { ++delivered; });
    for (int i = 0; i < 100; ++i) encoder.add(docs[i]);
  }
  EXPECT_EQ(delivered, 0);
}

}  // namespace mixture_tests
