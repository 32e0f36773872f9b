#pragma once

// A model's chat template: tokenizer_config.json's `chat_template` (Jinja, common/jinja)
// rendered over OpenAI-style messages the way transformers' apply_chat_template renders it, so
// /v1/chat/completions builds the prompt the model was trained on.

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/text/jinja.h"

namespace preft::text {

class ChatTemplate {
 public:
  // From a model folder: NotFound when tokenizer_config.json has no chat_template;
  // InvalidArgument, naming the file, when it does not parse. A list of named templates
  // picks "default". bos_token / eos_token may be strings or {"content": ...}.
  static absl::StatusOr<ChatTemplate> FromModelDir(const std::string& dir);
  static absl::StatusOr<ChatTemplate> Create(std::string_view source, std::string bos_token,
                                             std::string eos_token);

  // `messages`: [{role, content}, ...]. The template's raise_exception (e.g. roles that do not
  // alternate) is InvalidArgument with its message.
  absl::StatusOr<std::string> Render(const jinja::Value& messages,
                                     bool add_generation_prompt = true) const;

 private:
  ChatTemplate(jinja::Template t, std::string bos, std::string eos)
      : template_(std::move(t)), bos_(std::move(bos)), eos_(std::move(eos)) {}
  jinja::Template template_;
  std::string bos_, eos_;
};

// The template make-model writes for a tokenizer family: "llama3" (Llama 3.1 Instruct),
// "qwen2" (Qwen2.5 Instruct), "mistral" (Mistral Instruct); "" for others.
std::string_view BuiltinChatTemplate(std::string_view family);

}  // namespace preft::text
