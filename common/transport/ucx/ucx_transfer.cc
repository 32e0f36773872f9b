// The write protocol of UcxTransport: one put per run of blocks and layer, a flush, a DONE
// active message, and the receiver's ACK; and what ends a write early (bad input, a failed
// peer, the deadline). All of it runs on the progress thread.

#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log/log.h"
#include "common/transport/ucx/ucx_context.h"
#include "common/transport/ucx/ucx_transport_impl.h"

namespace preft::transport {

using ucx_internal::AckHeader;
using ucx_internal::kAmAck;
using ucx_internal::kAmDone;
using ucx_internal::kDoneMagic;

void UcxTransport::Impl::StartTransfer(WriteCommand command) {
  auto it = peers_.find(command.peer);
  if (it == peers_.end()) {
    Complete(std::move(command.done),
             absl::UnavailableError(
                 absl::StrCat("UCX transport: unknown peer ", command.peer, " (not from Connect)")),
             command.start, 0);
    return;
  }
  Peer& peer = *it->second;
  if (!peer.failed.ok()) {
    Complete(std::move(command.done), absl::UnavailableError(peer.failed.message()), command.start,
             0);
    return;
  }
  const kv::KvCacheShape& shape = cache_->shape();
  absl::Status valid = ValidateTransfer(command.blocks, shape.num_blocks, peer.address.num_blocks);
  if (!valid.ok()) {
    Complete(std::move(command.done), std::move(valid), command.start, 0);
    return;
  }

  auto owned = std::make_unique<Transfer>();
  Transfer& transfer = *owned;
  transfer.impl = this;
  transfer.seq = next_seq_++;
  transfer.peer = peer.id;
  transfer.blocks = std::move(command.blocks);
  transfer.done = std::move(command.done);
  transfer.start = command.start;
  transfer.deadline = Clock::now() + absl::ToChronoMicroseconds(options_.transfer_timeout);
  transfers_[transfer.seq] = std::move(owned);

  // One put per run of blocks consecutive on both sides, per layer. Over network transports a
  // run needs only consecutive destination blocks: scattered source blocks are first gathered
  // into a staging buffer (a memcpy costs far less than a put per block over TCP).
  const std::vector<int32_t>& src = transfer.blocks.src_blocks;
  const std::vector<int32_t>& dst = transfer.blocks.dst_blocks;
  const uint64_t block_bytes = shape.block_bytes();
  const uint64_t local_layer_bytes = shape.num_blocks * block_bytes;
  const uint64_t remote_layer_bytes = peer.address.num_blocks * block_bytes;
  const char* local_base = reinterpret_cast<const char*>(cache_->layer_data(0));
  ucp_request_param_t put{};
  for (int64_t layer = 0; layer < shape.num_layers; ++layer) {
    for (size_t i = 0; i < src.size();) {
      size_t run = 1;
      bool src_consecutive = true;
      while (i + run < src.size() && dst[i + run] == dst[i] + static_cast<int32_t>(run)) {
        const bool next_consecutive = src[i + run] == src[i] + static_cast<int32_t>(run);
        if (!next_consecutive && !gather_scattered_) break;  // a put per source run instead
        src_consecutive &= next_consecutive;
        ++run;
      }
      const char* from = local_base + layer * local_layer_bytes + src[i] * block_bytes;
      if (!src_consecutive) {
        std::vector<char> buffer;
        if (!staging_pool_.empty()) {
          buffer = std::move(staging_pool_.back());
          staging_pool_.pop_back();
        }
        buffer.resize(run * block_bytes);
        for (size_t j = 0; j < run; ++j) {
          std::memcpy(buffer.data() + j * block_bytes,
                      local_base + layer * local_layer_bytes + src[i + j] * block_bytes,
                      block_bytes);
        }
        from = buffer.data();
        transfer.staging.push_back(std::move(buffer));
      }
      const uint64_t to = peer.address.base + layer * remote_layer_bytes + dst[i] * block_bytes;
      ucs_status_ptr_t request = ucp_put_nbx(peer.ep, from, run * block_bytes, to, peer.rkey, &put);
      if (UCS_PTR_IS_ERR(request)) {
        // Puts already posted finish or fail on their own; the peer's blocks are undefined
        // until a retry (generation + 1) rewrites them.
        Finish(transfer, UcxError("ucp_put_nbx", UCS_PTR_STATUS(request)));
        // Puts posted before this one may still read the staging: keep it with the transport.
        for (auto& b : transfer.staging) retired_staging_.push_back(std::move(b));
        Release(transfer.seq);
        return;
      }
      if (request != nullptr) ucp_request_free(request);  // completion is covered by the flush
      transfer.bytes += run * block_bytes;
      i += run;
    }
  }

  ucp_request_param_t flush{};
  flush.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  flush.cb.send = &OnFlushed;
  flush.user_data = &transfer;
  ucs_status_ptr_t request = ucp_ep_flush_nbx(peer.ep, &flush);
  if (UCS_PTR_IS_ERR(request)) {
    Finish(transfer, UcxError("ucp_ep_flush_nbx", UCS_PTR_STATUS(request)));
    Release(transfer.seq);
  } else if (request == nullptr) {
    SendDone(transfer);
  } else {
    ++transfer.pending_ops;
  }
}

void UcxTransport::Impl::SendDone(Transfer& transfer) {
  auto it = peers_.find(transfer.peer);
  if (it == peers_.end() || !it->second->failed.ok() || it->second->ep == nullptr) {
    Finish(transfer, absl::UnavailableError("UCX transport: peer dropped before DONE"));
    Release(transfer.seq);
    return;
  }
  transfer.header = DoneHeader{transfer.seq, transfer.blocks.reservation_id,
                               transfer.blocks.generation, kDoneMagic};
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
  param.cb.send = &OnDoneSent;
  param.user_data = &transfer;
  ucs_status_ptr_t request = ucp_am_send_nbx(it->second->ep, kAmDone, &transfer.header,
                                             sizeof(transfer.header), nullptr, 0, &param);
  if (UCS_PTR_IS_ERR(request)) {
    Finish(transfer, UcxError("ucp_am_send_nbx (DONE)", UCS_PTR_STATUS(request)));
    Release(transfer.seq);
  } else if (request != nullptr) {
    ++transfer.pending_ops;
  }
  // Now the ACK finishes it (or the peer's failure, or the deadline).
}

void UcxTransport::Impl::Finish(Transfer& transfer, absl::Status status) {
  if (transfer.finished) return;
  transfer.finished = true;
  Complete(std::move(transfer.done), std::move(status), transfer.start, transfer.bytes);
}

void UcxTransport::Impl::Complete(std::function<void(absl::Status)> done, absl::Status status,
                                  Clock::time_point start, int64_t bytes) {
  {
    absl::MutexLock lock(&mu_);
    stats_.Record(status.ok(), bytes, std::chrono::duration<double>(Clock::now() - start).count());
  }
  completions_.emplace_back(std::move(done), std::move(status));
}

void UcxTransport::Impl::RunCompletions() {
  // Swapped out first: a callback may queue a Write, which only touches commands_.
  std::vector<std::pair<std::function<void(absl::Status)>, absl::Status>> completions;
  completions.swap(completions_);
  for (auto& [done, status] : completions) {
    if (done) done(std::move(status));
  }
}

void UcxTransport::Impl::Release(uint64_t seq) {
  auto it = transfers_.find(seq);
  if (it != transfers_.end() && it->second->finished && it->second->pending_ops == 0) {
    // No UCX op names it any more: its puts are done and its staging can be reused.
    for (auto& b : it->second->staging) {
      if (staging_pool_.size() < 64) staging_pool_.push_back(std::move(b));
    }
    transfers_.erase(it);
  }
}

void UcxTransport::Impl::FailPeer(Peer& peer, const absl::Status& status) {
  if (!peer.failed.ok()) return;
  peer.failed = status;
  if (!shutting_down_) {
    log::Warn("ucx: peer {} dropped: {}", peer.id, std::string(status.message()));
  }
  std::vector<uint64_t> seqs;
  for (auto& [seq, transfer] : transfers_) {
    if (transfer->peer == peer.id && !transfer->finished) seqs.push_back(seq);
  }
  for (uint64_t seq : seqs) {
    Finish(*transfers_[seq], absl::UnavailableError(status.message()));
    Release(seq);
  }
  if (peer.ep != nullptr) {
    // Force: fails whatever is still queued on the endpoint, and never waits for the peer.
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t request = ucp_ep_close_nbx(peer.ep, &param);
    peer.ep = nullptr;
    if (request != nullptr && !UCS_PTR_IS_ERR(request)) peer.close_request = request;
  }
  ReapClosedPeers();
}

void UcxTransport::Impl::ReapClosedPeers() {
  for (auto& [id, peer] : peers_) {
    if (peer->ep != nullptr || peer->rkey == nullptr) continue;
    if (peer->close_request != nullptr) {
      if (ucp_request_check_status(peer->close_request) == UCS_INPROGRESS) continue;
      ucp_request_free(peer->close_request);
      peer->close_request = nullptr;
    }
    ucp_rkey_destroy(peer->rkey);
    peer->rkey = nullptr;
  }
}

bool UcxTransport::Impl::HandleEvents() {
  bool any = false;
  std::vector<std::pair<PeerId, ucs_status_t>> errors;
  errors.swap(peer_errors_);
  for (auto [id, status] : errors) {
    any = true;
    auto it = peers_.find(id);
    if (it != peers_.end()) {
      FailPeer(*it->second, absl::UnavailableError(absl::StrCat(
                                "UCX peer ", id, " failed: ", ucs_status_string(status))));
    }
  }
  std::vector<OpEvent> flushed;
  flushed.swap(flushed_);
  for (const OpEvent& event : flushed) {
    any = true;
    auto it = transfers_.find(event.seq);
    if (it == transfers_.end()) continue;
    Transfer& transfer = *it->second;
    if (!transfer.finished) {
      if (event.status == UCS_OK) {
        SendDone(transfer);
      } else {
        Finish(transfer, UcxError("flush", event.status));
      }
    }
    Release(event.seq);
  }
  std::vector<OpEvent> sent;
  sent.swap(done_sent_);
  for (const OpEvent& event : sent) {
    any = true;
    auto it = transfers_.find(event.seq);
    if (it == transfers_.end()) continue;
    if (event.status != UCS_OK) Finish(*it->second, UcxError("DONE send", event.status));
    Release(event.seq);
  }
  std::vector<uint64_t> acked;
  acked.swap(acked_);
  for (uint64_t seq : acked) {
    any = true;
    auto it = transfers_.find(seq);
    if (it == transfers_.end()) continue;
    Finish(*it->second, absl::OkStatus());
    Release(seq);
  }
  std::vector<Notice> notices;
  notices.swap(notices_);
  for (const Notice& notice : notices) {
    any = true;
    if (on_done_) on_done_(notice.header.reservation_id, notice.header.generation);
    if (notice.reply_ep == nullptr) continue;
    // The reply endpoint is valid here: UCX releases it only inside progress.
    // UCX reads the header until the send completes: it lives until OnAckSent.
    auto* ack = new AckHeader{notice.header.seq};
    ucp_request_param_t param{};
    param.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_AM_SEND_FLAG_EAGER;
    param.cb.send = &OnAckSent;
    param.user_data = ack;
    ucs_status_ptr_t request =
        ucp_am_send_nbx(notice.reply_ep, kAmAck, ack, sizeof(*ack), nullptr, 0, &param);
    if (request == nullptr || UCS_PTR_IS_ERR(request)) delete ack;
  }
  return any;
}

void UcxTransport::Impl::CheckDeadlines() {
  if (transfers_.empty()) return;
  const auto now = Clock::now();
  std::vector<uint64_t> expired;
  for (auto& [seq, transfer] : transfers_) {
    if (!transfer->finished && now > transfer->deadline) expired.push_back(seq);
  }
  for (uint64_t seq : expired) {
    auto it = transfers_.find(seq);
    if (it == transfers_.end() || it->second->finished) continue;
    Transfer& transfer = *it->second;
    const PeerId peer = transfer.peer;
    Finish(transfer,
           absl::DeadlineExceededError(absl::StrCat(
               "UCX transport: KV transfer of reservation ", transfer.blocks.reservation_id,
               " to peer ", peer, " not acknowledged within ",
               absl::FormatDuration(options_.transfer_timeout))));
    Release(seq);
    auto p = peers_.find(peer);
    if (p != peers_.end()) {
      FailPeer(*p->second, absl::UnavailableError(absl::StrCat(
                               "UCX peer ", peer, " dropped after a transfer timed out")));
    }
  }
}

// ---- UCX callbacks ----

void UcxTransport::Impl::OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  Peer* peer = static_cast<Peer*>(arg);
  peer->impl->peer_errors_.emplace_back(peer->id, status);
}

void UcxTransport::Impl::OnFlushed(void* request, ucs_status_t status, void* user_data) {
  Transfer* transfer = static_cast<Transfer*>(user_data);
  --transfer->pending_ops;
  transfer->impl->flushed_.push_back(OpEvent{transfer->seq, status});
  ucp_request_free(request);
}

void UcxTransport::Impl::OnDoneSent(void* request, ucs_status_t status, void* user_data) {
  Transfer* transfer = static_cast<Transfer*>(user_data);
  --transfer->pending_ops;
  transfer->impl->done_sent_.push_back(OpEvent{transfer->seq, status});
  ucp_request_free(request);
}

void UcxTransport::Impl::OnAckSent(void* request, ucs_status_t status, void* user_data) {
  delete static_cast<AckHeader*>(user_data);
  ucp_request_free(request);
}

ucs_status_t UcxTransport::Impl::OnDoneMessage(void* arg, const void* header, size_t header_length,
                                               void* data, size_t length,
                                               const ucp_am_recv_param_t* param) {
  DoneHeader done;
  if (header_length != sizeof(done)) return UCS_OK;  // not ours: ignored
  std::memcpy(&done, header, sizeof(done));
  if (done.magic != kDoneMagic) return UCS_OK;
  ucp_ep_h reply =
      (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 ? param->reply_ep : nullptr;
  static_cast<Impl*>(arg)->notices_.push_back(Notice{reply, done});
  return UCS_OK;
}

ucs_status_t UcxTransport::Impl::OnAckMessage(void* arg, const void* header, size_t header_length,
                                              void* data, size_t length,
                                              const ucp_am_recv_param_t* param) {
  AckHeader ack;
  if (header_length != sizeof(ack)) return UCS_OK;
  std::memcpy(&ack, header, sizeof(ack));
  static_cast<Impl*>(arg)->acked_.push_back(ack.seq);
  return UCS_OK;
}

}  // namespace preft::transport
