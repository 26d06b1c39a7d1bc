#include "loom/train/tensorboard.h"

#include <unistd.h>

#include <c10/util/StringUtil.h>

#include <bit>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "loom/checkpoint/crc32c.h"
#include "loom/core/error.h"

namespace loom::train::tensorboard {
namespace {

// Protobuf wire format: each field is a varint key (field number << 3 | wire type) and a value.
enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

void put_varint(std::string& out, uint64_t value) {
  while (value >= 0x80) {
    out.push_back(static_cast<char>((value & 0x7F) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
}

void put_key(std::string& out, uint32_t field, WireType type) { put_varint(out, (field << 3) | type); }

template <typename T>
void put_little_endian(std::string& out, T value) {
  // Protobuf's fixed-width fields and TFRecord's header are little endian, as is every machine
  // Loom builds for; copying the bytes keeps it a plain memcpy.
  static_assert(std::endian::native == std::endian::little, "big-endian hosts need a byte swap here");
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));
  out.append(bytes, sizeof(T));
}

void put_bytes(std::string& out, uint32_t field, const std::string& bytes) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out += bytes;
}

void put_wall_time(std::string& event, double wall_time) {
  put_key(event, 1, kFixed64);
  put_little_endian(event, wall_time);
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string host_name() {
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0 || host[0] == '\0') return "localhost";
  return host;
}

}  // namespace

uint32_t masked_crc32c(const void* data, size_t size) {
  const uint32_t crc = checkpoint::crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string tfrecord(const std::string& data) {
  std::string header;
  put_little_endian(header, static_cast<uint64_t>(data.size()));
  std::string record = header;
  put_little_endian(record, masked_crc32c(header.data(), header.size()));
  record += data;
  put_little_endian(record, masked_crc32c(data.data(), data.size()));
  return record;
}

std::string file_version_event(double wall_time) {
  std::string event;
  put_wall_time(event, wall_time);
  put_bytes(event, 3, "brain.Event:2");
  return event;
}

std::string scalars_event(double wall_time, int64_t step,
                          const std::vector<std::pair<std::string, float>>& scalars) {
  std::string summary;
  for (const auto& [tag, value] : scalars) {
    std::string v;
    put_bytes(v, 1, tag);
    put_key(v, 2, kFixed32);
    put_little_endian(v, value);
    put_bytes(summary, 1, v);
  }
  std::string event;
  put_wall_time(event, wall_time);
  put_key(event, 2, kVarint);
  put_varint(event, static_cast<uint64_t>(step));  // int64 is varint-encoded as its two's complement
  put_bytes(event, 5, summary);
  return event;
}

std::string event_file_name(int64_t unix_seconds, const std::string& host, int pid) {
  return c10::str("events.out.tfevents.", unix_seconds, ".", host, ".", pid);
}

EventFileWriter::EventFileWriter(const std::filesystem::path& folder) {
  std::error_code ec;
  std::filesystem::create_directories(folder, ec);
  LOOM_REQUIRE(!ec, "cannot create the TensorBoard folder '", folder.string(), "': ", ec.message(),
               "; set job.dump_folder to a writable path or metrics.enable_tensorboard = false");
  const double now = now_seconds();
  path_ = folder / event_file_name(static_cast<int64_t>(now), host_name(), static_cast<int>(::getpid()));
  // Appending: a second writer in the same second and process (tests) continues the same file
  // with another file_version record, which readers accept.
  file_.reset(std::fopen(path_.c_str(), "ab"));
  LOOM_REQUIRE(file_ != nullptr, "cannot open '", path_.string(), "' for writing: ", std::strerror(errno));
  write_record(file_version_event(now));
}

void EventFileWriter::write_scalars(int64_t step, const std::vector<std::pair<std::string, float>>& scalars) {
  write_record(scalars_event(now_seconds(), step, scalars));
}

void EventFileWriter::write_record(const std::string& data) {
  const std::string record = tfrecord(data);
  const bool ok = std::fwrite(record.data(), 1, record.size(), file_.get()) == record.size() &&
                  std::fflush(file_.get()) == 0;
  LOOM_REQUIRE(ok, "cannot write to '", path_.string(), "': ", std::strerror(errno));
}

}  // namespace loom::train::tensorboard
