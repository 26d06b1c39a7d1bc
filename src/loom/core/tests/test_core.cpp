#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/cuda.h>

#include "loom/core/autocast.h"
#include "loom/core/device.h"
#include "loom/core/error.h"
#include "loom/core/error_report.h"
#include "loom/core/memory.h"
#include "loom/core/strings.h"

TEST(Error, CarriesMessageAndExitCode) {
  try {
    loom::fail_usage("bad key 'x'", "; did you mean 'y'?");
    FAIL() << "no throw";
  } catch (const loom::Error& e) {
    EXPECT_EQ(std::string(e.what()), "bad key 'x'; did you mean 'y'?");
    EXPECT_EQ(e.exit_code(), loom::kExitUsage);
  }
  EXPECT_THROW(LOOM_REQUIRE(1 == 2, "one is not two"), loom::Error);
}

TEST(Memory, PeakTracksAllocationAndResets) {
  const int64_t before = loom::memory::peak_rss_bytes();
  EXPECT_GT(before, 0);
  {
    std::vector<char> big(64 << 20, 1);  // touch 64 MiB
    // The buffer escapes, so the compiler must really allocate and fill it (clang elides an
    // allocation nobody reads).
    asm volatile("" : : "r"(big.data()) : "memory");
    EXPECT_GE(loom::memory::peak_rss_bytes(), before + (60 << 20));
  }
  if (loom::memory::reset_peak_rss()) {
    EXPECT_LT(loom::memory::peak_rss_bytes(), before + (60 << 20));
  }
}

TEST(Device, SelectionFollowsTrainingDevice) {
  EXPECT_EQ(loom::select_device("cpu", 0), c10::Device(c10::kCPU));
  const bool usable = torch::cuda::is_available();
  EXPECT_EQ(loom::select_device("auto", 0),
            usable ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU));
  if (usable) {
    EXPECT_EQ(loom::select_device("cuda", 0), c10::Device(c10::kCUDA, 0));
    return;
  }
  // No GPU here: asking for one is a one-line usage error (exit 2) that names the fix.
  try {
    loom::select_device("cuda", 0);
    ADD_FAILURE() << "expected loom::UsageError";
  } catch (const loom::UsageError& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    EXPECT_NE(message.find(at::detail::getCUDAHooks().isBuilt() ? "no CUDA device is visible"
                                                                  : "libtorch has no CUDA support"),
              std::string::npos) << message;
    EXPECT_NE(message.find("training.device = \"cpu\""), std::string::npos) << message;
  }
}

TEST(ErrorReport, DescribesEachKindOfException) {
  const auto usage = loom::describe_exception(std::make_exception_ptr(loom::UsageError("bad key")));
  EXPECT_EQ(usage.message, "bad key");
  EXPECT_EQ(usage.exit_code, loom::kExitUsage);
  const auto diverged = loom::describe_exception(std::make_exception_ptr(loom::DivergedError("nan")));
  EXPECT_EQ(diverged.exit_code, loom::kExitDiverged);
  const auto other = loom::describe_exception(std::make_exception_ptr(std::runtime_error("two\nlines")));
  EXPECT_EQ(other.message, "two lines");  // always one line
  EXPECT_EQ(other.exit_code, loom::kExitFailure);
  EXPECT_FALSE(loom::exit_code_is_retryable(loom::kExitUsage));
  EXPECT_FALSE(loom::exit_code_is_retryable(loom::kExitDiverged));
  EXPECT_TRUE(loom::exit_code_is_retryable(loom::kExitPeerFailed));
  EXPECT_TRUE(loom::exit_code_is_retryable(loom::kExitFailure));
}

// Issue 22, item 10: no error line can be megabytes, whatever a message quotes; an excerpt keeps
// the start (never half a UTF-8 character) and says how long the whole was.
TEST(ErrorReport, LinesAreCappedWithTheFullSize) {
  const std::string huge = "bad record: " + std::string(3'000'000, 'x');
  const auto report = loom::describe_exception(std::make_exception_ptr(loom::UsageError(huge)));
  EXPECT_EQ(report.exit_code, loom::kExitUsage);
  EXPECT_LE(report.message.size(), 2100u);
  EXPECT_EQ(report.message.rfind("bad record: xxx", 0), 0u);
  EXPECT_NE(report.message.find("\u2026 (3000012 bytes)"), std::string::npos) << report.message.substr(0, 100);
  EXPECT_EQ(loom::excerpt("short"), "short");
  // "é" is two bytes: a cut inside it backs up to before it.
  EXPECT_EQ(loom::excerpt("ab\u00e9cd", 3), "ab\u2026 (6 bytes)");
}

TEST(Memory, PeakBytesPerDevice) {
  const c10::Device cpu(c10::kCPU);
  EXPECT_GT(loom::memory::peak_bytes(cpu), 0);
  EXPECT_EQ(loom::memory::reserved_bytes(cpu), 0);
  if (!torch::cuda::is_available()) return;  // the accelerator half needs a GPU
  const c10::Device gpu(c10::kCUDA, 0);
  loom::memory::reset_peak(gpu);
  const int64_t before = loom::memory::peak_bytes(gpu);
  {
    auto t = torch::empty({64 << 20}, torch::TensorOptions().dtype(torch::kUInt8).device(gpu));
    EXPECT_GE(loom::memory::peak_bytes(gpu), before + (64 << 20));
    EXPECT_GE(loom::memory::reserved_bytes(gpu), 64 << 20);
  }
}

// The tracker's peak records what it was made of: tensors counted through c10's allocator hook,
// communication buffers through note_comm_buffer_bytes, and an UntrackedAllocationScope hides a
// buffer's own allocator traffic so nothing is counted twice.
TEST(Memory, TrackerSplitsItsPeakIntoBuffersAndTensors) {
  loom::memory::AllocationTracker tracker;
  const c10::Device cpu(c10::kCPU);
  const int64_t mib = 1 << 20;
  auto a = torch::empty({mib}, torch::kUInt8);  // 1 MiB of tensors
  EXPECT_EQ(tracker.current_bytes(), mib);
  loom::memory::note_comm_buffer_bytes(cpu, 2 * mib);  // a 2 MiB buffer in flight
  EXPECT_EQ(tracker.comm_buffer_bytes(), 2 * mib);
  at::Tensor escaped;
  {
    loom::memory::UntrackedAllocationScope untracked;
    auto hidden = torch::empty({4 * mib}, torch::kUInt8);  // the buffer's own allocation
    escaped = torch::empty({mib}, torch::kUInt8);
  }
  EXPECT_EQ(tracker.current_bytes(), 3 * mib);
  escaped.reset();  // freed outside the scope: still not reported (the allocator never recorded it)
  EXPECT_EQ(tracker.current_bytes(), 3 * mib);
  loom::memory::note_comm_buffer_bytes(cpu, -2 * mib);  // released
  auto b = torch::empty({mib / 2}, torch::kUInt8);
  const auto peak = tracker.peak();
  EXPECT_EQ(peak.total, 3 * mib);
  EXPECT_EQ(peak.comm_buffers, 2 * mib);
  EXPECT_EQ(peak.tensors(), mib);
  EXPECT_EQ(tracker.current_bytes(), mib + mib / 2);
  tracker.reset_peak();
  EXPECT_EQ(tracker.peak().total, mib + mib / 2);
  EXPECT_EQ(tracker.peak().comm_buffers, 0);
  // Buffers of another device type are not this tracker's.
  loom::memory::note_comm_buffer_bytes(c10::Device(c10::kCUDA, 0), mib);
  EXPECT_EQ(tracker.comm_buffer_bytes(), 0);
}

// MFU's denominator on accelerators: dense bf16 peaks from the data sheets, by the name the driver
// reports; the specific names before the general ones they contain.
TEST(Device, PeakFlopsTableByName) {
  EXPECT_EQ(loom::peak_bf16_flops_by_name("NVIDIA H100 80GB HBM3"), 989e12);
  EXPECT_EQ(loom::peak_bf16_flops_by_name("NVIDIA H100 PCIe"), 756e12);
  EXPECT_EQ(loom::peak_bf16_flops_by_name("NVIDIA H100 NVL"), 835e12);
  EXPECT_EQ(loom::peak_bf16_flops_by_name("NVIDIA H200"), 989e12);
  EXPECT_EQ(loom::peak_bf16_flops_by_name("NVIDIA H20"), 148e12);
  EXPECT_EQ(loom::peak_bf16_flops_by_name("NVIDIA A100-SXM4-80GB"), 312e12);
  EXPECT_EQ(loom::peak_bf16_flops_by_name("NVIDIA B200"), 2250e12);
  EXPECT_EQ(loom::peak_bf16_flops_by_name("NVIDIA L40S"), 362e12);
  EXPECT_EQ(loom::peak_bf16_flops_by_name("NVIDIA A10G"), 70e12);
  EXPECT_FALSE(loom::peak_bf16_flops_by_name("Some Future GPU").has_value());
  // The CPU is measured, not looked up.
  const loom::DeviceInfo cpu = loom::device_info(c10::Device(c10::kCPU));
  EXPECT_EQ(cpu.name, "cpu");
  EXPECT_FALSE(cpu.peak_bf16_flops.has_value());
  loom::synchronize(c10::Device(c10::kCPU));  // a no-op, but callable on every device
}

// The AMP path without FSDP: inside the scope matmuls run in bf16 and norms stay fp32; leaving it
// restores whatever was set before (nesting included).
TEST(Autocast, ScopeCastsMatmulsAndRestores) {
  const c10::Device cpu(c10::kCPU);
  const torch::Tensor a = torch::randn({4, 8}), b = torch::randn({8, 3});
  ASSERT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
  {
    loom::AutocastScope scope(cpu, torch::kBFloat16);
    EXPECT_TRUE(at::autocast::is_autocast_enabled(c10::kCPU));
    EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kBFloat16);
    EXPECT_EQ(torch::log_softmax(a, 1).scalar_type(), torch::kFloat32);
    {
      loom::AutocastScope none(cpu, std::nullopt);  // full precision: changes nothing
      EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kBFloat16);
    }
    EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kBFloat16);
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
  EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kFloat32);
}

namespace test_core {
// What a child process writes to stdout and stderr (one pipe, as a terminal shows them) while it
// runs `body`; report_error marks a process as reported, so each case gets its own process.
std::string child_output(void (*body)()) {
  int fds[2];
  if (pipe(fds) != 0) return "<pipe failed>";
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    dup2(fds[1], 1);
    dup2(fds[1], 2);
    body();
    std::fflush(stdout);
    std::fflush(stderr);
    _exit(0);
  }
  close(fds[1]);
  std::string out;
  char buf[256];
  for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  return out;
}
}  // namespace test_core

// Issue 22, item 11: a command that streamed part of a line to stdout (`loom generate`'s text) and
// then fails prints its error on a line of its own, not "hierror: ...".
TEST(ErrorReport, ErrorStartsItsOwnLineAfterAPartialStdoutLine) {
  EXPECT_EQ(test_core::child_output([] {
              std::printf("hi");
              loom::set_stdout_line_open(true);
              loom::report_error({"boom", 1});
            }),
            "hi\nerror: boom\n");
  // Nothing open: no blank line is added.
  EXPECT_EQ(test_core::child_output([] {
              std::printf("done\n");
              loom::report_error({"boom", 1});
            }),
            "done\nerror: boom\n");
}

// Issue 22, item 11: an allocation that cannot succeed names what, how much, where and what to
// change; other errors pass through unchanged.
TEST(Memory, AllocationFailureSaysWhatHowMuchAndWhatToLower) {
  const int64_t huge = int64_t{1} << 58;
  try {
    loom::memory::with_allocation_context([&] { (void)torch::empty({huge}, torch::kUInt8); },
                                          "the key/value cache for 9 tokens", huge, c10::Device(torch::kCPU),
                                          "lower --max-new-tokens");
    ADD_FAILURE() << "allocating 2^58 bytes succeeded";
  } catch (const loom::Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.rfind("out of memory allocating the key/value cache for 9 tokens: 268435456.0 GiB on cpu (", 0), 0u) << m;
    EXPECT_NE(m.find("); lower --max-new-tokens"), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
  EXPECT_THROW(loom::memory::with_allocation_context([] { throw std::runtime_error("other"); }, "x", 1,
                                                     c10::Device(torch::kCPU), "y"),
               std::runtime_error);
  EXPECT_EQ(loom::memory::bytes_text(3 << 20), "3.0 MiB");
}
