// `preft client`: the public API (preft.v1.Preft) from the command line, for scripts, the demo
// and people poking at a cluster, built on the C++ SDK (clients/cpp). Output mirrors
// `preft generate` (text, or --json).

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <optional>
#include <functional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "clients/cpp/preft_client.h"
#include "common/rpc/tls.h"
#include "nlohmann/json.hpp"
#include "services/wire/convert.h"
#include "tools/preft/commands.h"
#include "common/base/status_macros.h"
#include "tools/preft/connection_flags.h"

namespace preft::tools {

namespace {

struct ClientFlags : ConnectionFlags {
  // generate
  std::string model, prompt, prompt_ids, positions, request_id;
  int max_tokens = 16;
  float temperature = 0, top_p = 1;
  int64_t seed = -1;
  int logprobs = -1;
  std::string logprobs_mode = "raw";
  std::vector<std::string> stop;
  bool ignore_eos = false, json = false;
  // adapters
  std::string name, path;
  bool load = false, unregister = false;
  int64_t expected_version = -1;  // update: refuse unless the current version is this
  // health
  std::string service;
};

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "preft client: %s\n", s.ToString().c_str());
  return 1;
}

int RunGenerate(const ClientFlags& f) {
  client::Prompt prompt = client::Prompt::Text(f.prompt);
  if (!f.prompt_ids.empty()) {
    for (absl::string_view s : absl::StrSplit(f.prompt_ids, ',', absl::SkipEmpty())) {
      int32_t id = 0;
      if (!absl::SimpleAtoi(s, &id)) {
        std::fprintf(stderr, "preft client: --prompt-ids: '%s' is not a token id\n",
                     std::string(s).c_str());
        return 2;
      }
      prompt.token_ids.push_back(id);
    }
  }
  client::GenerateParams p;
  p.request_id = f.request_id;
  p.model = f.model;
  if (f.positions == "prompt") p.positions = v1::ADAPTER_POSITIONS_PROMPT;
  if (f.positions == "all") p.positions = v1::ADAPTER_POSITIONS_ALL;
  p.max_tokens = f.max_tokens;
  p.temperature = f.temperature;
  p.top_p = f.top_p;
  if (f.seed >= 0) p.seed = static_cast<uint64_t>(f.seed);
  if (f.logprobs >= 0) p.logprobs = f.logprobs;
  p.logprobs_mode =
      f.logprobs_mode == "processed" ? v1::LOGPROBS_MODE_PROCESSED : v1::LOGPROBS_MODE_RAW;
  p.stop = f.stop;
  p.ignore_eos = f.ignore_eos;

  auto c = Connect(f);
  if (!c.ok()) return Fail(c.status());
  auto out = (*c)->Generate(prompt, p, [&f](const v1::GenerateResponse& d) {
    if (!f.json) {
      std::fwrite(d.text().data(), 1, d.text().size(), stdout);
      std::fflush(stdout);
    }
    return true;
  });
  if (!f.json) std::printf("\n");
  if (!out.ok()) return Fail(out.status());
  if (!f.json) return 0;
  nlohmann::json j;
  j["request_id"] = out->request_id;
  j["token_ids"] = out->token_ids;
  j["text"] = out->text;
  const char* finish = wire::FinishReasonName(out->finish.reason());
  j["finish_reason"] = *finish != '\0' ? finish : "none";
  j["usage"] = {{"prompt_tokens", out->finish.usage().prompt_tokens()},
                {"completion_tokens", out->finish.usage().completion_tokens()}};
  if (!out->finish.adapter().empty()) {
    j["adapter"] = out->finish.adapter();
    j["adapter_version"] = out->finish.adapter_version();
    j["adapter_positions"] =
        out->finish.adapter_positions() == v1::ADAPTER_POSITIONS_PROMPT ? "prompt" : "all";
  }
  if (f.logprobs >= 0) {
    nlohmann::json logprobs = nlohmann::json::array();
    for (const auto& lp : out->logprobs) {
      nlohmann::json top = nlohmann::json::array();
      for (const auto& t : lp.top()) top.push_back({t.token_id(), t.logprob()});
      logprobs.push_back({{"token_id", lp.token_id()}, {"logprob", lp.logprob()}, {"top", top}});
    }
    j["logprobs"] = logprobs;
  }
  std::printf("%s\n", j.dump().c_str());
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

// Runs `call` on a connected client: 0, or 1 with the error on stderr.
int WithClient(const ClientFlags& f, const std::function<absl::Status(client::Client&)>& call) {
  auto c = Connect(f);
  if (!c.ok()) return Fail(c.status());
  const absl::Status s = call(**c);
  return s.ok() ? 0 : Fail(s);
}

int RunModels(const ClientFlags& f) {
  return WithClient(f, [](client::Client& c) {
    auto r = c.ListModels();
    if (!r.ok()) return r.status();
    nlohmann::json out;
    out["base"] = {{"name", r->base().name()},
                   {"architecture", r->base().architecture()},
                   {"dtype", r->base().dtype()},
                   {"vocab_size", r->base().vocab_size()},
                   {"max_context_tokens", r->base().max_context_tokens()}};
    out["adapters"] = nlohmann::json::array();
    for (const auto& a : r->adapters()) out["adapters"].push_back(AdapterJson(a));
    std::printf("%s\n", out.dump().c_str());
    return absl::OkStatus();
  });
}

int RunRegister(const ClientFlags& f) {
  return WithClient(f, [&f](client::Client& c) {
    auto a = c.RegisterAdapter(f.name, f.path, f.load);
    if (!a.ok()) return a.status();
    std::printf("%s\n", AdapterJson(*a).dump().c_str());
    return absl::OkStatus();
  });
}

int RunUnload(const ClientFlags& f) {
  return WithClient(f, [&f](client::Client& c) { return c.UnloadAdapter(f.name, f.unregister); });
}

int RunUpdate(const ClientFlags& f) {
  return WithClient(f, [&f](client::Client& c) {
    std::function<void(int64_t, int64_t)> progress;
    if (isatty(STDERR_FILENO)) {  // large adapters take a while to stream
      progress = [](int64_t sent, int64_t total) {
        std::fprintf(stderr, "\rpreft: sent %lld / %lld bytes", static_cast<long long>(sent),
                     static_cast<long long>(total));
        if (sent == total) std::fprintf(stderr, "\n");
      };
    }
    std::optional<int64_t> expected;
    if (f.expected_version >= 0) expected = f.expected_version;
    auto r = c.UpdateAdapter(f.name, f.path, progress, expected);
    if (!r.ok()) return r.status();
    std::printf("%s\n", nlohmann::json({{"name", r->name()},
                                        {"version", r->version()},
                                        {"bytes_received", r->bytes_received()}})
                            .dump()
                            .c_str());
    return absl::OkStatus();
  });
}

// What a Kubernetes grpc probe does: Check(service), healthy only on SERVING. Works against
// any preft binary (router, prefill, decode), not only the public API.
int RunHealth(const ClientFlags& f) {
  auto c = Connect(f);
  if (!c.ok()) return Fail(c.status());
  auto serving = (*c)->Healthy(f.service);
  if (!serving.ok()) return Fail(serving.status());
  std::printf("%s\n", *serving ? "SERVING" : "NOT_SERVING");
  return *serving ? 0 : 1;
}

}  // namespace

void AddConnectionFlags(CLI::App* cmd, ConnectionFlags* f) {
  cmd->add_option("--server", f->server, "router address")->capture_default_str();
  cmd->add_option("--timeout-s", f->timeout_s, "deadline of each call")->capture_default_str();
  rpc::AddTlsFlags(*cmd, &f->tls);
  cmd->add_option("--token", f->token, "bearer token (authorization metadata)");
  cmd->add_option("--token-file", f->token_file, "file holding the bearer token")
      ->check(CLI::ExistingFile);
}

absl::StatusOr<client::ClientOptions> ClientOptionsFrom(const ConnectionFlags& f) {
  client::ClientOptions o;
  o.address = f.server;
  o.tls = f.tls;
  o.timeout = absl::Seconds(f.timeout_s);
  o.token = f.token;
  if (o.token.empty() && !f.token_file.empty()) {
    std::ifstream in(f.token_file);
    if (!in) return absl::InvalidArgumentError("--token-file: cannot read " + f.token_file);
    std::getline(in, o.token);
  }
  return o;
}

absl::StatusOr<std::unique_ptr<client::Client>> Connect(const ConnectionFlags& f) {
  PREFT_ASSIGN_OR_RETURN(client::ClientOptions o, ClientOptionsFrom(f));
  return client::Client::Connect(std::move(o));
}

namespace {

// register / unload / update under `parent` (`preft client` and `preft adapters`).
void AddAdapterAdmin(CLI::App* parent, const std::shared_ptr<ClientFlags>& f, int* exit_code) {
  CLI::App* reg = parent->add_subcommand("register", "register an adapter folder (JSON out)");
  reg->add_option("--name", f->name)->required();
  reg->add_option("--path", f->path, "folder under the server's adapter root")->required();
  reg->add_flag("--load", f->load, "load it now on every worker that runs adapters");
  reg->callback([f, exit_code] { *exit_code = RunRegister(*f); });

  CLI::App* unload = parent->add_subcommand("unload", "drop an adapter from the workers");
  unload->add_option("--name", f->name)->required();
  unload->add_flag("--unregister", f->unregister, "and forget it");
  unload->callback([f, exit_code] { *exit_code = RunUnload(*f); });

  CLI::App* update = parent->add_subcommand(
      "update", "stream new weights for an adapter (its next version; JSON out)");
  update->add_option("--name", f->name)->required();
  update->add_option("--path", f->path, "local folder with the new files")->required();
  update->add_option("--expected-version", f->expected_version,
                     "refuse (FAILED_PRECONDITION) unless the adapter is at this version")
      ->check(CLI::NonNegativeNumber);
  update->callback([f, exit_code] { *exit_code = RunUpdate(*f); });
}

int RunAdaptersList(const ClientFlags& f) {
  return WithClient(f, [](client::Client& c) {
    auto r = c.ListModels();
    if (!r.ok()) return r.status();
    nlohmann::json out = nlohmann::json::array();
    for (const auto& a : r->adapters()) out.push_back(AdapterJson(a));
    std::printf("%s\n", out.dump(2).c_str());
    return absl::OkStatus();
  });
}

}  // namespace

void RegisterAdaptersCommand(CLI::App& app, int* exit_code) {
  auto f = std::make_shared<ClientFlags>();
  CLI::App* adapters = app.add_subcommand(
      "adapters", "list, register, update and unload a router's adapters (preft.v1 admin)");
  adapters->require_subcommand(1);
  AddConnectionFlags(adapters, f.get());
  adapters->add_subcommand("list", "the registered adapters, with their residency (JSON)")
      ->callback([f, exit_code] { *exit_code = RunAdaptersList(*f); });
  AddAdapterAdmin(adapters, f, exit_code);
}

void RegisterClientCommand(CLI::App& app, int* exit_code) {
  auto f = std::make_shared<ClientFlags>();
  CLI::App* client = app.add_subcommand("client", "talk to a running cluster (preft.v1 gRPC)");
  client->require_subcommand(1);
  AddConnectionFlags(client, f.get());

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
  gen->add_option("--logprobs-mode", f->logprobs_mode,
                  "raw (the model's softmax) or processed (the distribution sampled from)")
      ->check(CLI::IsMember({"raw", "processed"}));
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

  AddAdapterAdmin(client, f, exit_code);

  CLI::App* health = client->add_subcommand(
      "health", "grpc.health.v1 Check of any preft server; exits 0 only when SERVING");
  health->add_option("--service", f->service, "service name (default \"\": the whole server)");
  health->callback([f, exit_code] { *exit_code = RunHealth(*f); });
}

}  // namespace preft::tools
