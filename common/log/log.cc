#include "common/log/log.h"

#include <memory>
#include <string>
#include <utility>

#include "CLI/CLI.hpp"
#include "absl/strings/ascii.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "spdlog/sinks/stdout_sinks.h"

namespace preft::log {
namespace {

thread_local std::string_view current_request;

// One line per event: "<time> <level> <service>[ request=<id>]: <message>", or the same fields
// as one JSON object (the message escaped, invalid UTF-8 replaced: a line always parses).
class LineFormatter final : public spdlog::formatter {
 public:
  LineFormatter(std::string service, Format format)
      : service_(std::move(service)), format_(format) {}

  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    const std::string time = absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::FromChrono(msg.time),
                                              absl::UTCTimeZone());
    const spdlog::string_view_t level = spdlog::level::to_string_view(msg.level);
    const std::string_view text(msg.payload.data(), msg.payload.size());
    const std::string_view request = internal::CurrentRequest();
    std::string line;
    if (format_ == Format::kJson) {
      nlohmann::ordered_json j;
      j["time"] = time;
      j["level"] = std::string_view(level.data(), level.size());
      j["service"] = service_;
      if (!request.empty()) j["request_id"] = request;
      j["msg"] = text;
      line = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    } else {
      line = time;
      line.append(" ").append(level.data(), level.size()).append(" ").append(service_);
      if (!request.empty()) line.append(" request=").append(request);
      line.append(": ").append(text);
    }
    line.push_back('\n');
    dest.append(line.data(), line.data() + line.size());
  }

  std::unique_ptr<spdlog::formatter> clone() const override {
    return std::make_unique<LineFormatter>(service_, format_);
  }

 private:
  const std::string service_;
  const Format format_;
};

}  // namespace

namespace internal {

RequestScope::RequestScope(std::string_view id) : previous_(current_request) {
  current_request = id;
}
RequestScope::~RequestScope() { current_request = previous_; }
std::string_view CurrentRequest() { return current_request; }

}  // namespace internal

void Init(const Options& options, std::shared_ptr<spdlog::sinks::sink> sink) {
  if (sink == nullptr) sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
  auto logger = std::make_shared<spdlog::logger>(options.service, std::move(sink));
  logger->set_formatter(std::make_unique<LineFormatter>(options.service, options.format));
  logger->set_level(options.level);
  logger->flush_on(spdlog::level::trace);  // a killed process loses no line
  spdlog::set_default_logger(std::move(logger));
}

void AddFlags(CLI::App& app, Options* options) {
  // Names, checked with IsMember so a typo is answered "--log-level: loud not in {...}".
  app.add_option_function<std::string>(
         "--log-level",
         [options](const std::string& v) {
           const std::string level = absl::AsciiStrToLower(v);
           options->level = level == "debug"  ? spdlog::level::debug
                            : level == "warn" ? spdlog::level::warn
                            : level == "error" ? spdlog::level::err
                                               : spdlog::level::info;
         },
         "debug, info, warn or error")
      ->check(CLI::IsMember({"debug", "info", "warn", "error"}, CLI::ignore_case))
      ->default_str("info");
  app.add_option_function<std::string>(
         "--log-format",
         [options](const std::string& v) {
           options->format = absl::AsciiStrToLower(v) == "json" ? Format::kJson : Format::kText;
         },
         "text, or json: one object per line (time, level, service, request_id, msg)")
      ->check(CLI::IsMember({"text", "json"}, CLI::ignore_case))
      ->default_str("text");
}

}  // namespace preft::log
