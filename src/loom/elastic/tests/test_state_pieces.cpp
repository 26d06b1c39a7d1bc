// Training state in memory across a membership change (elastic/state_pieces.h), in one process:
// pieces taken under one layout restore another, region by region, bitwise.
#include <gtest/gtest.h>

#include "loom/distributed/comm.h"
#include "loom/elastic/state_pieces.h"

namespace loom::elastic {
namespace {

// Rank r of `ranks` FSDP-style flat shards of `full` (the last rank's shorter).
checkpoint::ShardedStateDict flat_shard(const torch::Tensor& full, int rank, int ranks, torch::Tensor& storage) {
  const int64_t n = full.numel();
  const int64_t per = (n + ranks - 1) / ranks;
  const int64_t begin = std::min(n, per * rank);
  const int64_t end = std::min(n, begin + per);
  storage = full.reshape({-1}).narrow(0, begin, end - begin).clone();
  checkpoint::ShardedStateDict sd;
  std::vector<checkpoint::LocalChunk> chunks;
  if (end > begin) chunks.push_back({begin, storage});
  sd.add_chunks("w", "model", full.sizes().vec(), full.scalar_type(), chunks);
  sd.json()["step"] = 7;
  sd.json()["data_loader"] = {{"rows_consumed", 84}};
  return sd;
}

TEST(StatePieces, PiecesOfFourShardsRestoreThreeShardsBitwise) {
  const torch::Tensor full = torch::randn({5, 7}, torch::kFloat32);
  std::vector<PieceSet> held;
  for (int r = 0; r < 4; ++r) {
    torch::Tensor storage;
    held.push_back(take_pieces(flat_shard(full, r, 4, storage), /*generation=*/2, r, /*step=*/7));
  }
  auto world = distributed::Comm::single("world", 0);
  // One process stands for a membership of one: it holds every old rank's pieces.
  torch::Tensor target_storage = torch::zeros({5, 7});
  checkpoint::ShardedStateDict target;
  target.add_full("w", "model", target_storage);
  std::vector<const PieceSet*> pointers;
  for (const auto& h : held) pointers.push_back(&h);
  EXPECT_EQ(restore_state(world, pointers, target), 7);
  EXPECT_TRUE(torch::equal(target_storage, full));
  EXPECT_EQ(target.json().at("data_loader").at("rows_consumed").get<int64_t>(), 84);
}

TEST(StatePieces, AMissingShardIsStateLostNamingTheTensor) {
  const torch::Tensor full = torch::randn({4, 4});
  std::vector<PieceSet> held;
  for (int r : {0, 2, 3}) {  // rank 1's pieces are nowhere
    torch::Tensor storage;
    held.push_back(take_pieces(flat_shard(full, r, 4, storage), 1, r, 3));
  }
  auto world = distributed::Comm::single("world", 0);
  torch::Tensor target_storage = torch::zeros({4, 4});
  checkpoint::ShardedStateDict target;
  target.add_full("w", "model", target_storage);
  std::vector<const PieceSet*> pointers;
  for (const auto& h : held) pointers.push_back(&h);
  try {
    restore_state(world, pointers, target);
    FAIL() << "expected StateLost";
  } catch (const StateLost& e) {
    EXPECT_NE(std::string(e.what()).find("'w' (12 of 16 elements)"), std::string::npos) << e.what();
  }
}

TEST(StatePieces, CopiesOfDifferentStepsAreStateLost) {
  const torch::Tensor full = torch::randn({4, 4});
  std::vector<PieceSet> held;
  for (int r = 0; r < 2; ++r) {
    torch::Tensor storage;
    held.push_back(take_pieces(flat_shard(full, r, 2, storage), 1, r, r == 0 ? 5 : 4));
  }
  auto world = distributed::Comm::single("world", 0);
  torch::Tensor target_storage = torch::zeros({4, 4});
  checkpoint::ShardedStateDict target;
  target.add_full("w", "model", target_storage);
  EXPECT_THROW(restore_state(world, {&held[0], &held[1]}, target), StateLost);
}

TEST(StatePieces, ReplicasAreReadOnceAndOlderMembershipsIgnored) {
  const torch::Tensor full = torch::arange(12, torch::kFloat64).reshape({3, 4});
  torch::Tensor a = full.clone(), b = full.clone(), stale = torch::zeros({3, 4}, torch::kFloat64);
  checkpoint::ShardedStateDict sa, sb, ss;
  sa.add_full("w", "model", a);
  sb.add_full("w", "model", b);
  ss.add_full("w", "model", stale);
  for (auto* sd : {&sa, &sb, &ss}) {
    sd->json()["step"] = 2;
    sd->json()["data_loader"] = nlohmann::json::object();
  }
  const PieceSet pa = take_pieces(sa, 4, 0, 2), pb = take_pieces(sb, 4, 1, 2), ps = take_pieces(ss, 3, 0, 1);
  auto world = distributed::Comm::single("world", 0);
  torch::Tensor out = torch::full({3, 4}, -1.0, torch::kFloat64);
  checkpoint::ShardedStateDict target;
  target.add_full("w", "model", out);
  EXPECT_EQ(restore_state(world, {&ps, &pa, &pb}, target), 2);
  EXPECT_TRUE(torch::equal(out, full));  // a sum of the two replicas would have doubled it
}

}  // namespace
}  // namespace loom::elastic
