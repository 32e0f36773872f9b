#include "services/prefill/prefill_service.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/adapters/versioned_adapters.h"
#include "common/base/status_macros.h"
#include "common/base/thread_pool.h"
#include "common/engine/engine_loop.h"
#include "common/kv/blocks.h"
#include "common/log/log.h"
#include "common/rpc/status.h"
#include "services/prefill/prefill_metrics.h"
#include "services/wire/adapter_admin.h"
#include "services/wire/convert.h"
#include "services/wire/kv_path.h"

namespace preft::prefill {

using worker::v1::PrefillRequest;
using worker::v1::PrefillResponse;
using worker::v1::TransportEndpoint;

// Everything the calls share. Thread-safe: the const parts are set before the engine thread
// starts; the rest are atomics or guarded below.
struct PrefillService::Impl {
  class Call;

  Impl(std::unique_ptr<engine::Engine> engine, std::unique_ptr<transport::KvTransport> kv,
       const transport::KvLayout& kv_layout, const PrefillServiceOptions& service_options);
  // Shutdown order: refuse new engine work -> run what was queued -> stop the engine thread
  // (fails its requests) -> close the transport (fails writes in flight) -> close the adapter
  // store (cancels pending loads). Every open call is answered on the way.
  ~Impl();

  // Queues `fn` for the engine thread; false (and `fn` dropped) once the service is stopping.
  // Whatever is posted before that runs.
  bool Post(std::function<void(engine::Engine&)> fn);
  // InvalidArgument for an endpoint without address; FailedPrecondition, naming both layouts,
  // when its layout is not ours. `field` names the endpoint in messages.
  absl::Status CheckEndpoint(const TransportEndpoint& endpoint, const std::string& field) const;
  // The transport's peer for `address`: `done` runs at once when it is connected, else after a
  // connect on the connector thread (a connect may take up to the transport's timeout; it must
  // hold neither a gRPC callback thread nor other calls, to this address or any other). Calls
  // for an address being connected wait for that one connect.
  using PeerCallback = std::function<void(absl::StatusOr<transport::PeerId>)>;
  void Peer(const std::string& address, PeerCallback done);
  // After a failed write: the next call connects again (a failed UCX peer is dropped).
  void ForgetPeer(const std::string& address, transport::PeerId peer);
  void LoadStarted(const std::string& key);
  void LoadEnded(const std::string& key);
  // Status's adapter, budget and endpoint fields (the caller adds the engine's figures).
  void FillStatus(worker::v1::PrefillStatusResponse* response);
  // What the metrics' gauges show; waits for the engine thread.
  PrefillMetrics::State ReadMetricsState();

  const transport::KvLayout layout;
  const PrefillServiceOptions options;
  const int64_t block_tokens;
  const int64_t block_bytes;  // one block, every layer
  const int64_t vocab_size;
  std::unique_ptr<adapters::AdapterStore> store;
  std::unique_ptr<adapters::VersionedAdapters> versioned;
  std::unique_ptr<transport::KvTransport> transport;
  TransportEndpoint endpoint;
  std::unique_ptr<engine::EngineLoop> loop;
  std::unique_ptr<PrefillMetrics> metrics;  // null without options.metrics

  std::atomic<bool> draining{false};
  std::atomic<int64_t> active{0};     // Prefill calls not answered yet
  std::atomic<int64_t> transfers{0};  // KV writes in flight
  std::atomic<int64_t> awaiting_adapter{0};  // calls waiting for their adapter's pin
  std::atomic<uint64_t> next_call{0};

  absl::Mutex mu;
  bool stopping ABSL_GUARDED_BY(mu) = false;
  absl::Mutex peers_mu;
  std::map<std::string, transport::PeerId> peers ABSL_GUARDED_BY(peers_mu);
  // Addresses being connected, with the callbacks waiting for them.
  std::map<std::string, std::vector<PeerCallback>> connecting ABSL_GUARDED_BY(peers_mu);
  std::unique_ptr<base::ThreadPool> connector = std::make_unique<base::ThreadPool>(1);
  absl::Mutex adapters_mu;
  std::map<std::string, int> loading ABSL_GUARDED_BY(adapters_mu);    // key -> pending Acquires
};

// One Prefill call from arrival to its answer. Held by the reactor (until OnDone), the adapter
// callback, the engine request's callbacks and the transfer's `done`: whichever ends the call
// first answers it, the others only clean up. Thread-safe.
//
// Blocks: the engine frees the prompt's blocks itself when the request ends before being
// prefilled (error, abort); once prefilled it holds them until ReleasePrefilled, which is
// posted exactly once, after the transfer ends (or at once if the call was already answered).
class PrefillService::Impl::Call : public std::enable_shared_from_this<Call> {
 public:
  Call(Impl* impl, grpc::CallbackServerContext* context, grpc::ServerUnaryReactor* reactor,
       const PrefillRequest& request, PrefillResponse* response)
      : impl_(impl),
        context_(context),
        reactor_(reactor),
        response_(response),
        request_(request),
        engine_id_(absl::StrCat(request.request_id(), "#", impl->next_call.fetch_add(1))),
        arrival_(absl::Now()) {}

  void Start();
  // The rest of Start, once the decode worker's peer is connected (or failed to be).
  void Connected(absl::StatusOr<transport::PeerId> peer);
  // The client went away: answer CANCELLED now; the engine request is aborted.
  void Cancel();

 private:
  absl::Status Validate() const;
  void OnPin(absl::StatusOr<adapters::AdapterPin> pin);
  void Enqueue();
  void Add(engine::Engine& engine);                    // engine thread
  void OnPrefilled(const engine::PrefilledPrompt& p);  // engine thread
  void OnEngineEnd(const engine::TokenEvent& event);   // engine thread
  void OnTransferred(const absl::Status& status, int64_t bytes,
                     absl::Duration took);  // transport thread
  void EngineRequestEnded();                // nothing left to abort; drops the adapter pin
  void PostRelease();
  // Answers once; later calls do nothing. `kv_path_failed` blames the decode worker's side
  // of the KV path (wire::kKvPathFailedKey).
  void Finish(const absl::Status& status, bool kv_path_failed = false);

  Impl* const impl_;
  grpc::CallbackServerContext* const context_;  // valid until Finish
  grpc::ServerUnaryReactor* const reactor_;  // valid until Finish
  PrefillResponse* const response_;          // valid until Finish
  const PrefillRequest request_;             // a copy: gRPC's goes away with the answer
  const std::string engine_id_;              // unique: a retry may reuse the request id
  const absl::Time arrival_;
  transport::PeerId peer_ = -1;  // set by Start before the call is shared
  absl::Time acquire_started_;   // set by Start before the call is shared
  std::thread::id acquire_thread_;  // a pin answered on it was resident (no load)

  absl::Mutex mu_;
  bool in_engine_ ABSL_GUARDED_BY(mu_) = false;  // Add posted, not prefilled yet
  bool answered_ ABSL_GUARDED_BY(mu_) = false;
  // Pins the adapter until the engine request ends (the engine holds a copy of the weights too).
  adapters::AdapterPin pin_ ABSL_GUARDED_BY(mu_);
  PrefillResponse result_ ABSL_GUARDED_BY(mu_);
  absl::Time added_ ABSL_GUARDED_BY(mu_);
  absl::Time prefilled_ ABSL_GUARDED_BY(mu_);
};

namespace {

// The reactor of a Prefill call; deletes itself when gRPC is done with it.
class PrefillReactor final : public grpc::ServerUnaryReactor {
 public:
  void set_on_cancel(std::function<void()> fn) { on_cancel_ = std::move(fn); }
  void OnCancel() override {
    if (on_cancel_) on_cancel_();
  }
  void OnDone() override { delete this; }

 private:
  std::function<void()> on_cancel_;
};

int64_t Micros(absl::Duration d) { return absl::ToInt64Microseconds(d); }


}  // namespace

absl::Status PrefillService::Impl::Call::Validate() const {
  const PrefillRequest& r = request_;
  if (r.request_id().empty()) return absl::InvalidArgumentError("request_id is empty");
  if (r.prompt_ids().empty()) return absl::InvalidArgumentError("prompt_ids is empty");
  for (int i = 0; i < r.prompt_ids_size(); ++i) {
    if (r.prompt_ids(i) < 0 || r.prompt_ids(i) >= impl_->vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("prompt_ids[", i, "] is ", r.prompt_ids(i),
                                                     ", outside the vocabulary [0, ",
                                                     impl_->vocab_size, ")"));
    }
  }
  if (!r.sampling().has_seed()) {
    return absl::InvalidArgumentError(
        "sampling.seed is not set (decode continues the prefill's sampling stream)");
  }
  PREFT_RETURN_IF_ERROR(wire::FromProto(r.sampling()).Validate(impl_->vocab_size));
  if (r.block_tokens() != impl_->block_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("block_tokens is ", r.block_tokens(),
                                                   "; this prefill worker's blocks hold ",
                                                   impl_->block_tokens, " tokens"));
  }
  const int64_t need = kv::BlocksFor(r.prompt_ids_size(), impl_->block_tokens);
  if (r.block_ids_size() < need) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block_ids has ", r.block_ids_size(), " ids; a prompt of ", r.prompt_ids_size(),
        " tokens needs ", need, " blocks of ", impl_->block_tokens, " tokens"));
  }
  for (int64_t i = 0; i < need; ++i) {
    if (r.block_ids(i) < 0) {
      return absl::InvalidArgumentError(absl::StrCat("block_ids[", i, "] is ", r.block_ids(i)));
    }
  }
  PREFT_RETURN_IF_ERROR(impl_->CheckEndpoint(r.decode_endpoint(), "decode_endpoint"));
  if (!r.adapter().empty()) {
    if (r.adapter_path().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("adapter '", r.adapter(), "' has no adapter_path"));
    }
    if (r.adapter_version() < 1) {
      return absl::InvalidArgumentError(absl::StrCat("adapter_version of adapter '", r.adapter(),
                                                     "' is ", r.adapter_version(),
                                                     "; versions start at 1"));
    }
  }
  return absl::OkStatus();
}

void PrefillService::Impl::Call::Start() {
  if (absl::Status s = Validate(); !s.ok()) return Finish(s);
  impl_->Peer(request_.decode_endpoint().address(),
              [self = shared_from_this()](absl::StatusOr<transport::PeerId> peer) {
                self->Connected(std::move(peer));
              });
}

void PrefillService::Impl::Call::Connected(absl::StatusOr<transport::PeerId> peer) {
  if (!peer.ok()) {
    return Finish(absl::Status(peer.status().code(),
                               absl::StrCat("KV connection to the decode worker failed: ",
                                            peer.status().message())),
                  /*kv_path_failed=*/true);
  }
  peer_ = *peer;
  if (request_.adapter().empty()) return Enqueue();
  impl_->LoadStarted(adapters::VersionKey(request_.adapter(), request_.adapter_version()));
  impl_->awaiting_adapter.fetch_add(1);
  acquire_started_ = absl::Now();
  acquire_thread_ = std::this_thread::get_id();
  // The callback comes at once (compute hit, bad path) or on a loader thread.
  impl_->versioned->Acquire(
      request_.adapter(), request_.adapter_version(), request_.adapter_path(),
      [self = shared_from_this()](absl::StatusOr<adapters::AdapterPin> pin) {
        self->OnPin(std::move(pin));
      });
}

void PrefillService::Impl::Call::OnPin(absl::StatusOr<adapters::AdapterPin> pin) {
  const std::string key = adapters::VersionKey(request_.adapter(), request_.adapter_version());
  impl_->LoadEnded(key);
  impl_->awaiting_adapter.fetch_sub(1);
  if (impl_->metrics != nullptr) {
    impl_->metrics->OnAdapterWait(absl::Now() - acquire_started_,
                                  /*loaded=*/std::this_thread::get_id() != acquire_thread_);
  }
  if (!pin.ok()) {
    const absl::Status& s = pin.status();
    // Cancelled: the store is shutting down, not the client.
    const absl::StatusCode code =
        s.code() == absl::StatusCode::kCancelled ? absl::StatusCode::kUnavailable : s.code();
    return Finish(absl::Status(code, absl::StrCat("adapter '", request_.adapter(), "' version ",
                                                  request_.adapter_version(), ": ", s.message())));
  }
  {
    absl::MutexLock lock(&mu_);
    pin_ = *std::move(pin);
  }
  Enqueue();
}

void PrefillService::Impl::Call::Enqueue() {
  bool posted = false;
  {
    absl::MutexLock lock(&mu_);
    if (answered_) return;  // cancelled while the adapter loaded
    in_engine_ = true;
    // Posted under the lock, so a Cancel's Abort is queued after it.
    posted = impl_->Post([self = shared_from_this()](engine::Engine& e) { self->Add(e); });
  }
  if (!posted) Finish(absl::UnavailableError("prefill worker is shutting down"));
}

void PrefillService::Impl::Call::Add(engine::Engine& engine) {
  engine::Request r;
  {
    absl::MutexLock lock(&mu_);
    if (answered_) return;
    added_ = absl::Now();
    if (pin_.weights != nullptr) {
      r.adapter =
          engine::RequestAdapter{pin_.weights, request_.adapter(), request_.adapter_version(),
                                 wire::FromProto(request_.adapter_positions())};
      result_.set_adapter_version(request_.adapter_version());
      result_.set_adapter_positions(
          wire::ToProto(r.adapter.positions.value_or(pin_.weights->default_positions)));
    }
  }
  r.id = engine_id_;
  r.prompt_ids.assign(request_.prompt_ids().begin(), request_.prompt_ids().end());
  r.sampling = wire::FromProto(request_.sampling());
  auto self = shared_from_this();
  r.on_prefilled = [self](const engine::PrefilledPrompt& p) { self->OnPrefilled(p); };
  r.on_token = [self](const engine::TokenEvent& event) { self->OnEngineEnd(event); };
  if (absl::Status s = engine.Add(std::move(r)); !s.ok()) {
    EngineRequestEnded();
    Finish(s);
  }
}

void PrefillService::Impl::Call::EngineRequestEnded() {
  absl::MutexLock lock(&mu_);
  in_engine_ = false;
  pin_ = adapters::AdapterPin{};  // the engine lets go of its copy as the request ends
}

void PrefillService::Impl::Call::OnPrefilled(const engine::PrefilledPrompt& p) {
  EngineRequestEnded();
  {
    absl::MutexLock lock(&mu_);
    prefilled_ = absl::Now();
    if (answered_) {  // cancelled while computing: nothing to send
      PostRelease();
      return;
    }
    result_.set_first_token_id(p.first_token);
    result_.set_cached_tokens(static_cast<int32_t>(p.cached_tokens));
    if (p.first_logprob) *result_.mutable_first_logprob() = wire::ToProto(*p.first_logprob);
    result_.set_queue_us(Micros(added_ - arrival_));
    result_.set_compute_us(Micros(prefilled_ - added_));
  }
  // The prompt's own blocks (the engine may hold one more for the token it sampled).
  const int64_t n = std::min<int64_t>(kv::BlocksFor(p.num_tokens, impl_->block_tokens),
                                      static_cast<int64_t>(p.blocks.size()));
  transport::BlockTransfer t;
  t.reservation_id = request_.reservation_id();
  t.generation = request_.generation();
  t.src_blocks.assign(p.blocks.begin(), p.blocks.begin() + n);
  t.dst_blocks.assign(request_.block_ids().begin(), request_.block_ids().begin() + n);
  impl_->transfers.fetch_add(1);
  impl_->transport->Write(
      peer_, t,
      [self = shared_from_this(), start = absl::Now(), bytes = n * impl_->block_bytes](
          absl::Status s) { self->OnTransferred(s, bytes, absl::Now() - start); });
}

void PrefillService::Impl::Call::OnEngineEnd(const engine::TokenEvent& event) {
  // A prefill-only request sends events only when it ends without being prefilled.
  EngineRequestEnded();
  if (event.finish == engine::FinishReason::kAbort) {
    return Finish(
        absl::CancelledError(absl::StrCat("request '", request_.request_id(), "' was aborted")));
  }
  if (event.finish == engine::FinishReason::kError) {
    return Finish(event.status.ok() ? absl::InternalError("engine failed the request")
                                    : event.status);
  }
}

void PrefillService::Impl::Call::OnTransferred(const absl::Status& status, int64_t bytes,
                                               absl::Duration took) {
  impl_->transfers.fetch_sub(1);
  if (impl_->metrics != nullptr) impl_->metrics->OnTransfer(status, bytes, took);
  PostRelease();
  if (!status.ok()) {
    // A bad block id is the caller's; anything else means the peer is unreachable.
    if (status.code() == absl::StatusCode::kInvalidArgument) return Finish(status);
    impl_->ForgetPeer(request_.decode_endpoint().address(), peer_);
    return Finish(absl::UnavailableError(
                      absl::StrCat("KV transfer to the decode worker failed: ", status.message())),
                  /*kv_path_failed=*/true);
  }
  {
    absl::MutexLock lock(&mu_);
    result_.set_transfer_bytes(bytes);
    result_.set_transfer_us(Micros(took));
  }
  Finish(absl::OkStatus());
}

void PrefillService::Impl::Call::PostRelease() {
  // Refused only when the engine is going away, and its blocks with it.
  impl_->Post([id = engine_id_](engine::Engine& e) { (void)e.ReleasePrefilled(id); });
}

void PrefillService::Impl::Call::Cancel() {
  {
    absl::MutexLock lock(&mu_);
    if (answered_) return;
    if (in_engine_) {
      impl_->Post([id = engine_id_](engine::Engine& e) { (void)e.Abort(id); });
    }
  }
  Finish(absl::CancelledError("the client cancelled the call"));
}

void PrefillService::Impl::Call::Finish(const absl::Status& status, bool kv_path_failed) {
  {
    absl::MutexLock lock(&mu_);
    if (answered_) return;
    answered_ = true;
    if (status.ok()) *response_ = result_;
    if (kv_path_failed) context_->AddTrailingMetadata(wire::kKvPathFailedKey, "1");
  }
  impl_->active.fetch_sub(1);
  const log::Request id{request_.request_id()};
  if (status.ok() || status.code() == absl::StatusCode::kInvalidArgument ||
      status.code() == absl::StatusCode::kCancelled) {
    log::Debug(id, "prefill of {} tokens (adapter '{}'): {}", request_.prompt_ids_size(),
               request_.adapter(), status);
  } else {
    log::Warn(id, "prefill of {} tokens (adapter '{}') failed: {}{}", request_.prompt_ids_size(),
              request_.adapter(), status, kv_path_failed ? " (KV path)" : "");
  }
  reactor_->Finish(rpc::ToGrpcStatus(status));
}

PrefillService::Impl::Impl(std::unique_ptr<engine::Engine> engine,
                           std::unique_ptr<transport::KvTransport> kv,
                           const transport::KvLayout& kv_layout,
                           const PrefillServiceOptions& service_options)
    : layout(kv_layout),
      options(service_options),
      block_tokens(engine->backend().cache_shape().block_tokens),
      block_bytes(engine->backend().cache_shape().bytes_per_block_all_layers()),
      vocab_size(engine->config().vocab_size),
      transport(std::move(kv)) {
  adapters::AdapterStoreOptions store_options = options.store;
  store_options.load.dtype = engine->backend().adapter_dtype();
  store_options.load.cpu_layout = engine->backend().cpu_adapter_kernels();
  store_options.load.confine_to = options.adapter_root;
  store = std::make_unique<adapters::AdapterStore>(engine->config(), store_options);
  versioned = std::make_unique<adapters::VersionedAdapters>(store.get(), options.adapter_root);
  endpoint = wire::MakeEndpoint(*transport, layout);
  loop = std::make_unique<engine::EngineLoop>(std::move(engine));
  if (options.metrics != nullptr) {
    metrics = std::make_unique<PrefillMetrics>(
        *options.metrics, [this] { return ReadMetricsState(); }, endpoint.transport());
  }
}

PrefillService::Impl::~Impl() {
  metrics.reset();  // it reads the engine
  {
    absl::MutexLock lock(&mu);
    stopping = true;
  }
  draining = true;
  loop->Call([](engine::Engine&) {});  // what was posted before `stopping` runs
  loop->Stop();
  connector.reset();  // connects in progress end (their calls answered) before the transport
  transport.reset();
  versioned.reset();
  store.reset();
  loop.reset();
}

bool PrefillService::Impl::Post(std::function<void(engine::Engine&)> fn) {
  absl::MutexLock lock(&mu);
  if (stopping) return false;
  loop->Post(std::move(fn));
  return true;
}

absl::Status PrefillService::Impl::CheckEndpoint(const TransportEndpoint& e,
                                                 const std::string& field) const {
  if (e.address().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".address is empty"));
  }
  return transport::CheckPeerLayout(layout, e.layout_hash(),
                                    absl::StrCat("the decode worker (", field, ")"), e.layout());
}

void PrefillService::Impl::Peer(const std::string& address, PeerCallback done) {
  std::optional<transport::PeerId> known;
  {
    absl::MutexLock lock(&peers_mu);
    auto it = peers.find(address);
    if (it != peers.end()) {
      known = it->second;
    } else {
      std::vector<PeerCallback>& waiting = connecting[address];
      waiting.push_back(std::move(done));
      if (waiting.size() > 1) return;  // a connect to this address is under way
    }
  }
  if (known) return done(*known);
  connector->Post([this, address] {
    const absl::StatusOr<transport::PeerId> peer = transport->Connect(address);
    std::vector<PeerCallback> waiting;
    {
      absl::MutexLock lock(&peers_mu);
      if (peer.ok()) peers[address] = *peer;
      waiting = std::move(connecting[address]);
      connecting.erase(address);
    }
    for (PeerCallback& callback : waiting) callback(peer);
  });
}

void PrefillService::Impl::ForgetPeer(const std::string& address, transport::PeerId peer) {
  absl::MutexLock lock(&peers_mu);
  auto it = peers.find(address);
  if (it != peers.end() && it->second == peer) peers.erase(it);
}

void PrefillService::Impl::LoadStarted(const std::string& key) {
  absl::MutexLock lock(&adapters_mu);
  ++loading[key];
}

void PrefillService::Impl::LoadEnded(const std::string& key) {
  absl::MutexLock lock(&adapters_mu);
  if (--loading[key] == 0) loading.erase(key);
}

void PrefillService::Impl::FillStatus(worker::v1::PrefillStatusResponse* response) {
  // Taken before adapters_mu: VersionedAdapters may answer an Acquire (OnPin -> LoadEnded)
  // under its own lock.
  const std::map<std::string, int64_t> versions = versioned->versions();
  const std::vector<adapters::AdapterInfo> store_list = store->List();
  absl::MutexLock lock(&adapters_mu);
  wire::AppendAdapterStates(
      versions, store_list,
      [this](const std::string& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(adapters_mu) {
        return loading.count(key) > 0;
      },
      response->mutable_adapters());
  const adapters::AdapterStoreStats stats = store->stats();
  const int64_t total = options.store.compute_bytes;
  response->set_adapter_bytes_free(std::max<int64_t>(0, total - stats.compute_bytes_used));
  response->set_adapter_bytes_total(total);
  response->set_loading(static_cast<int32_t>(loading.size()));
  response->set_draining(draining.load());
  *response->mutable_endpoint() = endpoint;
}

PrefillMetrics::State PrefillService::Impl::ReadMetricsState() {
  PrefillMetrics::State s;
  std::promise<void> read;
  const bool posted = Post([&](engine::Engine& e) {
    s.kv_total_blocks = e.allocator().num_blocks();
    s.kv_free_blocks = e.allocator().num_free();
    s.waiting = e.num_waiting();
    s.running = e.num_running();
    read.set_value();
  });
  if (!posted) return s;
  read.get_future().wait();
  s.waiting += awaiting_adapter.load();
  s.running += transfers.load();
  const std::vector<adapters::AdapterInfo> listed = store->List();
  s.store = metrics::AdapterStoreMetrics::Read(*store, options.store, listed);
  auto name_of = [](const std::string& key) { return key.substr(0, key.rfind("@v")); };
  for (const adapters::AdapterInfo& a : listed) {
    if (a.pins > 0) s.running_adapters.push_back(name_of(a.name));
  }
  {
    absl::MutexLock lock(&adapters_mu);
    for (const auto& [key, pending] : loading) s.waiting_adapters.push_back(name_of(key));
  }
  for (auto* names : {&s.running_adapters, &s.waiting_adapters}) {
    std::sort(names->begin(), names->end());
    names->erase(std::unique(names->begin(), names->end()), names->end());
  }
  return s;
}

absl::StatusOr<std::unique_ptr<PrefillService>> PrefillService::Create(
    std::unique_ptr<engine::Engine> engine, std::unique_ptr<transport::KvTransport> transport,
    const transport::KvLayout& layout, const PrefillServiceOptions& options) {
  if (engine == nullptr || transport == nullptr) {
    return absl::InvalidArgumentError("prefill service: engine and transport are required");
  }
  const transport::KvLayout cache_layout =
      transport::KvLayout::ForCache(engine->backend().cache_shape(), layout.model);
  if (cache_layout.Hash() != layout.Hash()) {
    return absl::InvalidArgumentError(absl::StrCat("prefill service: layout ", layout.ToString(),
                                                   " does not describe the engine's cache ",
                                                   cache_layout.ToString()));
  }
  if (engine->cache() == nullptr && !transport->moves_device_memory()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "prefill service: the engine's KV cache lives on the ", engine->backend().name(),
        " device with no host mirror, which the ", transport->name(), " transport cannot read"));
  }
  // The prefill side receives no transfers: DONE notices have nowhere to go.
  PREFT_RETURN_IF_ERROR(transport->Start(engine->cache(), layout, [](uint64_t, uint32_t) {}));
  return std::unique_ptr<PrefillService>(new PrefillService(
      std::make_unique<Impl>(std::move(engine), std::move(transport), layout, options)));
}

PrefillService::PrefillService(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

PrefillService::~PrefillService() = default;

void PrefillService::StartDrain() { impl_->draining = true; }

int64_t PrefillService::active_requests() const { return impl_->active.load(); }

const TransportEndpoint& PrefillService::endpoint() const { return impl_->endpoint; }

PrefillService::EngineCounts PrefillService::engine_counts() const {
  std::promise<EngineCounts> result;
  std::future<EngineCounts> counts = result.get_future();
  const bool posted = impl_->Post([&result](engine::Engine& e) {
    EngineCounts c;
    c.total_blocks = e.allocator().num_blocks();
    c.free_blocks = e.allocator().num_free();
    c.prefilled_held = e.num_prefilled_held();
    c.waiting = e.num_waiting();
    c.running = e.num_running();
    result.set_value(c);
  });
  return posted ? counts.get() : EngineCounts{};
}

grpc::ServerUnaryReactor* PrefillService::Prefill(grpc::CallbackServerContext* context,
                                                  const PrefillRequest* request,
                                                  PrefillResponse* response) {
  auto* reactor = new PrefillReactor();
  if (impl_->draining) {
    reactor->Finish(rpc::ToGrpcStatus(
        absl::UnavailableError("draining: this prefill worker takes no new requests")));
    return reactor;
  }
  impl_->active.fetch_add(1);
  auto call = std::make_shared<Impl::Call>(impl_.get(), context, reactor, *request, response);
  reactor->set_on_cancel([call] { call->Cancel(); });
  call->Start();
  return reactor;
}

grpc::ServerUnaryReactor* PrefillService::Status(grpc::CallbackServerContext* context,
                                                 const worker::v1::PrefillStatusRequest* request,
                                                 worker::v1::PrefillStatusResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  Impl* impl = impl_.get();
  // On the engine thread, after the step under way: requests that step ended have let go of
  // their adapters.
  const bool posted = impl_->Post([impl, reactor, response](engine::Engine& e) {
    impl->FillStatus(response);
    response->set_queue_depth(static_cast<int32_t>(e.num_waiting()));
    response->set_running(static_cast<int32_t>(e.num_running() + impl->transfers.load()));
    reactor->Finish(grpc::Status::OK);
  });
  if (!posted) {
    reactor->Finish(rpc::ToGrpcStatus(absl::UnavailableError("prefill worker is shutting down")));
  }
  return reactor;
}

grpc::ServerUnaryReactor* PrefillService::Connect(grpc::CallbackServerContext* context,
                                                  const worker::v1::ConnectRequest* request,
                                                  worker::v1::ConnectResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::Status s = impl_->CheckEndpoint(request->endpoint(), "endpoint");
  if (!s.ok()) {
    reactor->Finish(rpc::ToGrpcStatus(s));
    return reactor;
  }
  Impl* impl = impl_.get();
  impl->Peer(request->endpoint().address(),
             [impl, reactor, response](absl::StatusOr<transport::PeerId> peer) {
               if (peer.ok()) *response->mutable_endpoint() = impl->endpoint;
               reactor->Finish(rpc::ToGrpcStatus(peer.status()));
             });
  return reactor;
}

grpc::ServerUnaryReactor* PrefillService::LoadAdapter(grpc::CallbackServerContext* context,
                                                      const worker::v1::WorkerAdapterRequest* request,
                                                      worker::v1::AdapterState* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  Impl* impl = impl_.get();
  const std::string key = adapters::VersionKey(request->name(), request->version());
  impl->LoadStarted(key);  // the Status RPC reports it LOADING meanwhile
  wire::LoadAdapterFor(*impl->versioned, *request, response, reactor,
                       [impl, key] { impl->LoadEnded(key); });
  return reactor;
}

grpc::ServerUnaryReactor* PrefillService::UnloadAdapter(
    grpc::CallbackServerContext* context, const worker::v1::WorkerAdapterRequest* request,
    worker::v1::UnloadWorkerAdapterResponse*) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  wire::UnloadAdapterFor(*impl_->versioned, *request, reactor);
  return reactor;
}

}  // namespace preft::prefill
