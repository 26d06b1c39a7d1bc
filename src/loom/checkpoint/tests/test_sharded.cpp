// Sharded save and resharding load, with ranks simulated by threads in one process: each layout
// saves and loads through the same protocol as real ranks (collectives through a ThreadHub, files
// in one folder).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <fstream>

#include "loom/checkpoint/crc32c.h"
#include "loom/checkpoint/loader.h"
#include "loom/checkpoint/metadata.h"
#include "loom/checkpoint/safetensors.h"
#include "loom/checkpoint/saver.h"
#include "loom/checkpoint/tests/layouts.h"
#include "loom/testing/run.h"

namespace {
namespace fs = std::filesystem;
using namespace loom::checkpoint;
using namespace loom::checkpoint::testing;
using loom::testing::TempDir;

// Saves version `salt` of `specs` as step `step` from `world` thread-ranks laid out by `layout`.
void save_world(const fs::path& folder, int64_t step, int world,
                const std::function<Layout(int)>& layout, int salt, SaverOptions saver_options = {},
                SaveOptions options = {}) {
  const auto specs = training_specs();
  const auto errors = run_ranks(world, [&](int rank, std::shared_ptr<CheckpointGroup> group) {
    ShardedStateDict state = make_state(specs, layout(rank), salt);
    state.rank_json()["rng"] = rank * 100 + salt;
    ShardedSaver saver(group, saver_options);
    saver.save(state, folder, step, options);
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
}

// Loads the newest usable checkpoint into `world` thread-ranks laid out by `layout`, and checks
// every rank's chunks hold version `salt`.
void expect_load(const fs::path& folder, int world, const std::function<Layout(int)>& layout,
                 int64_t want_step, int salt) {
  const auto specs = training_specs();
  const auto errors = run_ranks(world, [&](int rank, std::shared_ptr<CheckpointGroup> group) {
    ShardedStateDict dest = make_state(specs, layout(rank), -1);
    const auto result = load_latest(folder, dest, *group);
    if (!result) throw std::runtime_error("no checkpoint loaded");
    if (result->step != want_step) throw std::runtime_error(c10::str("loaded step ", result->step));
    const std::string mismatch = check_state(specs, dest, salt);
    if (!mismatch.empty()) throw std::runtime_error(c10::str("rank ", rank, ": ", mismatch));
    if (result->json.at("loader").at("offset") != 1000 + salt) {
      throw std::runtime_error("loader state not restored");
    }
  });
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

std::function<Layout(int)> fsdp(int world) {
  return [world](int rank) { return fsdp_layout(training_specs(), world, rank); };
}
std::function<Layout(int)> hsdp(int shards) {
  return [shards](int rank) { return hsdp_layout(training_specs(), shards, rank); };
}
std::function<Layout(int)> cyclic(int world, int64_t block) {
  return [world, block](int rank) { return block_cyclic_layout(world, rank, block); };
}
std::function<Layout(int)> full() {
  return [](int) { return full_layout(); };
}

void flip_byte(const fs::path& path, int64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c = 0;
  f.get(c);
  f.seekp(offset);
  f.put(static_cast<char>(c ^ 0x5A));
}

int64_t data_offset_of_first_chunk(const fs::path& dir, const std::string& file) {
  const CheckpointMetadata m = CheckpointMetadata::read(dir);
  for (const auto& [name, t] : m.tensors) {
    for (const SavedChunk& c : t.chunks) {
      if (c.file == file) return c.byte_begin;
    }
  }
  return -1;
}

TEST(Crc32c, MatchesTheStandardCheckValueAndExtends) {
  const std::string text = "123456789";
  EXPECT_EQ(crc32c(text.data(), text.size()), 0xE3069283u);
  EXPECT_EQ(crc32c(nullptr, 0), 0u);
  const uint32_t head = crc32c(text.data(), 4);
  EXPECT_EQ(crc32c_extend(head, text.data() + 4, text.size() - 4), 0xE3069283u);
  // Unaligned starts and lengths take the byte-wise paths of the hardware loop.
  std::string long_text(1000, 'x');
  for (size_t i = 0; i < long_text.size(); ++i) long_text[i] = static_cast<char>(i * 7);
  const uint32_t whole = crc32c(long_text.data(), long_text.size());
  EXPECT_EQ(crc32c_extend(crc32c(long_text.data(), 3), long_text.data() + 3, 997), whole);
}

TEST(Crc32c, CopyReturnsTheChecksumOfWhatItCopied) {
  std::string src(1000, 'x');
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<char>(i * 13 + 5);
  // Every start alignment and a few lengths around the 8-byte word loop.
  for (size_t start : {0, 1, 3, 7, 8}) {
    for (size_t n : {0, 1, 7, 8, 9, 64, 991}) {
      std::string dst(n, '\0');
      const uint32_t crc = crc32c_copy(0x1234u, dst.data(), src.data() + start, n);
      EXPECT_EQ(crc, crc32c_extend(0x1234u, src.data() + start, n)) << start << " " << n;
      EXPECT_EQ(dst, src.substr(start, n)) << start << " " << n;
    }
  }
}

TEST(ShardedStateDict, RejectsBadChunks) {
  ShardedStateDict s;
  EXPECT_THROW(s.add_chunks("w", "model", {4}, c10::kFloat, {{2, torch::zeros({3})}}), loom::Error);
  EXPECT_THROW(s.add_chunks("w", "model", {4}, c10::kFloat, {{0, torch::zeros({2})},
                                                             {1, torch::zeros({2})}}),
               loom::Error);
  EXPECT_THROW(s.add_chunks("w", "model", {4}, c10::kFloat, {{0, torch::zeros({2}, torch::kHalf)}}),
               loom::Error);
  EXPECT_THROW(s.add_chunks("a@b", "model", {1}, c10::kFloat, {}), loom::Error);
  s.add_shard0("e", "model", {5, 2}, 3, torch::zeros({2, 2}));
  EXPECT_EQ(s.at("e").chunks.at(0).begin, 6);
  EXPECT_THROW(s.add_full("e", "model", torch::zeros({1})), loom::Error);
  EXPECT_THROW(s.add_shard0("f", "model", {5, 2}, 4, torch::zeros({2, 2})), loom::Error);
}

TEST(ShardedCheckpoint, Fsdp4LoadsAtFsdp2Hsdp2x2BlockCyclicAndSingleProcess) {
  TempDir dir("ckpt");
  save_world(dir.path(), 10, 4, fsdp(4), 1);
  expect_load(dir.path(), 2, fsdp(2), 10, 1);
  expect_load(dir.path(), 4, hsdp(2), 10, 1);
  expect_load(dir.path(), 3, cyclic(3, 5), 10, 1);
  expect_load(dir.path(), 1, full(), 10, 1);

  const CheckpointMetadata m = CheckpointMetadata::read(dir.path() / "step-10");
  EXPECT_EQ(m.world_size, 4);
  EXPECT_EQ(m.step, 10);
  ASSERT_EQ(m.rank_json.size(), 4u);
  EXPECT_EQ(m.rank_json[3].at("rng"), 301);
  // Replicated tensors are written once.
  EXPECT_EQ(m.tensors.at("optimizer.step").chunks.size(), 1u);
  EXPECT_EQ(m.tensors.at("lr_scheduler.last_step").chunks.size(), 1u);
  // Every rank file is a plain safetensors file with one 1-D tensor per chunk.
  SafetensorsFile f(dir.path() / "step-10" / "rank-1.safetensors");
  ASSERT_FALSE(f.names().empty());
  for (const auto& name : f.names()) {
    EXPECT_NE(name.find('@'), std::string::npos);
    EXPECT_EQ(f.entry(name).shape.size(), 1u);
  }
}

TEST(ShardedCheckpoint, ReplicasAndRaggedPiecesSaveOnceAndLoadAnywhere) {
  TempDir dir("ckpt");
  save_world(dir.path(), 5, 4, hsdp(2), 2);  // two replicas of a 2-way shard
  const CheckpointMetadata m = CheckpointMetadata::read(dir.path() / "step-5");
  int64_t saved_bytes = 0, global_bytes = 0;
  for (const auto& [name, t] : m.tensors) {
    for (const SavedChunk& c : t.chunks) saved_bytes += c.byte_end - c.byte_begin;
    global_bytes += t.numel() * static_cast<int64_t>(c10::elementSize(t.dtype));
  }
  EXPECT_EQ(saved_bytes, global_bytes);  // replicas deduplicated
  // Replicated chunks are spread over the holders, not all written by rank 0.
  std::set<std::string> writers;
  for (const auto& [name, t] : m.tensors) {
    for (const SavedChunk& c : t.chunks) writers.insert(c.file);
  }
  EXPECT_GE(writers.size(), 3u);
  expect_load(dir.path(), 4, fsdp(4), 5, 2);
  expect_load(dir.path(), 1, full(), 5, 2);

  TempDir cyc("ckpt");
  save_world(cyc.path(), 6, 3, cyclic(3, 4), 3);
  expect_load(cyc.path(), 2, fsdp(2), 6, 3);
}

std::function<Layout(int)> tp(int world, int64_t dim, int fsdp = 1) {
  return [=](int rank) { return tp_layout(world, rank, dim, fsdp); };
}

// Issue 10: tensor-parallel shards are n-D boxes (a Shard(1) piece is not a flat range), saved as
// box chunks and read back by any layout: TP at another degree or dim, FSDP's flat ranges, FSDP
// over TP (ranges of a box), block-cyclic pieces, one process; and the other way round. The
// values are compared bitwise on every rank.
TEST(ShardedCheckpoint, TensorParallelBoxesReshardToEveryLayout) {
  TempDir rowwise("ckpt");
  save_world(rowwise.path(), 3, 2, tp(2, 1), 4);  // Shard(1): each rank a column block
  const CheckpointMetadata m = CheckpointMetadata::read(rowwise.path() / "step-3");
  const SavedTensor& wq = m.tensors.at("model.layers.0.attention.wq.weight");
  ASSERT_EQ(wq.chunks.size(), 2u);  // one box per rank, not one chunk per row
  EXPECT_EQ(wq.chunks[0].box_sizes, (std::vector<int64_t>{16, 8}));
  EXPECT_EQ(m.tensors.at("model.layers.0.attention_norm.weight").chunks.size(), 1u);  // 1-D: replicated
  EXPECT_EQ(m.tensors.at("optimizer.step").chunks.size(), 1u);  // replicated: written once
  expect_load(rowwise.path(), 1, full(), 3, 4);
  expect_load(rowwise.path(), 4, tp(4, 0), 3, 4);
  expect_load(rowwise.path(), 3, fsdp(3), 3, 4);
  expect_load(rowwise.path(), 4, tp(2, 0, /*fsdp=*/2), 3, 4);
  expect_load(rowwise.path(), 3, cyclic(3, 5), 3, 4);

  // FSDP over TP (box ranges), saved on 4 ranks, loaded as TP at another dim and as FSDP.
  TempDir both("ckpt");
  save_world(both.path(), 4, 4, tp(2, 1, /*fsdp=*/2), 5);
  expect_load(both.path(), 2, tp(2, 0), 4, 5);
  expect_load(both.path(), 2, fsdp(2), 4, 5);
  expect_load(both.path(), 1, full(), 4, 5);

  // And from flat FSDP shards into boxes.
  TempDir flat("ckpt");
  save_world(flat.path(), 6, 3, fsdp(3), 6);
  expect_load(flat.path(), 2, tp(2, 1), 6, 6);
  expect_load(flat.path(), 4, tp(2, 1, /*fsdp=*/2), 6, 6);
}

TEST(ShardedCheckpoint, InconsistentLayoutsFailOnEveryRank) {
  TempDir dir("ckpt");
  auto errors_for = [&](const std::function<void(int, ShardedStateDict&)>& build) {
    return run_ranks(2, [&](int rank, std::shared_ptr<CheckpointGroup> group) {
      ShardedStateDict s;
      build(rank, s);
      ShardedSaver(group).save(s, dir.path(), 1);
    });
  };
  // A gap: rank 0 holds [0, 4), rank 1 holds [6, 10).
  auto gap = errors_for([](int rank, ShardedStateDict& s) {
    s.add_chunks("w", "model", {10}, c10::kFloat, {{rank == 0 ? 0 : 6, torch::zeros({4})}});
  });
  for (const auto& e : gap) EXPECT_NE(e.find("tensor 'w' [10]: elements [4, 6) are held by no chunk"), std::string::npos) << e;
  // A partial overlap.
  auto overlap = errors_for([](int rank, ShardedStateDict& s) {
    s.add_chunks("w", "model", {10}, c10::kFloat,
                 {{rank == 0 ? 0 : 4, torch::zeros({rank == 0 ? 6 : 6})}});
  });
  for (const auto& e : overlap) EXPECT_NE(e.find("overlap"), std::string::npos) << e;
  // Disagreeing global shapes.
  auto shapes = errors_for([](int rank, ShardedStateDict& s) {
    s.add_full("w", "model", torch::zeros({rank == 0 ? 3 : 4}));
  });
  for (const auto& e : shapes) EXPECT_NE(e.find("every rank must describe"), std::string::npos) << e;
  // A rank that cannot even describe its state takes the others down with it.
  auto bad_export = run_ranks(2, [&](int rank, std::shared_ptr<CheckpointGroup> group) {
    ShardedStateDict s;
    s.add_full("w", "model", torch::zeros({2}));
    SaveOptions o;
    if (rank == 1) o.export_dtype = c10::kInt;
    ShardedSaver(group).save(s, dir.path(), 2, o);
  });
  EXPECT_NE(bad_export[0].find("rank 1 cannot save"), std::string::npos) << bad_export[0];
  EXPECT_NE(bad_export[1].find("not floating point"), std::string::npos) << bad_export[1];
  EXPECT_THROW(ShardedSaver(single_process_group()).save({}, dir.path(), 2, {false, c10::kInt}),
               loom::UsageError);
  EXPECT_TRUE(list_complete_checkpoints(dir.path()).empty());
}

TEST(ShardedCheckpoint, CorruptedAndTruncatedFilesAreDetectedAndSkipped) {
  TempDir dir("ckpt");
  save_world(dir.path(), 1, 2, fsdp(2), 1);
  save_world(dir.path(), 2, 2, fsdp(2), 2);
  const fs::path step2 = dir.path() / "step-2";
  const fs::path rank0 = step2 / "rank-0.safetensors";
  const fs::path rank1 = step2 / "rank-1.safetensors";

  // A flipped data byte: structure is fine, the checksum is not.
  flip_byte(rank0, data_offset_of_first_chunk(step2, "rank-0.safetensors") + 3);
  EXPECT_NO_THROW(verify_checkpoint(step2, Verification::kStructure));
  try {
    verify_checkpoint(step2, Verification::kChecksums);
    ADD_FAILURE() << "corruption not detected";
  } catch (const CorruptCheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find(rank0.string()), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("CRC-32C"), std::string::npos) << e.what();
  }
  ShardedStateDict dest = make_state(training_specs(), full_layout(), -1);
  EXPECT_THROW(load_checkpoint(step2, dest), CorruptCheckpointError);
  auto latest = find_latest_complete(dir.path());
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->step, 1);
  expect_load(dir.path(), 2, fsdp(2), 1, 1);  // load_latest falls back on every rank
  expect_load(dir.path(), 1, full(), 1, 1);

  // A truncated file: caught from its size before anything is read.
  fs::resize_file(rank1, fs::file_size(rank1) - 5);
  try {
    verify_checkpoint(step2, Verification::kStructure);
    ADD_FAILURE() << "truncation not detected";
  } catch (const CorruptCheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find(rank1.string()), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
  }
  EXPECT_EQ(find_latest_complete(dir.path(), Verification::kStructure)->step, 1);

  // A damaged metadata.json no longer matches the CRC in its COMPLETE marker.
  const fs::path meta1 = dir.path() / "step-1" / kMetadataFile;
  flip_byte(meta1, 20);
  EXPECT_THROW(verify_checkpoint(dir.path() / "step-1", Verification::kStructure),
               CorruptCheckpointError);
  EXPECT_FALSE(find_latest_complete(dir.path()).has_value());
  // With checkpoints present but none usable, resuming is an error, not a fresh start.
  const auto errors = run_ranks(1, [&](int, std::shared_ptr<CheckpointGroup> group) {
    load_latest(dir.path(), dest, *group);
  });
  EXPECT_NE(errors[0].find("could be loaded"), std::string::npos) << errors[0];
}

TEST(ShardedCheckpoint, IncompleteCheckpointsAreIgnoredAndCleanedUp) {
  TempDir dir("ckpt");
  save_world(dir.path(), 1, 1, full(), 1);
  save_world(dir.path(), 2, 1, full(), 2);
  fs::remove(dir.path() / "step-2" / kCompleteMarker);  // crashed before the marker
  fs::create_directories(dir.path() / "step-3.tmp");     // crashed while writing
  std::ofstream(dir.path() / "step-3.tmp" / "rank-0.safetensors") << "partial";
  const auto complete = list_complete_checkpoints(dir.path());
  ASSERT_EQ(complete.size(), 1u);
  EXPECT_EQ(complete[0].step, 1);
  EXPECT_EQ(find_latest_complete(dir.path())->step, 1);
  expect_load(dir.path(), 1, full(), 1, 1);

  // The next save removes the leftovers of earlier steps.
  save_world(dir.path(), 4, 1, full(), 4);
  EXPECT_FALSE(fs::exists(dir.path() / "step-2"));
  EXPECT_FALSE(fs::exists(dir.path() / "step-3.tmp"));
  EXPECT_TRUE(fs::exists(dir.path() / "step-1" / kCompleteMarker));
  // Saving a step again replaces it atomically.
  save_world(dir.path(), 4, 2, fsdp(2), 5);
  expect_load(dir.path(), 1, full(), 4, 5);
}

TEST(ShardedCheckpoint, KeepLatestKPrunesOlderCompleteCheckpoints) {
  TempDir dir("ckpt");
  SaverOptions keep2;
  keep2.keep_latest_k = 2;
  for (int step = 1; step <= 5; ++step) save_world(dir.path(), step, 2, fsdp(2), step, keep2);
  const auto complete = list_complete_checkpoints(dir.path());
  ASSERT_EQ(complete.size(), 2u);
  EXPECT_EQ(complete[0].step, 5);
  EXPECT_EQ(complete[1].step, 4);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 2);
}

TEST(ShardedCheckpoint, ModelOnlyExportConvertsFloatingTensors) {
  TempDir dir("ckpt");
  SaveOptions options;
  options.model_only = true;
  options.export_dtype = c10::kBFloat16;
  save_world(dir.path(), 9, 2, fsdp(2), 7, {}, options);
  const CheckpointMetadata m = CheckpointMetadata::read(dir.path() / "step-9");
  EXPECT_TRUE(m.model_only);
  for (const auto& [name, t] : m.tensors) {
    EXPECT_EQ(t.component, "model") << name;
    EXPECT_EQ(t.dtype, c10::kBFloat16) << name;
  }
  const auto specs = training_specs();
  // Loads into the float32 model, with values rounded through bf16.
  ShardedStateDict full_dest = make_state(specs, full_layout(), -1);
  ShardedStateDict model = full_dest.only("model");
  const LoadResult r = load_checkpoint(dir.path() / "step-9", model);
  EXPECT_TRUE(r.model_only);
  EXPECT_EQ(check_state(specs, model, 7, c10::kBFloat16), "");
  // The full training state does not fit a model-only checkpoint...
  try {
    load_checkpoint(dir.path() / "step-9", full_dest);
    ADD_FAILURE() << "strict load of a model-only checkpoint succeeded";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("model weights only"), std::string::npos) << e.what();
  }
  // ...unless loaded non-strictly, which reports what it skipped.
  LoadOptions lenient;
  lenient.strict = false;
  const LoadResult partial = load_checkpoint(dir.path() / "step-9", full_dest, 0, lenient);
  EXPECT_EQ(partial.missing.size(), 4u);
}

TEST(ShardedCheckpoint, MismatchedModelIsAnErrorNotAFallback) {
  TempDir dir("ckpt");
  save_world(dir.path(), 3, 1, full(), 1);
  ShardedStateDict dest;
  dest.add_full("model.tok_embeddings.weight", "model", torch::zeros({38, 16}));
  const auto errors = run_ranks(2, [&](int, std::shared_ptr<CheckpointGroup> group) {
    load_latest(dir.path(), dest, *group);
  });
  for (const auto& e : errors) EXPECT_NE(e.find("shape [37, 16]"), std::string::npos) << e;
}

TEST(ShardedCheckpoint, NonContiguousDestinationsAndRankJson) {
  TempDir dir("ckpt");
  save_world(dir.path(), 1, 3, fsdp(3), 4);
  const auto specs = training_specs();
  const Spec& embed = specs[0];
  torch::Tensor transposed = torch::zeros({embed.shape[1], embed.shape[0]}).t();  // non-contiguous
  ShardedStateDict dest;
  dest.add_full(embed.name, embed.component, transposed);
  dest.add_full("model.output.weight", "model", torch::zeros({7, 3}, torch::kHalf));
  const LoadResult r = load_checkpoint(dir.path() / "step-1", dest, 2);
  EXPECT_TRUE(torch::equal(transposed, global_value(embed, 4)));
  EXPECT_EQ(check_state(specs, dest, 4), "");
  ASSERT_TRUE(r.rank_json.has_value());
  EXPECT_EQ(r.rank_json->at("rng"), 204);
  EXPECT_FALSE(load_checkpoint(dir.path() / "step-1", dest, 3).rank_json.has_value());
  EXPECT_LT(r.bytes_read, 37 * 16 * 4 + 7 * 3 * 2 + 64);  // only the needed chunks were read
}

TEST(RestartPolicy, ResumesFromTheNewestCompleteCheckpointWithinTheBudget) {
  TempDir dir("ckpt");
  RestartDecision none = decide_restart(dir.path(), 0, 3);
  EXPECT_TRUE(none.restart);
  EXPECT_FALSE(none.resume_from.has_value());
  save_world(dir.path(), 7, 1, full(), 1);
  RestartDecision d = decide_restart(dir.path(), 1, 3);
  EXPECT_TRUE(d.restart);
  ASSERT_TRUE(d.resume_from.has_value());
  EXPECT_EQ(d.resume_from->step, 7);
  EXPECT_NE(d.message.find("restart 2 of 3"), std::string::npos) << d.message;
  EXPECT_FALSE(decide_restart(dir.path(), 3, 3).restart);
}

}  // namespace
