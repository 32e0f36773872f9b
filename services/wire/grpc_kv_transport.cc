#include "services/wire/grpc_kv_transport.h"

#include <cstring>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/rpc/status.h"

namespace preft::wire {

GrpcKvTransport::~GrpcKvTransport() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](int64_t* n) { return *n == 0; }, &in_flight_));  // writes still sending
}

absl::Status GrpcKvTransport::Start(kv::KvCache* cache, const transport::KvLayout& layout,
                                    DoneNotice on_done) {
  cache_ = cache;
  layout_ = layout;
  on_done_ = std::move(on_done);
  return absl::OkStatus();
}

void GrpcKvTransport::SetAdvertisedAddress(const std::string& address) {
  absl::MutexLock lock(&mu_);
  advertised_ = address;
}

std::string GrpcKvTransport::LocalAddress() const {
  absl::MutexLock lock(&mu_);
  return absl::StrCat("grpc|", advertised_, "|", layout_.Hash(), "|", layout_.ToString());
}

absl::StatusOr<transport::PeerId> GrpcKvTransport::Connect(const std::string& peer_address) {
  const std::vector<std::string> parts = absl::StrSplit(peer_address, absl::MaxSplits('|', 3));
  uint64_t hash = 0;
  if (parts.size() != 4 || parts[0] != "grpc" || parts[1].empty() ||
      !absl::SimpleAtoi(parts[2], &hash)) {
    return absl::InvalidArgumentError("not a grpc KV transport address");
  }
  PREFT_RETURN_IF_ERROR(
      transport::CheckPeerLayout(layout_, hash, absl::StrCat("peer ", parts[1]), parts[3]));
  auto peer = std::make_shared<Peer>();
  peer->address = parts[1];
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(64 << 20);
  peer->stub = worker::v1::DecodeWorker::NewStub(
      grpc::CreateCustomChannel(
          parts[1], credentials_ != nullptr ? credentials_ : grpc::InsecureChannelCredentials(),
          args));
  absl::MutexLock lock(&mu_);
  peers_.push_back(std::move(peer));
  return static_cast<transport::PeerId>(peers_.size() - 1);
}

absl::Status GrpcKvTransport::Send(const Peer& peer, const transport::BlockTransfer& t,
                                   int64_t* bytes) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  worker::v1::KvWriteAck ack;
  auto writer = peer.stub->WriteKv(&ctx, &ack);
  const kv::KvCacheShape& shape = cache_->shape();
  const size_t block_bytes = static_cast<size_t>(shape.block_bytes());
  worker::v1::KvChunk chunk;
  chunk.set_reservation_id(t.reservation_id);
  chunk.set_generation(t.generation);
  chunk.set_layout_hash(layout_.Hash());
  bool ok = true;
  for (int64_t l = 0; l < shape.num_layers && ok; ++l) {
    for (size_t i = 0; i < t.src_blocks.size() && ok; ++i) {
      chunk.set_layer(static_cast<int32_t>(l));
      chunk.set_block(t.dst_blocks[i]);
      chunk.set_data(cache_->block_data(l, t.src_blocks[i]), block_bytes);
      ok = writer->Write(chunk);
      *bytes += static_cast<int64_t>(block_bytes);
    }
  }
  worker::v1::KvChunk last;
  last.set_reservation_id(t.reservation_id);
  last.set_generation(t.generation);
  last.set_done(true);
  if (ok) writer->Write(last);
  writer->WritesDone();
  return rpc::FromGrpcStatus(writer->Finish());
}

void GrpcKvTransport::Write(transport::PeerId peer, const transport::BlockTransfer& transfer,
                            std::function<void(absl::Status)> done) {
  std::shared_ptr<Peer> p;
  {
    absl::MutexLock lock(&mu_);
    if (peer >= 0 && peer < static_cast<transport::PeerId>(peers_.size())) p = peers_[peer];
    ++in_flight_;
  }
  absl::Status valid =
      p == nullptr ? absl::InvalidArgumentError(absl::StrCat("unknown peer ", peer))
                   : transport::ValidateTransfer(transfer, cache_->shape().num_blocks,
                                                 std::numeric_limits<int32_t>::max());
  std::thread([this, p, transfer, done = std::move(done), valid] {
    const absl::Time start = absl::Now();
    int64_t bytes = 0;
    absl::Status s = valid.ok() ? Send(*p, transfer, &bytes) : valid;
    if (!s.ok() && s.code() != absl::StatusCode::kInvalidArgument &&
        s.code() != absl::StatusCode::kFailedPrecondition) {
      s = absl::UnavailableError(absl::StrCat("KV stream to ", p ? p->address : "?",
                                              " failed: ", s.message()));
    }
    {
      absl::MutexLock lock(&mu_);
      stats_.Record(s.ok(), bytes, absl::ToDoubleSeconds(absl::Now() - start));
    }
    done(s);
    absl::MutexLock lock(&mu_);
    --in_flight_;
  }).detach();
}

absl::Status GrpcKvTransport::Receive(const worker::v1::KvChunk& chunk, bool first,
                                      int64_t* bytes) {
  if (cache_ == nullptr) return absl::FailedPreconditionError("transport not started");
  if (first && chunk.layout_hash() != layout_.Hash()) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV layout hash ", chunk.layout_hash(), " is not this worker's (",
                     layout_.ToString(), ")"));
  }
  if (chunk.done()) {
    on_done_(chunk.reservation_id(), chunk.generation());
    return absl::OkStatus();
  }
  const kv::KvCacheShape& shape = cache_->shape();
  const size_t block_bytes = static_cast<size_t>(shape.block_bytes());
  if (chunk.layer() < 0 || chunk.layer() >= shape.num_layers || chunk.block() < 0 ||
      chunk.block() >= shape.num_blocks || chunk.data().size() != block_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV chunk out of range: layer ", chunk.layer(), " block ", chunk.block(), ", ",
        chunk.data().size(), " bytes (a block is ", block_bytes, ")"));
  }
  std::memcpy(cache_->block_data(chunk.layer(), chunk.block()), chunk.data().data(),
              block_bytes);
  *bytes += static_cast<int64_t>(block_bytes);
  return absl::OkStatus();
}

transport::TransportStats GrpcKvTransport::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

absl::StatusOr<std::unique_ptr<transport::KvTransport>> MakeWorkerTransport(
    const serving::TransportFlags& flags, std::shared_ptr<grpc::ChannelCredentials> credentials,
    kv::DeviceKvView device_cache) {
  if (flags.kind == "grpc") return std::make_unique<GrpcKvTransport>(std::move(credentials));
  return serving::MakeTransport(flags, device_cache);
}

}  // namespace preft::wire
