#pragma once

// KvTransport over UCX (the only code that sees UCX). Start opens a UCP context (RMA + active
// messages + wakeup) and one worker, registers the whole KV cache once, and starts the worker's
// progress thread. LocalAddress is {worker address, packed rkey, cache base and size, layout};
// Connect checks the peer's layout and opens an endpoint with peer failure handling. A Write
// is one ucp_put_nbx per run of consecutive blocks and layer, an endpoint flush, then a DONE
// active message (reservation id, generation); the receiver's progress thread calls its
// DoneNotice and answers with an ACK, and `done` fires when the ACK arrives: so OK means the
// peer has the bytes and has seen the notice, and a peer that dies at any point (including
// over shared memory, where sends complete locally) ends in an error, never a hang.
//
// Failures: an endpoint error (peer died, connection reset) fails that peer's transfers with
// Unavailable and drops the peer (later writes to it are Unavailable; Connect again for a new
// id); a transfer not acknowledged within `transfer_timeout` fails with DeadlineExceeded and
// drops the peer too.
//
// Thread-safe. Every UCX call after Start runs on the progress thread: public methods queue
// work for it and wake it (ucp_worker_signal). `done` and DoneNotice run on that thread and
// must not block it for long nor destroy the transport. Destruction fails queued and unfinished
// writes with Unavailable, force-closes endpoints (bounded), then releases UCX.
//
// Settings: UCX reads UCX_* environment variables; `tls`/`net_devices` below override UCX_TLS
// and UCX_NET_DEVICES for this context only. Between processes of one host "posix,self" (or
// "sysv,self") is the fast path; "tcp,self" with UCX_NET_DEVICES=lo (or the pod's interface)
// crosses hosts; RDMA NICs add "rc,ud" / "dc" and GPU memory "cuda_copy,cuda_ipc" where UCX is
// built with them (Debian's 1.13 is not). With peer error handling UCX 1.13 drops transports
// that cannot report peer failure (cma among them), so KV puts over shared memory are carried
// by active messages. Start logs the transports the context opened and Connect the lanes the
// endpoint chose; transports() lets a service refuse readiness on the wrong ones.

#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "common/transport/kv_transport.h"

namespace preft::transport {

struct UcxTransportOptions {
  // UCX_TLS and UCX_NET_DEVICES for this context ("" = the environment's, else UCX's default).
  // Tests use {"posix,self" | "tcp,self", "lo"}.
  std::string tls;
  std::string net_devices;
  // Shared-memory transports handle peer failure only when enabled (UCX 1.13 defaults to "n",
  // and an endpoint with peer error handling then finds no transport). Applied unless the
  // environment sets UCX_{POSIX,SYSV,MM}_ERROR_HANDLING itself.
  bool shm_error_handling = true;
  // UCX's check of connected peers (UCX_KEEPALIVE_INTERVAL, default 20 s there): how soon a
  // peer that died without closing its sockets (or one on shared memory) is noticed. Applied
  // unless the environment sets it; zero leaves UCX's default.
  absl::Duration keepalive_interval = absl::Seconds(1);
  absl::Duration transfer_timeout = absl::Seconds(10);  // Write to ACK
  absl::Duration connect_timeout = absl::Seconds(30);   // waiting for the progress thread
  // After activity the progress thread busy-polls this long before sleeping on the worker's
  // event fd. Zero by default: on cores shared with engines (and the peer's progress thread)
  // a spinning thread delays the very wake-ups it waits for; a 128-token handoff over shared
  // memory took 0.8 ms with 500 us of spin and 0.19 ms without (bench/NOTES.md step 33).
  // Worth setting only where the progress thread has a core of its own.
  absl::Duration spin = absl::ZeroDuration();
};

class UcxTransport final : public KvTransport {
 public:
  explicit UcxTransport(UcxTransportOptions options = {});
  ~UcxTransport() override;
  UcxTransport(const UcxTransport&) = delete;
  UcxTransport& operator=(const UcxTransport&) = delete;

  absl::Status Start(kv::KvCache* cache, const KvLayout& layout, DoneNotice on_done) override;
  std::string LocalAddress() const override;
  absl::StatusOr<PeerId> Connect(const std::string& peer_address) override;
  void Write(PeerId peer, const BlockTransfer& transfer,
             std::function<void(absl::Status)> done) override;
  TransportStats stats() const override;
  // "ucx(posix,self)": the transports the context opened (after Start; "ucx" before).
  std::string name() const override;
  // The same list, e.g. {"posix", "self"}; services compare it with the configured one.
  std::vector<std::string> transports() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace preft::transport
