#include "services/router/openai_protocol.h"

#include <cmath>
#include <initializer_list>

#include "absl/strings/str_cat.h"

namespace preft::router::openai {

namespace {

using nlohmann::json;

absl::Status Bad(const std::string& param, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("'", param, "' ", what));
}

// The field if present and not null.
const json* Field(const json& body, const char* name) {
  auto it = body.find(name);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

absl::StatusOr<std::optional<double>> Number(const json& body, const char* name, double lo,
                                             double hi) {
  const json* v = Field(body, name);
  if (v == nullptr) return std::optional<double>();
  if (!v->is_number()) return Bad(name, "must be a number");
  const double x = v->get<double>();
  if (!(x >= lo && x <= hi)) return Bad(name, absl::StrCat("must be in [", lo, ", ", hi, "]"));
  return std::optional<double>(x);
}

absl::StatusOr<std::optional<int64_t>> Integer(const json& body, const char* name, int64_t lo,
                                               int64_t hi) {
  const json* v = Field(body, name);
  if (v == nullptr) return std::optional<int64_t>();
  if (!v->is_number_integer()) return Bad(name, "must be an integer");
  const int64_t x = v->get<int64_t>();
  if (x < lo || x > hi) return Bad(name, absl::StrCat("must be in [", lo, ", ", hi, "]"));
  return std::optional<int64_t>(x);
}

absl::StatusOr<bool> Bool(const json& body, const char* name) {
  const json* v = Field(body, name);
  if (v == nullptr) return false;
  if (!v->is_boolean()) return Bad(name, "must be true or false");
  return v->get<bool>();
}

// Features preft does not implement: refused when asked for, never ignored.
absl::Status RefuseUnsupported(const json& body) {
  for (const char* name : {"presence_penalty", "frequency_penalty"}) {
    if (const json* v = Field(body, name); v != nullptr && !(v->is_number() && *v == 0)) {
      return Bad(name, "is not supported (only 0)");
    }
  }
  if (const json* v = Field(body, "repetition_penalty"); v != nullptr && !(v->is_number() && *v == 1)) {
    return Bad("repetition_penalty", "is not supported (only 1)");
  }
  if (const json* v = Field(body, "logit_bias"); v != nullptr && !(v->is_object() && v->empty())) {
    return Bad("logit_bias", "is not supported");
  }
  if (const json* v = Field(body, "echo"); v != nullptr && !(v->is_boolean() && !v->get<bool>())) {
    return Bad("echo", "is not supported");
  }
  if (const json* v = Field(body, "suffix"); v != nullptr && !(v->is_string() && v->empty())) {
    return Bad("suffix", "is not supported");
  }
  if (const json* v = Field(body, "tools"); v != nullptr && !(v->is_array() && v->empty())) {
    return Bad("tools", "is not supported");
  }
  return absl::OkStatus();
}

// Choices (streams) one completions request may open: prompts x n.
constexpr int64_t kMaxChoicesPerRequest = 64;

// The fields both endpoints read (or refuse by value in RefuseUnsupported).
constexpr const char* kCommonFields[] = {
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens",
    "max_completion_tokens", "stop", "stop_token_ids", "ignore_eos", "adapter_positions",
    "stream", "stream_options", "user", "n", "best_of", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "echo", "suffix", "tools"};

// Any other field (response_format, tool_choice, functions, guided_json, ...) is refused by
// name: a client must not believe a feature ran when preft ignored it.
absl::Status RefuseUnknownFields(const json& body, std::initializer_list<const char*> endpoint) {
  for (const auto& [key, value] : body.items()) {
    bool known = false;
    for (const char* f : kCommonFields) known = known || key == f;
    for (const char* f : endpoint) known = known || key == f;
    if (!known) return Bad(key, "is not supported by preft");
  }
  return absl::OkStatus();
}

// A JSON integer as a token id: within int32 (the range ids travel in), never wrapped.
bool TokenId(const json& v, int32_t* out) {
  if (!v.is_number_integer()) return false;
  if (v.is_number_unsigned() ? v.get<uint64_t>() > INT32_MAX
                             : (v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX)) {
    return false;
  }
  *out = static_cast<int32_t>(v.get<int64_t>());
  return true;
}

// The fields both endpoints share, applied to `base`; returns n.
absl::StatusOr<int> ParseCommon(const json& body, Plan* plan, v1::GenerateRequest* base,
                                std::initializer_list<const char*> endpoint_fields) {
  if (!body.is_object()) return absl::InvalidArgumentError("the body must be a JSON object");
  if (absl::Status s = RefuseUnknownFields(body, endpoint_fields); !s.ok()) return s;
  const json* model = Field(body, "model");
  if (model == nullptr || !model->is_string() || model->get<std::string>().empty()) {
    return Bad("model", "is required: the base model's name or an adapter's");
  }
  plan->model = model->get<std::string>();
  base->set_model(plan->model);
  if (absl::Status s = RefuseUnsupported(body); !s.ok()) return s;
  v1::SamplingParams* sp = base->mutable_sampling();
  auto temperature = Number(body, "temperature", 0, 2);
  if (!temperature.ok()) return temperature.status();
  sp->set_temperature(static_cast<float>(temperature->value_or(1.0)));  // OpenAI's default
  auto top_p = Number(body, "top_p", 0, 1);
  if (!top_p.ok()) return top_p.status();
  if (*top_p) {
    if (**top_p == 0) return Bad("top_p", "must be in (0, 1]");
    sp->set_top_p(static_cast<float>(**top_p));
  }
  auto top_k = Integer(body, "top_k", -1, 1 << 30);
  if (!top_k.ok()) return top_k.status();
  if (*top_k && **top_k > 0) sp->set_top_k(static_cast<int32_t>(**top_k));
  auto min_p = Number(body, "min_p", 0, 1);
  if (!min_p.ok()) return min_p.status();
  if (*min_p) sp->set_min_p(static_cast<float>(**min_p));
  auto seed = Integer(body, "seed", INT64_MIN, INT64_MAX);
  if (!seed.ok()) return seed.status();
  if (*seed) sp->set_seed(static_cast<uint64_t>(**seed));
  // Chat clients send max_completion_tokens (OpenAI's newer name) or max_tokens.
  const char* max_name = Field(body, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  auto max_tokens = Integer(body, max_name, 1, 1 << 30);
  if (!max_tokens.ok()) return max_tokens.status();
  if (*max_tokens) sp->set_max_tokens(static_cast<int32_t>(**max_tokens));
  if (const json* stop = Field(body, "stop")) {
    if (stop->is_string()) {
      sp->add_stop(stop->get<std::string>());
    } else if (stop->is_array() && stop->size() <= 16) {
      for (const json& s : *stop) {
        if (!s.is_string() || s.get<std::string>().empty()) {
          return Bad("stop", "must be a string or a list of non-empty strings");
        }
        sp->add_stop(s.get<std::string>());
      }
    } else {
      return Bad("stop", "must be a string or a list of up to 16 strings");
    }
  }
  if (const json* ids = Field(body, "stop_token_ids")) {  // vLLM's extension
    if (!ids->is_array()) return Bad("stop_token_ids", "must be a list of token ids");
    for (const json& id : *ids) {
      int32_t token;
      if (!TokenId(id, &token)) {
        return Bad("stop_token_ids", "must be a list of token ids (0 .. 2^31-1)");
      }
      sp->add_stop_token_ids(token);
    }
  }
  auto ignore_eos = Bool(body, "ignore_eos");
  if (!ignore_eos.ok()) return ignore_eos.status();
  sp->set_ignore_eos(*ignore_eos);
  if (const json* p = Field(body, "adapter_positions")) {
    const std::string v = p->is_string() ? p->get<std::string>() : "";
    if (v == "prompt") {
      base->set_adapter_positions(v1::ADAPTER_POSITIONS_PROMPT);
    } else if (v == "all") {
      base->set_adapter_positions(v1::ADAPTER_POSITIONS_ALL);
    } else {
      return Bad("adapter_positions", "must be \"prompt\" (PreFT) or \"all\"");
    }
  }
  auto stream = Bool(body, "stream");
  if (!stream.ok()) return stream.status();
  plan->stream = *stream;
  if (const json* o = Field(body, "stream_options")) {
    if (!o->is_object()) return Bad("stream_options", "must be an object");
    auto usage = Bool(*o, "include_usage");
    if (!usage.ok()) return usage.status();
    plan->include_usage = *usage;
  }
  if (const json* user = Field(body, "user"); user != nullptr && !user->is_string()) {
    return Bad("user", "must be a string");
  }
  auto n = Integer(body, "n", 1, 16);
  if (!n.ok()) return n.status();
  if (auto best_of = Integer(body, "best_of", 1, 16); !best_of.ok()) {
    return best_of.status();
  } else if (*best_of && **best_of != n->value_or(1)) {
    return Bad("best_of", "is not supported (other than equal to n)");
  }
  base->set_stream(true);
  return static_cast<int>(n->value_or(1));
}

// n choices of `prompt`: sample i continues the seed (seed + i) so they differ, reproducibly.
void AddChoices(const v1::GenerateRequest& prompt, int n, Plan* plan) {
  plan->n = n;
  for (int i = 0; i < n; ++i) {
    v1::GenerateRequest r = prompt;
    if (r.sampling().has_seed()) r.mutable_sampling()->set_seed(r.sampling().seed() + i);
    plan->choices.push_back(std::move(r));
  }
}

std::string TokenName(int32_t id, const text::Tokenizer* tokenizer) {
  if (tokenizer == nullptr) return absl::StrCat("token_id:", id);
  return tokenizer->TokenBytes(id);
}

json Bytes(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(static_cast<int>(c));
  return b;
}

json CompletionLogprobs(const ChoiceResult& c, const text::Tokenizer* tokenizer) {
  json tokens = json::array(), token_logprobs = json::array(), top = json::array(),
       offsets = json::array();
  int64_t offset = 0;
  for (const v1::TokenLogprob& lp : c.logprobs) {
    const std::string name = TokenName(lp.token_id(), tokenizer);
    tokens.push_back(name);
    token_logprobs.push_back(lp.logprob());
    json alternatives = json::object();
    for (const v1::TopLogprob& t : lp.top()) alternatives[TokenName(t.token_id(), tokenizer)] = t.logprob();
    top.push_back(alternatives);
    offsets.push_back(offset);
    offset += static_cast<int64_t>(name.size());
  }
  return {{"tokens", tokens}, {"token_logprobs", token_logprobs}, {"top_logprobs", top},
          {"text_offset", offsets}};
}

json ChatLogprobs(const ChoiceResult& c, const text::Tokenizer* tokenizer) {
  json content = json::array();
  for (const v1::TokenLogprob& lp : c.logprobs) {
    const std::string name = TokenName(lp.token_id(), tokenizer);
    json top = json::array();
    for (const v1::TopLogprob& t : lp.top()) {
      const std::string alt = TokenName(t.token_id(), tokenizer);
      top.push_back({{"token", alt}, {"logprob", t.logprob()}, {"bytes", Bytes(alt)}});
    }
    content.push_back(
        {{"token", name}, {"logprob", lp.logprob()}, {"bytes", Bytes(name)}, {"top_logprobs", top}});
  }
  return {{"content", content}};
}

json FinishValue(const ChoiceResult& c) {
  return c.finish_reason.empty() ? json(nullptr) : json(c.finish_reason);
}

}  // namespace

absl::StatusOr<Plan> ParseCompletion(const json& body) {
  Plan plan;
  v1::GenerateRequest base;
  absl::StatusOr<int> n = ParseCommon(body, &plan, &base, {"prompt", "logprobs"});
  if (!n.ok()) return n.status();
  auto logprobs = Integer(body, "logprobs", 0, 20);
  if (!logprobs.ok()) return logprobs.status();
  if (*logprobs) {
    plan.logprobs = static_cast<int>(**logprobs);
    base.mutable_sampling()->set_logprobs(plan.logprobs.value());
  }
  const json* prompt = Field(body, "prompt");
  auto bad_prompt = [] {
    return Bad("prompt", "must be a string, a list of strings, a list of token ids (0 .. 2^31-1) "
                         "or a list of lists of token ids");
  };
  if (prompt == nullptr) return Bad("prompt", "is required");
  auto ids_of = [](const json& list, v1::GenerateRequest* r) {
    for (const json& id : list) {
      int32_t token;
      if (!TokenId(id, &token)) return false;  // 4294967297 must not run as 1
      r->mutable_token_ids()->add_ids(token);
    }
    return !list.empty();
  };
  std::vector<v1::GenerateRequest> prompts;
  if (prompt->is_string()) {
    base.set_text(prompt->get<std::string>());
    prompts.push_back(base);
  } else if (prompt->is_array() && !prompt->empty() && (*prompt)[0].is_number_integer()) {
    v1::GenerateRequest r = base;
    if (!ids_of(*prompt, &r)) return bad_prompt();
    prompts.push_back(std::move(r));
  } else if (prompt->is_array() && !prompt->empty() && prompt->size() <= 64) {
    for (const json& p : *prompt) {
      v1::GenerateRequest r = base;
      if (p.is_string()) {
        r.set_text(p.get<std::string>());
      } else if (!p.is_array() || !ids_of(p, &r)) {
        return bad_prompt();
      }
      prompts.push_back(std::move(r));
    }
  } else {
    return bad_prompt();
  }
  // Every choice is a stream of its own: bound what one request may open.
  if (static_cast<int64_t>(prompts.size()) * *n > kMaxChoicesPerRequest) {
    return Bad("n", absl::StrCat("times the number of prompts (", prompts.size(), " x ", *n,
                                 ") must be at most ", kMaxChoicesPerRequest));
  }
  for (const v1::GenerateRequest& p : prompts) AddChoices(p, *n, &plan);
  return plan;
}

absl::StatusOr<json> ChatMessages(const json& body) {
  const json* messages = body.is_object() ? Field(body, "messages") : nullptr;
  if (messages == nullptr || !messages->is_array() || messages->empty()) {
    return Bad("messages", "must be a non-empty list of {role, content}");
  }
  json out = json::array();
  for (size_t i = 0; i < messages->size(); ++i) {
    const json& m = (*messages)[i];
    const std::string where = absl::StrCat("messages[", i, "]");
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
      return Bad(where, "needs a string 'role'");
    }
    const std::string role = m["role"];
    if (role != "system" && role != "user" && role != "assistant" && role != "developer") {
      return Bad(where + ".role", "must be system, developer, user or assistant");
    }
    std::string content;
    const json* c = Field(m, "content");
    if (c != nullptr && c->is_string()) {
      content = c->get<std::string>();
    } else if (c != nullptr && c->is_array()) {  // [{type: "text", text}]
      for (const json& part : *c) {
        // Each field's type is checked before it is read (json::value throws on a number).
        const json* type = part.is_object() ? Field(part, "type") : nullptr;
        const json* text = part.is_object() ? Field(part, "text") : nullptr;
        if (type == nullptr || !type->is_string() || *type != "text" || text == nullptr ||
            !text->is_string()) {
          return Bad(where + ".content", "parts other than {type: \"text\"} are not supported");
        }
        content += text->get<std::string>();
      }
    } else if (c != nullptr) {
      return Bad(where + ".content", "must be a string or a list of text parts");
    }
    out.push_back({{"role", role == "developer" ? "system" : role}, {"content", content}});
  }
  return out;
}

absl::StatusOr<Plan> ParseChat(const json& body, const std::vector<int32_t>& prompt_ids) {
  Plan plan;
  v1::GenerateRequest base;
  absl::StatusOr<int> n =
      ParseCommon(body, &plan, &base, {"messages", "logprobs", "top_logprobs"});
  if (!n.ok()) return n.status();
  auto logprobs = Bool(body, "logprobs");
  if (!logprobs.ok()) return logprobs.status();
  auto top = Integer(body, "top_logprobs", 0, 20);
  if (!top.ok()) return top.status();
  if (*top && !*logprobs) return Bad("top_logprobs", "needs logprobs: true");
  if (*logprobs) {
    plan.logprobs = static_cast<int>(top->value_or(0));
    base.mutable_sampling()->set_logprobs(plan.logprobs.value());
  }
  for (int32_t id : prompt_ids) base.mutable_token_ids()->add_ids(id);
  AddChoices(base, *n, &plan);
  return plan;
}

json Usage(int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens) {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", cached_tokens}}}};
}

namespace {

json UsageOf(const std::vector<ChoiceResult>& choices, int n_per_prompt) {
  int64_t prompt = 0, completion = 0, cached = 0;
  for (size_t i = 0; i < choices.size(); ++i) {
    if (i % n_per_prompt == 0) {  // each prompt once
      prompt += choices[i].prompt_tokens;
      cached += choices[i].cached_tokens;
    }
    completion += static_cast<int64_t>(choices[i].token_ids.size());
  }
  return Usage(prompt, completion, cached);
}

}  // namespace

json CompletionBody(const std::string& id, int64_t created, const Plan& plan,
                    const std::vector<ChoiceResult>& choices, const text::Tokenizer* tokenizer) {
  json out = json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    out.push_back({{"index", i},
                   {"text", choices[i].text},
                   {"logprobs", plan.logprobs ? CompletionLogprobs(choices[i], tokenizer) : json(nullptr)},
                   {"finish_reason", FinishValue(choices[i])}});
  }
  return {{"id", id},           {"object", "text_completion"}, {"created", created},
          {"model", plan.model}, {"choices", out},             {"usage", UsageOf(choices, plan.n)}};
}

json ChatBody(const std::string& id, int64_t created, const Plan& plan,
              const std::vector<ChoiceResult>& choices, const text::Tokenizer* tokenizer) {
  json out = json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    out.push_back({{"index", i},
                   {"message", {{"role", "assistant"}, {"content", choices[i].text}}},
                   {"logprobs", plan.logprobs ? ChatLogprobs(choices[i], tokenizer) : json(nullptr)},
                   {"finish_reason", FinishValue(choices[i])}});
  }
  return {{"id", id},           {"object", "chat.completion"}, {"created", created},
          {"model", plan.model}, {"choices", out},             {"usage", UsageOf(choices, plan.n)}};
}

json CompletionChunk(const std::string& id, int64_t created, const Plan& plan, int index,
                     const ChoiceResult& delta, const text::Tokenizer* tokenizer) {
  json choice = {{"index", index},
                 {"text", delta.text},
                 {"logprobs", plan.logprobs ? CompletionLogprobs(delta, tokenizer) : json(nullptr)},
                 {"finish_reason", FinishValue(delta)}};
  return {{"id", id}, {"object", "text_completion"}, {"created", created}, {"model", plan.model},
          {"choices", json::array({choice})}};
}

json ChatChunk(const std::string& id, int64_t created, const Plan& plan, int index,
               const ChoiceResult& delta, bool first, const text::Tokenizer* tokenizer) {
  json d = json::object();
  if (first) d["role"] = "assistant";
  if (!delta.text.empty() || delta.finish_reason.empty()) d["content"] = delta.text;
  json choice = {{"index", index},
                 {"delta", d},
                 {"logprobs", plan.logprobs ? ChatLogprobs(delta, tokenizer) : json(nullptr)},
                 {"finish_reason", FinishValue(delta)}};
  return {{"id", id}, {"object", "chat.completion.chunk"}, {"created", created},
          {"model", plan.model}, {"choices", json::array({choice})}};
}

json UsageChunk(const std::string& id, int64_t created, const Plan& plan, bool chat,
                int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens) {
  return {{"id", id},
          {"object", chat ? "chat.completion.chunk" : "text_completion"},
          {"created", created},
          {"model", plan.model},
          {"choices", json::array()},
          {"usage", Usage(prompt_tokens, completion_tokens, cached_tokens)}};
}

HttpError ToHttpError(const absl::Status& status, const std::string& param) {
  int http = 500;
  std::string type = "internal_error", code;
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
      http = 400;
      type = "invalid_request_error";
      break;
    case absl::StatusCode::kNotFound:
      http = 404;
      type = "invalid_request_error";
      code = "model_not_found";
      break;
    case absl::StatusCode::kAlreadyExists:
      http = 409;
      type = "invalid_request_error";
      break;
    case absl::StatusCode::kUnauthenticated:
      http = 401;
      type = "authentication_error";
      code = "invalid_api_key";
      break;
    case absl::StatusCode::kPermissionDenied:
      http = 403;
      type = "permission_error";
      break;
    case absl::StatusCode::kResourceExhausted:
      http = 429;
      type = "rate_limit_error";
      break;
    case absl::StatusCode::kUnavailable:
      http = 503;
      type = "service_unavailable";
      break;
    case absl::StatusCode::kDeadlineExceeded:
      http = 504;
      type = "timeout";
      break;
    case absl::StatusCode::kCancelled:
      http = 499;
      type = "cancelled";
      break;
    default:
      break;
  }
  json error = {{"message", std::string(status.message())},
                {"type", type},
                {"param", param.empty() ? json(nullptr) : json(param)},
                {"code", code.empty() ? json(nullptr) : json(code)}};
  return {http, {{"error", error}}};
}

json ModelsBody(const v1::ListModelsResponse& models, int64_t created) {
  json data = json::array();
  const std::string& base = models.base().name();
  data.push_back({{"id", base}, {"object", "model"}, {"created", created}, {"owned_by", "preft"},
                  {"root", base}, {"parent", nullptr},
                  {"max_model_len", models.base().max_context_tokens()}});
  for (const v1::AdapterInfo& a : models.adapters()) {
    data.push_back({{"id", a.name()}, {"object", "model"}, {"created", created},
                    {"owned_by", "preft"}, {"root", a.path()}, {"parent", base},
                    {"adapter_type", a.type() == v1::ADAPTER_TYPE_LORA ? "lora" : "direft"},
                    {"adapter_version", a.version()},
                    {"default_positions",
                     a.default_positions() == v1::ADAPTER_POSITIONS_ALL ? "all" : "prompt"}});
  }
  return {{"object", "list"}, {"data", data}};
}

}  // namespace preft::router::openai
