#pragma once

// The KV transport's fallback where UCX is absent: blocks travel as a client stream of
// DecodeWorker.WriteKv on the decode worker's own gRPC server (one message per block and
// layer), then a final message delivers the DONE notice; the call's answer is the ACK. Slower
// than RMA (every byte is serialised and copied twice) but it needs nothing but gRPC.
//
// Receiving side: the decode service hands each WriteKv stream to Receive. Its address blob
// names the worker's gRPC address, known only once the server is bound: SetAdvertisedAddress
// must be called before LocalAddress is read by anyone.

#include <grpcpp/grpcpp.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/serving/worker_setup.h"
#include "common/transport/kv_transport.h"
#include "proto/preft/v1/worker.grpc.pb.h"

namespace preft::wire {

class GrpcKvTransport final : public transport::KvTransport {
 public:
  // Dials decode workers with `credentials` (null: plaintext).
  explicit GrpcKvTransport(std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr)
      : credentials_(std::move(credentials)) {}
  ~GrpcKvTransport() override;

  absl::Status Start(kv::KvCache* cache, const transport::KvLayout& layout,
                     DoneNotice on_done) override;
  // "grpc|<host:port>|<layout hash>|<layout>".
  std::string LocalAddress() const override;
  absl::StatusOr<transport::PeerId> Connect(const std::string& peer_address) override;
  // Runs on a thread of its own per transfer; `done` fires there.
  void Write(transport::PeerId peer, const transport::BlockTransfer& transfer,
             std::function<void(absl::Status)> done) override;
  transport::TransportStats stats() const override;
  std::string name() const override { return "grpc"; }

  void SetAdvertisedAddress(const std::string& address);
  // One WriteKv stream's messages, in order (the decode service's reactor calls this);
  // returns the bytes written or the error that ends the stream.
  absl::Status Receive(const worker::v1::KvChunk& chunk, bool first, int64_t* bytes);

 private:
  struct Peer {
    std::string address;
    std::unique_ptr<worker::v1::DecodeWorker::Stub> stub;
  };

  absl::Status Send(const Peer& peer, const transport::BlockTransfer& transfer, int64_t* bytes);

  const std::shared_ptr<grpc::ChannelCredentials> credentials_;
  kv::KvCache* cache_ = nullptr;
  transport::KvLayout layout_;
  DoneNotice on_done_;
  mutable absl::Mutex mu_;
  std::string advertised_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<Peer>> peers_ ABSL_GUARDED_BY(mu_);
  transport::TransportStats stats_ ABSL_GUARDED_BY(mu_);
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
};

// The transport a worker's flags ask for: "grpc" here (dialling with `credentials`), "ucx",
// "cuda_ipc" (moving `device_cache`) and "inproc" via serving::MakeTransport.
absl::StatusOr<std::unique_ptr<transport::KvTransport>> MakeWorkerTransport(
    const serving::TransportFlags& flags,
    std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr,
    kv::DeviceKvView device_cache = {});

}  // namespace preft::wire
