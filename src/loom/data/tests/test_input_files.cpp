// User-given data files that are not plain data: a FIFO, a device, an empty or too short corpus, a
// JSONL record too large to quote. Each is a one-line error (exit 2 where no restart can help)
// naming the setting and the path, and none blocks: before the fix, opening a FIFO with no writer
// waited forever (the watchdog below turns that into a failure instead of a hung suite).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <mutex>
#include <thread>

#include "loom/core/error.h"
#include "loom/data/loader.h"
#include "loom/data/sources.h"
#include "loom/data/tokenizer.h"
#include "loom/testing/errors.h"
#include "loom/testing/files.h"

namespace fs = std::filesystem;

namespace test_input_files {

using loom::testing::expect_error;

// Runs `fn`; if it has not returned after `seconds` (it blocked on an open), fails the test and
// ends the process, since a thread stuck in open() cannot be stopped.
void within_seconds(int seconds, const std::function<void()>& fn) {
  std::mutex mutex;
  std::condition_variable done_cv;
  bool done = false;
  std::thread watchdog([&] {
    std::unique_lock<std::mutex> lock(mutex);
    if (!done_cv.wait_for(lock, std::chrono::seconds(seconds), [&] { return done; })) {
      ADD_FAILURE() << "blocked for " << seconds << " s (an open of a FIFO waiting for a writer)";
      std::fprintf(stderr, "blocked: ending the test process\n");
      std::_Exit(1);
    }
  });
  fn();
  {
    std::lock_guard<std::mutex> lock(mutex);
    done = true;
  }
  done_cv.notify_one();
  watchdog.join();
}

fs::path make_fifo(const fs::path& dir) {
  const fs::path fifo = dir / "pipe.jsonl";
  EXPECT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  return fifo;
}

// A token file of `documents` (ids below 10; BOS 1, EOS 2, vocabulary 10).
fs::path write_tokens(const fs::path& path, const std::vector<std::vector<int64_t>>& documents) {
  loom::data::TokenFileWriter writer(path.string(), 10, 1, 2);
  for (const auto& d : documents) writer.add_document(d);
  writer.close();
  return path;
}

}  // namespace test_input_files

using namespace loom::data;
using namespace test_input_files;

TEST(InputFiles, FifoIsRefusedWithoutBlocking) {
  const fs::path dir = loom::testing::temp_dir();
  const fs::path fifo = make_fifo(dir);
  within_seconds(10, [&] {
    // Resolving a spec (what the Trainer does before rendezvous): stat only.
    expect_error<loom::UsageError>([&] { resolve_inputs({fifo.string()}, "training.dataset_path"); },
                                   {"training.dataset_path = \"" + fifo.string() + "\"", "FIFO (named pipe)",
                                    "not a regular file"});
    // A glob that matches it.
    expect_error<loom::UsageError>([&] { resolve_inputs({(dir / "*.jsonl").string()}, "validation.dataset_path"); },
                                   {fifo.string(), "matched by validation.dataset_path", "FIFO"});
    // Every reader opens without blocking and refuses it, whoever calls it.
    expect_error<loom::UsageError>([&] { read_file(fifo.string(), "tokenizer"); }, {"tokenizer '" + fifo.string() + "'", "FIFO"});
    expect_error<loom::UsageError>([&] { Tokenizer::from_file(fifo.string()); }, {fifo.string(), "FIFO"});
    expect_error<loom::UsageError>([&] { is_token_file(fifo.string()); }, {fifo.string(), "FIFO"});
    expect_error<loom::UsageError>([&] { TokenFile file(fifo.string()); }, {"token file", "FIFO"});
    expect_error<loom::UsageError>([&] { for_each_text_document(fifo.string(), {}, [](std::string_view) {}); },
                                   {fifo.string(), "FIFO"});
    SourceOptions options;
    options.inputs_setting = "validation.dataset_path";
    expect_error<loom::UsageError>([&] { TokenCorpus::load({fifo.string()}, nullptr, options); },
                                   {"validation.dataset_path", "FIFO"});
    // Devices too (a socket cannot even be opened; /dev/null would read as an empty corpus).
    expect_error<loom::UsageError>([&] { resolve_inputs({"/dev/null"}); }, {"'/dev/null'", "character device"});
    expect_error<loom::UsageError>([&] { read_file("/dev/zero", "text file"); }, {"/dev/zero", "character device"});
  });
  // A folder still gives its regular files, skipping the FIFO beside them.
  write_tokens(dir / "corpus.bin", {{3, 4, 5}});
  EXPECT_EQ(resolve_inputs({dir.string()}), (std::vector<std::string>{(dir / "corpus.bin").string()}));
  EXPECT_EQ(resolve_inputs({(dir / "*.bin").string()}), (std::vector<std::string>{(dir / "corpus.bin").string()}));
  // A missing input is a configuration mistake too.
  expect_error<loom::UsageError>([&] { resolve_inputs({(dir / "nope").string()}, "training.dataset_path"); },
                                 {"training.dataset_path = \"" + (dir / "nope").string() + "\" does not exist"});
  fs::remove_all(dir);
}

// Issue 22, item 9: the corpus named by the setting that gave it, with exit 2, so an empty or short
// validation set is not reported as the training data.
TEST(InputFiles, EmptyOrShortDataNamesItsSetting) {
  const fs::path dir = loom::testing::temp_dir();
  SourceOptions options;
  options.inputs_setting = "validation.dataset_path";
  const fs::path empty = write_tokens(dir / "empty.bin", {});
  expect_error<loom::UsageError>([&] { TokenCorpus::load({empty.string()}, nullptr, options); },
                                 {"validation.dataset_path = \"" + empty.string() + "\" holds no documents"});
  const fs::path short_file = write_tokens(dir / "short.bin", {{3, 4, 5}});
  const auto corpus = TokenCorpus::load({short_file.string()}, nullptr, options);
  expect_error<loom::UsageError>([&] { SequencePacker rejected(corpus, 64, "validation.seq_len"); },
                                 {"validation.dataset_path = \"" + short_file.string() + "\" packs into 5 tokens",
                                  "fewer than one row of validation.seq_len + 1 = 65", "shorter validation.seq_len"});
  // The training loader names its own settings.
  options.inputs_setting = "training.dataset_path";
  const auto training = TokenCorpus::load({short_file.string()}, nullptr, options);
  DataLoaderOptions loader{64, 1, 0, 1, "training.seq_len"};
  expect_error<loom::UsageError>([&] { DataLoader rejected(training, loader); },
                                 {"training.dataset_path = \"", "training.seq_len + 1 = 65"});
  fs::remove_all(dir);
}

// Issue 22, item 10: a parse error quotes the start of a huge record and its size, not all of it.
TEST(InputFiles, JsonlErrorQuotesAnExcerptOfAHugeRecord) {
  const fs::path dir = loom::testing::temp_dir();
  const fs::path file = dir / "big.jsonl";
  // An unterminated string: nlohmann's message quotes everything it read, i.e. the whole record.
  loom::testing::write(file, "{\"text\": \"ok\"}\n{\"text\": \"" + std::string(1'000'000, 'a') + "\n");
  try {
    for_each_text_document(file.string(), {}, [](std::string_view) {});
    ADD_FAILURE() << "no error";
  } catch (const loom::Error& e) {
    const std::string message = e.what();
    EXPECT_LT(message.size(), 600u) << message.substr(0, 600);
    EXPECT_NE(message.find(file.string() + ":2: not valid JSON"), std::string::npos) << message;
    EXPECT_NE(message.find("\"aaaa"), std::string::npos) << message;
    EXPECT_NE(message.find(" bytes)"), std::string::npos) << message;
  }
  fs::remove_all(dir);
}
