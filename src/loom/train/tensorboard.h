// TensorBoard event files written without TensorFlow or protobuf: the format is small enough to
// write by hand, and a dependency on either would be far larger than this file.
//
// An event file is a sequence of TFRecords:
//   uint64 length (little endian) | uint32 masked_crc32c(length bytes) | data | uint32 masked_crc32c(data)
// where each `data` is a serialized tensorflow.Event protobuf. The first record holds only
// wall_time and file_version "brain.Event:2"; each later one holds wall_time, step and a Summary
// of scalar values (Summary.Value{tag, simple_value}: the float32 that TensorBoard's Scalars
// dashboard reads). Field numbers (tensorflow/core/util/event.proto, summary.proto):
//   Event:   1 wall_time (double), 2 step (int64), 3 file_version (string), 5 summary (Summary)
//   Summary: 1 value (repeated Value)
//   Value:   1 tag (string), 2 simple_value (float)
#pragma once
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace loom::train::tensorboard {

// TFRecord's checksum: CRC-32C rotated right by 15 bits plus a constant, so that a CRC stored
// inside checksummed data does not checksum to a fixed value.
uint32_t masked_crc32c(const void* data, size_t size);

// One TFRecord around `data`.
std::string tfrecord(const std::string& data);

// Serialized Event protos.
std::string file_version_event(double wall_time);
std::string scalars_event(double wall_time, int64_t step,
                          const std::vector<std::pair<std::string, float>>& scalars);

// "events.out.tfevents.<unix seconds>.<host>.<pid>" (the name TensorBoard's loader looks for; the
// pid keeps two processes starting in the same second apart, as PyTorch's SummaryWriter does).
std::string event_file_name(int64_t unix_seconds, const std::string& host, int pid);

// An open event file: the file_version record is written on open; each write_scalars() appends
// and flushes one record, so TensorBoard shows a run as it trains and a crash loses nothing
// already logged.
class EventFileWriter {
 public:
  // Creates `folder`; loom::Error when the folder or the file cannot be created.
  explicit EventFileWriter(const std::filesystem::path& folder);
  void write_scalars(int64_t step, const std::vector<std::pair<std::string, float>>& scalars);
  const std::filesystem::path& path() const { return path_; }

 private:
  void write_record(const std::string& data);

  std::filesystem::path path_;
  std::unique_ptr<FILE, int (*)(FILE*)> file_{nullptr, &std::fclose};
};

}  // namespace loom::train::tensorboard
