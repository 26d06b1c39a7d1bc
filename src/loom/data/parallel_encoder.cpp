#include "loom/data/parallel_encoder.h"

namespace loom::data {

ParallelEncoder::ParallelEncoder(const Tokenizer& tokenizer, int64_t workers, Sink sink)
    : tokenizer_(tokenizer), sink_(std::move(sink)), workers_(std::max<int64_t>(1, workers)) {
  if (workers_ == 1) return;
  for (int64_t i = 0; i < workers_; ++i) threads_.emplace_back([this] { work(); });
}

ParallelEncoder::~ParallelEncoder() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void ParallelEncoder::add(std::string_view document) {
  if (workers_ == 1) {
    sink_(tokenizer_.encode(document));
    return;
  }
  if (!filling_) filling_ = std::make_shared<Batch>();
  filling_->documents.emplace_back(document);
  filling_bytes_ += document.size() + 64;  // a batch of many tiny documents is still bounded
  if (filling_bytes_ >= kBatchBytes) submit();
}

void ParallelEncoder::submit() {
  if (!filling_) return;
  // Bounded look-ahead: the oldest batch is delivered (waiting for it) before another is queued.
  while (in_flight_.size() >= static_cast<size_t>(4 * workers_)) deliver_oldest();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(filling_);
  }
  in_flight_.push_back(std::move(filling_));
  filling_.reset();
  filling_bytes_ = 0;
  work_ready_.notify_one();
}

void ParallelEncoder::deliver_oldest() {
  std::shared_ptr<Batch> batch = in_flight_.front();
  {
    std::unique_lock<std::mutex> lock(mutex_);
    batch_done_.wait(lock, [&] { return batch->done; });
  }
  in_flight_.pop_front();
  if (batch->error) std::rethrow_exception(batch->error);
  for (const auto& tokens : batch->tokens) sink_(tokens);
}

void ParallelEncoder::finish() {
  if (workers_ == 1) return;
  submit();
  while (!in_flight_.empty()) deliver_oldest();
}

void ParallelEncoder::work() {
  while (true) {
    std::shared_ptr<Batch> batch;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_ready_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      batch = queue_.front();
      queue_.pop_front();
    }
    try {
      batch->tokens.reserve(batch->documents.size());
      for (const std::string& document : batch->documents) batch->tokens.push_back(tokenizer_.encode(document));
    } catch (...) {
      batch->error = std::current_exception();
    }
    batch->documents = {};
    {
      std::lock_guard<std::mutex> lock(mutex_);
      batch->done = true;
    }
    batch_done_.notify_all();
  }
}

}  // namespace loom::data
