#include "services/decode/decode_service.h"

#include <algorithm>
#include <future>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "common/kv/blocks.h"
#include "common/rpc/status.h"
#include "services/decode/decode_impl.h"
#include "services/decode/streams_call.h"
#include "services/wire/adapter_admin.h"
#include "services/wire/convert.h"
#include "services/wire/grpc_kv_transport.h"

namespace preft::decode {

DecodeService::Impl::~Impl() {
  Failures failures;
  {
    absl::MutexLock lock(&mu);
    stopping = true;
    for (auto& [ptr, start] : starts) {
      failures.emplace_back(start.stream, absl::UnavailableError("decode worker is shutting down"));
    }
    timer_cv.Signal();
  }
  if (timer.joinable()) timer.join();
  Fail(failures);
  transport.reset();       // no DONE notice and no write into the cache from here on
  if (loop) loop->Stop();  // fails running requests with UNAVAILABLE
  loop.reset();
  {
    absl::MutexLock lock(&mu);
    starts.clear();  // adapter pins go before the store
  }
  versioned.reset();
  store.reset();
}

std::shared_ptr<StartStream> DecodeService::Impl::OpenStream(StreamFinishInfo info,
                                                             StreamSink* sink) {
  StartStream::Hooks hooks;
  hooks.on_cancel = [this](StartStream* s) { OnStreamCancel(s); };
  hooks.on_done = [this](StartStream* s) { OnStreamDone(s); };
  const std::string request_id = info.request_id;
  std::shared_ptr<StartStream> stream =
      sink == nullptr ? StartStream::Create(std::move(info), std::move(hooks))
                      : StartStream::Create(std::move(info), std::move(hooks), sink);
  absl::MutexLock lock(&mu);
  Start& start = starts[stream.get()];
  start.stream = stream;
  start.request_id = request_id;
  return stream;
}

absl::Status DecodeService::Impl::ValidatePrompt(
    const std::string& request_id,
    const google::protobuf::RepeatedField<int32_t>& prompt_ids) const {
  const int64_t vocab = config.vocab_size;
  const int64_t context = config.max_position_embeddings;
  const int64_t num_prompt = prompt_ids.size();
  if (request_id.empty()) return absl::InvalidArgumentError("request_id is empty");
  if (num_prompt == 0) return absl::InvalidArgumentError("prompt_ids is empty");
  if (num_prompt >= context) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt_ids has ", num_prompt, " tokens; the model's context is ", context));
  }
  for (int i = 0; i < num_prompt; ++i) {
    if (prompt_ids[i] < 0 || prompt_ids[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("prompt_ids[", i, "] = ", prompt_ids[i],
                                                     " is outside the vocabulary [0, ", vocab,
                                                     ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status DecodeService::Impl::BeginStart(const std::shared_ptr<StartStream>& stream,
                                             const worker::v1::StartRequest& req) {
  const int64_t vocab = config.vocab_size;
  const int64_t context = config.max_position_embeddings;
  const int64_t num_prompt = req.prompt_ids_size();
  PREFT_RETURN_IF_ERROR(ValidatePrompt(req.request_id(), req.prompt_ids()));
  if (req.first_token_id() < 0 || req.first_token_id() >= vocab) {
    return absl::InvalidArgumentError(absl::StrCat("first_token_id = ", req.first_token_id(),
                                                   " is outside the vocabulary [0, ", vocab, ")"));
  }
  if (!req.sampling().has_seed()) {
    return absl::InvalidArgumentError(
        "sampling.seed is not set: decode must continue the prefill's sampling stream");
  }
  const engine::SamplingParams sampling = wire::FromProto(req.sampling());
  PREFT_RETURN_IF_ERROR(sampling.Validate(vocab));
  if (sampling.logprobs && !req.has_first_logprob()) {
    return absl::InvalidArgumentError("sampling.logprobs is set but first_logprob is missing");
  }
  const bool with_adapter = !req.adapter().empty();
  if (with_adapter && !options.all_position_adapters) {
    return absl::FailedPreconditionError(absl::StrCat(
        "this decode worker runs no adapters (PreFT mode): adapter must be empty, got '",
        req.adapter(), "' (start the worker with --adapters all-positions for the baseline)"));
  }
  if (with_adapter && req.adapter_path().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("adapter '", req.adapter(), "' is given without adapter_path"));
  }
  const int64_t max_new = std::min<int64_t>(sampling.max_tokens, context - num_prompt);
  const int64_t need = kv::BlocksFor(num_prompt + max_new, block_tokens);

  engine::Request request;
  request.id = req.request_id();
  request.prompt_ids.assign(req.prompt_ids().begin(), req.prompt_ids().end());
  request.sampling = sampling;
  engine::ImportedPrompt imported;
  imported.first_token = req.first_token_id();
  if (sampling.logprobs) imported.first_logprob = wire::FromProto(req.first_logprob());

  const uint64_t id = req.reservation_id();
  {
    absl::MutexLock lock(&mu);
    if (stopping) return absl::UnavailableError("decode worker is shutting down");
    auto it = reservations.find(id);
    if (it == reservations.end()) {
      return absl::NotFoundError(absl::StrCat("reservation ", id, " is unknown"));
    }
    Reservation& r = it->second;
    if (r.state == State::kReleased) {
      return absl::NotFoundError(
          absl::StrCat("reservation ", id, " was released (", r.why_released, ")"));
    }
    if (r.state == State::kStarted) {
      return absl::FailedPreconditionError(
          absl::StrCat("reservation ", id, " was already started"));
    }
    if (r.waiter != nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("reservation ", id, " already has a Start waiting for its KV"));
    }
    if (req.generation() != r.generation) {
      return absl::FailedPreconditionError(
          absl::StrCat("generation ", req.generation(), " of reservation ", id,
                       " is not its current generation ", r.generation));
    }
    if (need > static_cast<int64_t>(r.blocks.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt_ids (", num_prompt, " tokens) and max_tokens ", max_new, " need ", need,
          " blocks of ", block_tokens, " tokens; reservation ", id, " holds ", r.blocks.size()));
    }
    Start& start = starts.at(stream.get());
    start.reservation_id = id;
    start.claimed = true;
    start.adapter_pending = with_adapter;
    start.request = std::move(request);
    start.imported = std::move(imported);
    r.waiter = stream.get();
    if (!with_adapter && r.done) CommitLocked(r, start);
  }
  if (with_adapter) {
    versioned->Acquire(req.adapter(), req.adapter_version(), req.adapter_path(),
                       [this, stream](absl::StatusOr<adapters::AdapterPin> pin) {
                         OnAdapter(stream, std::move(pin));
                       });
  }
  return absl::OkStatus();
}

void DecodeService::Impl::OnAdapter(const std::shared_ptr<StartStream>& stream,
                                    absl::StatusOr<adapters::AdapterPin> pin) {
  Failures failures;
  {
    absl::MutexLock lock(&mu);
    auto it = starts.find(stream.get());
    if (it == starts.end() || !it->second.claimed) return;  // ended meanwhile: pin dropped
    Start& start = it->second;
    auto rit = reservations.find(start.reservation_id);
    if (rit == reservations.end()) return;
    Reservation& r = rit->second;
    if (!pin.ok()) {
      AbortLocked(rit->first, r, absl::StrCat("adapter failed: ", pin.status().message()),
                  pin.status(), &failures);
    } else {
      start.request.adapter = engine::RequestAdapter{pin->weights, pin->name, pin->version,
                                                     model::AdapterPositions::kAll};
      start.adapter_pending = false;
      if (r.done) CommitLocked(r, start);
    }
  }
  Fail(failures);
}

void DecodeService::Impl::OnStreamCancel(StartStream* stream) {
  Failures failures;
  {
    absl::MutexLock lock(&mu);
    auto it = starts.find(stream);
    if (it == starts.end()) return;
    Start& start = it->second;
    start.cancelled = true;  // a Run still pinning its adapter is dropped when the pin comes
    if (start.committed) {
      loop->Post([id = start.request_id](engine::Engine& e) { (void)e.Abort(id); });
    } else if (start.claimed) {
      auto rit = reservations.find(start.reservation_id);
      if (rit == reservations.end()) return;
      AbortLocked(rit->first, rit->second, "its Start call was cancelled",
                  absl::CancelledError("the Start call was cancelled"), &failures);
    }
  }
  Fail(failures);
}

void DecodeService::Impl::OnStreamDone(StartStream* stream) {
  Failures failures;
  std::map<StartStream*, Start>::node_type gone;  // destroyed outside mu
  {
    absl::MutexLock lock(&mu);
    auto it = starts.find(stream);
    if (it == starts.end()) return;
    if (it->second.claimed) {  // not expected: a waiting stream ends by cancel or failure
      auto rit = reservations.find(it->second.reservation_id);
      if (rit != reservations.end())
        AbortLocked(rit->first, rit->second, "its Start call ended",
                    absl::CancelledError("the Start call ended"), &failures);
    }
    gone = starts.extract(it);
  }
  Fail(failures);
}

absl::StatusOr<std::unique_ptr<DecodeService>> DecodeService::Create(
    std::unique_ptr<engine::Engine> engine, std::unique_ptr<transport::KvTransport> transport,
    const transport::KvLayout& layout, const DecodeServiceOptions& options) {
  if (engine == nullptr || transport == nullptr) {
    return absl::InvalidArgumentError("DecodeService needs an engine and a transport");
  }
  if (options.default_lease <= absl::ZeroDuration() || options.max_lease < options.default_lease ||
      options.quarantine < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad decode options: default_lease ", absl::FormatDuration(options.default_lease),
        " must be positive and at most max_lease ", absl::FormatDuration(options.max_lease),
        "; quarantine ", absl::FormatDuration(options.quarantine), " must not be negative"));
  }
  auto impl = std::make_unique<Impl>(options);
  impl->config = engine->config();
  impl->block_tokens = engine->backend().cache_shape().block_tokens;
  impl->total_blocks = engine->allocator().num_blocks();
  if (options.all_position_adapters || options.colocated) {
    adapters::AdapterStoreOptions store = options.store;
    store.load.cpu_layout = engine->backend().cpu_adapter_kernels();
    store.load.confine_to = options.adapter_root;
    impl->store = std::make_unique<adapters::AdapterStore>(impl->config, store);
    impl->versioned =
        std::make_unique<adapters::VersionedAdapters>(impl->store.get(), options.adapter_root);
  }
  Impl* raw = impl.get();
  if (engine->cache() != nullptr || transport->moves_device_memory()) {
    PREFT_RETURN_IF_ERROR(transport->Start(
        engine->cache(), layout,
        [raw](uint64_t id, uint32_t generation) { raw->OnDoneNotice(id, generation); }));
  } else if (!options.colocated) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the engine's KV cache lives on the ", engine->backend().name(),
        " device with no host mirror, which the ", transport->name(),
        " transport cannot reach: run this worker colocated, with a host mirror, or with "
        "--transport cuda_ipc"));
  }  // else colocated: the transport never moves KV (Reserve is refused), so it stays idle
  impl->endpoint = wire::MakeEndpoint(*transport, layout);
  impl->transport = std::move(transport);
  impl->loop = std::make_unique<engine::EngineLoop>(std::move(engine));
  impl->timer = std::thread([raw] { raw->TimerLoop(); });
  return std::unique_ptr<DecodeService>(new DecodeService(std::move(impl)));
}

DecodeService::DecodeService(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

const adapters::AdapterStore* DecodeService::adapter_store() const { return impl_->store.get(); }

const DecodeServiceOptions& DecodeService::options() const { return impl_->options; }

DecodeService::~DecodeService() = default;

void DecodeService::StartDrain() {
  absl::MutexLock lock(&impl_->mu);
  impl_->draining = true;
}

const worker::v1::TransportEndpoint& DecodeService::endpoint() const { return impl_->endpoint; }

void DecodeService::SetAdvertisedAddress(const std::string& address) {
  auto* grpc_transport = dynamic_cast<wire::GrpcKvTransport*>(impl_->transport.get());
  if (grpc_transport == nullptr) return;
  grpc_transport->SetAdvertisedAddress(address);
  absl::MutexLock lock(&impl_->mu);
  impl_->endpoint.set_address(grpc_transport->LocalAddress());
}

namespace {

// One WriteKv stream: every chunk goes to the "grpc" transport, which writes it into the cache.
class WriteKvReactor final : public grpc::ServerReadReactor<worker::v1::KvChunk> {
 public:
  WriteKvReactor(wire::GrpcKvTransport* transport, worker::v1::KvWriteAck* ack)
      : transport_(transport), ack_(ack) {
    if (transport_ == nullptr) {
      Finish(rpc::ToGrpcStatus(
          absl::FailedPreconditionError("this decode worker's KV transport is not grpc")));
      return;
    }
    StartRead(&chunk_);
  }
  void OnReadDone(bool ok) override {
    if (!ok) {
      ack_->set_bytes(bytes_);
      Finish(grpc::Status::OK);
      return;
    }
    const absl::Status s = transport_->Receive(chunk_, first_, &bytes_);
    first_ = false;
    if (!s.ok()) {
      Finish(rpc::ToGrpcStatus(s));
      return;
    }
    StartRead(&chunk_);
  }
  void OnDone() override { delete this; }

 private:
  wire::GrpcKvTransport* const transport_;
  worker::v1::KvWriteAck* const ack_;
  worker::v1::KvChunk chunk_;
  bool first_ = true;
  int64_t bytes_ = 0;
};

}  // namespace

grpc::ServerReadReactor<worker::v1::KvChunk>* DecodeService::WriteKv(
    grpc::CallbackServerContext*, worker::v1::KvWriteAck* response) {
  return new WriteKvReactor(dynamic_cast<wire::GrpcKvTransport*>(impl_->transport.get()),
                            response);
}

int64_t DecodeService::active_streams() const {
  absl::MutexLock lock(&impl_->mu);
  return static_cast<int64_t>(impl_->starts.size());
}

DecodeService::BlockCounts DecodeService::block_counts() const {
  Impl* impl = impl_.get();
  auto counts = [impl](engine::Engine& e) {
    absl::MutexLock lock(&impl->mu);
    BlockCounts c;
    c.total = e.allocator().num_blocks();
    c.free = e.allocator().num_free();
    c.reserved = static_cast<int32_t>(impl->reserved_blocks);
    c.quarantined = static_cast<int32_t>(impl->quarantined_blocks);
    c.filled = c.total - c.free - c.reserved - c.quarantined;
    c.sequences = static_cast<int32_t>(e.num_running());
    c.queued = static_cast<int32_t>(e.num_waiting());
    for (const auto& [id, r] : impl->reservations) {
      c.reservations_waiting += r.state == Impl::State::kReserved;
    }
    return c;
  };
  try {
    return impl->loop->Call(counts);
  } catch (const std::future_error&) {  // the engine thread has stopped
    BlockCounts c;
    c.total = static_cast<int32_t>(impl->total_blocks);
    return c;
  }
}

grpc::ServerUnaryReactor* DecodeService::Reserve(grpc::CallbackServerContext* context,
                                                 const worker::v1::ReserveRequest* request,
                                                 worker::v1::ReserveResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<Impl::ReservePlan> plan = impl_->PlanReserve(*request);
  if (!plan.ok()) {
    reactor->Finish(rpc::ToGrpcStatus(plan.status()));
    return reactor;
  }
  Impl* impl = impl_.get();
  impl->loop->Post([impl, request, response, reactor, plan = *plan](engine::Engine& e) {
    Impl::Failures failures;
    const absl::Status s = impl->ReserveOnEngine(e, *request, plan, response, &failures);
    Impl::Fail(failures);
    reactor->Finish(rpc::ToGrpcStatus(s));
  });
  return reactor;
}

grpc::ServerWriteReactor<v1::GenerateResponse>* DecodeService::Start(
    grpc::CallbackServerContext* context, const worker::v1::StartRequest* request) {
  std::shared_ptr<StartStream> stream = impl_->OpenStream(FinishInfoOf(*request));
  const absl::Status s = impl_->BeginStart(stream, *request);
  if (!s.ok()) stream->Fail(s);
  return stream->reactor();
}

grpc::ServerWriteReactor<v1::GenerateResponse>* DecodeService::Run(
    grpc::CallbackServerContext* context, const worker::v1::RunRequest* request) {
  std::shared_ptr<StartStream> stream = impl_->OpenStream(FinishInfoOf(*request));
  const absl::Status s = impl_->BeginRun(stream, *request);
  if (!s.ok()) stream->Fail(s);
  return stream->reactor();
}

grpc::ServerBidiReactor<worker::v1::StreamsRequest, worker::v1::StreamsResponse>*
DecodeService::Streams(grpc::CallbackServerContext* context) {
  return new StreamsCall(impl_.get());
}

grpc::ServerUnaryReactor* DecodeService::Release(grpc::CallbackServerContext* context,
                                                 const worker::v1::ReleaseRequest* request,
                                                 worker::v1::ReleaseResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  Impl::Failures failures;
  const absl::Status s = impl_->Release(*request, &failures);
  Impl::Fail(failures);
  reactor->Finish(rpc::ToGrpcStatus(s));
  return reactor;
}

grpc::ServerUnaryReactor* DecodeService::Status(grpc::CallbackServerContext* context,
                                                const worker::v1::DecodeStatusRequest* request,
                                                worker::v1::DecodeStatusResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  Impl* impl = impl_.get();
  {
    absl::MutexLock lock(&impl->mu);
    if (impl->stopping) {
      reactor->Finish(rpc::ToGrpcStatus(absl::UnavailableError("decode worker is shutting down")));
      return reactor;
    }
  }
  impl->loop->Post([impl, response, reactor](engine::Engine& e) {
    {
      absl::MutexLock lock(&impl->mu);
      response->set_reserved_blocks(static_cast<int32_t>(impl->reserved_blocks));
      response->set_draining(impl->draining);
      *response->mutable_endpoint() = impl->endpoint;
    }
    response->set_free_blocks(e.allocator().num_free());
    response->set_total_blocks(e.allocator().num_blocks());
    response->set_block_tokens(static_cast<int32_t>(impl->block_tokens));
    response->set_running(static_cast<int32_t>(e.num_running()));
    response->set_queue_depth(static_cast<int32_t>(e.num_waiting()));
    response->set_max_running(static_cast<int32_t>(e.max_running()));
    response->set_all_position_adapters(impl->options.all_position_adapters);
    response->set_colocated(impl->options.colocated);
    if (impl->versioned != nullptr) {  // no loads tracked here: a version not in memory is DISK
      wire::AppendAdapterStates(impl->versioned->versions(), impl->store->List(),
                                [](const std::string&) { return false; },
                                response->mutable_adapters());
    }
    reactor->Finish(grpc::Status::OK);
  });
  return reactor;
}

grpc::ServerUnaryReactor* DecodeService::LoadAdapter(
    grpc::CallbackServerContext* context, const worker::v1::WorkerAdapterRequest* request,
    worker::v1::AdapterState* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (impl_->versioned == nullptr) {
    reactor->Finish(rpc::ToGrpcStatus(absl::FailedPreconditionError(
        "this decode worker runs no adapters (a PreFT decode tier); start it with --colocated "
        "or --adapters all-positions to load them")));
    return reactor;
  }
  wire::LoadAdapterFor(*impl_->versioned, *request, response, reactor);
  return reactor;
}

grpc::ServerUnaryReactor* DecodeService::UnloadAdapter(
    grpc::CallbackServerContext* context, const worker::v1::WorkerAdapterRequest* request,
    worker::v1::UnloadWorkerAdapterResponse*) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (impl_->versioned == nullptr) {  // nothing loaded here: nothing to forget
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  wire::UnloadAdapterFor(*impl_->versioned, *request, reactor);
  return reactor;
}

}  // namespace preft::decode
