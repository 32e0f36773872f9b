#include "services/router/openai_server.h"

#include <grpcpp/grpcpp.h>
#include <httplib.h>

#include <ctime>
#include <deque>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/http/bind.h"
#include "common/model/chat_template.h"
#include "common/rpc/status.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"
#include "proto/preft/v1/preft.grpc.pb.h"
#include "services/router/openai_protocol.h"
#include "services/wire/convert.h"

namespace preft::router {

namespace {

using nlohmann::json;

// Tokens' bytes may be partial UTF-8 (logprobs): replaced, never a throw.
std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

void SendError(httplib::Response& res, const absl::Status& status) {
  const openai::HttpError e = openai::ToHttpError(status);
  res.status = e.status;
  res.set_content(Dump(e.body), "application/json");
}

// `key` of a JSON object when it is a string; "" otherwise (a number where a string belongs is
// a 400, never an exception that becomes an empty 500).
std::string StringField(const json& body, const char* key) {
  if (!body.is_object()) return "";
  const auto it = body.find(key);
  return it != body.end() && it->is_string() ? it->get<std::string>() : "";
}

// The routes and their one method: a known path with another method is 405, not 404.
constexpr std::pair<const char*, const char*> kRoutes[] = {
    {"/v1/completions", "POST"},        {"/v1/chat/completions", "POST"},
    {"/v1/models", "GET"},              {"/v1/load_lora_adapter", "POST"},
    {"/v1/unload_lora_adapter", "POST"}, {"/health", "GET"}};

absl::StatusOr<json> ParseBody(const httplib::Request& req) {
  json body = json::parse(req.body, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) return absl::InvalidArgumentError("the body is not valid JSON");
  return body;
}

// The HTTP caller's token and address travel with every call it causes.
void Prepare(const httplib::Request& req, absl::Duration timeout, grpc::ClientContext* ctx) {
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  if (req.has_header("Authorization")) {
    ctx->AddMetadata("authorization", req.get_header_value("Authorization"));
  }
  ctx->AddMetadata("x-preft-http-client", req.remote_addr);
}

std::string NewId(const char* prefix) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return absl::StrFormat("%s-%016x", prefix, rng());
}

// The choices of one HTTP request: a Generate stream each, on threads of their own, reporting
// to a queue that the HTTP thread drains.
class Generation {
 public:
  struct Event {
    int index = 0;
    openai::ChoiceResult delta;
    bool end = false;  // the choice's stream ended (with `status`)
    absl::Status status;
  };

  Generation(v1::Preft::Stub* stub, const openai::Plan& plan, const httplib::Request& req,
             absl::Duration timeout)
      : running_(static_cast<int>(plan.choices.size())) {
    for (size_t i = 0; i < plan.choices.size(); ++i) {
      contexts_.push_back(std::make_unique<grpc::ClientContext>());
      Prepare(req, timeout, contexts_.back().get());
    }
    for (size_t i = 0; i < plan.choices.size(); ++i) {
      threads_.emplace_back(
          [this, stub, i, r = plan.choices[i]] { Run(stub, static_cast<int>(i), r); });
    }
  }
  ~Generation() {
    Cancel();
    for (std::thread& t : threads_) t.join();
  }

  // The next event; false once every choice has ended and all were taken.
  bool Next(Event* e) {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](Generation* g) { return !g->queue_.empty() || g->running_ == 0; }, this));
    if (queue_.empty()) return false;
    *e = std::move(queue_.front());
    queue_.pop_front();
    return true;
  }

  void Cancel() {
    for (auto& ctx : contexts_) ctx->TryCancel();
  }

 private:
  void Run(v1::Preft::Stub* stub, int index, const v1::GenerateRequest& request) {
    grpc::ClientContext* ctx = contexts_[index].get();
    auto reader = stub->Generate(ctx, request);
    v1::GenerateResponse msg;
    while (reader->Read(&msg)) {
      Event e;
      e.index = index;
      e.delta.token_ids.assign(msg.token_ids().begin(), msg.token_ids().end());
      e.delta.text = msg.text();
      e.delta.logprobs.assign(msg.logprobs().begin(), msg.logprobs().end());
      if (msg.has_finish()) {
        e.delta.finish_reason = wire::FinishReasonName(msg.finish().reason());
        e.delta.prompt_tokens = msg.finish().usage().prompt_tokens();
      }
      Push(std::move(e), false);
    }
    Event end;
    end.index = index;
    end.end = true;
    end.status = rpc::FromGrpcStatus(reader->Finish());
    Push(std::move(end), true);
  }

  void Push(Event e, bool last) {
    absl::MutexLock lock(&mu_);
    queue_.push_back(std::move(e));
    if (last) --running_;
  }

  std::vector<std::unique_ptr<grpc::ClientContext>> contexts_;
  std::vector<std::thread> threads_;
  absl::Mutex mu_;
  std::deque<Event> queue_ ABSL_GUARDED_BY(mu_);
  int running_ ABSL_GUARDED_BY(mu_);
};

void Append(const openai::ChoiceResult& delta, openai::ChoiceResult* all) {
  all->token_ids.insert(all->token_ids.end(), delta.token_ids.begin(), delta.token_ids.end());
  all->text += delta.text;
  all->logprobs.insert(all->logprobs.end(), delta.logprobs.begin(), delta.logprobs.end());
  if (!delta.finish_reason.empty()) all->finish_reason = delta.finish_reason;
  if (delta.prompt_tokens > 0) all->prompt_tokens = delta.prompt_tokens;
}

// Answers a completion or chat request whose plan is parsed.
void Serve(v1::Preft::Stub* stub, const OpenAiServerOptions& options, const openai::Plan& plan,
           bool chat, const httplib::Request& req, httplib::Response& res) {
  auto generation = std::make_shared<Generation>(stub, plan, req, options.timeout);
  const std::string id = NewId(chat ? "chatcmpl" : "cmpl");
  const int64_t created = static_cast<int64_t>(std::time(nullptr));
  const model::Tokenizer* tokenizer = options.tokenizer;
  if (!plan.stream) {
    std::vector<openai::ChoiceResult> results(plan.choices.size());
    absl::Status failed;
    Generation::Event e;
    while (generation->Next(&e)) {
      if (e.end) {
        if (!e.status.ok() && failed.ok()) failed = e.status;
      } else {
        Append(e.delta, &results[e.index]);
      }
    }
    if (!failed.ok()) return SendError(res, failed);
    const json body = chat ? openai::ChatBody(id, created, plan, results, tokenizer)
                           : openai::CompletionBody(id, created, plan, results, tokenizer);
    res.set_content(Dump(body), "application/json");
    return;
  }
  // Streaming: an error before the first token is the HTTP answer (a bad model name is a 404,
  // not an event in a 200 stream).
  Generation::Event first;
  if (!generation->Next(&first)) return SendError(res, absl::InternalError("no response"));
  if (first.end && !first.status.ok()) return SendError(res, first.status);
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [generation, first, plan, chat, id, created, tokenizer](size_t, httplib::DataSink& sink) {
        auto send = [&](const std::string& data) {
          const std::string event = absl::StrCat("data: ", data, "\n\n");
          return sink.write(event.data(), event.size());
        };
        std::vector<bool> started(plan.choices.size(), false);
        int64_t prompt_tokens = 0, completion_tokens = 0;
        bool failed = false;  // a choice ended in an error: its usage is unknown
        Generation::Event e = first;
        for (bool more = true; more; more = generation->Next(&e)) {
          bool ok = true;
          if (e.end) {
            if (!e.status.ok()) {
              failed = true;
              ok = send(Dump(openai::ToHttpError(e.status).body));
            }
          } else {
            completion_tokens += static_cast<int64_t>(e.delta.token_ids.size());
            if (e.index % plan.n == 0) prompt_tokens += e.delta.prompt_tokens;
            const json chunk =
                chat ? openai::ChatChunk(id, created, plan, e.index, e.delta, !started[e.index],
                                         tokenizer)
                     : openai::CompletionChunk(id, created, plan, e.index, e.delta, tokenizer);
            started[e.index] = true;
            ok = send(Dump(chunk));
          }
          if (!ok) {  // the client went away: stop generating
            generation->Cancel();
            return false;
          }
        }
        // Usage is true or absent: after a failed choice its prompt tokens were never reported.
        if (plan.include_usage && !failed) {
          send(Dump(openai::UsageChunk(id, created, plan, chat, prompt_tokens, completion_tokens)));
        }
        send("[DONE]");
        sink.done();
        return true;
      });
}

}  // namespace

absl::StatusOr<ChatRenderer> ChatRendererFor(const std::string& model_dir) {
  absl::StatusOr<model::ChatTemplate> t = model::ChatTemplate::FromModelDir(model_dir);
  if (absl::IsNotFound(t.status())) return ChatRenderer();
  if (!t.ok()) return t.status();
  auto shared = std::make_shared<model::ChatTemplate>(*std::move(t));
  return ChatRenderer([shared](const json& messages) {
    return shared->Render(jinja::Value::parse(messages.dump()), /*add_generation_prompt=*/true);
  });
}

OpenAiServer::OpenAiServer(OpenAiServerOptions options)
    : options_(std::move(options)), server_(std::make_unique<httplib::Server>()) {}

OpenAiServer::~OpenAiServer() {
  server_->stop();
  if (thread_.joinable()) thread_.join();
}

absl::StatusOr<std::unique_ptr<OpenAiServer>> OpenAiServer::Start(OpenAiServerOptions options) {
  if (options.router == nullptr) return absl::InvalidArgumentError("OpenAI server: no router channel");
  std::unique_ptr<OpenAiServer> s(new OpenAiServer(std::move(options)));
  const int threads = std::max(1, s->options_.threads);
  s->server_->new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  s->server_->set_payload_max_length(static_cast<size_t>(s->options_.max_body_bytes));
  s->Routes();
  absl::StatusOr<std::string> bound = http::Bind(*s->server_, s->options_.address);
  if (!bound.ok()) return bound.status();
  s->address_ = *std::move(bound);
  httplib::Server* server = s->server_.get();
  s->thread_ = std::thread([server] { server->listen_after_bind(); });
  return s;
}

void OpenAiServer::Routes() {
  auto stub = std::shared_ptr<v1::Preft::Stub>(v1::Preft::NewStub(options_.router));
  const OpenAiServerOptions* o = &options_;

  server_->Post("/v1/completions", [stub, o](const httplib::Request& req, httplib::Response& res) {
    absl::StatusOr<json> body = ParseBody(req);
    if (!body.ok()) return SendError(res, body.status());
    absl::StatusOr<openai::Plan> plan = openai::ParseCompletion(*body);
    if (!plan.ok()) return SendError(res, plan.status());
    Serve(stub.get(), *o, *plan, /*chat=*/false, req, res);
  });

  server_->Post("/v1/chat/completions",
                [stub, o](const httplib::Request& req, httplib::Response& res) {
                  absl::StatusOr<json> body = ParseBody(req);
                  if (!body.ok()) return SendError(res, body.status());
                  absl::StatusOr<json> messages = openai::ChatMessages(*body);
                  if (!messages.ok()) return SendError(res, messages.status());
                  if (!o->render_chat || o->tokenizer == nullptr) {
                    return SendError(res, absl::InvalidArgumentError(
                                              "the base model has no chat template "
                                              "(tokenizer_config.json chat_template): use "
                                              "/v1/completions"));
                  }
                  absl::StatusOr<std::string> prompt = o->render_chat(*messages);
                  if (!prompt.ok()) return SendError(res, prompt.status());
                  // The template wrote the special tokens (BOS included): add none.
                  absl::StatusOr<std::vector<int32_t>> ids =
                      o->tokenizer->Encode(*prompt, /*add_special_tokens=*/false);
                  if (!ids.ok()) return SendError(res, ids.status());
                  absl::StatusOr<openai::Plan> plan = openai::ParseChat(*body, *ids);
                  if (!plan.ok()) return SendError(res, plan.status());
                  Serve(stub.get(), *o, *plan, /*chat=*/true, req, res);
                });

  server_->Get("/v1/models", [stub, o](const httplib::Request& req, httplib::Response& res) {
    grpc::ClientContext ctx;
    Prepare(req, o->timeout, &ctx);
    v1::ListModelsResponse models;
    const absl::Status s =
        rpc::FromGrpcStatus(stub->ListModels(&ctx, v1::ListModelsRequest(), &models));
    if (!s.ok()) return SendError(res, s);
    res.set_content(Dump(openai::ModelsBody(models, static_cast<int64_t>(std::time(nullptr)))),
                    "application/json");
  });

  // vLLM's runtime adapter API: register (and load) a folder under the adapter root; unload
  // and forget. The admin token applies.
  server_->Post("/v1/load_lora_adapter",
                [stub, o](const httplib::Request& req, httplib::Response& res) {
                  absl::StatusOr<json> body = ParseBody(req);
                  if (!body.ok()) return SendError(res, body.status());
                  const std::string name = StringField(*body, "lora_name");
                  const std::string path = StringField(*body, "lora_path");
                  if (name.empty() || path.empty()) {
                    return SendError(res, absl::InvalidArgumentError(
                                              "'lora_name' and 'lora_path' are required strings"));
                  }
                  grpc::ClientContext ctx;
                  Prepare(req, o->timeout, &ctx);
                  v1::RegisterAdapterRequest r;
                  r.set_name(name);
                  r.set_path(path);
                  r.set_load(true);
                  v1::RegisterAdapterResponse out;
                  const absl::Status s = rpc::FromGrpcStatus(stub->RegisterAdapter(&ctx, r, &out));
                  if (!s.ok()) return SendError(res, s);
                  res.set_content(absl::StrCat("Success: LoRA adapter '", name,
                                               "' added successfully."),
                                  "text/plain");
                });
  server_->Post("/v1/unload_lora_adapter",
                [stub, o](const httplib::Request& req, httplib::Response& res) {
                  absl::StatusOr<json> body = ParseBody(req);
                  if (!body.ok()) return SendError(res, body.status());
                  const std::string name = StringField(*body, "lora_name");
                  if (name.empty()) {
                    return SendError(res,
                                     absl::InvalidArgumentError("'lora_name' is a required string"));
                  }
                  grpc::ClientContext ctx;
                  Prepare(req, o->timeout, &ctx);
                  v1::UnloadAdapterRequest r;
                  r.set_name(name);
                  r.set_unregister(true);
                  v1::UnloadAdapterResponse out;
                  const absl::Status s = rpc::FromGrpcStatus(stub->UnloadAdapter(&ctx, r, &out));
                  if (!s.ok()) return SendError(res, s);
                  res.set_content(absl::StrCat("Success: LoRA adapter '", name,
                                               "' removed successfully."),
                                  "text/plain");
                });

  // Errors the routes above did not write (no route, wrong method) and exceptions get
  // OpenAI-shaped bodies too.
  server_->set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    if (res.status == 404) {
      for (const auto& [path, method] : kRoutes) {
        if (req.path != path) continue;
        res.status = 405;
        res.set_header("Allow", method);
        const openai::HttpError e = openai::ToHttpError(absl::InvalidArgumentError(
            absl::StrCat("method ", req.method, " is not allowed on ", path, "; use ", method)));
        res.set_content(Dump(e.body), "application/json");
        return;
      }
      const openai::HttpError e = openai::ToHttpError(
          absl::NotFoundError(absl::StrCat("no route ", req.method, " ", req.path)));
      res.set_content(Dump(e.body), "application/json");
      return;
    }
    const std::string what = res.status == 413 ? "the request body is over the size limit"
                                               : absl::StrCat("HTTP ", res.status);
    const openai::HttpError e = openai::ToHttpError(absl::Status(
        res.status >= 500 ? absl::StatusCode::kInternal : absl::StatusCode::kInvalidArgument,
        what));
    res.set_content(Dump(e.body), "application/json");
  });
  server_->set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
        SendError(res, absl::InternalError("the request could not be handled"));
      });

  server_->Get("/health", [o](const httplib::Request&, httplib::Response& res) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    grpc::health::v1::HealthCheckResponse out;
    const grpc::Status s = grpc::health::v1::Health::NewStub(o->router)->Check(
        &ctx, grpc::health::v1::HealthCheckRequest(), &out);
    const bool serving = s.ok() && out.status() == grpc::health::v1::HealthCheckResponse::SERVING;
    res.status = serving ? 200 : 503;
    res.set_content(serving ? "{}" : R"({"status":"not serving"})", "application/json");
  });
}

}  // namespace preft::router
