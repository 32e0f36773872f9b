#include "common/transport/ucx/ucx_put_probe.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/transport/ucx/ucx_address.h"
#include "common/transport/ucx/ucx_context.h"

namespace preft::transport {

struct UcxPutProbe::State {
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  ucp_mem_h memh = nullptr;
  ucp_ep_h ep = nullptr;
  ucp_rkey_h rkey = nullptr;
  void* base = nullptr;
  size_t bytes = 0;
  uint64_t remote_base = 0;
  uint64_t remote_bytes = 0;
  std::string address;

  ~State() {
    if (rkey != nullptr) ucp_rkey_destroy(rkey);
    if (ep != nullptr) {
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      param.flags = UCP_EP_CLOSE_FLAG_FORCE;
      ucs_status_ptr_t request = ucp_ep_close_nbx(ep, &param);
      if (request != nullptr && !UCS_PTR_IS_ERR(request)) {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
        while (ucp_request_check_status(request) == UCS_INPROGRESS &&
               std::chrono::steady_clock::now() < deadline) {
          ucp_worker_progress(worker);
        }
        ucp_request_free(request);
      }
    }
    if (memh != nullptr) ucp_mem_unmap(context, memh);
    if (worker != nullptr) ucp_worker_destroy(worker);
    if (context != nullptr) ucp_cleanup(context);
  }
};

UcxPutProbe::UcxPutProbe(std::unique_ptr<State> state) : state_(std::move(state)) {}
UcxPutProbe::~UcxPutProbe() = default;

absl::StatusOr<std::unique_ptr<UcxPutProbe>> UcxPutProbe::Create(const UcxTransportOptions& options,
                                                                 void* base, size_t bytes) {
  auto s = std::make_unique<State>();
  s->base = base;
  s->bytes = bytes;
  absl::StatusOr<ucp_context_h> context = CreateUcpContext(options);
  if (!context.ok()) return context.status();
  s->context = *context;
  ucp_worker_params_t worker_params{};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucs_status_t st = ucp_worker_create(s->context, &worker_params, &s->worker);
  if (st != UCS_OK) {
    s->worker = nullptr;
    return UcxError("ucp_worker_create", st);
  }
  ucp_mem_map_params_t map{};
  map.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  map.address = base;
  map.length = bytes;
  st = ucp_mem_map(s->context, &map, &s->memh);
  if (st != UCS_OK) {
    s->memh = nullptr;
    return UcxError("ucp_mem_map", st);
  }
  UcxPeerAddress self;
  self.base = reinterpret_cast<uint64_t>(base);
  self.bytes = bytes;
  void* rkey = nullptr;
  size_t rkey_size = 0;
  st = ucp_rkey_pack(s->context, s->memh, &rkey, &rkey_size);
  if (st != UCS_OK) return UcxError("ucp_rkey_pack", st);
  self.rkey.assign(static_cast<const char*>(rkey), rkey_size);
  ucp_rkey_buffer_release(rkey);
  ucp_address_t* worker_address = nullptr;
  size_t worker_address_size = 0;
  st = ucp_worker_get_address(s->worker, &worker_address, &worker_address_size);
  if (st != UCS_OK) return UcxError("ucp_worker_get_address", st);
  self.worker_address.assign(reinterpret_cast<const char*>(worker_address), worker_address_size);
  ucp_worker_release_address(s->worker, worker_address);
  s->address = EncodeUcxPeerAddress(self);
  return std::unique_ptr<UcxPutProbe>(new UcxPutProbe(std::move(s)));
}

std::string UcxPutProbe::address() const { return state_->address; }

absl::Status UcxPutProbe::Connect(const std::string& peer_address) {
  absl::StatusOr<UcxPeerAddress> peer = DecodeUcxPeerAddress(peer_address);
  if (!peer.ok()) return peer.status();
  ucp_ep_params_t params{};
  // The same endpoint settings as UcxTransport, so both measure the same lanes.
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  params.address = reinterpret_cast<const ucp_address_t*>(peer->worker_address.data());
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ucs_status_t st = ucp_ep_create(state_->worker, &params, &state_->ep);
  if (st != UCS_OK) {
    state_->ep = nullptr;
    return UcxError("ucp_ep_create", st);
  }
  st = ucp_ep_rkey_unpack(state_->ep, peer->rkey.data(), &state_->rkey);
  if (st != UCS_OK) {
    state_->rkey = nullptr;
    return UcxError("ucp_ep_rkey_unpack", st);
  }
  state_->remote_base = peer->base;
  state_->remote_bytes = peer->bytes;
  return absl::OkStatus();
}

absl::StatusOr<double> UcxPutProbe::Put(size_t bytes, absl::Duration timeout) {
  State& s = *state_;
  if (s.ep == nullptr) return absl::FailedPreconditionError("put probe: not connected");
  if (bytes > s.bytes || bytes > s.remote_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("put probe: ", bytes, " bytes do not fit"));
  }
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + absl::ToChronoMicroseconds(timeout);
  auto wait = [&](ucs_status_ptr_t request, const char* what) -> absl::Status {
    if (UCS_PTR_IS_ERR(request)) return UcxError(what, UCS_PTR_STATUS(request));
    if (request == nullptr) return absl::OkStatus();
    while (ucp_request_check_status(request) == UCS_INPROGRESS) {
      if (std::chrono::steady_clock::now() > deadline) {
        // Left to the endpoint's force-close in the destructor.
        return absl::DeadlineExceededError(absl::StrCat("put probe: ", what, " timed out"));
      }
      ucp_worker_progress(s.worker);
    }
    const ucs_status_t st = ucp_request_check_status(request);
    ucp_request_free(request);
    return st == UCS_OK ? absl::OkStatus() : UcxError(what, st);
  };
  ucp_request_param_t param{};
  absl::Status put =
      wait(ucp_put_nbx(s.ep, s.base, bytes, s.remote_base, s.rkey, &param), "ucp_put_nbx");
  if (!put.ok()) return put;
  absl::Status flush = wait(ucp_ep_flush_nbx(s.ep, &param), "ucp_ep_flush_nbx");
  if (!flush.ok()) return flush;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

bool UcxPutProbe::Progress() { return ucp_worker_progress(state_->worker) != 0; }

}  // namespace preft::transport
