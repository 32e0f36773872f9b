#include "train/data.h"

#include <fstream>
#include <functional>

#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "nlohmann/json.hpp"

namespace preft::train {
namespace {

using Json = nlohmann::ordered_json;

// Errors of one line: "path:line: what".
class LineContext {
 public:
  LineContext(const std::string& path, int64_t line) : where_(absl::StrCat(path, ":", line)) {}
  const std::string& where() const { return where_; }
  absl::Status Invalid(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(where_, ": ", what));
  }

 private:
  std::string where_;
};

absl::Status CheckMessages(const LineContext& at, const Json& messages, const char* field) {
  if (!messages.is_array() || messages.empty()) {
    return at.Invalid(absl::StrCat("\"", field, "\" must be a non-empty list of messages"));
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    const Json& m = messages[i];
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string() ||
        !m.contains("content") || !m["content"].is_string()) {
      return at.Invalid(absl::StrCat("\"", field, "\"[", i,
                                     "] must be an object with string \"role\" and \"content\""));
    }
    const std::string role = m["role"].get<std::string>();
    if (role != "system" && role != "user" && role != "assistant" && role != "tool") {
      return at.Invalid(absl::StrCat("\"", field, "\"[", i, "] has role \"", role,
                                     "\"; expected system, user, assistant or tool"));
    }
  }
  return absl::OkStatus();
}

class Reader {
 public:
  Reader(const text::Tokenizer& tokenizer, const text::ChatTemplate* chat,
         const SftDataOptions& options, std::vector<Example>* out)
      : tokenizer_(tokenizer), chat_(chat), options_(options), out_(out) {}

  absl::Status Line(const LineContext& at, const std::string& text) {
    const Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return at.Invalid("malformed JSON");
    if (!j.is_object()) return at.Invalid("expected a JSON object");
    if (j.contains("messages")) {
      if (j.contains("prompt") || j.contains("completion")) {
        return at.Invalid("give \"messages\", or \"prompt\" and \"completion\", not both");
      }
      PREFT_RETURN_IF_ERROR(CheckMessages(at, j["messages"], "messages"));
      return Conversation(at, j["messages"], 0);
    }
    if (!j.contains("prompt") || !j.contains("completion")) {
      return at.Invalid("needs \"prompt\" and \"completion\", or \"messages\"");
    }
    const Json& prompt = j["prompt"];
    const Json& completion = j["completion"];
    if (prompt.is_array() && completion.is_array()) {  // TRL's conversational prompt-completion
      PREFT_RETURN_IF_ERROR(CheckMessages(at, prompt, "prompt"));
      PREFT_RETURN_IF_ERROR(CheckMessages(at, completion, "completion"));
      for (const Json& m : completion) {
        if (m["role"] != "assistant") {
          return at.Invalid("\"completion\" messages must all be assistant messages");
        }
      }
      Json all = prompt;
      for (const Json& m : completion) all.push_back(m);
      return Conversation(at, all, prompt.size());
    }
    if (!prompt.is_string() || !completion.is_string()) {
      return at.Invalid("\"prompt\" and \"completion\" must both be strings (or both lists of "
                        "messages)");
    }
    if (completion.get<std::string>().empty()) return at.Invalid("the completion is empty");
    Example e;
    e.source = at.where();
    PREFT_ASSIGN_OR_RETURN(e.prompt_ids, Encode(at, prompt.get<std::string>(), true, "prompt"));
    PREFT_ASSIGN_OR_RETURN(e.completion_ids,
                           Encode(at, completion.get<std::string>(), false, "completion"));
    if (options_.append_eos && tokenizer_.eos_token_id() >= 0) {
      e.completion_ids.push_back(tokenizer_.eos_token_id());
    }
    return Add(at, std::move(e));
  }

 private:
  absl::StatusOr<std::vector<int32_t>> Encode(const LineContext& at, const std::string& text,
                                              bool special, const char* what) {
    auto ids = tokenizer_.Encode(text, special);
    if (!ids.ok()) return at.Invalid(absl::StrCat(what, ": ", ids.status().message()));
    return *std::move(ids);
  }

  // One example per assistant turn at index >= first.
  absl::Status Conversation(const LineContext& at, const Json& messages, size_t first) {
    if (chat_ == nullptr) {
      return at.Invalid("chat messages need the model's chat template, and it has none");
    }
    int64_t turns = 0;
    for (size_t k = first; k < messages.size(); ++k) {
      if (messages[k]["role"] != "assistant") continue;
      ++turns;
      if (messages[k]["content"].get<std::string>().empty()) {
        return at.Invalid(absl::StrCat("assistant turn ", turns, " (message ", k, ") is empty"));
      }
      Json before = Json::array(), through = Json::array();
      for (size_t i = 0; i < k; ++i) before.push_back(messages[i]);
      through = before;
      through.push_back(messages[k]);
      auto prompt = chat_->Render(before, /*add_generation_prompt=*/true);
      if (!prompt.ok()) return at.Invalid(prompt.status().message());
      auto full = chat_->Render(through, /*add_generation_prompt=*/false);
      if (!full.ok()) return at.Invalid(full.status().message());
      if (full->size() <= prompt->size() || full->compare(0, prompt->size(), *prompt) != 0) {
        return at.Invalid(absl::StrCat(
            "the chat template's rendering of the conversation through message ", k,
            " does not start with its rendering of the messages before it: cannot tell the "
            "assistant turn's tokens apart"));
      }
      Example e;
      e.source = absl::StrCat(at.where(), " (assistant turn ", turns, ")");
      PREFT_ASSIGN_OR_RETURN(e.prompt_ids, Encode(at, *prompt, false, "prompt"));
      PREFT_ASSIGN_OR_RETURN(e.completion_ids,
                             Encode(at, full->substr(prompt->size()), false, "completion"));
      PREFT_RETURN_IF_ERROR(Add(at, std::move(e)));
    }
    if (turns == 0) return at.Invalid("the conversation has no assistant turn to train on");
    return absl::OkStatus();
  }

  absl::Status Add(const LineContext& at, Example e) {
    if (e.prompt_ids.empty()) return at.Invalid("the prompt encodes to no tokens");
    if (e.completion_ids.empty()) return at.Invalid("the completion encodes to no tokens");
    if (e.num_tokens() > options_.max_length) {
      return at.Invalid(absl::StrCat("the example is ", e.num_tokens(), " tokens (prompt ",
                                     e.prompt_ids.size(), " + completion ",
                                     e.completion_ids.size(), "), over --max-length ",
                                     options_.max_length));
    }
    if (options_.vocab_size > 0) {
      for (const auto* ids : {&e.prompt_ids, &e.completion_ids}) {
        for (int32_t id : *ids) {
          if (id < 0 || id >= options_.vocab_size) {
            return at.Invalid(absl::StrCat("token id ", id, " is outside the model's vocabulary (",
                                           options_.vocab_size, ")"));
          }
        }
      }
    }
    out_->push_back(std::move(e));
    return absl::OkStatus();
  }

  const text::Tokenizer& tokenizer_;
  const text::ChatTemplate* chat_;
  const SftDataOptions& options_;
  std::vector<Example>* out_;
};

absl::StatusOr<RlPrompt> ReadRlPrompt(const LineContext& at, const std::string& text,
                                      const text::Tokenizer& tokenizer,
                                      const text::ChatTemplate* chat,
                                      const SftDataOptions& options, bool need_answer) {
  const Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return at.Invalid("malformed JSON");
  if (!j.is_object()) return at.Invalid("expected a JSON object");
  RlPrompt p;
  p.source = at.where();
  bool special = true;
  if (j.contains("messages")) {
    PREFT_RETURN_IF_ERROR(CheckMessages(at, j["messages"], "messages"));
    if (chat == nullptr) {
      return at.Invalid("chat messages need the model's chat template, and it has none");
    }
    auto rendered = chat->Render(j["messages"], /*add_generation_prompt=*/true);
    if (!rendered.ok()) return at.Invalid(rendered.status().message());
    p.text = *rendered;
    special = false;  // the template wrote them
  } else if (j.contains("prompt") && j["prompt"].is_string()) {
    p.text = j["prompt"].get<std::string>();
  } else {
    return at.Invalid("needs a string \"prompt\" or \"messages\"");
  }
  if (j.contains("answer")) {
    const Json& a = j["answer"];
    if (a.is_string()) {
      p.answer = a.get<std::string>();
    } else if (a.is_number()) {
      p.answer = a.dump();
    } else {
      return at.Invalid("\"answer\" must be a string or a number");
    }
  } else if (need_answer) {
    return at.Invalid("needs an \"answer\" for --reward exact");
  }
  auto ids = tokenizer.Encode(p.text, special);
  if (!ids.ok()) return at.Invalid(absl::StrCat("prompt: ", ids.status().message()));
  p.prompt_ids = *std::move(ids);
  if (p.prompt_ids.empty()) return at.Invalid("the prompt encodes to no tokens");
  if (static_cast<int64_t>(p.prompt_ids.size()) >= options.max_length) {
    return at.Invalid(absl::StrCat("the prompt is ", p.prompt_ids.size(),
                                   " tokens, leaving nothing to generate under --max-length ",
                                   options.max_length));
  }
  for (int32_t id : p.prompt_ids) {
    if (options.vocab_size > 0 && (id < 0 || id >= options.vocab_size)) {
      return at.Invalid(absl::StrCat("token id ", id, " is outside the model's vocabulary (",
                                     options.vocab_size, ")"));
    }
  }
  return p;
}

// Calls `line` for every non-blank line of `path`.
absl::Status ForEachLine(const std::string& path,
                         const std::function<absl::Status(const LineContext&,
                                                          const std::string&)>& line) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::string text;
  int64_t n = 0;
  while (std::getline(in, text)) {
    ++n;
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank
    PREFT_RETURN_IF_ERROR(line(LineContext(path, n), text));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<RlPrompt>> ReadRlPrompts(const std::string& path,
                                                    const text::Tokenizer& tokenizer,
                                                    const text::ChatTemplate* chat,
                                                    const SftDataOptions& options,
                                                    bool need_answer) {
  std::vector<RlPrompt> out;
  PREFT_RETURN_IF_ERROR(ForEachLine(path, [&](const LineContext& at, const std::string& text) {
    PREFT_ASSIGN_OR_RETURN(RlPrompt p,
                           ReadRlPrompt(at, text, tokenizer, chat, options, need_answer));
    out.push_back(std::move(p));
    return absl::OkStatus();
  }));
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no prompts"));
  return out;
}

absl::StatusOr<std::vector<Example>> ReadSftData(const std::string& path,
                                                 const text::Tokenizer& tokenizer,
                                                 const text::ChatTemplate* chat,
                                                 const SftDataOptions& options) {
  std::vector<Example> out;
  Reader reader(tokenizer, chat, options, &out);
  PREFT_RETURN_IF_ERROR(ForEachLine(
      path, [&](const LineContext& at, const std::string& text) { return reader.Line(at, text); }));
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no examples"));
  return out;
}

}  // namespace preft::train
