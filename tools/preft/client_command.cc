// `preft client`: a small gRPC client of the public API (preft.v1.Preft), for scripts, the
// demo and people poking at a cluster. Output mirrors `preft generate` (text, or --json).

#include <grpcpp/grpcpp.h>

#include <cstdio>
#include <fstream>
#include <iostream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "common/rpc/status.h"
#include "common/rpc/tls.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"
#include "proto/preft/v1/preft.grpc.pb.h"
#include "services/wire/convert.h"
#include "tools/preft/commands.h"

namespace preft::tools {

namespace {

struct ClientFlags {
  std::string server = "127.0.0.1:50051";
  double timeout_s = 120;
  rpc::TlsFiles tls;
  std::string token, token_file;  // sent as `authorization: Bearer <token>`
  // generate
  std::string model, prompt, prompt_ids, positions, request_id;
  int max_tokens = 16;
  float temperature = 0, top_p = 1;
  int64_t seed = -1;
  int logprobs = -1;
  std::vector<std::string> stop;
  bool ignore_eos = false, json = false;
  // adapters
  std::string name, path;
  bool load = false, unregister = false;
  // health
  std::string service;
};

std::shared_ptr<grpc::Channel> Channel(const ClientFlags& f) {
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> c = rpc::MakeChannelCredentials(f.tls);
  if (!c.ok()) {  // the calls fail with this message
    std::fprintf(stderr, "preft client: %s\n", c.status().ToString().c_str());
    return grpc::CreateChannel(f.server, grpc::InsecureChannelCredentials());
  }
  return grpc::CreateChannel(f.server, *c);
}

std::unique_ptr<v1::Preft::Stub> Connect(const ClientFlags& f) {
  return v1::Preft::NewStub(Channel(f));
}

// The call's deadline and bearer token.
void Prepare(const ClientFlags& f, grpc::ClientContext* ctx) {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(static_cast<int64_t>(f.timeout_s * 1000)));
  std::string token = f.token;
  if (token.empty() && !f.token_file.empty()) {
    std::ifstream in(f.token_file);
    std::getline(in, token);
  }
  if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
}

int Fail(const grpc::Status& s) {
  std::fprintf(stderr, "preft client: %s\n", rpc::FromGrpcStatus(s).ToString().c_str());
  return 1;
}


int RunGenerate(const ClientFlags& f) {
  v1::GenerateRequest req;
  req.set_request_id(f.request_id);
  req.set_model(f.model);
  req.set_stream(true);
  if (!f.prompt_ids.empty()) {
    for (absl::string_view s : absl::StrSplit(f.prompt_ids, ',', absl::SkipEmpty())) {
      int32_t id = 0;
      if (!absl::SimpleAtoi(s, &id)) {
        std::fprintf(stderr, "preft client: --prompt-ids: '%s' is not a token id\n",
                     std::string(s).c_str());
        return 2;
      }
      req.mutable_token_ids()->add_ids(id);
    }
  } else {
    req.set_text(f.prompt);
  }
  if (f.positions == "prompt") req.set_adapter_positions(v1::ADAPTER_POSITIONS_PROMPT);
  if (f.positions == "all") req.set_adapter_positions(v1::ADAPTER_POSITIONS_ALL);
  v1::SamplingParams* s = req.mutable_sampling();
  s->set_max_tokens(f.max_tokens);
  s->set_temperature(f.temperature);
  s->set_top_p(f.top_p);
  if (f.seed >= 0) s->set_seed(static_cast<uint64_t>(f.seed));
  if (f.logprobs >= 0) s->set_logprobs(f.logprobs);
  for (const auto& stop : f.stop) s->add_stop(stop);
  s->set_ignore_eos(f.ignore_eos);

  grpc::ClientContext ctx;
  Prepare(f, &ctx);
  auto stub = Connect(f);
  auto reader = stub->Generate(&ctx, req);
  v1::GenerateResponse msg;
  nlohmann::json out;
  out["token_ids"] = nlohmann::json::array();
  std::string text;
  nlohmann::json logprobs = nlohmann::json::array();
  while (reader->Read(&msg)) {
    out["request_id"] = msg.request_id();
    for (int32_t t : msg.token_ids()) out["token_ids"].push_back(t);
    text += msg.text();
    for (const auto& lp : msg.logprobs()) {
      nlohmann::json top = nlohmann::json::array();
      for (const auto& t : lp.top()) top.push_back({t.token_id(), t.logprob()});
      logprobs.push_back({{"token_id", lp.token_id()}, {"logprob", lp.logprob()}, {"top", top}});
    }
    if (!f.json) {
      std::fwrite(msg.text().data(), 1, msg.text().size(), stdout);
      std::fflush(stdout);
    }
    if (msg.has_finish()) {
      const v1::Finish& fin = msg.finish();
      const char* finish = wire::FinishReasonName(fin.reason());
      out["finish_reason"] = *finish != '\0' ? finish : "none";
      out["usage"] = {{"prompt_tokens", fin.usage().prompt_tokens()},
                      {"completion_tokens", fin.usage().completion_tokens()}};
      if (!fin.adapter().empty()) {
        out["adapter"] = fin.adapter();
        out["adapter_version"] = fin.adapter_version();
        out["adapter_positions"] =
            fin.adapter_positions() == v1::ADAPTER_POSITIONS_PROMPT ? "prompt" : "all";
      }
    }
  }
  const grpc::Status status = reader->Finish();
  if (!f.json && !text.empty()) std::printf("\n");
  if (!status.ok()) return Fail(status);
  if (f.json) {
    out["text"] = text;
    if (f.logprobs >= 0) out["logprobs"] = logprobs;
    std::printf("%s\n", out.dump().c_str());
  }
  return 0;
}

nlohmann::json AdapterJson(const v1::AdapterInfo& a) {
  nlohmann::json workers = nlohmann::json::array();
  for (const auto& w : a.workers()) {
    workers.push_back({{"worker", w.worker()},
                       {"version", w.version()},
                       {"residency", v1::AdapterResidency_Name(w.residency())}});
  }
  return {{"name", a.name()},
          {"version", a.version()},
          {"type", v1::AdapterType_Name(a.type())},
          {"default_positions", v1::AdapterPositions_Name(a.default_positions())},
          {"rank", a.rank()},
          {"path", a.path()},
          {"bytes", a.bytes()},
          {"workers", workers}};
}

int RunModels(const ClientFlags& f) {
  grpc::ClientContext ctx;
  Prepare(f, &ctx);
  v1::ListModelsResponse r;
  const grpc::Status s = Connect(f)->ListModels(&ctx, v1::ListModelsRequest(), &r);
  if (!s.ok()) return Fail(s);
  nlohmann::json out;
  out["base"] = {{"name", r.base().name()},
                 {"architecture", r.base().architecture()},
                 {"dtype", r.base().dtype()},
                 {"vocab_size", r.base().vocab_size()},
                 {"max_context_tokens", r.base().max_context_tokens()}};
  out["adapters"] = nlohmann::json::array();
  for (const auto& a : r.adapters()) out["adapters"].push_back(AdapterJson(a));
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

int RunRegister(const ClientFlags& f) {
  grpc::ClientContext ctx;
  Prepare(f, &ctx);
  v1::RegisterAdapterRequest req;
  req.set_name(f.name);
  req.set_path(f.path);
  req.set_load(f.load);
  v1::RegisterAdapterResponse r;
  const grpc::Status s = Connect(f)->RegisterAdapter(&ctx, req, &r);
  if (!s.ok()) return Fail(s);
  std::printf("%s\n", AdapterJson(r.adapter()).dump().c_str());
  return 0;
}

int RunUnload(const ClientFlags& f) {
  grpc::ClientContext ctx;
  Prepare(f, &ctx);
  v1::UnloadAdapterRequest req;
  req.set_name(f.name);
  req.set_unregister(f.unregister);
  v1::UnloadAdapterResponse r;
  const grpc::Status s = Connect(f)->UnloadAdapter(&ctx, req, &r);
  return s.ok() ? 0 : Fail(s);
}

int RunUpdate(const ClientFlags& f) {
  grpc::ClientContext ctx;
  Prepare(f, &ctx);
  v1::UpdateAdapterResponse r;
  auto writer = Connect(f)->UpdateAdapter(&ctx, &r);
  v1::UpdateAdapterRequest header;
  header.mutable_header()->set_name(f.name);
  writer->Write(header);
  for (const char* file : {"adapter_config.json", "adapter_model.safetensors"}) {
    std::ifstream in(f.path + "/" + file, std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "preft client: cannot read %s/%s\n", f.path.c_str(), file);
      return 1;
    }
    std::string chunk(1 << 20, '\0');
    while (in.read(chunk.data(), static_cast<std::streamsize>(chunk.size())) || in.gcount() > 0) {
      v1::UpdateAdapterRequest msg;
      msg.mutable_chunk()->set_file_name(file);
      msg.mutable_chunk()->set_data(chunk.data(), static_cast<size_t>(in.gcount()));
      if (!writer->Write(msg)) break;
    }
  }
  writer->WritesDone();
  const grpc::Status s = writer->Finish();
  if (!s.ok()) return Fail(s);
  std::printf("%s\n", nlohmann::json({{"name", r.name()},
                                      {"version", r.version()},
                                      {"bytes_received", r.bytes_received()}})
                          .dump()
                          .c_str());
  return 0;
}

// What a Kubernetes grpc probe does: Check(service), healthy only on SERVING. Works against
// any preft binary (router, prefill, decode), not only the public API.
int RunHealth(const ClientFlags& f) {
  grpc::ClientContext ctx;
  Prepare(f, &ctx);
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(f.service);
  grpc::health::v1::HealthCheckResponse r;
  auto stub = grpc::health::v1::Health::NewStub(Channel(f));
  const grpc::Status s = stub->Check(&ctx, req, &r);
  if (!s.ok()) return Fail(s);
  std::printf("%s\n", grpc::health::v1::HealthCheckResponse::ServingStatus_Name(r.status()).c_str());
  return r.status() == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}

}  // namespace

void RegisterClientCommand(CLI::App& app, int* exit_code) {
  auto f = std::make_shared<ClientFlags>();
  CLI::App* client = app.add_subcommand("client", "talk to a running cluster (preft.v1 gRPC)");
  client->require_subcommand(1);
  client->add_option("--server", f->server, "router address")->capture_default_str();
  client->add_option("--timeout-s", f->timeout_s, "deadline of the call");
  rpc::AddTlsFlags(*client, &f->tls);
  client->add_option("--token", f->token, "bearer token (authorization metadata)");
  client->add_option("--token-file", f->token_file, "file holding the bearer token")
      ->check(CLI::ExistingFile);

  CLI::App* gen = client->add_subcommand("generate", "stream one generation");
  gen->add_option("--model", f->model, "adapter name (empty: the base model)");
  auto* prompt = gen->add_option("--prompt", f->prompt, "prompt text");
  auto* ids = gen->add_option("--prompt-ids", f->prompt_ids, "comma-separated token ids");
  prompt->excludes(ids);
  gen->add_option("--adapter-positions", f->positions, "prompt|all (default: the adapter's)")
      ->check(CLI::IsMember({"prompt", "all"}));
  gen->add_option("--request-id", f->request_id);
  gen->add_option("--max-tokens", f->max_tokens);
  gen->add_option("--temperature", f->temperature);
  gen->add_option("--top-p", f->top_p);
  gen->add_option("--seed", f->seed);
  gen->add_option("--logprobs", f->logprobs);
  gen->add_option("--stop", f->stop);
  gen->add_flag("--ignore-eos", f->ignore_eos);
  gen->add_flag("--json", f->json, "print one JSON object at the end instead of streaming text");
  gen->callback([f, exit_code] {
    if (f->prompt.empty() && f->prompt_ids.empty()) {
      std::fprintf(stderr, "preft client generate: give --prompt or --prompt-ids\n");
      *exit_code = 2;
      return;
    }
    *exit_code = RunGenerate(*f);
  });

  client->add_subcommand("models", "the base model and registered adapters (JSON)")
      ->callback([f, exit_code] { *exit_code = RunModels(*f); });

  CLI::App* reg = client->add_subcommand("register", "register an adapter folder");
  reg->add_option("--name", f->name)->required();
  reg->add_option("--path", f->path, "folder under the server's adapter root")->required();
  reg->add_flag("--load", f->load, "load it onto prefill workers now");
  reg->callback([f, exit_code] { *exit_code = RunRegister(*f); });

  CLI::App* unload = client->add_subcommand("unload", "drop an adapter from the workers");
  unload->add_option("--name", f->name)->required();
  unload->add_flag("--unregister", f->unregister, "and forget it");
  unload->callback([f, exit_code] { *exit_code = RunUnload(*f); });

  CLI::App* update = client->add_subcommand("update", "stream new weights for an adapter");
  update->add_option("--name", f->name)->required();
  update->add_option("--path", f->path, "local folder with the new files")->required();
  update->callback([f, exit_code] { *exit_code = RunUpdate(*f); });

  CLI::App* health = client->add_subcommand(
      "health", "grpc.health.v1 Check of any preft server; exits 0 only when SERVING");
  health->add_option("--service", f->service, "service name (default \"\": the whole server)");
  health->callback([f, exit_code] { *exit_code = RunHealth(*f); });
}

}  // namespace preft::tools
