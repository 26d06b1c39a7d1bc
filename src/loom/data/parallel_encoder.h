// Tokenizing documents on worker threads (training.data_workers, `loom tokenizer pretokenize
// --workers`), handing the tokens back in input order.
//
// The reader (the caller's thread) cuts documents into batches of about kBatchBytes of text; the
// workers encode whole batches, and the caller receives each batch's documents in input order
// once it is done, on its own thread (so the sink needs no lock). At most 4 batches per worker are
// in flight, which bounds memory whatever the corpus size. One worker encodes on the caller's
// thread, as before workers existed.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "loom/data/tokenizer.h"

namespace loom::data {

class ParallelEncoder {
 public:
  using Sink = std::function<void(const std::vector<int64_t>& tokens)>;
  static constexpr size_t kBatchBytes = size_t{256} << 10;

  ParallelEncoder(const Tokenizer& tokenizer, int64_t workers, Sink sink);
  ~ParallelEncoder();  // stops the workers; documents not yet delivered are dropped
  ParallelEncoder(const ParallelEncoder&) = delete;
  ParallelEncoder& operator=(const ParallelEncoder&) = delete;

  // Queues one document (copied); may deliver earlier documents to the sink.
  void add(std::string_view document);
  // Delivers every queued document; rethrows a worker's exception.
  void finish();

 private:
  struct Batch {
    std::vector<std::string> documents;
    std::vector<std::vector<int64_t>> tokens;
    bool done = false;
    std::exception_ptr error;
  };
  void submit();
  void deliver_oldest();
  void work();

  const Tokenizer& tokenizer_;
  Sink sink_;
  int64_t workers_;
  std::shared_ptr<Batch> filling_;
  size_t filling_bytes_ = 0;
  std::deque<std::shared_ptr<Batch>> in_flight_;  // input order
  std::deque<std::shared_ptr<Batch>> queue_;      // not yet taken by a worker
  std::mutex mutex_;
  std::condition_variable work_ready_, batch_done_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace loom::data
