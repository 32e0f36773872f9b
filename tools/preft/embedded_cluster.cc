#include "tools/preft/embedded_cluster.h"

#include <filesystem>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "common/rpc/server.h"
#include "common/serving/worker_setup.h"
#include "services/wire/grpc_kv_transport.h"

namespace preft::tools {

namespace {

absl::StatusOr<std::unique_ptr<engine::Engine>> MakeEngine(model::Model* model,
                                                           const text::Tokenizer* tokenizer,
                                                           int64_t kv_bytes,
                                                           const std::string& kv_dtype,
                                                           const EmbeddedClusterOptions& o) {
  engine::EngineOptions e;
  e.kv_bytes = kv_bytes;
  PREFT_ASSIGN_OR_RETURN(e.kv_dtype,
                         serving::ResolveKvDtype(kv_dtype, model->weight_dtype()));
  e.scheduler.max_batch_tokens = o.max_batch_tokens;
  e.num_threads = o.threads;
  o.prefix_cache.ApplyTo(&e);
  return serving::MakeEngine(model, tokenizer, o.device, e, /*kv_transport=*/!o.colocated);
}

}  // namespace

absl::StatusOr<std::unique_ptr<EmbeddedCluster>> EmbeddedCluster::Start(
    EmbeddedClusterOptions o) {
  if (o.colocated) {
    o.num_prefill = 0;
    o.decode.colocated = true;
    o.router.colocated = true;
  }
  std::unique_ptr<EmbeddedCluster> c(new EmbeddedCluster());
  PREFT_ASSIGN_OR_RETURN(serving::LoadedModel first, serving::LoadModel(o.model_dir));
  c->tokenizer_ = std::move(first.tokenizer);
  const std::string fingerprint = first.fingerprint;
  const model::ModelConfig config = first.model->config();
  const kernels::DType dtype = first.model->weight_dtype();
  c->models_.push_back(std::move(first.model));
  for (int i = 1; i < o.num_prefill + o.num_decode; ++i) {  // mapped: the pages are shared
    PREFT_ASSIGN_OR_RETURN(auto m, model::Model::Load(o.model_dir));
    c->models_.push_back(std::move(m));
  }
  size_t next = 0;
  auto next_model = [&] { return c->models_[next++].get(); };

  std::vector<std::string> prefill_addresses, decode_addresses;
  for (int i = 0; i < o.num_decode; ++i) {
    model::Model* m = next_model();
    PREFT_ASSIGN_OR_RETURN(auto e, MakeEngine(m, c->tokenizer_.get(), o.decode_kv_bytes,
                                              o.decode_kv_dtype, o));
    PREFT_ASSIGN_OR_RETURN(auto t, wire::MakeWorkerTransport(o.transport));
    const transport::KvLayout layout = serving::LayoutFor(*e, fingerprint);
    decode::DecodeServiceOptions d = o.decode;
    d.adapter_root = o.adapter_root;
    d.store.load.dtype = dtype;
    PREFT_ASSIGN_OR_RETURN(auto s, decode::DecodeService::Create(std::move(e), std::move(t),
                                                                  layout, d));
    c->decode_.push_back(std::move(s));
  }
  for (int i = 0; i < o.num_prefill; ++i) {
    model::Model* m = next_model();
    PREFT_ASSIGN_OR_RETURN(auto e, MakeEngine(m, c->tokenizer_.get(), o.prefill_kv_bytes,
                                              o.prefill_kv_dtype, o));
    PREFT_ASSIGN_OR_RETURN(auto t, wire::MakeWorkerTransport(o.transport));
    const transport::KvLayout layout = serving::LayoutFor(*e, fingerprint);
    prefill::PrefillServiceOptions p = o.prefill;
    p.adapter_root = o.adapter_root;
    p.store.load.dtype = dtype;
    PREFT_ASSIGN_OR_RETURN(auto s, prefill::PrefillService::Create(std::move(e), std::move(t),
                                                                    layout, p));
    c->prefill_.push_back(std::move(s));
  }
  // Each worker on its own loopback server, as it would be in its own process.
  for (auto& d : c->decode_) {
    rpc::ServerOptions so;
    so.services = {d.get()};
    PREFT_ASSIGN_OR_RETURN(auto server, rpc::Server::Start(so));
    d->SetAdvertisedAddress(server->address());
    decode_addresses.push_back(server->address());
    c->worker_servers_.push_back(std::move(server));
  }
  for (auto& p : c->prefill_) {
    rpc::ServerOptions so;
    so.services = {p.get()};
    PREFT_ASSIGN_OR_RETURN(auto server, rpc::Server::Start(so));
    prefill_addresses.push_back(server->address());
    c->worker_servers_.push_back(std::move(server));
  }

  router::WorkerPoolOptions po;
  po.prefill = prefill_addresses;
  po.decode = decode_addresses;
  po.poll_interval = o.poll_interval;
  c->pool_ = std::make_unique<router::WorkerPool>(po);
  adapters::LoadOptions load;
  load.max_rank = o.prefill.store.load.max_rank;
  std::string base_name = o.router.base_name;
  if (base_name == router::RouterOptions().base_name) {
    base_name = std::filesystem::path(o.model_dir).filename().string();
  }
  o.router.base_name = base_name;
  o.router.base_dtype = absl::AsciiStrToLower(kernels::DTypeName(dtype));
  c->registry_ =
      std::make_unique<router::AdapterRegistry>(config, base_name, o.adapter_root, load);
  c->router_ = std::make_unique<router::RouterService>(config, c->tokenizer_.get(), c->pool_.get(),
                                                       c->registry_.get(), o.router);
  rpc::ServerOptions so;
  so.address = o.listen;
  so.services = {c->router_.get()};
  so.max_receive_message_bytes = o.max_request_bytes;
  PREFT_ASSIGN_OR_RETURN(c->router_server_, rpc::Server::Start(so));
  if (!o.http_listen.empty()) {
    router::OpenAiServerOptions h;
    h.http.address = o.http_listen;
    h.router = c->router_server_->InProcessChannel();
    h.generate = c->router_.get();
    h.tokenizer = c->tokenizer_.get();
    h.http.max_body_bytes = o.max_request_bytes;
    h.timeout = o.http_request_timeout;
    PREFT_ASSIGN_OR_RETURN(h.render_chat, router::ChatRendererFor(o.model_dir));
    PREFT_ASSIGN_OR_RETURN(c->http_, router::OpenAiServer::Start(std::move(h)));
  }
  return c;
}

const std::string& EmbeddedCluster::address() const { return router_server_->address(); }

void EmbeddedCluster::Drain(absl::Duration timeout) {
  const absl::Time until = absl::Now() + timeout;
  http_.reset();
  router_->StartDrain();
  router_server_->SetServing("", false);
  while (router_->active_requests() > 0 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(20));
  router_server_->Shutdown(absl::Seconds(1));
  for (auto& p : prefill_) p->StartDrain();
  for (auto& d : decode_) d->StartDrain();
  for (auto& s : worker_servers_) s->Shutdown(absl::Seconds(1));
}

EmbeddedCluster::~EmbeddedCluster() {
  http_.reset();  // its streams are router calls
  if (router_server_) router_server_->Shutdown(absl::ZeroDuration());
  router_.reset();  // waits for its call threads
  pool_.reset();
  for (auto& s : worker_servers_) s->Shutdown(absl::ZeroDuration());
  prefill_.clear();
  decode_.clear();
}

}  // namespace preft::tools
