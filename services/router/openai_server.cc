#include "services/router/openai_server.h"

#include <grpcpp/grpcpp.h>

#include <ctime>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/base/status_macros.h"
#include "common/rpc/status.h"
#include "common/text/chat_template.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"
#include "proto/preft/v1/preft.grpc.pb.h"
#include "services/router/openai_protocol.h"
#include "services/router/generate_call.h"
#include "services/router/router_service.h"
#include "services/wire/request_convert.h"

namespace preft::router {

namespace {

using nlohmann::json;
using Exchange = std::shared_ptr<http::HttpExchange>;

// Tokens' bytes may be partial UTF-8 (logprobs): replaced, never a throw.
std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

void SendError(http::HttpExchange& ex, const absl::Status& status) {
  const openai::HttpError e = openai::ToHttpError(status);
  ex.Reply(e.status, "application/json", Dump(e.body));
}

std::string Event(const std::string& data) { return absl::StrCat("data: ", data, "\n\n"); }

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

absl::StatusOr<json> ParseBody(const http::HttpRequest& req) {
  json body = json::parse(req.body, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) return absl::InvalidArgumentError("the body is not valid JSON");
  return body;
}

// The HTTP caller's token travels with every gRPC call it causes (admin and model routes).
void Prepare(const http::HttpRequest& req, absl::Duration timeout, grpc::ClientContext* ctx) {
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  if (req.HasHeader("Authorization")) ctx->AddMetadata("authorization", req.Header("Authorization"));
}

std::string NewId(const char* prefix) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return absl::StrFormat("%s-%016x", prefix, rng());
}

void Append(const openai::ChoiceResult& delta, openai::ChoiceResult* all) {
  all->token_ids.insert(all->token_ids.end(), delta.token_ids.begin(), delta.token_ids.end());
  all->text += delta.text;
  all->logprobs.insert(all->logprobs.end(), delta.logprobs.begin(), delta.logprobs.end());
  if (!delta.finish_reason.empty()) all->finish_reason = delta.finish_reason;
  if (delta.prompt_tokens > 0) all->prompt_tokens = delta.prompt_tokens;
  if (delta.cached_tokens > 0) all->cached_tokens = delta.cached_tokens;
}

// The gRPC calls in flight: their callbacks point into the server, which waits for the last.
class CallTracker {
 public:
  void Begin() {
    absl::MutexLock lock(&mu_);
    ++n_;
  }
  void End() {
    absl::MutexLock lock(&mu_);
    --n_;
  }
  void WaitIdle() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(+[](int* n) { return *n == 0; }, &n_));
  }

 private:
  absl::Mutex mu_;
  int n_ ABSL_GUARDED_BY(mu_) = 0;
};

class ChoiceStream;

// The choices of one completion request: a Generate call each, straight to the router in this
// process, whose messages become the HTTP answer (one body, or server-sent events as they come).
class Generation : public std::enable_shared_from_this<Generation> {
 public:
  Generation(RouterService* router, CallTracker* calls, Exchange ex, openai::Plan plan, bool chat,
             const text::Tokenizer* tokenizer, absl::Duration timeout)
      : router_(router),
        calls_(calls),
        ex_(std::move(ex)),
        plan_(std::move(plan)),
        chat_(chat),
        tokenizer_(tokenizer),
        id_(NewId(chat ? "chatcmpl" : "cmpl")),
        created_(static_cast<int64_t>(std::time(nullptr))),
        deadline_(absl::Now() + timeout),
        running_(static_cast<int>(plan_.choices.size())),
        results_(plan_.choices.size()),
        started_(plan_.choices.size(), false) {}

  void Start();
  void OnDelta(int index, const v1::GenerateResponse& msg);
  void OnEnd(int index, const absl::Status& status);

  CallTracker* calls() const { return calls_; }

 private:
  // Cancels every choice still running (the client left, or one choice's error answered).
  // Called with mu_ not held: a choice's end takes it.
  void Cancel();
  void BeginStream() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (stream_started_) return;
    stream_started_ = true;
    ex_->StartStream(200, "text/event-stream", {{"Cache-Control", "no-cache"}});
  }
  void Finish() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  RouterService* const router_;
  CallTracker* const calls_;
  const Exchange ex_;
  const openai::Plan plan_;
  const bool chat_;
  const text::Tokenizer* const tokenizer_;
  const std::string id_;
  const int64_t created_;
  const absl::Time deadline_;

  absl::Mutex mu_;  // orders the answer's pieces
  int running_ ABSL_GUARDED_BY(mu_);
  std::vector<openai::ChoiceResult> results_ ABSL_GUARDED_BY(mu_);  // non-streamed
  std::vector<bool> started_ ABSL_GUARDED_BY(mu_);                   // a chunk was sent
  absl::Status failed_ ABSL_GUARDED_BY(mu_);  // the first choice that failed
  bool stream_started_ ABSL_GUARDED_BY(mu_) = false;
  bool answered_ ABSL_GUARDED_BY(mu_) = false;  // an error answered the request
  std::vector<std::weak_ptr<ChoiceStream>> choices_ ABSL_GUARDED_BY(mu_);  // started
  bool client_gone_ ABSL_GUARDED_BY(mu_) = false;  // or the choices are cancelled
  int64_t prompt_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t cached_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t completion_tokens_ ABSL_GUARDED_BY(mu_) = 0;
};

// One choice's Generate call, in process: its messages and end go to its Generation. The
// call lives until Finish and every Cancel in progress are over (whichever is last frees it).
class ChoiceStream final : public GenerateClient {
 public:
  ChoiceStream(std::shared_ptr<Generation> g, int index) : g_(std::move(g)), index_(index) {}

  // Starts the call; it holds the choice (`self`) until it ends.
  static void Start(RouterService* router, std::shared_ptr<ChoiceStream> self,
                    const v1::GenerateRequest& request, Caller caller, absl::Time deadline) {
    ChoiceStream* s = self.get();
    s->self_ = std::move(self);
    router->GenerateInProcess(request, std::move(caller), deadline, s);
  }

  void StartWrite(const v1::GenerateResponse* msg) override {
    g_->OnDelta(index_, *msg);
    call()->WriteDone(true);  // the HTTP connection buffers it
  }
  void Finish(const absl::Status& status) override {
    bool last;
    {
      absl::MutexLock lock(&mu_);
      finished_ = true;
      last = cancelling_ == 0;
    }
    g_->OnEnd(index_, status);
    if (last) Release();
  }
  // The HTTP client left: the call ends as a cancelled gRPC call would.
  void Cancel() {
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return;
      ++cancelling_;
    }
    call()->Cancel();
    bool last;
    {
      absl::MutexLock lock(&mu_);
      last = --cancelling_ == 0 && finished_;
    }
    if (last) Release();
  }

 private:
  void Release() {
    call()->Done();
    CallTracker* calls = g_->calls();
    g_.reset();
    std::shared_ptr<ChoiceStream> self = std::move(self_);  // may free this
    calls->End();
  }

  std::shared_ptr<Generation> g_;
  const int index_;
  std::shared_ptr<ChoiceStream> self_;  // until Release
  absl::Mutex mu_;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  int cancelling_ ABSL_GUARDED_BY(mu_) = 0;
};

void Generation::Start() {
  // The client leaving cancels every choice (a weak pointer: the exchange must not keep the
  // generation alive, the generation keeps the exchange).
  std::weak_ptr<Generation> weak = weak_from_this();
  ex_->OnClientGone([weak] {
    if (auto g = weak.lock()) g->Cancel();
  });
  const http::HttpRequest& req = ex_->request();
  Caller caller;
  if (req.HasHeader("Authorization")) caller.authorization = req.Header("Authorization");
  caller.address = absl::StrCat("http:", req.peer);
  for (size_t i = 0; i < plan_.choices.size(); ++i) {
    auto choice = std::make_shared<ChoiceStream>(shared_from_this(), static_cast<int>(i));
    calls_->Begin();
    ChoiceStream::Start(router_, choice, plan_.choices[i], caller, deadline_);
    // Listed once started (its call is known): a client that left meanwhile cancels it here.
    bool gone;
    {
      absl::MutexLock lock(&mu_);
      choices_.push_back(choice);
      gone = client_gone_;
    }
    if (gone) choice->Cancel();
  }
}

void Generation::Cancel() {
  std::vector<std::shared_ptr<ChoiceStream>> running;
  {
    absl::MutexLock lock(&mu_);
    client_gone_ = true;
    for (const auto& w : choices_) {
      if (auto c = w.lock()) running.push_back(std::move(c));
    }
  }
  for (const auto& c : running) c->Cancel();
}

void Generation::OnDelta(int index, const v1::GenerateResponse& msg) {
  openai::ChoiceResult d;
  d.token_ids.assign(msg.token_ids().begin(), msg.token_ids().end());
  d.text = msg.text();
  d.logprobs.assign(msg.logprobs().begin(), msg.logprobs().end());
  if (msg.has_finish()) {
    d.finish_reason = wire::FinishReasonName(msg.finish().reason());
    d.prompt_tokens = msg.finish().usage().prompt_tokens();
    d.cached_tokens = msg.finish().usage().cached_tokens();
  }
  absl::MutexLock lock(&mu_);
  if (answered_) return;
  if (!plan_.stream) return Append(d, &results_[index]);
  BeginStream();
  completion_tokens_ += static_cast<int64_t>(d.token_ids.size());
  if (index % plan_.n == 0) {
    prompt_tokens_ += d.prompt_tokens;
    cached_tokens_ += d.cached_tokens;
  }
  const json chunk =
      chat_ ? openai::ChatChunk(id_, created_, plan_, index, d, !started_[index], tokenizer_)
            : openai::CompletionChunk(id_, created_, plan_, index, d, tokenizer_);
  started_[index] = true;
  ex_->Write(Event(Dump(chunk)));
}

void Generation::OnEnd(int index, const absl::Status& status) {
  bool cancel_others = false;
  {
    absl::MutexLock lock(&mu_);
    --running_;
    if (!status.ok() && !answered_) {
      if (failed_.ok()) failed_ = status;
      if (!plan_.stream || !stream_started_) {
        // The answer is this error (a bad model name is a 404, not an event in a 200 stream):
        // the other choices are not needed.
        answered_ = true;
        SendError(*ex_, status);
        cancel_others = true;
      } else {
        ex_->Write(Event(Dump(openai::ToHttpError(status).body)));
      }
    }
    (void)index;
    if (running_ == 0 && !answered_) Finish();
  }
  if (cancel_others) Cancel();
}

void Generation::Finish() {
  if (!plan_.stream) {
    const json body = chat_ ? openai::ChatBody(id_, created_, plan_, results_, tokenizer_)
                            : openai::CompletionBody(id_, created_, plan_, results_, tokenizer_);
    ex_->Reply(200, "application/json", Dump(body));
    return;
  }
  BeginStream();
  // Usage is true or absent: after a failed choice its prompt tokens were never reported.
  if (plan_.include_usage && failed_.ok()) {
    ex_->Write(Event(Dump(
        openai::UsageChunk(id_, created_, plan_, chat_, prompt_tokens_, completion_tokens_,
                           cached_tokens_))));
  }
  ex_->Write(Event("[DONE]"));
  ex_->End();
}

}  // namespace

class OpenAiServer::Impl {
 public:
  explicit Impl(OpenAiServerOptions o)
      : options(std::move(o)),
        stub(v1::Preft::NewStub(options.router)),
        health(grpc::health::v1::Health::NewStub(options.router)) {}

  void Handle(const Exchange& ex);

  const OpenAiServerOptions options;
  const std::unique_ptr<v1::Preft::Stub> stub;
  const std::unique_ptr<grpc::health::v1::Health::Stub> health;
  CallTracker calls;
  std::unique_ptr<http::EventServer> server;

 private:
  void Complete(const Exchange& ex, bool chat);
  // A unary call whose result answers `ex`: `start(ctx, request, response, done)` makes the
  // callback call, `ok(response)` answers on success; errors answer themselves.
  template <typename Request, typename Response, typename StartFn, typename OkFn>
  void Unary(const Exchange& ex, Request request, absl::Duration timeout, StartFn start, OkFn ok);
};

template <typename Request, typename Response, typename StartFn, typename OkFn>
void OpenAiServer::Impl::Unary(const Exchange& ex, Request request, absl::Duration timeout,
                               StartFn start, OkFn ok) {
  struct Call {
    grpc::ClientContext ctx;
    Request request;
    Response response;
  };
  auto call = std::make_shared<Call>();
  call->request = std::move(request);
  Prepare(ex->request(), timeout, &call->ctx);
  ex->OnClientGone([weak = std::weak_ptr<Call>(call)] {
    if (auto c = weak.lock()) c->ctx.TryCancel();
  });
  calls.Begin();
  start(&call->ctx, &call->request, &call->response,
        [this, ex, call, ok = std::move(ok)](grpc::Status s) {
          if (s.ok()) {
            ok(call->response, *ex);
          } else {
            SendError(*ex, rpc::FromGrpcStatus(s));
          }
          calls.End();
        });
}

void OpenAiServer::Impl::Complete(const Exchange& ex, bool chat) {
  absl::StatusOr<json> body = ParseBody(ex->request());
  if (!body.ok()) return SendError(*ex, body.status());
  absl::StatusOr<openai::Plan> plan;
  if (!chat) {
    plan = openai::ParseCompletion(*body);
  } else {
    absl::StatusOr<json> messages = openai::ChatMessages(*body);
    if (!messages.ok()) return SendError(*ex, messages.status());
    if (!options.render_chat || options.tokenizer == nullptr) {
      return SendError(*ex, absl::InvalidArgumentError(
                                "the base model has no chat template (tokenizer_config.json "
                                "chat_template): use /v1/completions"));
    }
    absl::StatusOr<std::string> prompt = options.render_chat(*messages);
    if (!prompt.ok()) return SendError(*ex, prompt.status());
    // The template wrote the special tokens (BOS included): add none.
    absl::StatusOr<std::vector<int32_t>> ids =
        options.tokenizer->Encode(*prompt, /*add_special_tokens=*/false);
    if (!ids.ok()) return SendError(*ex, ids.status());
    plan = openai::ParseChat(*body, *ids);
  }
  if (!plan.ok()) return SendError(*ex, plan.status());
  std::make_shared<Generation>(options.generate, &calls, ex, *std::move(plan), chat,
                               options.tokenizer, options.timeout)
      ->Start();
}

// Runs on the server's handler pool: parsing, templates and tokenising happen here; every
// wait is a callback.
void OpenAiServer::Impl::Handle(const Exchange& ex) {
  const http::HttpRequest& r = ex->request();
  const char* method = nullptr;
  for (const auto& [path, m] : kRoutes) {
    if (r.path == path) method = m;
  }
  if (method == nullptr) {
    return SendError(*ex, absl::NotFoundError(absl::StrCat("no route ", r.method, " ", r.path)));
  }
  if (r.method != method) {
    const openai::HttpError e = openai::ToHttpError(absl::InvalidArgumentError(
        absl::StrCat("method ", r.method, " is not allowed on ", r.path, "; use ", method)));
    return ex->Reply(405, "application/json", Dump(e.body), {{"Allow", method}});
  }
  if (r.path == "/v1/completions") return Complete(ex, /*chat=*/false);
  if (r.path == "/v1/chat/completions") return Complete(ex, /*chat=*/true);
  if (r.path == "/health") {
    Unary<grpc::health::v1::HealthCheckRequest, grpc::health::v1::HealthCheckResponse>(
        ex, {}, absl::Seconds(5),
        [this](auto* ctx, auto* req, auto* resp, auto done) {
          health->async()->Check(ctx, req, resp, std::move(done));
        },
        [](const grpc::health::v1::HealthCheckResponse& out, http::HttpExchange& answer) {
          const bool serving = out.status() == grpc::health::v1::HealthCheckResponse::SERVING;
          answer.Reply(serving ? 200 : 503, "application/json",
                       serving ? "{}" : R"({"status":"not serving"})");
        });
    return;
  }
  if (r.path == "/v1/models") {
    Unary<v1::ListModelsRequest, v1::ListModelsResponse>(
        ex, {}, options.timeout,
        [this](auto* ctx, auto* req, auto* resp, auto done) {
          stub->async()->ListModels(ctx, req, resp, std::move(done));
        },
        [](const v1::ListModelsResponse& models, http::HttpExchange& answer) {
          answer.Reply(200, "application/json",
                       Dump(openai::ModelsBody(models, static_cast<int64_t>(std::time(nullptr)))));
        });
    return;
  }
  // vLLM's runtime adapter API: register (and load) a folder under the adapter root; unload
  // and forget. The admin token applies.
  absl::StatusOr<json> body = ParseBody(r);
  if (!body.ok()) return SendError(*ex, body.status());
  const std::string name = StringField(*body, "lora_name");
  if (r.path == "/v1/load_lora_adapter") {
    const std::string path = StringField(*body, "lora_path");
    if (name.empty() || path.empty()) {
      return SendError(*ex, absl::InvalidArgumentError(
                                "'lora_name' and 'lora_path' are required strings"));
    }
    v1::RegisterAdapterRequest req;
    req.set_name(name);
    req.set_path(path);
    req.set_load(true);
    Unary<v1::RegisterAdapterRequest, v1::RegisterAdapterResponse>(
        ex, std::move(req), options.timeout,
        [this](auto* ctx, auto* req, auto* resp, auto done) {
          stub->async()->RegisterAdapter(ctx, req, resp, std::move(done));
        },
        [name](const v1::RegisterAdapterResponse&, http::HttpExchange& answer) {
          answer.Reply(200, "text/plain",
                       absl::StrCat("Success: LoRA adapter '", name, "' added successfully."));
        });
    return;
  }
  if (name.empty()) {
    return SendError(*ex, absl::InvalidArgumentError("'lora_name' is a required string"));
  }
  v1::UnloadAdapterRequest req;
  req.set_name(name);
  req.set_unregister(true);
  Unary<v1::UnloadAdapterRequest, v1::UnloadAdapterResponse>(
      ex, std::move(req), options.timeout,
      [this](auto* ctx, auto* req, auto* resp, auto done) {
        stub->async()->UnloadAdapter(ctx, req, resp, std::move(done));
      },
      [name](const v1::UnloadAdapterResponse&, http::HttpExchange& answer) {
        answer.Reply(200, "text/plain",
                     absl::StrCat("Success: LoRA adapter '", name, "' removed successfully."));
      });
}

absl::StatusOr<ChatRenderer> ChatRendererFor(const std::string& model_dir) {
  absl::StatusOr<text::ChatTemplate> t = text::ChatTemplate::FromModelDir(model_dir);
  if (absl::IsNotFound(t.status())) return ChatRenderer();
  if (!t.ok()) return t.status();
  auto shared = std::make_shared<text::ChatTemplate>(*std::move(t));
  return ChatRenderer([shared](const json& messages) {
    return shared->Render(text::jinja::Value::parse(messages.dump()), /*add_generation_prompt=*/true);
  });
}

OpenAiServer::OpenAiServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

absl::StatusOr<std::unique_ptr<OpenAiServer>> OpenAiServer::Start(OpenAiServerOptions options) {
  if (options.router == nullptr || options.generate == nullptr) {
    return absl::InvalidArgumentError("OpenAI server: no router channel or service");
  }
  auto impl = std::make_unique<Impl>(std::move(options));
  http::EventServerOptions h = impl->options.http;
  h.always_served = {"/health"};
  // Errors the server answers itself (413, 431, 503, ...) are OpenAI-shaped too.
  h.error_body = [](int status, const std::string& message) {
    return Dump(openai::ToHttpError(absl::Status(status >= 500 ? absl::StatusCode::kUnavailable
                                                               : absl::StatusCode::kInvalidArgument,
                                                 message))
                    .body);
  };
  Impl* raw = impl.get();
  PREFT_ASSIGN_OR_RETURN(raw->server, http::EventServer::Start(std::move(h), [raw](Exchange ex) {
                           raw->Handle(ex);
                         }));
  return std::unique_ptr<OpenAiServer>(new OpenAiServer(std::move(impl)));
}

const std::string& OpenAiServer::address() const { return impl_->server->address(); }

void OpenAiServer::Stop(absl::Duration grace) { impl_->server->Stop(grace); }

http::EventServer::Stats OpenAiServer::stats() const { return impl_->server->stats(); }

OpenAiServer::~OpenAiServer() {
  // Closing every connection cancels the calls behind them; the server returns once each
  // exchange is released, which the calls do as they end.
  impl_->server.reset();
  impl_->calls.WaitIdle();
}

}  // namespace preft::router
