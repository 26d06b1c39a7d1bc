// Test support: a training state with known values, laid out the way the parallel layouts lay it
// out (FSDP flat shards, HSDP, block-cyclic ragged pieces, whole tensors), and ranks simulated by
// threads in one process. Used by the unit tests and by loom_checkpoint_worker.
#pragma once
#include <torch/torch.h>

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "loom/checkpoint/group.h"
#include "loom/checkpoint/state_dict.h"

namespace loom::checkpoint::testing {

struct Spec {
  std::string name;
  std::string component;
  std::vector<int64_t> shape;
  c10::ScalarType dtype;
  bool replicated = false;  // every rank holds it whole, whatever the layout
};

// Model and optimizer tensors of mixed shapes and dtypes, including a 0-dim step counter and a
// tensor whose rows do not divide evenly over any rank count.
inline std::vector<Spec> training_specs() {
  return {
      {"model.tok_embeddings.weight", "model", {37, 16}, c10::kFloat},
      {"model.layers.0.attention.wq.weight", "model", {16, 16}, c10::kBFloat16},
      {"model.layers.0.attention_norm.weight", "model", {16}, c10::kFloat},
      {"model.output.weight", "model", {7, 3}, c10::kHalf},
      {"optimizer.tok_embeddings.weight.exp_avg", "optimizer", {37, 16}, c10::kFloat},
      {"optimizer.tok_embeddings.weight.exp_avg_sq", "optimizer", {37, 16}, c10::kFloat},
      {"optimizer.step", "optimizer", {}, c10::kFloat, true},
      {"lr_scheduler.last_step", "lr_scheduler", {}, c10::kLong, true},
  };
}

// Bigger state for throughput: `mib` MiB of float32 in a few tensors.
inline std::vector<Spec> bulk_specs(int64_t mib) {
  const int64_t rows = mib * (1 << 20) / 4 / 4 / 1024;  // 4 tensors of rows x 1024 floats
  std::vector<Spec> specs;
  for (int i = 0; i < 4; ++i) {
    specs.push_back({"model.w" + std::to_string(i), "model", {rows, 1024}, c10::kFloat});
  }
  return specs;
}

// The global value of `spec` for version `salt` (different salts = different training steps).
inline torch::Tensor global_value(const Spec& spec, int salt) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(std::hash<std::string>{}(spec.name) + salt);
  if (c10::isFloatingType(spec.dtype)) return torch::randn(spec.shape, gen).to(spec.dtype);
  return torch::randint(0, 1 << 20, spec.shape, gen).to(spec.dtype);
}

// One flat element range of a tensor held by a rank: of the whole tensor, or of a box of it.
struct Piece {
  int64_t begin;
  int64_t end;
  std::vector<int64_t> box_offsets = {};  // empty: the whole tensor
  std::vector<int64_t> box_sizes = {};
};

// The elements of `global` a piece holds, flat.
inline torch::Tensor piece_values(const torch::Tensor& global, const Piece& p) {
  torch::Tensor region = global;
  for (size_t d = 0; d < p.box_offsets.size(); ++d) {
    region = region.narrow(static_cast<int64_t>(d), p.box_offsets[d], p.box_sizes[d]);
  }
  return region.reshape(-1).narrow(0, p.begin, p.end - p.begin);
}

using Layout = std::function<std::vector<Piece>(const Spec&, size_t index)>;

inline int64_t numel_of(const Spec& s) {
  int64_t n = 1;
  for (const int64_t d : s.shape) n *= d;
  return n;
}

// FSDP flat-buffer sharding: every tensor concatenated into one buffer, split into W equal shards;
// rank r's pieces are its shard's intersections with the tensors (ragged, rows cut anywhere).
inline Layout fsdp_layout(const std::vector<Spec>& specs, int world, int rank) {
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (const Spec& s : specs) {
    offsets.push_back(total);
    total += numel_of(s);
  }
  const int64_t shard = (total + world - 1) / world;
  return [offsets, shard, rank](const Spec& s, size_t i) -> std::vector<Piece> {
    const int64_t lo = std::max(offsets[i], rank * shard);
    const int64_t hi = std::min(offsets[i] + numel_of(s), (rank + 1) * shard);
    if (lo >= hi) return {};
    return {{lo - offsets[i], hi - offsets[i]}};
  };
}

// HSDP: `replicas` copies of an FSDP layout over `shards` ranks; rank = replica * shards + shard.
inline Layout hsdp_layout(const std::vector<Spec>& specs, int shards, int rank) {
  return fsdp_layout(specs, shards, rank % shards);
}

// Block-cyclic: blocks of `block` elements dealt round-robin, so a rank holds many disjoint pieces
// of each tensor.
inline Layout block_cyclic_layout(int world, int rank, int64_t block) {
  return [world, rank, block](const Spec& s, size_t) {
    std::vector<Piece> out;
    const int64_t n = numel_of(s);
    for (int64_t b = rank * block; b < n; b += world * block) out.push_back({b, std::min(n, b + block)});
    return out;
  };
}

// Tensor parallel: dim `dim` split into `world` consecutive boxes (uneven sizes allowed, as a
// chunk of torch.chunk); tensors with fewer dims are replicated. With `fsdp` > 1, each box's
// flattening is further split into `fsdp` equal ranges (FSDP over TP); rank = dp * world + tp.
inline Layout tp_layout(int world, int rank, int64_t dim, int fsdp = 1) {
  const int tp_rank = rank % world, dp_rank = rank / world;
  return [=](const Spec& s, size_t) -> std::vector<Piece> {
    std::vector<int64_t> offsets(s.shape.size(), 0), sizes = s.shape;
    if (dim < static_cast<int64_t>(s.shape.size())) {
      const int64_t n = s.shape[static_cast<size_t>(dim)];
      const int64_t piece = (n + world - 1) / world;
      offsets[static_cast<size_t>(dim)] = std::min(n, piece * tp_rank);
      sizes[static_cast<size_t>(dim)] = std::min(n, piece * (tp_rank + 1)) - offsets[static_cast<size_t>(dim)];
    }
    int64_t numel = 1;
    for (int64_t d : sizes) numel *= d;
    const int64_t part = (numel + fsdp - 1) / fsdp;
    const int64_t lo = std::min(numel, part * dp_rank), hi = std::min(numel, part * (dp_rank + 1));
    if (lo >= hi) return {};
    if (s.shape.empty()) return {{lo, hi}};
    return {{lo, hi, offsets, sizes}};
  };
}

// Everything on every rank (single process, or fully replicated).
inline Layout full_layout() {
  return [](const Spec& s, size_t) { return std::vector<Piece>{{0, numel_of(s)}}; };
}

// The state dict of one rank: with `salt` >= 0 chunks hold the values of that version, else NaN
// (or -1 for integers) so a test sees what a load did not write.
inline ShardedStateDict make_state(const std::vector<Spec>& specs, const Layout& layout, int salt) {
  ShardedStateDict state;
  for (size_t i = 0; i < specs.size(); ++i) {
    const Spec& s = specs[i];
    std::vector<LocalChunk> chunks;
    const std::vector<Piece> pieces =
        s.replicated ? std::vector<Piece>{{0, numel_of(s)}} : layout(s, i);
    for (const Piece& p : pieces) {
      torch::Tensor data =
          salt >= 0 ? piece_values(global_value(s, salt), p).clone()
                    : torch::full({p.end - p.begin}, c10::isFloatingType(s.dtype) ? NAN : -1.0,
                                  torch::TensorOptions().dtype(s.dtype));
      // A whole tensor (or box) is handed over in its own shape, as a module would.
      if (p.box_offsets.empty() && p.begin == 0 && p.end == numel_of(s)) data = data.reshape(s.shape);
      int64_t box_numel = 1;
      for (int64_t d : p.box_sizes) box_numel *= d;
      if (!p.box_offsets.empty() && p.begin == 0 && p.end == box_numel) data = data.reshape(p.box_sizes);
      chunks.push_back({p.begin, data, p.box_offsets, p.box_sizes});
    }
    state.add_chunks(s.name, s.component, s.shape, s.dtype, std::move(chunks));
  }
  state.json()["loader"] = {{"epoch", 1}, {"offset", 1000 + salt}};
  return state;
}

// Empty string when every chunk of `state` holds version `salt` (converted through `via` when
// set), else a description of the first mismatch.
inline std::string check_state(const std::vector<Spec>& specs, const ShardedStateDict& state,
                               int salt, std::optional<c10::ScalarType> via = std::nullopt) {
  for (const Spec& s : specs) {
    if (!state.contains(s.name)) continue;
    torch::Tensor want = global_value(s, salt);
    if (via && c10::isFloatingType(s.dtype)) want = want.to(*via).to(s.dtype);
    for (const LocalChunk& c : state.at(s.name).chunks) {
      const torch::Tensor got = c.data.reshape(-1);
      if (!torch::equal(got, piece_values(want, {c.begin, c.end(), c.box_offsets, c.box_sizes}))) {
        return c10::str("tensor ", s.name, " chunk ", describe(c.region()), " differs");
      }
    }
  }
  return "";
}

// ---------------------------------------------------------------------------------------------
// Ranks as threads

class ThreadHub {
 public:
  explicit ThreadHub(int size) : size_(size), slots_(static_cast<size_t>(size)) {}
  int size() const { return size_; }

  std::vector<std::string> exchange(int rank, const std::string& bytes) {
    std::unique_lock lock(mutex_);
    slots_[static_cast<size_t>(rank)] = bytes;
    const uint64_t generation = generation_;
    if (++arrived_ == size_) {
      result_ = slots_;
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation_ != generation; });
    }
    return result_;
  }

 private:
  int size_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<std::string> slots_, result_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
};

class ThreadGroup final : public CheckpointGroup {
 public:
  ThreadGroup(ThreadHub& hub, int rank) : hub_(hub), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return hub_.size(); }
  std::vector<std::string> all_gather(const std::string& bytes) override {
    return hub_.exchange(rank_, bytes);
  }
  int64_t all_reduce_max(int64_t value) override {
    int64_t best = value;
    for (const std::string& s : hub_.exchange(rank_, std::to_string(value))) {
      best = std::max<int64_t>(best, std::stoll(s));
    }
    return best;
  }

 private:
  ThreadHub& hub_;
  int rank_;
};

// Runs fn(rank, group) on `world` threads; returns each rank's error message ("" = none).
inline std::vector<std::string> run_ranks(
    int world, const std::function<void(int, std::shared_ptr<CheckpointGroup>)>& fn) {
  ThreadHub hub(world);
  std::vector<std::string> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r, std::make_shared<ThreadGroup>(hub, r));
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
        if (errors[static_cast<size_t>(r)].empty()) errors[static_cast<size_t>(r)] = "(empty)";
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace loom::checkpoint::testing
