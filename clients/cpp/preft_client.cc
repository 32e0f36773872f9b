#include "clients/cpp/preft_client.h"

#include <grpcpp/grpcpp.h>

#include <fstream>

#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "common/rpc/status.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"

namespace preft::client {

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(ClientOptions options) {
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      rpc::MakeChannelCredentials(options.tls);
  if (!credentials.ok()) return credentials.status();
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  auto channel = grpc::CreateCustomChannel(options.address, *credentials, args);
  return std::unique_ptr<Client>(new Client(std::move(options), std::move(channel)));
}

Client::Client(ClientOptions options, std::shared_ptr<grpc::Channel> channel)
    : options_(std::move(options)),
      channel_(std::move(channel)),
      stub_(v1::Preft::NewStub(channel_)) {}

void Client::Prepare(grpc::ClientContext* ctx) const {
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  if (!options_.token.empty()) ctx->AddMetadata("authorization", "Bearer " + options_.token);
}

absl::StatusOr<Generation> Client::Generate(
    const Prompt& prompt, const GenerateParams& p,
    const std::function<bool(const v1::GenerateResponse&)>& on_delta) {
  v1::GenerateRequest req;
  req.set_request_id(p.request_id);
  req.set_model(p.model);
  req.set_adapter_positions(p.positions);
  req.set_stream(true);
  if (!prompt.token_ids.empty()) {
    for (int32_t id : prompt.token_ids) req.mutable_token_ids()->add_ids(id);
  } else {
    req.set_text(prompt.text);
  }
  v1::SamplingParams* s = req.mutable_sampling();
  s->set_max_tokens(p.max_tokens);
  s->set_temperature(p.temperature);
  s->set_top_p(p.top_p);
  s->set_top_k(p.top_k);
  if (p.seed) s->set_seed(*p.seed);
  if (p.logprobs) s->set_logprobs(*p.logprobs);
  s->set_logprobs_mode(p.logprobs_mode);
  for (const std::string& stop : p.stop) s->add_stop(stop);
  s->set_ignore_eos(p.ignore_eos);

  grpc::ClientContext ctx;
  Prepare(&ctx);
  auto reader = stub_->Generate(&ctx, req);
  Generation out;
  v1::GenerateResponse msg;
  bool cancelled = false;
  while (reader->Read(&msg)) {
    out.request_id = msg.request_id();
    out.token_ids.insert(out.token_ids.end(), msg.token_ids().begin(), msg.token_ids().end());
    out.text += msg.text();
    out.logprobs.insert(out.logprobs.end(), msg.logprobs().begin(), msg.logprobs().end());
    if (msg.has_finish()) out.finish = msg.finish();
    if (on_delta && !cancelled && !on_delta(msg)) {
      cancelled = true;
      ctx.TryCancel();
    }
  }
  const absl::Status status = rpc::FromGrpcStatus(reader->Finish());
  if (cancelled) return absl::CancelledError("cancelled by the caller");
  if (!status.ok()) return status;
  return out;
}

absl::Status Client::Abort(const std::string& request_id) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  v1::AbortRequest req;
  req.set_request_id(request_id);
  v1::AbortResponse out;
  return rpc::FromGrpcStatus(stub_->Abort(&ctx, req, &out));
}

absl::StatusOr<v1::ListModelsResponse> Client::ListModels() {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  v1::ListModelsResponse out;
  absl::Status s = rpc::FromGrpcStatus(stub_->ListModels(&ctx, v1::ListModelsRequest(), &out));
  if (!s.ok()) return s;
  return out;
}

absl::StatusOr<v1::AdapterInfo> Client::RegisterAdapter(const std::string& name,
                                                        const std::string& path, bool load) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  v1::RegisterAdapterRequest req;
  req.set_name(name);
  req.set_path(path);
  req.set_load(load);
  v1::RegisterAdapterResponse out;
  absl::Status s = rpc::FromGrpcStatus(stub_->RegisterAdapter(&ctx, req, &out));
  if (!s.ok()) return s;
  return out.adapter();
}

absl::StatusOr<v1::AdapterInfo> Client::LoadAdapter(const std::string& name, int32_t num_workers,
                                                    bool prefill_only) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  v1::LoadAdapterRequest req;
  req.set_name(name);
  req.set_num_workers(num_workers);
  req.set_prefill_only(prefill_only);
  v1::LoadAdapterResponse out;
  PREFT_RETURN_IF_ERROR(rpc::FromGrpcStatus(stub_->LoadAdapter(&ctx, req, &out)));
  return out.adapter();
}

absl::Status Client::UnloadAdapter(const std::string& name, bool unregister) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  v1::UnloadAdapterRequest req;
  req.set_name(name);
  req.set_unregister(unregister);
  v1::UnloadAdapterResponse out;
  return rpc::FromGrpcStatus(stub_->UnloadAdapter(&ctx, req, &out));
}

absl::StatusOr<v1::UpdateAdapterResponse> Client::UpdateAdapter(
    const std::string& name, const std::string& dir,
    const std::function<void(int64_t, int64_t)>& progress,
    std::optional<int64_t> expected_version) {
  // Read first: a missing file is the caller's error, not a half-sent update.
  std::vector<std::pair<std::string, std::string>> files;
  for (const char* file : {"adapter_config.json", "adapter_model.safetensors"}) {
    std::ifstream in(dir + "/" + file, std::ios::binary);
    if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", dir, "/", file));
    files.emplace_back(file, std::string(std::istreambuf_iterator<char>(in), {}));
  }
  grpc::ClientContext ctx;
  Prepare(&ctx);
  v1::UpdateAdapterResponse out;
  auto writer = stub_->UpdateAdapter(&ctx, &out);
  v1::UpdateAdapterRequest header;
  header.mutable_header()->set_name(name);
  if (expected_version) header.mutable_header()->set_expected_version(*expected_version);
  bool open = writer->Write(header);
  constexpr size_t kChunk = 1 << 20;  // well under the server's message limit
  int64_t total = 0, sent = 0;
  for (const auto& [file, data] : files) total += static_cast<int64_t>(data.size());
  for (const auto& [file, data] : files) {
    for (size_t at = 0; open && at < data.size(); at += kChunk) {
      v1::UpdateAdapterRequest msg;
      msg.mutable_chunk()->set_file_name(file);
      msg.mutable_chunk()->set_data(data.substr(at, kChunk));
      open = writer->Write(msg);
      sent += static_cast<int64_t>(msg.chunk().data().size());
      if (progress) progress(sent, total);
    }
  }
  writer->WritesDone();
  absl::Status s = rpc::FromGrpcStatus(writer->Finish());
  if (!s.ok()) return s;
  return out;
}

absl::StatusOr<bool> Client::Healthy(const std::string& service) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse out;
  absl::Status s =
      rpc::FromGrpcStatus(grpc::health::v1::Health::NewStub(channel_)->Check(&ctx, req, &out));
  if (!s.ok()) return s;
  return out.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

}  // namespace preft::client
