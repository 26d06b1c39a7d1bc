#include <gtest/gtest.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cstring>
#include <fstream>

#include "loom/checkpoint/safetensors.h"
#include "loom/core/error.h"
#include "loom/testing/run.h"

namespace {
namespace fs = std::filesystem;
using loom::checkpoint::NamedTensors;
using loom::checkpoint::SafetensorsCheckpoint;
using loom::checkpoint::SafetensorsFile;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("loom_safetensors_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  static NamedTensors sample() {
    torch::manual_seed(0);
    return {
        {"f32", torch::randn({3, 5})},
        {"bf16", torch::randn({4}).to(torch::kBFloat16)},
        {"f16", torch::randn({2, 2}).to(torch::kHalf)},
        {"i64", torch::arange(7, torch::kInt64)},
        {"i32", torch::arange(3, torch::kInt32)},
        {"u8", torch::tensor({1, 2, 255}, torch::kUInt8)},
        {"bool", torch::tensor({true, false})},
        {"scalar", torch::tensor(2.5)},
        {"empty", torch::empty({0, 4})},
        {"strided", torch::randn({4, 6}).t()},  // non-contiguous input
    };
  }
  fs::path dir_;
};

void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

TEST_F(SafetensorsTest, RoundTripsEveryDtypeShapeAndMetadata) {
  const NamedTensors tensors = sample();
  const fs::path path = dir_ / "t.safetensors";
  loom::checkpoint::save_safetensors(path, tensors, {{"format", "pt"}});
  SafetensorsFile file(path);
  EXPECT_EQ(file.metadata().at("format"), "pt");
  ASSERT_EQ(file.names().size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, expected] = tensors[i];
    EXPECT_EQ(file.names()[i], name);  // data order = given order
    const torch::Tensor got = file.tensor(name);
    EXPECT_EQ(got.scalar_type(), expected.scalar_type()) << name;
    EXPECT_TRUE(torch::equal(got, expected)) << name;
  }
  EXPECT_EQ(file.entry("bf16").dtype_name, "BF16");
  EXPECT_EQ(file.entry("f32").shape, (std::vector<int64_t>{3, 5}));
  // The data section is 8-byte aligned, so the f32 tensor is a view of the mapping; writing to it
  // changes neither the file nor later reads.
  torch::Tensor view = file.tensor("f32");
  view.fill_(0);
  EXPECT_TRUE(torch::equal(SafetensorsFile(path).tensor("f32"), tensors[0].second));
  EXPECT_THROW(file.tensor("missing"), loom::Error);
  // No temporary file left behind.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 1);
}

TEST_F(SafetensorsTest, TensorsOutliveTheFileObject) {
  const fs::path path = dir_ / "t.safetensors";
  loom::checkpoint::save_safetensors(path, {{"w", torch::arange(1000, torch::kFloat32)}});
  torch::Tensor w;
  {
    SafetensorsFile file(path);
    w = file.tensor("w");
  }
  fs::remove(path);
  EXPECT_EQ(w.sum().item<double>(), 999.0 * 1000 / 2);
}

TEST_F(SafetensorsTest, ReadsFilesWrittenByTheReferenceLayout) {
  // Hand-built file as the Python library lays it out (no padding requirement on the header).
  nlohmann::json header = {{"a", {{"dtype", "I32"}, {"shape", {2}}, {"data_offsets", {0, 8}}}},
                           {"b", {{"dtype", "F64"}, {"shape", {1}}, {"data_offsets", {8, 16}}}}};
  const std::string text = header.dump();
  std::string bytes(8, '\0');
  const uint64_t n = text.size();
  std::memcpy(bytes.data(), &n, 8);
  bytes += text;
  const int32_t a[2] = {-3, 7};
  const double b = 0.125;
  bytes.append(reinterpret_cast<const char*>(a), 8);
  bytes.append(reinterpret_cast<const char*>(&b), 8);
  write_bytes(dir_ / "ref.safetensors", bytes);
  SafetensorsFile file(dir_ / "ref.safetensors");
  EXPECT_TRUE(torch::equal(file.tensor("a"), torch::tensor({-3, 7}, torch::kInt32)));
  EXPECT_EQ(file.tensor("b").item<double>(), 0.125);
}

TEST_F(SafetensorsTest, TruncatedAndMalformedFilesGiveOneLineErrorsNamingTheFile) {
  const fs::path good = dir_ / "good.safetensors";
  loom::checkpoint::save_safetensors(good, {{"w", torch::randn({64})}});
  const std::string bytes = loom::testing::file_bytes(good);
  auto expect_error = [&](const std::string& content, const std::string& fragment) {
    const fs::path bad = dir_ / "bad.safetensors";
    write_bytes(bad, content);
    try {
      SafetensorsFile file(bad);
      FAIL() << "no error for: " << fragment;
    } catch (const loom::Error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(bad.string()), std::string::npos) << message;
      EXPECT_NE(message.find(fragment), std::string::npos) << message;
      EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    }
  };
  expect_error(bytes.substr(0, bytes.size() - 10), "truncated");  // data cut short
  expect_error(bytes.substr(0, 20), "truncated");                 // header cut short
  expect_error(bytes.substr(0, 5), "truncated");                  // not even a length
  std::string garbage = bytes;
  garbage.replace(8, 1, "!");
  expect_error(garbage, "malformed JSON");
  std::string huge(8, '\xff');
  expect_error(huge + "{}", "header length");
  EXPECT_THROW(SafetensorsFile(dir_ / "absent.safetensors"), loom::Error);
}

TEST_F(SafetensorsTest, ShardedSaveAndIndexRead) {
  NamedTensors tensors;
  for (int i = 0; i < 5; ++i) {
    tensors.emplace_back("layer." + std::to_string(i), torch::full({256}, float(i)));  // 1 KiB
  }
  // 2.5 KiB shards -> 2 + 2 + 1 tensors.
  const auto files = loom::checkpoint::save_safetensors_sharded(dir_, tensors, 2560);
  ASSERT_EQ(files.size(), 4u);
  EXPECT_EQ(files[0].filename(), "model-00001-of-00003.safetensors");
  EXPECT_EQ(files[3].filename(), "model.safetensors.index.json");
  const SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(dir_);
  EXPECT_EQ(ckpt.num_files(), 3u);
  ASSERT_EQ(ckpt.names().size(), 5u);
  for (const auto& [name, value] : tensors) EXPECT_TRUE(torch::equal(ckpt.tensor(name), value));
  EXPECT_EQ(ckpt.entry("layer.4").nbytes(), 1024);
  const auto index = nlohmann::json::parse(loom::testing::file_bytes(files[3]));
  EXPECT_EQ(index["metadata"]["total_size"], 5 * 1024);

  // One shard only: a plain model.safetensors as transformers writes it.
  const fs::path single = dir_ / "single";
  const auto one = loom::checkpoint::save_safetensors_sharded(single, tensors, 1 << 20);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].filename(), "model.safetensors");
  EXPECT_EQ(SafetensorsCheckpoint::open(single).names().size(), 5u);

  // An index pointing at a missing shard names both.
  fs::remove(files[1]);
  try {
    SafetensorsCheckpoint::open(dir_);
    FAIL();
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("model-00002-of-00003.safetensors"), std::string::npos);
  }
  EXPECT_THROW(SafetensorsCheckpoint::open(dir_ / "nowhere"), loom::Error);
}

TEST_F(SafetensorsTest, RejectsBadInputsToTheWriter) {
  const fs::path path = dir_ / "x.safetensors";
  EXPECT_THROW(loom::checkpoint::save_safetensors(
                   path, {{"a", torch::ones({1})}, {"a", torch::ones({1})}}),
               loom::Error);
  EXPECT_THROW(loom::checkpoint::save_safetensors(
                   path, {{"m", torch::empty({4}, torch::TensorOptions().device(torch::kMeta))}}),
               loom::Error);
  EXPECT_THROW(loom::checkpoint::save_safetensors(dir_ / "no" / "dir.safetensors",
                                                  {{"a", torch::ones({1})}}),
               loom::Error);
  EXPECT_FALSE(fs::exists(path));
}

}  // namespace
