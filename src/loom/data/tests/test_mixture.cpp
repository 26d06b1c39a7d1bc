// Weighted mixtures (TokenCorpus::mix), a loader state that reshards across data-parallel degrees,
// and tokenizing on worker threads (ParallelEncoder).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include <sys/resource.h>
#include <chrono>
#include <random>
#include <tuple>

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
  // Within one document of the share at every count (stride scheduling's bound).
  const std::vector<int64_t> counts = mixed->mixture_counts(10000);
  EXPECT_NEAR(counts[0], 5000, 1);
  EXPECT_NEAR(counts[1], 3000, 1);
  EXPECT_NEAR(counts[2], 2000, 1);
  EXPECT_EQ(counts[0] + counts[1] + counts[2], 10000);
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

// Issue 46 (4): the mixture is stride scheduling, computed per lookup; here it is checked against
// the schedule written out: every document's key (pass, source) sorted, documents past the epoch's
// last first-time document dropped.
TEST(DataMixture, TheIndexEqualsTheStrideScheduleWrittenOut) {
  const std::vector<std::vector<MixtureSource>> mixtures = {
      three_sources(),
      {{named_documents(0, 40, 3), 1.0, "a"}, {named_documents(1, 7, 6), 1.0, "b"}},
      {{named_documents(0, 30, 2), 0.25, "a"}, {named_documents(1, 30, 4), 0.0, "zero"},
       {named_documents(2, 3, 5), 0.75, "c"}, {named_documents(3, 11, 1), 0.5, "d"}},
  };
  for (uint64_t seed : {1, 2, 3}) {
    for (const auto& sources : mixtures) {
      auto mixed = TokenCorpus::mix(sources, seed);
      // The schedule written out: each weighted source's documents keyed (offset + k * stride,
      // source), sorted, up to the latest key among the sources' last first-time documents.
      using Pass = unsigned __int128;
      double total = 0;
      for (const auto& m : sources) total += m.weight;
      std::mt19937_64 rng(seed);
      std::uniform_real_distribution<double> uniform(0.0, 1.0);
      std::vector<std::tuple<Pass, size_t, int64_t>> keys;
      std::tuple<Pass, size_t, int64_t> end{0, 0, 0};
      std::vector<Pass> stride(sources.size()), offset(sources.size());
      for (size_t j = 0; j < sources.size(); ++j) {
        if (sources[j].weight == 0) continue;
        stride[j] = static_cast<Pass>(std::ldexp(static_cast<long double>(total) / sources[j].weight, 40) + 0.5L);
        offset[j] = static_cast<Pass>(uniform(rng) * static_cast<long double>(stride[j]));
        const int64_t n = sources[j].corpus->num_documents();
        end = std::max(end, std::tuple<Pass, size_t, int64_t>{offset[j] + static_cast<Pass>(n - 1) * stride[j], j, 0});
      }
      for (size_t j = 0; j < sources.size(); ++j) {
        if (sources[j].weight == 0) continue;
        for (int64_t k = 0; offset[j] + static_cast<Pass>(k) * stride[j] <= std::get<0>(end); ++k) {
          keys.emplace_back(offset[j] + static_cast<Pass>(k) * stride[j], j, k);
        }
      }
      std::sort(keys.begin(), keys.end());
      while (!keys.empty() && std::make_pair(std::get<0>(keys.back()), std::get<1>(keys.back())) >
                                  std::make_pair(std::get<0>(end), std::get<1>(end))) {
        keys.pop_back();
      }
      const std::vector<int64_t> names = document_names(*mixed);
      ASSERT_EQ(names.size(), keys.size());
      for (size_t i = 0; i < keys.size(); ++i) {
        const auto [pass, j, k] = keys[i];
        ASSERT_EQ(names[i], static_cast<int64_t>(j) * 100000 + k % sources[j].corpus->num_documents()) << i;
      }
      ASSERT_EQ(static_cast<int64_t>(names.size()), mixed->num_documents());
      std::vector<int64_t> given(sources.size(), 0);
      for (size_t i = 0; i < names.size(); ++i) {
        const int64_t s = names[i] / 100000;
        ASSERT_GT(sources[s].weight, 0.0);
        ASSERT_EQ(names[i] % 100000, given[s] % sources[s].corpus->num_documents()) << i;
        ++given[s];
        // Every prefix holds each source within two documents of its share.
        for (size_t j = 0; j < sources.size(); ++j) {
          ASSERT_NEAR(static_cast<double>(given[j]), (i + 1) * sources[j].weight / total, 2.0) << i << " " << j;
        }
        // The index's random access agrees with the sequential read.
        if (i % 7 == 0) {
          const std::vector<int64_t> counts = mixed->mixture_counts(static_cast<int64_t>(i + 1));
          ASSERT_EQ(counts, given) << i;
        }
      }
      // The epoch ends when every weighted source has given each document once.
      for (size_t j = 0; j < sources.size(); ++j) {
        if (sources[j].weight > 0) EXPECT_GE(given[j], sources[j].corpus->num_documents());
      }
      EXPECT_EQ(mixed->mixture_counts(mixed->num_documents()), given);
      // document_at over every stream position.
      const int64_t n = mixed->stream_length();
      std::vector<int64_t> tokens(n), positions(n), documents(n);
      mixed->read_stream(0, n, tokens.data(), positions.data(), documents.data());
      for (int64_t p = 0; p < n; p += 3) ASSERT_EQ(mixed->document_at(p), documents[p]) << p;
      // Reads starting anywhere equal the whole read's slice.
      for (int64_t start : {int64_t{0}, n / 3, n / 2 + 1, n - 5}) {
        std::vector<int64_t> t(5), q(5), d(5);
        mixed->read_stream(start, 5, t.data(), q.data(), d.data());
        for (int64_t i = 0; i < 5; ++i) {
          ASSERT_EQ(t[i], tokens[start + i]);
          ASSERT_EQ(q[i], positions[start + i]);
          ASSERT_EQ(d[i], documents[start + i]);
        }
      }
    }
  }
}

// Issue 46 (4): a small weight on a large source made an epoch index of 20 bytes per mixed
// document (two billion documents here: 40 GB, then the OOM killer). The index is a few words per
// source: the mixture is made at once, in no memory to speak of, and reads anywhere in its epoch.
TEST(DataMixture, ATinyWeightOnALargeSourceBuildsNoIndexPerDocument) {
  struct rusage before {};
  getrusage(RUSAGE_SELF, &before);
  auto large = named_documents(0, 2000, 3);
  auto filler = named_documents(1, 50, 4);
  const auto start = std::chrono::steady_clock::now();
  auto mixed = TokenCorpus::mix({{large, 1e-6, "large"}, {filler, 1.0 - 1e-6, "filler"}}, 9);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 1.0);
  // The large source's 2000 documents at a share of 1e-6: about 2e9 documents in the epoch.
  EXPECT_NEAR(static_cast<double>(mixed->num_documents()), 2e9, 2e9 * 1e-3);
  const std::vector<int64_t> epoch = mixed->mixture_counts(mixed->num_documents());
  EXPECT_EQ(epoch[0], 2000);
  EXPECT_EQ(epoch[0] + epoch[1], mixed->num_documents());
  // Rows deep in the epoch read as anywhere else.
  SequencePacker packer(mixed, 64);
  const int64_t rows = packer.rows_per_epoch();
  for (int64_t row : {int64_t{0}, rows / 2, rows - 1}) {
    std::vector<int64_t> tokens(65), positions(65), documents(65);
    packer.read_row(row, tokens.data(), positions.data(), documents.data());
    for (int64_t i = 0; i < 65; ++i) ASSERT_TRUE(positions[i] > 0 || tokens[i] == kBos) << row;
  }
  // The large source's k-th document sits where its count passes k: find document 1000 of it by
  // the counts and read it.
  int64_t lo = 0, hi = mixed->num_documents();
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (mixed->mixture_counts(mid + 1)[0] > 1000) hi = mid; else lo = mid + 1;
  }
  const int64_t position = [&] {  // the document's BOS: search the stream by document
    int64_t a = 0, b = mixed->stream_length() - 1;
    while (a < b) {
      const int64_t m = a + (b - a) / 2;
      if (mixed->document_at(m) >= lo) b = m; else a = m + 1;
    }
    return a;
  }();
  std::vector<int64_t> t(2), q(2), d(2);
  mixed->read_stream(position, 2, t.data(), q.data(), d.data());
  EXPECT_EQ(t[0], kBos);
  EXPECT_EQ(t[1], 1000);
  struct rusage after {};
  getrusage(RUSAGE_SELF, &after);
  EXPECT_LT(after.ru_maxrss - before.ru_maxrss, 64 * 1024) << "peak resident set grew by more than 64 MiB";
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
