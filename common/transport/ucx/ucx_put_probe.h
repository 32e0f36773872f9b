#pragma once

// The reference UcxTransport is measured against (bench/kv_transfer_bench): one contiguous
// ucp_put_nbx of a registered buffer into a peer's, then a flush, with the context settings
// the transport uses and no protocol around it. Both ends create a probe over their buffer;
// the initiator connects and puts, the target only progresses (tcp and emulated RMA need the
// target's worker to run). Not thread-safe: one thread drives a probe.

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/transport/ucx/ucx_transport.h"

namespace preft::transport {

class UcxPutProbe {
 public:
  static absl::StatusOr<std::unique_ptr<UcxPutProbe>> Create(const UcxTransportOptions& options,
                                                             void* base, size_t bytes);
  ~UcxPutProbe();

  // Worker address, rkey and buffer, for the initiator's Connect.
  std::string address() const;
  absl::Status Connect(const std::string& peer_address);
  // Puts the first `bytes` of the local buffer to the peer's, flushes; returns the seconds.
  absl::StatusOr<double> Put(size_t bytes, absl::Duration timeout);
  // One ucp_worker_progress; returns whether it did anything.
  bool Progress();

 private:
  struct State;
  explicit UcxPutProbe(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace preft::transport
