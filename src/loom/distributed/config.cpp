#include "loom/distributed/config.h"

namespace loom::distributed {

namespace {
void check(const CommConfig& c) {
  options::require(c.timeout_seconds > 0 && c.timeout_seconds <= kMaxCommTimeoutSeconds, comm_section(),
                   "timeout_seconds",
                   c10::str("in [1, ", kMaxCommTimeoutSeconds,
                            "] (at most one week: larger values overflow the millisecond timeouts)"),
                   &c);
}
}  // namespace

const options::EnumNames<DeviceTransport>& option_names(DeviceTransport) {
  static const options::EnumNames<DeviceTransport> names = {{"nccl", DeviceTransport::kNccl},
                                                            {"host", DeviceTransport::kHost}};
  return names;
}

const options::Section& comm_section() {
  static const options::Section section{
      "comm",
      {
          {LOOM_OPTION(CommConfig, timeout_seconds),
           "Timeout for rendezvous and for each collective, in seconds: 1 to 604800 (one week; larger"
           " values would overflow the millisecond timeouts)."},
          {LOOM_OPTION(CommConfig, shared_memory),
           "When every rank runs on one host, all-gathers, reduce-scatters and all-reduces of CPU"
           " tensors go through shared memory (one copy in, reads straight from the peers' segments)"
           " instead of Gloo's TCP loopback; false keeps them on Gloo. Sums run in rank order."},
          {LOOM_OPTION(CommConfig, device_transport),
           "How collectives on GPU tensors travel: `nccl` (one GPU per rank; the production path) or"
           " `host`: each GPU tensor is copied to host memory, exchanged by the CPU transport (shared"
           " memory or Gloo, the same rank-order sums) and copied back, so several ranks may share one"
           " GPU (rank r computes on GPU r mod the visible count; NCCL refuses two ranks on one device)."
           " For checking parallel layouts on CUDA tensors with one GPU; slow by design."},
      },
      {},
      {},
      &options::validate_as<CommConfig, check>};
  return section;
}

}  // namespace loom::distributed
