// The one device a rank computes on, chosen once (training.device) and passed down: the model is
// materialized there and every batch is moved there. "auto" means the rank's GPU when CUDA is
// usable (cuda:LOCAL_RANK), else the CPU.
#pragma once
#include <c10/core/Device.h>

#include <string>

namespace loom {

// `requested`: "auto", "cpu" or "cuda". loom::UsageError (exit 2, one line) when CUDA is asked
// for but this libtorch has no CUDA support, or no CUDA device is visible, or the rank's local
// index has no GPU of its own.
c10::Device select_device(const std::string& requested, int local_rank);

// Makes `device` this thread's current device of its type (torch.cuda.set_device): allocations
// that name no device index, NCCL's communicators and the caching allocator's pools then use the
// rank's own GPU rather than device 0. No-op for the CPU. Device-generic (no CUDA headers).
void set_current_device(c10::Device device);

}  // namespace loom
