#include "loom/checkpoint/group.h"

#include <torch/torch.h>

#include <cstring>

#include "loom/core/error.h"
#include "loom/distributed/comm.h"

namespace loom::checkpoint {
namespace {

class SingleProcessGroup final : public CheckpointGroup {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::vector<std::string> all_gather(const std::string& bytes) override { return {bytes}; }
  int64_t all_reduce_max(int64_t value) override { return value; }
  void barrier() override {}
};

class CommGroup final : public CheckpointGroup {
 public:
  explicit CommGroup(std::shared_ptr<distributed::Comm> comm) : comm_(std::move(comm)) {}
  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }

  std::vector<std::string> all_gather(const std::string& bytes) override {
    const int n = size();
    auto length = torch::tensor({static_cast<int64_t>(bytes.size())}, torch::kInt64);
    auto lengths = torch::empty({n}, torch::kInt64);
    comm_->all_gather_into_tensor(lengths, length);
    const int64_t longest = lengths.max().item<int64_t>();
    auto padded = torch::zeros({std::max<int64_t>(longest, 1)}, torch::kUInt8);
    std::memcpy(padded.data_ptr<uint8_t>(), bytes.data(), bytes.size());
    auto gathered = torch::empty({n * padded.numel()}, torch::kUInt8);
    comm_->all_gather_into_tensor(gathered, padded);
    std::vector<std::string> out(static_cast<size_t>(n));
    const auto* base = reinterpret_cast<const char*>(gathered.data_ptr<uint8_t>());
    for (int r = 0; r < n; ++r) {
      out[static_cast<size_t>(r)].assign(base + r * padded.numel(),
                                         static_cast<size_t>(lengths[r].item<int64_t>()));
    }
    return out;
  }

  int64_t all_reduce_max(int64_t value) override {
    auto t = torch::tensor({value}, torch::kInt64);
    comm_->all_reduce(t, distributed::ReduceOp::kMax);
    return t.item<int64_t>();
  }

  void barrier() override { comm_->barrier(); }

 private:
  std::shared_ptr<distributed::Comm> comm_;
};

}  // namespace

std::shared_ptr<CheckpointGroup> single_process_group() {
  return std::make_shared<SingleProcessGroup>();
}

std::shared_ptr<CheckpointGroup> comm_group(std::shared_ptr<distributed::Comm> comm) {
  LOOM_REQUIRE(comm != nullptr, "comm_group needs a communicator; use single_process_group() for "
               "a run without one");
  return std::make_shared<CommGroup>(std::move(comm));
}

}  // namespace loom::checkpoint
