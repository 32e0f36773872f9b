// The OpenAI translation rules, one by one: request fields to preft.v1, bodies and chunks back,
// errors in OpenAI's shape with the right HTTP status.

#include "services/router/openai_protocol.h"

#include <gtest/gtest.h>

namespace preft::router::openai {
namespace {

using nlohmann::json;

absl::Status ErrorOf(const json& body) { return ParseCompletion(body).status(); }

TEST(OpenAiProtocolTest, CompletionFieldsMapToTheGenerateRequest) {
  auto plan = ParseCompletion(json::parse(R"({
      "model": "user-1", "prompt": "hello", "max_tokens": 7, "temperature": 0.5,
      "top_p": 0.9, "top_k": 40, "seed": 11, "stop": ["\n", "END"], "logprobs": 3,
      "stream": true, "stream_options": {"include_usage": true}, "user": "u",
      "adapter_positions": "prompt", "ignore_eos": true, "stop_token_ids": [2]})"));
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->choices.size(), 1u);
  const v1::GenerateRequest& r = plan->choices[0];
  EXPECT_EQ(r.model(), "user-1");
  EXPECT_EQ(r.text(), "hello");
  EXPECT_EQ(r.adapter_positions(), v1::ADAPTER_POSITIONS_PROMPT);
  EXPECT_TRUE(r.stream());
  const v1::SamplingParams& s = r.sampling();
  EXPECT_EQ(s.max_tokens(), 7);
  EXPECT_FLOAT_EQ(s.temperature(), 0.5f);
  EXPECT_FLOAT_EQ(s.top_p(), 0.9f);
  EXPECT_EQ(s.top_k(), 40);
  EXPECT_EQ(s.seed(), 11u);
  ASSERT_EQ(s.stop_size(), 2);
  EXPECT_EQ(s.stop(1), "END");
  EXPECT_EQ(s.logprobs(), 3);
  EXPECT_TRUE(s.ignore_eos());
  EXPECT_EQ(s.stop_token_ids(0), 2);
  EXPECT_TRUE(plan->stream);
  EXPECT_TRUE(plan->include_usage);
  EXPECT_EQ(plan->logprobs, 3);
}

TEST(OpenAiProtocolTest, DefaultsFollowOpenAi) {
  auto plan = ParseCompletion(json::parse(R"({"model": "m", "prompt": "x"})"));
  ASSERT_TRUE(plan.ok());
  const v1::SamplingParams& s = plan->choices[0].sampling();
  EXPECT_FLOAT_EQ(s.temperature(), 1.0f);  // OpenAI's default, not greedy
  EXPECT_FALSE(s.has_max_tokens());        // the router's default applies
  EXPECT_FALSE(s.has_seed());
  EXPECT_FALSE(plan->logprobs.has_value());
  EXPECT_FALSE(plan->stream);
}

TEST(OpenAiProtocolTest, PromptFormsAndNMakeOneChoiceEach) {
  auto plan = ParseCompletion(
      json::parse(R"({"model": "m", "prompt": ["a", [5, 6]], "n": 3, "seed": 100})"));
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->choices.size(), 6u);
  EXPECT_EQ(plan->n, 3);
  EXPECT_EQ(plan->choices[0].text(), "a");
  EXPECT_EQ(plan->choices[3].token_ids().ids_size(), 2);
  // Samples of one prompt continue the seed: different, reproducible.
  EXPECT_EQ(plan->choices[0].sampling().seed(), 100u);
  EXPECT_EQ(plan->choices[2].sampling().seed(), 102u);
  EXPECT_EQ(plan->choices[5].sampling().seed(), 102u);
  auto ids = ParseCompletion(json::parse(R"({"model": "m", "prompt": [1, 2, 3]})"));
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(ids->choices.size(), 1u);
  EXPECT_EQ(ids->choices[0].token_ids().ids(2), 3);
}

TEST(OpenAiProtocolTest, BadFieldsNameTheField) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"prompt": "x"})", "'model' is required"},
      {R"({"model": "", "prompt": "x"})", "'model' is required"},
      {R"({"model": "m"})", "'prompt' is required"},
      {R"({"model": "m", "prompt": 5})", "'prompt' must be"},
      {R"({"model": "m", "prompt": [1, "a"]})", "'prompt' must be"},
      {R"({"model": "m", "prompt": []})", "'prompt' must be"},
      {R"({"model": "m", "prompt": "x", "temperature": "hot"})", "'temperature' must be a number"},
      {R"({"model": "m", "prompt": "x", "temperature": 2.5})", "'temperature' must be in [0, 2]"},
      {R"({"model": "m", "prompt": "x", "top_p": 0})", "'top_p' must be in (0, 1]"},
      {R"({"model": "m", "prompt": "x", "max_tokens": 0})", "'max_tokens' must be in"},
      {R"({"model": "m", "prompt": "x", "max_tokens": 1.5})", "'max_tokens' must be an integer"},
      {R"({"model": "m", "prompt": "x", "n": 0})", "'n' must be in [1, 16]"},
      {R"({"model": "m", "prompt": "x", "n": 2, "best_of": 3})", "'best_of' is not supported"},
      {R"({"model": "m", "prompt": "x", "logprobs": 21})", "'logprobs' must be in [0, 20]"},
      {R"({"model": "m", "prompt": "x", "stop": [""]})", "'stop' must be"},
      {R"({"model": "m", "prompt": "x", "stream": "yes"})", "'stream' must be true or false"},
      {R"({"model": "m", "prompt": "x", "stream_options": 1})", "'stream_options' must be an object"},
      {R"({"model": "m", "prompt": "x", "adapter_positions": "some"})", "'adapter_positions'"},
      {R"({"model": "m", "prompt": "x", "echo": true})", "'echo' is not supported"},
      {R"({"model": "m", "prompt": "x", "suffix": "s"})", "'suffix' is not supported"},
      {R"({"model": "m", "prompt": "x", "presence_penalty": 0.5})", "'presence_penalty'"},
      {R"({"model": "m", "prompt": "x", "logit_bias": {"5": 1}})", "'logit_bias' is not supported"},
      {R"([1, 2])", "the body must be a JSON object"},
      // Fields preft does not implement are refused by name, never ignored.
      {R"({"model": "m", "prompt": "x", "response_format": {"type": "json_object"}})",
       "'response_format' is not supported by preft"},
      {R"({"model": "m", "prompt": "x", "guided_json": {}})", "'guided_json' is not supported"},
      {R"({"model": "m", "prompt": "x", "tool_choice": "auto"})", "'tool_choice' is not supported"},
      {R"({"model": "m", "prompt": "x", "functions": []})", "'functions' is not supported"},
      {R"({"model": "m", "prompt": "x", "top_logprobs": 2})", "'top_logprobs' is not supported"},
      // Token ids never wrap into int32: 4294967297 must not run as 1.
      {R"({"model": "m", "prompt": [4294967297, 5]})", "'prompt' must be"},
      {R"({"model": "m", "prompt": [[1], [-1]]})", "'prompt' must be"},
      {R"({"model": "m", "prompt": "x", "stop_token_ids": [4294967296]})", "'stop_token_ids'"},
      // One request opens at most 64 streams (prompts x n).
      {R"({"model": "m", "prompt": ["a", "b", "c", "d", "e"], "n": 16})",
       "'n' times the number of prompts (5 x 16) must be at most 64"},
  };
  for (const auto& [body, needle] : cases) {
    const absl::Status s = ErrorOf(json::parse(body));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << body;
    EXPECT_NE(s.message().find(needle), std::string::npos) << body << " -> " << s;
  }
  // Zero penalties, an empty logit_bias, echo false and nulls are fine (clients send them).
  EXPECT_TRUE(ParseCompletion(json::parse(R"({"model": "m", "prompt": "x", "presence_penalty": 0,
      "frequency_penalty": 0, "logit_bias": {}, "echo": false, "max_tokens": null,
      "user": "me"})")).ok());
}

TEST(OpenAiProtocolTest, ChatMessagesAndChatLogprobs) {
  auto messages = ChatMessages(json::parse(R"({"messages": [
      {"role": "developer", "content": "be brief"},
      {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]})"));
  ASSERT_TRUE(messages.ok()) << messages.status();
  EXPECT_EQ((*messages)[0]["role"], "system");
  EXPECT_EQ((*messages)[1]["content"], "hi there");
  for (const char* bad : {R"({"messages": []})", R"({"messages": [{"content": "x"}]})",
                          R"({"messages": [{"role": "robot", "content": "x"}]})",
                          R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})",
                          // Found by openai_fuzz: a part's type or text of another JSON type
                          // threw (json::value) instead of answering 400.
                          R"({"messages": [{"role": "user", "content": [{"type": 7, "text": "x"}]}]})",
                          R"({"messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}]})",
                          R"({"messages": [{"role": "user", "content": [7]}]})"}) {
    EXPECT_EQ(ChatMessages(json::parse(bad)).status().code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
  auto plan = ParseChat(json::parse(R"({"model": "m", "messages": [], "logprobs": true,
                                        "top_logprobs": 2, "max_completion_tokens": 9})"),
                        {7, 8, 9});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->choices[0].token_ids().ids(2), 9);
  EXPECT_EQ(plan->choices[0].sampling().logprobs(), 2);
  EXPECT_EQ(plan->choices[0].sampling().max_tokens(), 9);
  EXPECT_EQ(ParseChat(json::parse(R"({"model": "m", "top_logprobs": 2})"), {1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  const absl::Status format = ParseChat(
      json::parse(R"({"model": "m", "messages": [], "response_format": {"type": "json_object"}})"),
      {1}).status();
  EXPECT_EQ(format.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(format.message().find("'response_format' is not supported"), std::string::npos) << format;
}

TEST(OpenAiProtocolTest, BodiesAndChunksHaveOpenAisShape) {
  auto plan = ParseCompletion(json::parse(R"({"model": "m", "prompt": "x", "n": 2, "logprobs": 1})"));
  ASSERT_TRUE(plan.ok());
  ChoiceResult a;
  a.token_ids = {5, 6};
  a.text = "ab";
  a.finish_reason = "length";
  a.prompt_tokens = 4;
  for (int id : {5, 6}) {
    v1::TokenLogprob lp;
    lp.set_token_id(id);
    lp.set_logprob(-0.5);
    v1::TopLogprob* t = lp.add_top();
    t->set_token_id(id);
    t->set_logprob(-0.5);
    a.logprobs.push_back(lp);
  }
  ChoiceResult b = a;
  b.token_ids = {7};
  b.finish_reason = "stop";
  const json body = CompletionBody("cmpl-1", 10, *plan, {a, b}, nullptr);
  EXPECT_EQ(body["object"], "text_completion");
  EXPECT_EQ(body["choices"][1]["index"], 1);
  EXPECT_EQ(body["choices"][1]["finish_reason"], "stop");
  EXPECT_EQ(body["choices"][0]["logprobs"]["tokens"][0], "token_id:5");
  EXPECT_EQ(body["choices"][0]["logprobs"]["token_logprobs"][1], -0.5);
  // The prompt counts once for its n samples.
  EXPECT_EQ(body["usage"]["prompt_tokens"], 4);
  EXPECT_EQ(body["usage"]["completion_tokens"], 3);
  EXPECT_EQ(body["usage"]["total_tokens"], 7);
  const json chat = ChatBody("chatcmpl-1", 10, *plan, {a, b}, nullptr);
  EXPECT_EQ(chat["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(chat["choices"][0]["message"]["content"], "ab");
  EXPECT_EQ(chat["choices"][0]["logprobs"]["content"][0]["logprob"], -0.5);
  ChoiceResult d;
  d.text = "a";
  const json first = ChatChunk("c", 1, *plan, 0, d, /*first=*/true, nullptr);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  EXPECT_TRUE(first["choices"][0]["finish_reason"].is_null());
  EXPECT_EQ(UsageChunk("c", 1, *plan, true, 3, 4)["usage"]["total_tokens"], 7);
}

TEST(OpenAiProtocolTest, StatusesMapToHttpErrors) {
  const std::vector<std::tuple<absl::Status, int, std::string>> cases = {
      {absl::InvalidArgumentError("x"), 400, "invalid_request_error"},
      {absl::NotFoundError("x"), 404, "invalid_request_error"},
      {absl::UnauthenticatedError("x"), 401, "authentication_error"},
      {absl::PermissionDeniedError("x"), 403, "permission_error"},
      {absl::ResourceExhaustedError("x"), 429, "rate_limit_error"},
      {absl::UnavailableError("x"), 503, "service_unavailable"},
      {absl::InternalError("x"), 500, "internal_error"},
  };
  for (const auto& [status, http, type] : cases) {
    const HttpError e = ToHttpError(status);
    EXPECT_EQ(e.status, http) << status;
    EXPECT_EQ(e.body["error"]["type"], type);
    EXPECT_EQ(e.body["error"]["message"], "x");
  }
  EXPECT_EQ(ToHttpError(absl::NotFoundError("m")).body["error"]["code"], "model_not_found");
}

TEST(OpenAiProtocolTest, ModelsListTheBaseThenAdaptersWithTheirParent) {
  v1::ListModelsResponse m;
  m.mutable_base()->set_name("llama");
  v1::AdapterInfo* a = m.add_adapters();
  a->set_name("u1");
  a->set_type(v1::ADAPTER_TYPE_DIREFT);
  a->set_default_positions(v1::ADAPTER_POSITIONS_PROMPT);
  const json body = ModelsBody(m, 5);
  ASSERT_EQ(body["data"].size(), 2u);
  EXPECT_EQ(body["data"][0]["id"], "llama");
  EXPECT_TRUE(body["data"][0]["parent"].is_null());
  EXPECT_EQ(body["data"][1]["id"], "u1");
  EXPECT_EQ(body["data"][1]["parent"], "llama");
  EXPECT_EQ(body["data"][1]["adapter_type"], "direft");
  EXPECT_EQ(body["data"][1]["default_positions"], "prompt");
}

}  // namespace
}  // namespace preft::router::openai
