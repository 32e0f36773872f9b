// Rewards of `preft train rl` and its prompt reader.

#include "train/reward.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/train/train_test_util.h"
#include "train/data.h"

namespace preft::train {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<double> Score(const std::string& spec, const std::vector<RewardInput>& in) {
  auto r = MakeReward(spec);
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return {};
  auto s = (*r)->Score(in);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : std::vector<double>{};
}

TEST(RewardTest, ExactReadsTheFinalAnswerAsGsm8kAndMathGradersDo) {
  EXPECT_EQ(ExtractAnswer("so 3 + 4 = 7\n#### 7", "####"), " 7");
  EXPECT_EQ(ExtractAnswer("#### 1\nthen #### 2\nmore text", "####"), " 2");
  EXPECT_EQ(ExtractAnswer("thus \\boxed{\\frac{1}{2}}.", "####"), "\\frac{1}{2}");
  EXPECT_EQ(ExtractAnswer("it costs $1,234.50 in total.", "####"), "1,234.50");
  EXPECT_EQ(ExtractAnswer("down to -3", "####"), "-3");
  EXPECT_EQ(ExtractAnswer("no number", "####"), "");
  EXPECT_THAT(Score("exact", {{"", "x #### 1,000.", "1000", {}},
                               {"", "x #### 999", "1000", {}},
                               {"", "\\boxed{$42$}", "42", {}},
                               {"", "the answer is 42", "42", {}}}),
              ElementsAre(1, 0, 1, 1));  // "$" and thousands commas are dropped
}

TEST(RewardTest, RegexMatchesAnywhereAndCommandsPlugIn) {
  EXPECT_THAT(Score("regex:^[A-Z][a-z]+ (yes|no)\\.$",
                    {{"", "Answer yes.", "", {}}, {"", "answer yes.", "", {}}}),
              ElementsAre(1, 0));
  EXPECT_THAT(Score("regex:\\d{3}", {{"", "code 12345", "", {}}, {"", "12", "", {}}}),
              ElementsAre(1, 0));
  // One JSON line per rollout in, one score per line out.
  EXPECT_THAT(Score("command:/usr/bin/python3 -c \"import json,sys; "
                    "[print(len(json.loads(l)['completion_ids']) / 10) for l in sys.stdin]\"",
                    {{"p", "c", "", {1, 2, 3}}, {"p", "c", "", {4}}}),
              ElementsAre(0.3, 0.1));
}

TEST(RewardTest, BadSpecsAndMisbehavingCommandsAreErrors) {
  auto bad = MakeReward("fuzzy");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("exact, regex:PATTERN or command:PROG"));
  auto regex = MakeReward("regex:([a-z");
  ASSERT_FALSE(regex.ok());
  EXPECT_THAT(std::string(regex.status().message()), HasSubstr("does not compile"));
  const std::vector<RewardInput> two = {{"p", "a", "", {1}}, {"p", "b", "", {2}}};
  for (const auto& [command, message] :
       std::vector<std::pair<std::string, std::string>>{
           {"command:echo 1", "printed 1 scores for 2 rollouts"},
           {"command:printf '1\\nnope\\n'", "output line 2 is not a finite number"},
           {"command:exit 3", "exited with status 3"}}) {
    auto r = MakeReward(command);
    ASSERT_TRUE(r.ok());
    auto s = (*r)->Score(two);
    ASSERT_FALSE(s.ok()) << command;
    EXPECT_THAT(std::string(s.status().message()), HasSubstr(message)) << command;
  }
}

TEST(RlPromptsTest, TextAndChatPromptsWithAnswers) {
  const std::string model = testing::TinyModel();
  auto tok = text::Tokenizer::LoadFromModelDir(model);
  auto chat = text::ChatTemplate::FromModelDir(model);
  ASSERT_TRUE(tok.ok() && chat.ok());
  const std::string dir = testing::TempDir("rl_prompts");
  const std::string path = testing::WriteFile(
      dir + "/p.jsonl",
      "{\"prompt\": \"2+2?\", \"answer\": 4}\n"
      "{\"messages\": [{\"role\": \"user\", \"content\": \"3+3?\"}], \"answer\": \"6\"}\n");
  auto p = ReadRlPrompts(path, **tok, &*chat, {}, /*need_answer=*/true);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->size(), 2u);
  EXPECT_EQ((*p)[0].answer, "4");
  EXPECT_EQ((*p)[0].prompt_ids, *(*tok)->Encode("2+2?", true));
  auto rendered = chat->Render(text::jinja::Value::parse(R"([{"role": "user", "content": "3+3?"}])"));
  ASSERT_TRUE(rendered.ok());
  EXPECT_EQ((*p)[1].text, *rendered);
  EXPECT_EQ((*p)[1].prompt_ids, *(*tok)->Encode(*rendered, false));

  const std::string missing = testing::WriteFile(dir + "/m.jsonl", "{\"prompt\": \"x\"}\n");
  auto m = ReadRlPrompts(missing, **tok, &*chat, {}, true);
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("m.jsonl:1: needs an \"answer\""));
  EXPECT_TRUE(ReadRlPrompts(missing, **tok, &*chat, {}, false).ok());
}

}  // namespace
}  // namespace preft::train
