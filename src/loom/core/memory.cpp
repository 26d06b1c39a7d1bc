#include "loom/core/memory.h"

#include <ATen/Context.h>
#include <c10/core/Allocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/util/Logging.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <c10/util/Exception.h>

#include "loom/core/error.h"

#include <algorithm>
#include <cstdio>
#include <atomic>

#include <fstream>
#include <mutex>
#include <vector>
#include <string>

namespace loom::memory {
namespace {
int64_t read_status_kib(const std::string& key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(key + ":", 0) == 0) {
      return std::stoll(line.substr(key.size() + 1));
    }
  }
  return 0;
}
}  // namespace

int64_t current_rss_bytes() { return read_status_kib("VmRSS") * 1024; }
int64_t peak_rss_bytes() { return read_status_kib("VmHWM") * 1024; }
bool reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  if (!f) return false;
  f << "5";
  return static_cast<bool>(f);
}
namespace {
// The accelerator's caching allocator has no per-device state until the device is initialised
// (its stats calls then fail with "Invalid device argument"); PyTorch's memory functions do the
// same lazy initialisation first.
c10::DeviceAllocator* accelerator_allocator(const c10::Device& device) {
  at::globalContext().lazyInitDevice(device.type());
  return c10::getDeviceAllocator(device.type());
}
c10::CachingDeviceAllocator::DeviceStats accelerator_stats(const c10::Device& device) {
  return accelerator_allocator(device)->getDeviceStats(device.index() < 0 ? 0 : device.index());
}
constexpr size_t kAggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
}  // namespace

int64_t peak_bytes(const c10::Device& device) {
  if (device.is_cpu()) return peak_rss_bytes();
  return accelerator_stats(device).allocated_bytes[kAggregate].peak;
}

int64_t reserved_bytes(const c10::Device& device) {
  if (device.is_cpu()) return 0;
  return accelerator_stats(device).reserved_bytes[kAggregate].current;
}

void reset_peak(const c10::Device& device) {
  if (device.is_cpu()) {
    reset_peak_rss();
    return;
  }
  accelerator_allocator(device)->resetPeakStats(device.index() < 0 ? 0 : device.index());
}



// The reporter c10's allocators call on every allocation and free (with a negative size) while it
// is the thread's PROFILER_STATE debug info. A mutex rather than lone atomics: the peak and what
// made it up are recorded together.
struct AllocationTracker::State : c10::MemoryReportingInfoBase {
  explicit State(c10::Device d) : device(d) {}
  void reportMemoryUsage(void*, int64_t alloc_size, size_t, size_t, c10::Device d) override {
    if (d.type() != device.type()) return;
    add(alloc_size, 0);
  }
  bool memoryProfilingEnabled() const override { return true; }

  void add(int64_t tensor_delta, int64_t comm_delta, int64_t gradient_delta = 0) {
    std::lock_guard<std::mutex> lock(mutex);
    tensors += tensor_delta;
    comm += comm_delta;
    gradients += gradient_delta;
    if (tensors + comm > peak.total) peak = {tensors + comm, comm, gradients};
  }

  c10::Device device;
  mutable std::mutex mutex;
  int64_t tensors = 0;
  int64_t comm = 0;
  int64_t gradients = 0;
  Peak peak;
  std::unique_ptr<c10::DebugInfoGuard> guard;
};

namespace {
// Memory profiling switched off: c10's CPU allocator then does not record the allocation at all,
// so its free is reported to nobody, whichever thread frees it (a tensor freed on a thread that
// does not inherit the tracker would otherwise leave its bytes counted for good).
struct NotReporting : c10::MemoryReportingInfoBase {
  void reportMemoryUsage(void*, int64_t, size_t, size_t, c10::Device) override {}
  bool memoryProfilingEnabled() const override { return false; }
};
}  // namespace

UntrackedAllocationScope::UntrackedAllocationScope() {
  // Only over a tracker: the slot otherwise belongs to torch's profiler (or nobody), whose
  // callbacks read whatever sits there as their own state.
  if (dynamic_cast<AllocationTracker::State*>(c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE))) {
    guard_.emplace(c10::DebugInfoKind::PROFILER_STATE, std::make_shared<NotReporting>());
  }
}
UntrackedAllocationScope::~UntrackedAllocationScope() = default;

namespace {
// Every live tracker, for note_comm_buffer_bytes (buffers may be allocated on any thread).
std::mutex registry_mutex;
std::vector<AllocationTracker::State*>& registry() {
  static std::vector<AllocationTracker::State*> states;
  return states;
}

// c10's CPU allocator logs "Memory block of unknown size was allocated before the profiling
// started, profiler results will not include the deallocation event" (c10 LOG(WARNING)) the first
// time a thread with memory reporting on frees a block it never saw allocated. A tracker meets such
// frees by design: blocks allocated before it started, and communication buffers allocated in an
// UntrackedAllocationScope (never recorded, so never counted). So while a CPU tracker lives, c10's
// log threshold is raised from WARNING to ERROR (TORCH_WARN, which Loom's own warnings and
// libtorch's user-facing ones use, goes through another channel and still prints); the last
// tracker to go restores it. Counted under registry_mutex.
int quiet_cpu_trackers = 0;
int saved_c10_log_level = 0;
constexpr int kC10LogError = 2;  // c10's GLOG_ERROR
}  // namespace

AllocationTracker::AllocationTracker(c10::Device device) : state_(std::make_shared<State>(device)) {
  state_->guard = std::make_unique<c10::DebugInfoGuard>(c10::DebugInfoKind::PROFILER_STATE, state_);
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry().push_back(state_.get());
  if (device.is_cpu() && quiet_cpu_trackers++ == 0) {
    saved_c10_log_level = FLAGS_caffe2_log_level;
    FLAGS_caffe2_log_level = std::max(FLAGS_caffe2_log_level, kC10LogError);
  }
}

AllocationTracker::~AllocationTracker() {
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto& states = registry();
    states.erase(std::remove(states.begin(), states.end(), state_.get()), states.end());
    if (state_->device.is_cpu() && --quiet_cpu_trackers == 0) FLAGS_caffe2_log_level = saved_c10_log_level;
  }
  state_->guard.reset();
}

int64_t AllocationTracker::current_bytes() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->tensors + state_->comm;
}
int64_t AllocationTracker::peak_bytes() const { return peak().total; }
int64_t AllocationTracker::comm_buffer_bytes() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->comm;
}
AllocationTracker::Peak AllocationTracker::peak() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->peak;
}
void AllocationTracker::reset_gradient_bytes() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->gradients = 0;
}
void AllocationTracker::reset_peak() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->peak = {state_->tensors + state_->comm, state_->comm, state_->gradients};
}

void note_gradient_bytes(const c10::Device& device, int64_t bytes) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  for (AllocationTracker::State* state : registry()) {
    if (state->device.type() == device.type()) state->add(0, 0, bytes);
  }
}

void note_comm_buffer_bytes(const c10::Device& device, int64_t delta) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  for (AllocationTracker::State* state : registry()) {
    if (state->device.type() == device.type()) state->add(0, delta);
  }
}

namespace {
// The allocator's message without c10's backtrace, first line only (and bounded).
std::string allocator_words(const std::exception_ptr& error) {
  std::string text;
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    text = e.what_without_backtrace();
  } catch (const std::exception& e) {
    text = e.what();
  } catch (...) {
  }
  text = text.substr(0, text.find('\n'));
  if (text.size() > 200) text = text.substr(0, 200) + "...";
  return text;
}
}  // namespace

bool is_allocation_failure(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::OutOfMemoryError&) {
    return true;
  } catch (const std::bad_alloc&) {
    return true;
  } catch (const c10::Error& e) {
    // The CPU allocator fails with a plain c10::Error ("DefaultCPUAllocator: can't allocate memory"
    // from posix_memalign, "not enough memory" from the null check).
    const std::string text = e.what_without_backtrace();
    return text.find("can't allocate memory") != std::string::npos ||
           text.find("not enough memory") != std::string::npos ||
           text.find("out of memory") != std::string::npos;
  } catch (...) {
    return false;
  }
}

void rethrow_with_allocation_context(const std::exception_ptr& error, const std::string& what, int64_t bytes,
                                     const c10::Device& device, const std::string& hint) {
  if (!is_allocation_failure(error)) std::rethrow_exception(error);
  throw MemoryError(c10::str("out of memory allocating ", what, ": ", bytes_text(bytes), " on ", device.str(), " (",
                             allocator_words(error), "); ", hint));
}

std::string bytes_text(int64_t bytes) {
  char buf[64];
  const double b = static_cast<double>(bytes);
  if (b >= double(int64_t{1} << 30)) {
    std::snprintf(buf, sizeof buf, "%.1f GiB", b / double(int64_t{1} << 30));
  } else if (b >= double(int64_t{1} << 20)) {
    std::snprintf(buf, sizeof buf, "%.1f MiB", b / double(int64_t{1} << 20));
  } else {
    std::snprintf(buf, sizeof buf, "%lld bytes", static_cast<long long>(bytes));
  }
  return buf;
}

}  // namespace loom::memory
