#include "common/log/log.h"

#include <gtest/gtest.h>

#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "spdlog/sinks/ostream_sink.h"

namespace preft::log {
namespace {

class LogTest : public ::testing::Test {
 protected:
  void Start(Options o) {
    o.service = "preft-test";
    Init(o, std::make_shared<spdlog::sinks::ostream_sink_mt>(out_));
  }
  std::vector<std::string> Lines() const {
    return absl::StrSplit(out_.str(), '\n', absl::SkipEmpty());
  }
  void TearDown() override { Init(Options{}); }  // back to stderr for later tests

  std::ostringstream out_;
};

TEST_F(LogTest, JsonLinesCarryLevelServiceRequestAndMessage) {
  Options o;
  o.format = Format::kJson;
  Start(o);
  Info("connected to {}", "10.0.0.1:9000");
  Warn(Request{"req-42"}, "prefill on {} failed ({}); retrying", "a:1",
       absl::UnavailableError("gone"));
  const std::vector<std::string> lines = Lines();
  ASSERT_EQ(lines.size(), 2u) << out_.str();
  const nlohmann::json first = nlohmann::json::parse(lines[0]);
  EXPECT_EQ(first["level"], "info");
  EXPECT_EQ(first["service"], "preft-test");
  EXPECT_EQ(first["msg"], "connected to 10.0.0.1:9000");
  EXPECT_FALSE(first.contains("request_id"));
  EXPECT_EQ(first["time"].get<std::string>().size(), 24u) << first["time"];  // ...T..:..:..123Z
  const nlohmann::json second = nlohmann::json::parse(lines[1]);
  EXPECT_EQ(second["level"], "warning");
  EXPECT_EQ(second["request_id"], "req-42");
  EXPECT_EQ(second["msg"], "prefill on a:1 failed (UNAVAILABLE: gone); retrying");
}

TEST_F(LogTest, JsonEscapesQuotesNewlinesAndInvalidUtf8) {
  Options o;
  o.format = Format::kJson;
  Start(o);
  Error(Request{"id \"with\" quotes"}, "line one\nline \"two\" \xff\xfe end");
  const std::vector<std::string> lines = Lines();
  ASSERT_EQ(lines.size(), 1u) << "a message's newline split the JSON line: " << out_.str();
  const nlohmann::json j = nlohmann::json::parse(lines[0]);
  EXPECT_EQ(j["request_id"], "id \"with\" quotes");
  EXPECT_EQ(j["msg"], "line one\nline \"two\" \xEF\xBF\xBD\xEF\xBF\xBD end");
}

TEST_F(LogTest, TextLinesNameTheServiceAndRequest) {
  Start(Options{});
  Info(Request{"r1"}, "admitted");
  Info("ready");
  const std::vector<std::string> lines = Lines();
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_NE(lines[0].find(" info preft-test request=r1: admitted"), std::string::npos) << lines[0];
  EXPECT_NE(lines[1].find(" info preft-test: ready"), std::string::npos) << lines[1];
}

TEST_F(LogTest, TheRequestIdEndsWithItsLine) {
  Start(Options{});
  Info(Request{"r1"}, "first");
  Info("second");
  EXPECT_EQ(internal::CurrentRequest(), "");
  EXPECT_EQ(Lines()[1].find("request="), std::string::npos) << Lines()[1];
}

TEST_F(LogTest, LinesBelowTheLevelAreDropped) {
  Options o;
  o.level = spdlog::level::warn;
  Start(o);
  Debug("d");
  Info("i");
  Warn("w");
  Error("e");
  const std::vector<std::string> lines = Lines();
  ASSERT_EQ(lines.size(), 2u) << out_.str();
  EXPECT_NE(lines[0].find("warning preft-test: w"), std::string::npos);
  EXPECT_NE(lines[1].find("error preft-test: e"), std::string::npos);
}

TEST(LogFlagsTest, ParseLevelAndFormatAndRefuseOthers) {
  {
    CLI::App app;
    Options o;
    AddFlags(app, &o);
    app.parse(std::vector<std::string>{"json", "--log-format", "debug", "--log-level"});
    EXPECT_EQ(o.level, spdlog::level::debug);
    EXPECT_EQ(o.format, Format::kJson);
  }
  for (const std::vector<std::string>& bad :
       {std::vector<std::string>{"loud", "--log-level"},
        std::vector<std::string>{"xml", "--log-format"}}) {
    CLI::App app;
    Options o;
    AddFlags(app, &o);
    EXPECT_THROW(app.parse(std::vector<std::string>(bad)), CLI::ValidationError) << bad[1];
  }
}

}  // namespace
}  // namespace preft::log
