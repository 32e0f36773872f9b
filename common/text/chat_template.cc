#include "common/text/chat_template.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/base/mapped_file.h"

namespace preft::text {

namespace {

// "bos_token": "<s>" or {"content": "<s>", ...} (transformers' AddedToken form).
std::string TokenText(const jinja::Value& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"];
  return "";
}

}  // namespace

absl::StatusOr<ChatTemplate> ChatTemplate::FromModelDir(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "tokenizer_config.json").string();
  absl::StatusOr<std::string> text = base::ReadFileToString(path);
  if (!text.ok()) return absl::NotFoundError(absl::StrCat(path, ": ", text.status().message()));
  const jinja::Value config = jinja::Value::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded() || !config.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  }
  std::string source;
  if (auto it = config.find("chat_template"); it != config.end()) {
    if (it->is_string()) {
      source = it->get<std::string>();
    } else if (it->is_array()) {  // [{"name": "default", "template": ...}, ...]
      for (const jinja::Value& named : *it) {
        if (named.is_object() && named.contains("name") && named["name"].is_string() &&
            named["name"] == "default" &&
            named.contains("template") && named["template"].is_string()) {
          source = named["template"].get<std::string>();
        }
      }
    }
  }
  if (source.empty()) return absl::NotFoundError(absl::StrCat(path, " has no chat_template"));
  absl::StatusOr<ChatTemplate> t =
      Create(source, TokenText(config.value("bos_token", jinja::Value())),
             TokenText(config.value("eos_token", jinja::Value())));
  if (!t.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": chat_template: ", t.status().message()));
  }
  return t;
}

absl::StatusOr<ChatTemplate> ChatTemplate::Create(std::string_view source, std::string bos_token,
                                                  std::string eos_token) {
  absl::StatusOr<jinja::Template> t = jinja::Template::Parse(source);
  if (!t.ok()) return t.status();
  return ChatTemplate(*std::move(t), std::move(bos_token), std::move(eos_token));
}

absl::StatusOr<std::string> ChatTemplate::Render(const jinja::Value& messages,
                                                 bool add_generation_prompt) const {
  jinja::Value context = {{"messages", messages},
                          {"bos_token", bos_},
                          {"eos_token", eos_},
                          {"add_generation_prompt", add_generation_prompt}};
  return template_.Render(context);
}

}  // namespace preft::text
