// The OpenAI-compatible HTTP front door of the embedded cluster: OpenAI-shaped errors, the
// fixture's outputs, usage (cached prompt tokens included), streams, clients that leave or
// read slowly, the per-client stream cap shared with gRPC, deadlines.

#include <arpa/inet.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "tests/services/cluster/cluster_fixture.h"

namespace preft::tools {
namespace {

// The OpenAI-compatible HTTP front end on the embedded cluster, with tokens.
class HttpClusterTest : public EmbeddedClusterTest {
 protected:
  static constexpr char kApi[] = "http-api-token";
  static constexpr char kAdmin[] = "http-admin-token";
  void Configure(EmbeddedClusterOptions* o) override {
    o->http_listen = "127.0.0.1:0";
    o->router.metrics = &registry_;
    o->router.access.api_token = kApi;
    o->router.access.admin_token = kAdmin;
    o->max_request_bytes = 1 << 20;  // gRPC messages and HTTP bodies
  }

  // The router's counter `name`, summed over its series.
  double Counter(const std::string& name) {
    double sum = 0;
    for (const auto& family : registry_.Collect()) {
      if (family.name != name) continue;
      for (const auto& m : family.metric) sum += m.counter.value;
    }
    return sum;
  }

  struct Reply {
    int status = 0;
    std::string body;
  };
  prometheus::Registry registry_;
  // POSTs `body`; `on_data` (optional) sees the body as it streams and may stop it (false).
  Reply Post(const std::string& path, const nlohmann::json& body, const std::string& token,
             std::function<bool(const std::string&)> on_data = nullptr) {
    return Send("POST", path, body.dump(), token, std::move(on_data));
  }
  Reply Send(const std::string& method, const std::string& path, std::string body,
             const std::string& token, std::function<bool(const std::string&)> on_data = nullptr,
             httplib::Headers* headers = nullptr) {
    const std::string address = cluster_->http_address();
    const size_t colon = address.rfind(':');
    httplib::Client client(address.substr(0, colon), std::stoi(address.substr(colon + 1)));
    client.set_read_timeout(60);
    httplib::Request req;
    req.method = method;
    req.path = path;
    req.body = std::move(body);
    req.set_header("Content-Type", "application/json");
    if (!token.empty()) req.set_header("Authorization", std::string("Bearer ") + token);
    Reply reply;
    if (on_data) {
      req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
        reply.body.append(data, n);
        return on_data(reply.body);
      };
    }
    httplib::Response res;
    httplib::Error error = httplib::Error::Success;
    if (client.send(req, res, error)) {
      reply.status = res.status;
      if (!on_data) reply.body = res.body;
      if (headers != nullptr) *headers = res.headers;
    }
    return reply;
  }
  // An OpenAI-shaped error body: {"error": {"message", "type", ...}}.
  static bool OpenAiError(const Reply& r) {
    const nlohmann::json j = nlohmann::json::parse(r.body, nullptr, false);
    return j.is_object() && j.contains("error") && j["error"].contains("message") &&
           j["error"]["message"].is_string() && !j["error"]["message"].get<std::string>().empty();
  }
};

// Whatever goes wrong at the front door is answered in OpenAI's shape with the right status:
// wrong JSON types in admin calls (once a 500 with an empty body), unknown paths and methods,
// bodies over the limit (refused before they are read), control characters in paths.
TEST_F(HttpClusterTest, FrontDoorErrorsAreOpenAiShaped) {
  const Reply typed = Post("/v1/load_lora_adapter", {{"lora_name", 5}, {"lora_path", "lora"}}, kAdmin);
  EXPECT_EQ(typed.status, 400) << typed.body;
  EXPECT_TRUE(OpenAiError(typed)) << typed.body;
  const Reply unload = Post("/v1/unload_lora_adapter", {{"lora_name", {1, 2}}}, kAdmin);
  EXPECT_EQ(unload.status, 400) << unload.body;
  const Reply nul = Post("/v1/load_lora_adapter",
                         {{"lora_name", "nul"}, {"lora_path", std::string("lora\0x", 6)}}, kAdmin);
  EXPECT_EQ(nul.status, 400) << nul.body;
  EXPECT_NE(nul.body.find("control character"), std::string::npos) << nul.body;
  const Reply missing = Send("POST", "/v1/embeddings", "{}", kApi);
  EXPECT_EQ(missing.status, 404);
  EXPECT_TRUE(OpenAiError(missing)) << missing.body;
  httplib::Headers headers;
  const Reply method = Send("GET", "/v1/completions", "", kApi, nullptr, &headers);
  EXPECT_EQ(method.status, 405);
  EXPECT_TRUE(OpenAiError(method)) << method.body;
  const auto allow = headers.find("Allow");
  ASSERT_NE(allow, headers.end());
  EXPECT_EQ(allow->second, "POST");
  const Reply big = Send("POST", "/v1/completions", std::string(2 << 20, ' '), kApi);
  EXPECT_EQ(big.status, 413);
  EXPECT_TRUE(OpenAiError(big)) << big.body;
  const Reply format = Post("/v1/completions",
                            {{"model", "tiny-llama"}, {"prompt", "hi"},
                             {"response_format", {{"type", "json_object"}}}}, kApi);
  EXPECT_EQ(format.status, 400);
  EXPECT_NE(format.body.find("response_format"), std::string::npos) << format.body;
  ExpectNoLeaks();
}

TEST_F(HttpClusterTest, CompletionsReproduceTheFixtureAndTokensApply) {
  auto text = base::ReadFileToString(testing::TinyLlamaFixture() + "/reference.json");
  ASSERT_TRUE(text.ok());
  const nlohmann::json ref = nlohmann::json::parse(*text);
  int checked = 0;
  for (const auto& c : ref["cases"]) {
    const bool prompt_only = !c["adapter"].is_null() && c["adapter_positions"] == "prompt";
    if (!c["adapter"].is_null() && !prompt_only) continue;  // all-position: gRPC tests cover it
    nlohmann::json body = {{"model", c["adapter"].is_null() ? "tiny-llama" : c["adapter"]},
                           {"prompt", c["prompt_ids"]},
                           {"max_tokens", c["token_ids"].size()},
                           {"temperature", 0},
                           {"ignore_eos", true}};
    if (prompt_only) body["adapter_positions"] = "prompt";
    const Reply r = Post("/v1/completions", body, kApi);
    ASSERT_EQ(r.status, 200) << r.body;
    const nlohmann::json out = nlohmann::json::parse(r.body);
    auto want = cluster_->tokenizer()->Decode(c["token_ids"].get<std::vector<int32_t>>(), true);
    ASSERT_TRUE(want.ok());
    EXPECT_EQ(out["choices"][0]["text"], *want) << body.dump();
    EXPECT_EQ(out["usage"]["completion_tokens"], c["token_ids"].size());
    ++checked;
  }
  EXPECT_GE(checked, 3);
  const nlohmann::json body = {{"model", "tiny-llama"}, {"prompt", "hi"}, {"max_tokens", 2}};
  const Reply anonymous = Post("/v1/completions", body, "");
  EXPECT_EQ(anonymous.status, 401);
  EXPECT_EQ(nlohmann::json::parse(anonymous.body)["error"]["type"], "authentication_error");
  EXPECT_EQ(Post("/v1/completions", body, "wrong").status, 401);
  // Adapter admin needs the admin token.
  const nlohmann::json load = {{"lora_name", "again"}, {"lora_path", "lora"}};
  EXPECT_EQ(Post("/v1/load_lora_adapter", load, kApi).status, 403);
  EXPECT_EQ(Post("/v1/load_lora_adapter", load, kAdmin).status, 200);
  EXPECT_EQ(Post("/v1/load_lora_adapter", load, kAdmin).status, 409);  // already registered
  EXPECT_EQ(Post("/v1/unload_lora_adapter", {{"lora_name", "again"}}, kAdmin).status, 200);
  EXPECT_EQ(Post("/v1/unload_lora_adapter", {{"lora_name", "again"}}, kAdmin).status, 404);
  EXPECT_EQ(Post("/v1/completions", nlohmann::json::array(), kApi).status, 400);
  // The fixture's tokenizer_config.json has no chat template: chat is refused, saying so.
  const Reply chat = Post("/v1/chat/completions",
                          {{"model", "tiny-llama"}, {"messages", {{{"role", "user"}, {"content", "hi"}}}}},
                          kApi);
  EXPECT_EQ(chat.status, 400);
  EXPECT_NE(chat.body.find("no chat template"), std::string::npos) << chat.body;
  ExpectNoLeaks();
}

// usage.prompt_tokens_details.cached_tokens, as OpenAI reports it: 0 the first time, the
// prompt's cached full blocks the second.
TEST_F(HttpClusterTest, UsageReportsCachedPromptTokens) {
  std::vector<int32_t> prompt(40);
  for (int i = 0; i < 40; ++i) prompt[i] = 9 + (i * 11) % 200;
  const nlohmann::json body = {{"model", "tiny-llama"}, {"prompt", prompt}, {"max_tokens", 3}};
  for (int cached : {0, 32}) {
    const Reply r = Post("/v1/completions", body, kApi);
    ASSERT_EQ(r.status, 200) << r.body;
    const nlohmann::json usage = nlohmann::json::parse(r.body)["usage"];
    EXPECT_EQ(usage["prompt_tokens"], 40);
    EXPECT_EQ(usage["prompt_tokens_details"]["cached_tokens"], cached) << r.body;
  }
  ExpectNoLeaks();
}

TEST_F(HttpClusterTest, StreamsCarryEveryChoiceThenDone) {
  const nlohmann::json body = {{"model", "tiny-llama"}, {"prompt", "stream me"},
                               {"max_tokens", 6},        {"n", 2},
                               {"seed", 4},              {"ignore_eos", true},
                               {"stream", true},         {"stream_options", {{"include_usage", true}}}};
  std::string all;
  const Reply r = Post("/v1/completions", body, kApi, [&](const std::string& s) {
    all = s;
    return true;
  });
  ASSERT_EQ(r.status, 200);
  std::vector<int> finished(2, 0);
  int usage = 0;
  size_t pos = 0;
  std::string last;
  while ((pos = all.find("data: ", pos)) != std::string::npos) {
    const size_t end = all.find("\n\n", pos);
    ASSERT_NE(end, std::string::npos);
    last = all.substr(pos + 6, end - pos - 6);
    pos = end;
    if (last == "[DONE]") break;
    const nlohmann::json chunk = nlohmann::json::parse(last);
    if (chunk.contains("usage")) {
      ++usage;
      EXPECT_EQ(chunk["usage"]["completion_tokens"], 12);
      continue;
    }
    const auto& c = chunk["choices"][0];
    if (!c["finish_reason"].is_null()) ++finished[c["index"].get<int>()];
  }
  EXPECT_EQ(last, "[DONE]");
  EXPECT_EQ(finished, std::vector<int>({1, 1}));
  EXPECT_EQ(usage, 1);
  ExpectNoLeaks();
}

TEST_F(HttpClusterTest, AClientLeavingMidStreamStopsItsGeneration) {
  const nlohmann::json body = {{"model", "tiny-llama"}, {"prompt", "a long one"},
                               {"max_tokens", 1500},     {"ignore_eos", true},
                               {"stream", true}};
  Post("/v1/completions", body, kApi,
       [](const std::string& s) { return s.find("data: ") == std::string::npos; });
  ExpectNoLeaks();  // both tiers freed
  // ... because the generation was cancelled, not run to its end.
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (Counter("preft:router_requests_total") < 1 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(Counter("preft:router_requests_total"), 1);
  EXPECT_LT(Counter("preft:router_generation_tokens_total"), 1500);
}

// 200 clients that send their headers a line at a time hold no thread of the front door:
// /health and a completion are answered while they trickle (the old thread-per-connection
// server answered neither until they left).
TEST_F(HttpClusterTest, SlowClientsDoNotHoldTheFrontDoor) {
  const std::string address = cluster_->http_address();
  const int port = std::stoi(address.substr(address.rfind(':') + 1));
  std::vector<int> slow;
  for (int i = 0; i < 200; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    ::send(fd, "POST /v1/completions HTTP/1.1\r\n", 31, MSG_NOSIGNAL);
    slow.push_back(fd);
  }
  for (int round = 0; round < 3; ++round) {
    for (int fd : slow) ::send(fd, "X-Slow: 1\r\n", 11, MSG_NOSIGNAL);
    const absl::Time asked = absl::Now();
    EXPECT_EQ(Send("GET", "/health", "", "").status, 200);
    const Reply r = Post("/v1/completions",
                         {{"model", "tiny-llama"}, {"prompt", "hi"}, {"max_tokens", 3}}, kApi);
    EXPECT_EQ(r.status, 200) << r.body;
    EXPECT_LT(absl::Now() - asked, absl::Seconds(2));
    absl::SleepFor(absl::Milliseconds(300));
  }
  for (int fd : slow) ::close(fd);
  ExpectNoLeaks();
}

// A stream that fails after its first tokens (here: the request's deadline) ends with an error
// event and [DONE]; the usage chunk, whose prompt tokens were never reported, is left out
// rather than sent with zeros.
// Completions call the router in process (no gRPC hop): the same per-client stream cap as the
// gRPC API, where a known token names the client whichever door it came through.
class CappedHttpTest : public HttpClusterTest {
  void Configure(EmbeddedClusterOptions* o) override {
    HttpClusterTest::Configure(o);
    o->router.access.max_streams_per_client = 1;
    o->router.admission_timeout = absl::Seconds(20);
  }
};

TEST_F(CappedHttpTest, HttpAndGrpcStreamsShareTheClientsCap) {
  HoldDecodeKv(2040);  // the first stream waits for room, open
  const nlohmann::json body = {{"model", "tiny-llama"}, {"prompt", "hello"}, {"max_tokens", 4},
                               {"stream", true}};
  Reply first;
  std::thread t([&] { first = Post("/v1/completions", body, kApi); });
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (cluster_->router().active_requests() < 1 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(cluster_->router().active_requests(), 1);
  const Reply second = Post("/v1/completions", body, kApi);
  EXPECT_EQ(second.status, 429) << second.body;
  EXPECT_NE(second.body.find("already has 1 streams open"), std::string::npos) << second.body;
  auto grpc_call = Generate(stub_.get(), Request({1, 2, 3}, 4), 60, nullptr, kApi);
  EXPECT_EQ(grpc_call.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  ReleaseHeldKv();
  t.join();
  EXPECT_EQ(first.status, 200) << first.body;
  EXPECT_EQ(first.body.substr(first.body.size() - 14), "data: [DONE]\n\n");
  ExpectNoLeaks();
}

class ShortDeadlineHttpTest : public HttpClusterTest {
  void Configure(EmbeddedClusterOptions* o) override {
    HttpClusterTest::Configure(o);
    o->http_request_timeout = absl::Milliseconds(40);
  }
};

TEST_F(ShortDeadlineHttpTest, AStreamFailingMidWaySendsAnErrorAndNoUsage) {
  const nlohmann::json body = {{"model", "tiny-llama"}, {"prompt", "a long one"},
                               {"max_tokens", 1500},      {"ignore_eos", true},
                               {"stream", true},          {"stream_options", {{"include_usage", true}}}};
  // The deadline must fall after the first token and before the last (1,500 tokens take about
  // 100 ms here): a busy machine may miss the first; try a few times.
  Reply failed;
  for (int attempt = 0; attempt < 5 && failed.status == 0; ++attempt) {
    const Reply r = Post("/v1/completions", body, kApi, [](const std::string&) { return true; });
    if (r.status == 200 && r.body.find("data: {\"error\"") != std::string::npos) failed = r;
  }
  ASSERT_EQ(failed.status, 200) << "no stream failed after its first token";
  EXPECT_NE(failed.body.find("\"choices\""), std::string::npos);
  EXPECT_NE(failed.body.find("Deadline Exceeded"), std::string::npos);
  EXPECT_EQ(failed.body.find("\"usage\""), std::string::npos);
  EXPECT_EQ(failed.body.substr(failed.body.size() - 14), "data: [DONE]\n\n");
  ExpectNoLeaks();
}

}  // namespace
}  // namespace preft::tools
