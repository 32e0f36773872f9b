// Chat templates from tokenizer_config.json: found, named, with AddedToken-style special tokens,
// and the errors for folders without one or with a broken one.

#include "common/text/chat_template.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "common/model/make_model.h"

namespace preft::text {
namespace {

namespace fs = std::filesystem;

class ChatTemplateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("chat_template_" + std::to_string(getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  void WriteConfig(const std::string& json) {
    std::ofstream(dir_ / "tokenizer_config.json") << json;
  }
  fs::path dir_;
};

const jinja::Value kHello = jinja::Value::array({{{"role", "user"}, {"content", "Hello"}}});

TEST_F(ChatTemplateTest, RendersWithTheConfigsSpecialTokens) {
  WriteConfig(R"({"bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>",
                  "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"})");
  auto t = ChatTemplate::FromModelDir(dir_.string());
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*t->Render(kHello), "<s>[user] Hello</s>[assistant] ");
  EXPECT_EQ(*t->Render(kHello, /*add_generation_prompt=*/false), "<s>[user] Hello</s>");
}

TEST_F(ChatTemplateTest, NamedTemplatesPickDefault) {
  WriteConfig(R"({"chat_template": [{"name": "tool_use", "template": "tools"},
                                    {"name": "default", "template": "plain {{ messages[0].content }}"}]})");
  auto t = ChatTemplate::FromModelDir(dir_.string());
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*t->Render(kHello, false), "plain Hello");
}

TEST_F(ChatTemplateTest, MissingOrBrokenTemplatesAreClearErrors) {
  EXPECT_EQ(ChatTemplate::FromModelDir(dir_.string()).status().code(), absl::StatusCode::kNotFound);
  WriteConfig(R"({"bos_token": "<s>"})");
  EXPECT_EQ(ChatTemplate::FromModelDir(dir_.string()).status().code(), absl::StatusCode::kNotFound);
  WriteConfig(R"({"chat_template": "{% for m in messages %}never closed"})");
  auto broken = ChatTemplate::FromModelDir(dir_.string());
  EXPECT_EQ(broken.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(broken.status().message().find("tokenizer_config.json: chat_template"), std::string::npos)
      << broken.status();
  WriteConfig("not json");
  EXPECT_EQ(ChatTemplate::FromModelDir(dir_.string()).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A template's own refusal (raise_exception) comes back as the error.
  WriteConfig(R"({"chat_template": "{{ raise_exception('only user messages') }}"})");
  auto refusing = ChatTemplate::FromModelDir(dir_.string());
  ASSERT_TRUE(refusing.ok());
  EXPECT_EQ(refusing->Render(kHello).status().message(), "only user messages");
}

TEST_F(ChatTemplateTest, MadeModelsCarryTheirFamilysTemplate) {
  for (const auto& [preset, marker] : std::vector<std::pair<std::string, std::string>>{
           {"tiny", "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"},
           {"tiny-qwen2", "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"},
           {"tiny-mistral", "[INST] Hello [/INST]"}}) {
    model::MakeModelOptions o;
    o.preset = preset;
    o.out_dir = (dir_ / preset).string();
    ASSERT_TRUE(model::MakeModel(o).ok()) << preset;
    auto t = ChatTemplate::FromModelDir(o.out_dir);
    ASSERT_TRUE(t.ok()) << preset << ": " << t.status();
    auto text = t->Render(kHello);
    ASSERT_TRUE(text.ok()) << text.status();
    EXPECT_NE(text->find(marker), std::string::npos) << preset << ": " << *text;
  }
}

}  // namespace
}  // namespace preft::text
