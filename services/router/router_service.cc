#include "services/router/router_service.h"

#include <functional>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/rpc/status.h"
#include "services/router/generate_call.h"
#include "services/router/router_impl.h"
#include "services/wire/request_convert.h"

namespace preft::router {

void RouterService::Impl::RunAdmin(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mu);
    ++threads;
  }
  admin->Post([this, fn = std::move(fn)] {
    fn();
    std::lock_guard<std::mutex> lock(mu);
    if (--threads == 0) idle.notify_all();
  });
}

RouterService::RouterService(const model::ModelConfig& config, const text::Tokenizer* tokenizer,
                             WorkerPool* pool, AdapterRegistry* registry, RouterOptions options)
    : impl_(std::make_unique<Impl>()) {
  impl_->config = config;
  impl_->tokenizer = tokenizer;
  impl_->pool = pool;
  impl_->registry = registry;
  impl_->options = std::move(options);
  prometheus::Registry* metrics = impl_->options.metrics;
  if (metrics == nullptr) {
    impl_->own_registry = std::make_shared<prometheus::Registry>();
    metrics = impl_->own_registry.get();
  }
  impl_->metrics = std::make_unique<RouterMetrics>(*metrics);
  impl_->access = std::make_unique<Access>(impl_->options.access);
  impl_->cpu = std::make_unique<base::ThreadPool>(impl_->options.cpu_threads);
  impl_->admin = std::make_unique<base::ThreadPool>(impl_->options.admin_threads);
  Impl* impl = impl_.get();
  pool->OnPrefillRejoin([impl](const std::shared_ptr<PrefillWorker>& w) {
    {
      std::lock_guard<std::mutex> lock(impl->mu);
      if (impl->draining) return;
    }
    // Adapters an admin loaded ahead of traffic (RegisterAdapter(load), LoadAdapter), as the
    // registry keeps them: loaded again onto the rejoining worker, off the polling thread.
    impl->RunAdmin([impl, w] {
      const absl::StatusOr<std::vector<std::string>> preloaded = impl->registry->Preloaded();
      if (!preloaded.ok()) return;  // the registry is unreachable: requests load on demand
      for (const std::string& name : *preloaded) {
        absl::StatusOr<RegisteredAdapter> a = impl->registry->Get(name);
        if (!a.ok()) continue;  // unregistered meanwhile
        worker::v1::WorkerAdapterRequest req;
        req.set_name(a->name);
        req.set_version(a->version);
        req.set_path(a->path);
        worker::v1::AdapterState out;
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
        (void)w->stub->LoadAdapter(&ctx, req, &out);  // best effort: requests load on demand
      }
    });
  });
}

RouterService::~RouterService() {
  impl_->pool->OnPrefillRejoin(nullptr);  // no new preloads after this
  {
    std::unique_lock<std::mutex> lock(impl_->mu);
    impl_->idle.wait(lock, [&] { return impl_->threads == 0; });
  }
  // Joined while the mutex their last task let go of still exists.
  impl_->admin.reset();
  impl_->cpu.reset();
}

void RouterService::StartDrain() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->draining = true;
}

int64_t RouterService::active_requests() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return static_cast<int64_t>(impl_->active.size());
}

namespace {

// A Generate call's gRPC stream: its reactions go to the call, which it outlives.
class GrpcGenerateClient final : public grpc::ServerWriteReactor<v1::GenerateResponse>,
                                 public GenerateClient {
 public:
  GrpcGenerateClient(RouterService::Impl* router, grpc::CallbackServerContext* context,
                     const v1::GenerateRequest* request) {
    new GenerateCall(router, *request, CallerOf(*context), context->deadline(), this);
  }

  void StartWrite(const v1::GenerateResponse* msg) override {
    grpc::ServerWriteReactor<v1::GenerateResponse>::StartWrite(msg);
  }
  void Finish(const absl::Status& status) override {
    grpc::ServerWriteReactor<v1::GenerateResponse>::Finish(rpc::ToGrpcStatus(status));
  }
  void OnWriteDone(bool ok) override { call()->WriteDone(ok); }
  void OnCancel() override { call()->Cancel(); }
  void OnDone() override {
    call()->Done();
    delete this;
  }
};

}  // namespace

grpc::ServerWriteReactor<v1::GenerateResponse>* RouterService::Generate(
    grpc::CallbackServerContext* context, const v1::GenerateRequest* request) {
  return new GrpcGenerateClient(impl_.get(), context, request);
}

void RouterService::GenerateInProcess(const v1::GenerateRequest& request, Caller caller,
                                      absl::Time deadline, GenerateClient* client) {
  new GenerateCall(impl_.get(), request, std::move(caller),
                   deadline == absl::InfiniteFuture() ? std::chrono::system_clock::time_point::max()
                                                      : absl::ToChronoTime(deadline),
                   client);
}

namespace {

// Finishes `reactor` with the refusal and returns true when the caller may not make the call.
bool Refused(const Access& access, const grpc::CallbackServerContext& context, Scope scope,
             grpc::ServerUnaryReactor* reactor) {
  const absl::Status s = access.Authorize(context, scope);
  if (s.ok()) return false;
  reactor->Finish(rpc::ToGrpcStatus(s));
  return true;
}

// An UpdateAdapter stream refused before its first message.
class RefusedUpdate final : public grpc::ServerReadReactor<v1::UpdateAdapterRequest> {
 public:
  explicit RefusedUpdate(const absl::Status& status) { Finish(rpc::ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};

}  // namespace

grpc::ServerUnaryReactor* RouterService::Abort(grpc::CallbackServerContext* context,
                                               const v1::AbortRequest* request,
                                               v1::AbortResponse*) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (Refused(*impl_->access, *context, Scope::kApi, reactor)) return reactor;
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->active.find(request->request_id());
  if (it == impl_->active.end()) {
    reactor->Finish(rpc::ToGrpcStatus(
        absl::NotFoundError(absl::StrCat("no running request '", request->request_id(), "'"))));
  } else {
    it->second->Abort();
    reactor->Finish(grpc::Status::OK);
  }
  return reactor;
}

namespace {

v1::AdapterInfo ToInfo(const RegisteredAdapter& a, WorkerPool* pool) {
  v1::AdapterInfo info;
  info.set_name(a.name);
  info.set_version(a.version);
  info.set_type(a.kind == model::AdapterKind::kLora ? v1::ADAPTER_TYPE_LORA
                                                    : v1::ADAPTER_TYPE_DIREFT);
  info.set_default_positions(wire::ToProto(a.default_positions));
  info.set_rank(static_cast<int32_t>(a.rank));
  info.set_path(a.registered_path);
  info.set_bytes(a.bytes);
  // Prefill workers, then decode workers that run adapters (their polled lists).
  auto add = [&](const auto& workers) {
    for (const auto& w : workers) {
      absl::MutexLock lock(&w->mu);
      for (const auto& s : w->status.adapters()) {
        if (s.name() != a.name) continue;
        v1::WorkerResidency* r = info.add_workers();
        r->set_worker(w->address);
        r->set_version(s.version());
        r->set_residency(s.residency());
      }
    }
  };
  add(pool->prefill());
  add(pool->decode());
  return info;
}

// Runs an adapter RPC on every healthy worker that runs adapters: prefill workers, then
// colocated and all-position decode workers (`limit` > 0: on that many at most). The first
// error wins; with `need_one`, FailedPrecondition when no such worker is healthy.
absl::Status ForEachAdapterWorker(
    WorkerPool* pool, int limit, bool need_one, bool include_decode,
    const std::function<grpc::Status(worker::v1::PrefillWorker::Stub&, grpc::ClientContext*)>&
        prefill_call,
    const std::function<grpc::Status(worker::v1::DecodeWorker::Stub&, grpc::ClientContext*)>&
        decode_call) {
  absl::Status first = absl::OkStatus();
  int done = 0;
  auto run = [&](const std::string& address, auto& stub, const auto& call) {
    if (limit > 0 && done >= limit) return;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    const absl::Status s = rpc::FromGrpcStatus(call(stub, &ctx));
    if (!s.ok() && first.ok()) first = absl::Status(s.code(), absl::StrCat(address, ": ", s.message()));
    ++done;
  };
  for (const auto& w : pool->prefill()) {
    {
      absl::MutexLock lock(&w->mu);
      if (!w->view.healthy || w->view.draining) continue;
    }
    run(w->address, *w->stub, prefill_call);
  }
  for (const auto& w : pool->decode()) {
    if (!include_decode) break;
    {
      absl::MutexLock lock(&w->mu);
      if (!w->view.healthy || w->view.draining || !(w->view.adapters || w->view.colocated)) continue;
    }
    run(w->address, *w->stub, decode_call);
  }
  if (done == 0 && need_one) {
    return absl::FailedPreconditionError(
        "no healthy worker runs adapters (prefill, colocated or all-position decode workers)");
  }
  return first;
}

absl::Status LoadOnWorkers(WorkerPool* pool, const RegisteredAdapter& a, int limit,
                           bool include_decode = true) {
  worker::v1::WorkerAdapterRequest req;
  req.set_name(a.name);
  req.set_version(a.version);
  req.set_path(a.path);
  worker::v1::AdapterState out;
  return ForEachAdapterWorker(
      pool, limit, /*need_one=*/true, include_decode,
      [&](worker::v1::PrefillWorker::Stub& stub, grpc::ClientContext* ctx) {
        return stub.LoadAdapter(ctx, req, &out);
      },
      [&](worker::v1::DecodeWorker::Stub& stub, grpc::ClientContext* ctx) {
        return stub.LoadAdapter(ctx, req, &out);
      });
}

absl::Status UnloadOnWorkers(WorkerPool* pool, const std::string& name) {
  worker::v1::WorkerAdapterRequest req;
  req.set_name(name);
  worker::v1::UnloadWorkerAdapterResponse out;
  return ForEachAdapterWorker(
      pool, 0, /*need_one=*/false, /*include_decode=*/true,
      [&](worker::v1::PrefillWorker::Stub& stub, grpc::ClientContext* ctx) {
        return stub.UnloadAdapter(ctx, req, &out);
      },
      [&](worker::v1::DecodeWorker::Stub& stub, grpc::ClientContext* ctx) {
        return stub.UnloadAdapter(ctx, req, &out);
      });
}

}  // namespace

grpc::ServerUnaryReactor* RouterService::ListModels(grpc::CallbackServerContext* context,
                                                    const v1::ListModelsRequest*,
                                                    v1::ListModelsResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (Refused(*impl_->access, *context, Scope::kApi, reactor)) return reactor;
  v1::BaseModel* base = response->mutable_base();
  base->set_name(impl_->options.base_name);
  base->set_architecture(impl_->config.architecture_name);
  base->set_dtype(impl_->options.base_dtype);
  base->set_vocab_size(static_cast<int32_t>(impl_->config.vocab_size));
  base->set_max_context_tokens(static_cast<int32_t>(impl_->config.max_position_embeddings));
  const absl::StatusOr<std::vector<RegisteredAdapter>> all = impl_->registry->List();
  if (all.ok()) {
    for (const RegisteredAdapter& a : *all) *response->add_adapters() = ToInfo(a, impl_->pool);
  }
  reactor->Finish(rpc::ToGrpcStatus(all.status()));
  return reactor;
}

grpc::ServerUnaryReactor* RouterService::RegisterAdapter(grpc::CallbackServerContext* context,
                                                         const v1::RegisterAdapterRequest* request,
                                                         v1::RegisterAdapterResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (Refused(*impl_->access, *context, Scope::kAdmin, reactor)) return reactor;
  impl_->RunAdmin([this, reactor, request, response] {  // reads the adapter from disk
    absl::StatusOr<RegisteredAdapter> a =
        impl_->registry->Register(request->name(), request->path());
    absl::Status s = a.status();
    if (s.ok() && request->load()) {
      impl_->pool->PollNow();
      s = LoadOnWorkers(impl_->pool, *a, 0);
      if (s.ok()) impl_->pool->PollNow();
      if (s.ok()) s = impl_->registry->SetPreload(a->name, true);
    }
    if (s.ok()) *response->mutable_adapter() = ToInfo(*a, impl_->pool);
    reactor->Finish(rpc::ToGrpcStatus(s));
  });
  return reactor;
}

grpc::ServerUnaryReactor* RouterService::LoadAdapter(grpc::CallbackServerContext* context,
                                                     const v1::LoadAdapterRequest* request,
                                                     v1::LoadAdapterResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (Refused(*impl_->access, *context, Scope::kAdmin, reactor)) return reactor;
  impl_->RunAdmin([this, reactor, request, response] {
    absl::StatusOr<RegisteredAdapter> a = impl_->registry->Get(request->name());
    absl::Status s = a.status();
    if (s.ok()) {
      s = LoadOnWorkers(impl_->pool, *a, request->num_workers() > 0 ? request->num_workers() : 1,
                        /*include_decode=*/!request->prefill_only());
    }
    if (s.ok()) {
      impl_->pool->PollNow();
      *response->mutable_adapter() = ToInfo(*a, impl_->pool);
      s = impl_->registry->SetPreload(a->name, true);
    }
    reactor->Finish(rpc::ToGrpcStatus(s));
  });
  return reactor;
}

grpc::ServerUnaryReactor* RouterService::UnloadAdapter(grpc::CallbackServerContext* context,
                                                       const v1::UnloadAdapterRequest* request,
                                                       v1::UnloadAdapterResponse*) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (Refused(*impl_->access, *context, Scope::kAdmin, reactor)) return reactor;
  impl_->RunAdmin([this, reactor, request] {
    absl::Status s = impl_->registry->Get(request->name()).status();
    if (s.ok()) s = UnloadOnWorkers(impl_->pool, request->name());
    if (s.ok() && !request->unregister()) s = impl_->registry->SetPreload(request->name(), false);
    if (s.ok() && request->unregister()) s = impl_->registry->Unregister(request->name());
    reactor->Finish(rpc::ToGrpcStatus(s));
  });
  return reactor;
}

grpc::ServerUnaryReactor* RouterService::ListAdapters(grpc::CallbackServerContext* context,
                                                      const v1::ListAdaptersRequest* request,
                                                      v1::ListAdaptersResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (Refused(*impl_->access, *context, Scope::kApi, reactor)) return reactor;
  if (!request->name().empty()) {
    absl::StatusOr<RegisteredAdapter> a = impl_->registry->Get(request->name());
    if (a.ok()) *response->add_adapters() = ToInfo(*a, impl_->pool);
    reactor->Finish(rpc::ToGrpcStatus(a.status()));
    return reactor;
  }
  const absl::StatusOr<std::vector<RegisteredAdapter>> all = impl_->registry->List();
  if (all.ok()) {
    for (const RegisteredAdapter& a : *all) *response->add_adapters() = ToInfo(a, impl_->pool);
  }
  reactor->Finish(rpc::ToGrpcStatus(all.status()));
  return reactor;
}

namespace {

// Collects the streamed files, then validates and swaps them in off the gRPC thread.
class UpdateReactor final : public grpc::ServerReadReactor<v1::UpdateAdapterRequest> {
 public:
  static constexpr int64_t kMaxBytes = int64_t{4} << 30;

  UpdateReactor(RouterService::Impl* router, v1::UpdateAdapterResponse* response)
      : router_(router), response_(response) {
    StartRead(&msg_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client half-closed: all files are here
      Complete();
      return;
    }
    if (!header_) {
      if (!msg_.has_header()) return Fail("the first message must be the header");
      header_ = msg_.header();
    } else {
      if (!msg_.has_chunk()) return Fail("only the first message may be a header");
      const v1::AdapterFileChunk& c = msg_.chunk();
      if (c.file_name() != "adapter_config.json" && c.file_name() != "adapter_model.safetensors") {
        return Fail(absl::StrCat("file name '", c.file_name(),
                                 "' is not adapter_config.json or adapter_model.safetensors"));
      }
      if (!last_file_.empty() && c.file_name() != last_file_ && files_.count(c.file_name())) {
        return Fail(absl::StrCat("chunks of '", c.file_name(), "' are interleaved with another file"));
      }
      last_file_ = c.file_name();
      bytes_ += static_cast<int64_t>(c.data().size());
      if (bytes_ > kMaxBytes) return Fail("the update exceeds 4 GiB");
      files_[c.file_name()] += c.data();
    }
    StartRead(&msg_);
  }

  void OnDone() override { delete this; }

 private:
  void Fail(const std::string& message) {
    Finish(rpc::ToGrpcStatus(absl::InvalidArgumentError(message)));
  }

  void Complete() {
    if (!header_) return Fail("no header was sent");
    router_->RunAdmin([this] {
      std::optional<int64_t> expected;
      if (header_->has_expected_version()) expected = header_->expected_version();
      absl::StatusOr<RegisteredAdapter> a = router_->registry->Update(header_->name(), expected, files_);
      if (a.ok()) {
        response_->set_name(a->name);
        response_->set_version(a->version);
        response_->set_bytes_received(bytes_);
      }
      Finish(rpc::ToGrpcStatus(a.status()));
    });
  }

  RouterService::Impl* const router_;
  v1::UpdateAdapterResponse* const response_;
  v1::UpdateAdapterRequest msg_;
  std::optional<v1::UpdateAdapterHeader> header_;
  std::map<std::string, std::string> files_;
  std::string last_file_;
  int64_t bytes_ = 0;
};

}  // namespace

grpc::ServerReadReactor<v1::UpdateAdapterRequest>* RouterService::UpdateAdapter(
    grpc::CallbackServerContext* context, v1::UpdateAdapterResponse* response) {
  if (absl::Status s = impl_->access->Authorize(*context, Scope::kAdmin); !s.ok()) {
    return new RefusedUpdate(s);
  }
  return new UpdateReactor(impl_.get(), response);
}

}  // namespace preft::router
