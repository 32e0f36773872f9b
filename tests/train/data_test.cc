// ReadSftData: TRL's JSONL formats tokenized as the server tokenizes prompts, one example per
// assistant turn, and errors that name the file and line.

#include "train/data.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/train/train_test_util.h"

namespace preft::train {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

class SftDataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::TempDir("sft_data");
    const std::string model = testing::TinyModel();
    auto tok = text::Tokenizer::LoadFromModelDir(model);
    ASSERT_TRUE(tok.ok()) << tok.status();
    tokenizer_ = std::move(tok).value();
    auto chat = text::ChatTemplate::FromModelDir(model);
    ASSERT_TRUE(chat.ok()) << chat.status();
    chat_ = std::make_unique<text::ChatTemplate>(*std::move(chat));
  }

  absl::StatusOr<std::vector<Example>> Read(const std::string& text,
                                            SftDataOptions options = {}) {
    path_ = testing::WriteFile(dir_ + "/data.jsonl", text);
    return ReadSftData(path_, *tokenizer_, chat_.get(), options);
  }
  std::vector<int32_t> Encode(const std::string& text, bool special) {
    auto ids = tokenizer_->Encode(text, special);
    EXPECT_TRUE(ids.ok());
    return ids.ok() ? *ids : std::vector<int32_t>{};
  }
  std::string Render(const text::jinja::Value& messages, bool generation_prompt) {
    auto text = chat_->Render(messages, generation_prompt);
    EXPECT_TRUE(text.ok()) << text.status();
    return text.ok() ? *text : "";
  }
  // The error of reading `text`, which must fail.
  std::string Error(const std::string& text, SftDataOptions options = {}) {
    auto r = Read(text, options);
    EXPECT_FALSE(r.ok()) << text;
    if (r.ok()) return "";
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    return std::string(r.status().message());
  }

  std::string dir_, path_;
  std::unique_ptr<text::Tokenizer> tokenizer_;
  std::unique_ptr<text::ChatTemplate> chat_;
};

TEST_F(SftDataTest, PromptCompletionIsTokenizedAsTheServerTokenizesPrompts) {
  auto data = Read(R"({"prompt": "Who are you?", "completion": " A model."})"
                   "\n\n"
                   R"({"prompt": "Hi", "completion": "Hello"})"
                   "\n");
  ASSERT_TRUE(data.ok()) << data.status();
  ASSERT_EQ(data->size(), 2u);
  const Example& e = (*data)[0];
  EXPECT_EQ(e.prompt_ids, Encode("Who are you?", true));  // with BOS, as /v1/completions
  EXPECT_EQ(e.prompt_ids.front(), tokenizer_->bos_token_id());
  std::vector<int32_t> completion = Encode(" A model.", false);
  completion.push_back(tokenizer_->eos_token_id());
  EXPECT_EQ(e.completion_ids, completion);
  EXPECT_EQ(e.source, path_ + ":1");
  EXPECT_EQ((*data)[1].source, path_ + ":3");  // the blank line is skipped, not renumbered

  SftDataOptions no_eos;
  no_eos.append_eos = false;
  auto bare = Read(R"({"prompt": "Hi", "completion": "Hello"})", no_eos);
  ASSERT_TRUE(bare.ok());
  EXPECT_EQ((*bare)[0].completion_ids, Encode("Hello", false));
}

TEST_F(SftDataTest, EveryAssistantTurnIsAnExampleWithEverythingBeforeItAsPrompt) {
  const text::jinja::Value messages = text::jinja::Value::parse(R"([
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "One?"},
    {"role": "assistant", "content": "Uno."},
    {"role": "user", "content": "Two?"},
    {"role": "assistant", "content": "Dos."}])");
  auto data = Read(nlohmann::json({{"messages", messages}}).dump() + "\n");
  ASSERT_TRUE(data.ok()) << data.status();
  ASSERT_EQ(data->size(), 2u);
  for (int turn = 0; turn < 2; ++turn) {
    const size_t k = turn == 0 ? 2 : 4;  // the assistant message's index
    text::jinja::Value before = text::jinja::Value::array(), through;
    for (size_t i = 0; i < k; ++i) before.push_back(messages[i]);
    through = before;
    through.push_back(messages[k]);
    const std::string prompt = Render(before, true);
    const std::string full = Render(through, false);
    const Example& e = (*data)[turn];
    // The prompt is what /v1/chat/completions sends for the conversation so far (the earlier
    // assistant turn included: under PreFT it is prompt, adapted, when this turn is trained).
    EXPECT_EQ(e.prompt_ids, Encode(prompt, false)) << turn;
    EXPECT_EQ(e.completion_ids, Encode(full.substr(prompt.size()), false)) << turn;
    auto text = tokenizer_->Decode(e.completion_ids);
    ASSERT_TRUE(text.ok());
    EXPECT_THAT(*text, StartsWith(messages[k]["content"].get<std::string>())) << turn;
    EXPECT_THAT(e.source, HasSubstr("(assistant turn " + std::to_string(turn + 1) + ")"));
  }
  // The second turn's prompt holds the first turn's answer.
  auto prompt2 = tokenizer_->Decode((*data)[1].prompt_ids);
  ASSERT_TRUE(prompt2.ok());
  EXPECT_THAT(*prompt2, HasSubstr("Uno."));
}

TEST_F(SftDataTest, ConversationalPromptCompletionTrainsTheCompletionTurnsOnly) {
  auto data = Read(
      R"({"prompt": [{"role": "user", "content": "A?"}, {"role": "assistant", "content": "B."},)"
      R"( {"role": "user", "content": "C?"}], "completion": [{"role": "assistant", "content": "D."}]})");
  ASSERT_TRUE(data.ok()) << data.status();
  ASSERT_EQ(data->size(), 1u);
  auto text = tokenizer_->Decode((*data)[0].completion_ids);
  ASSERT_TRUE(text.ok());
  EXPECT_THAT(*text, StartsWith("D."));
}

TEST_F(SftDataTest, BadLinesNameTheFileAndLine) {
  const std::string ok = R"({"prompt": "a", "completion": "b"})";
  struct Case {
    std::string line;
    std::string message;
  } cases[] = {
      {R"({"prompt": "a", "completion": )", "malformed JSON"},
      {R"(["prompt", "completion"])", "expected a JSON object"},
      {R"({"prompt": "a"})", "needs \"prompt\" and \"completion\", or \"messages\""},
      {R"({"prompt": "a", "completion": 3})", "must both be strings"},
      {R"({"prompt": "a", "completion": ""})", "the completion is empty"},
      {R"({"prompt": "", "completion": "b"})", ""},  // BOS only: a valid prompt
      {R"({"messages": []})", "\"messages\" must be a non-empty list"},
      {R"({"messages": [{"role": "user"}]})", "string \"role\" and \"content\""},
      {R"({"messages": [{"role": "wizard", "content": "x"}]})", "role \"wizard\""},
      {R"({"messages": [{"role": "user", "content": "x"}]})", "no assistant turn"},
      {R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]})",
       "assistant turn 1 (message 1) is empty"},
      {R"({"messages": [{"role": "user", "content": "x"}], "prompt": "a", "completion": "b"})",
       "not both"},
      {R"({"prompt": [{"role": "user", "content": "x"}], "completion": [{"role": "user", "content": "y"}]})",
       "must all be assistant messages"},
  };
  for (const Case& c : cases) {
    auto r = Read(ok + "\n" + ok + "\n" + c.line + "\n" + ok + "\n");
    if (c.message.empty()) {
      EXPECT_TRUE(r.ok()) << c.line << ": " << r.status();
      continue;
    }
    ASSERT_FALSE(r.ok()) << c.line;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(r.status().message()), StartsWith(path_ + ":3: ")) << c.line;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.message)) << c.line;
  }
}

TEST_F(SftDataTest, LongExamplesEmptyFilesAndMissingFilesAreErrors) {
  SftDataOptions short_max;
  short_max.max_length = 6;
  const std::string long_line = R"({"prompt": "a long prompt here", "completion": "b"})";
  EXPECT_THAT(Error(long_line, short_max), HasSubstr("over --max-length 6"));
  EXPECT_THAT(Error("\n  \n"), HasSubstr("no examples"));
  SftDataOptions small_vocab;
  small_vocab.vocab_size = 10;
  EXPECT_THAT(Error(R"({"prompt": "a", "completion": "b"})", small_vocab),
              HasSubstr("outside the model's vocabulary"));
  auto missing = ReadSftData(dir_ + "/none.jsonl", *tokenizer_, chat_.get(), {});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  path_ = testing::WriteFile(dir_ + "/chat.jsonl",
                             R"({"messages": [{"role": "user", "content": "x"}, )"
                             R"({"role": "assistant", "content": "y"}]})");
  auto no_template = ReadSftData(path_, *tokenizer_, nullptr, {});
  ASSERT_FALSE(no_template.ok());
  EXPECT_THAT(std::string(no_template.status().message()), HasSubstr(":1: chat messages need the model's chat template"));
}

}  // namespace
}  // namespace preft::train
