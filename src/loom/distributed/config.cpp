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
      },
      {},
      {},
      &options::validate_as<CommConfig, check>};
  return section;
}

}  // namespace loom::distributed
