#pragma once

// Every preft process logs through here: one line per event on stderr, with a level, the
// process's name and, on a request's path, the request's id, as text for people or as one JSON
// object per line for Kubernetes' log collectors (--log-format json). spdlog does the
// formatting and the locking; stdout stays for the lines scripts read ("listening on ...").
//
//   log::Info("connected to {}", address);
//   log::Warn(log::Request{id}, "prefill on {} failed ({}); retrying", worker, status);

#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "spdlog/spdlog.h"

namespace CLI {
class App;
}  // namespace CLI

namespace preft::log {

enum class Format { kText, kJson };

struct Options {
  std::string service = "preft";  // the process's name on every line
  spdlog::level::level_enum level = spdlog::level::info;
  Format format = Format::kText;
};

// Replaces the default logger; call once, early in main (lines before it go out as spdlog's
// default text at info level). Lines go to stderr, or to `sink` (tests).
void Init(const Options& options, std::shared_ptr<spdlog::sinks::sink> sink = nullptr);

// --log-level debug|info|warn|error and --log-format text|json, parsed into `options`.
void AddFlags(CLI::App& app, Options* options);

// The request a line belongs to: its id goes on the line ("request=<id>" in text,
// "request_id" in JSON).
struct Request {
  std::string_view id;
};

namespace internal {
// The request id of the line being written on this thread (set only during the call).
class RequestScope {
 public:
  explicit RequestScope(std::string_view id);
  ~RequestScope();
  RequestScope(const RequestScope&) = delete;
  RequestScope& operator=(const RequestScope&) = delete;

 private:
  std::string_view previous_;
};
std::string_view CurrentRequest();

// Every line goes through here; a line below the level costs one comparison.
template <typename... Args>
void Write(spdlog::level::level_enum level, std::string_view request,
           fmt::format_string<Args...> f, Args&&... args) {
  spdlog::logger* logger = spdlog::default_logger_raw();
  if (!logger->should_log(level)) return;
  RequestScope scope(request);
  logger->log(level, f, std::forward<Args>(args)...);
}
}  // namespace internal

template <typename... Args>
void Debug(fmt::format_string<Args...> f, Args&&... args) {
  internal::Write(spdlog::level::debug, {}, f, std::forward<Args>(args)...);
}
template <typename... Args>
void Info(fmt::format_string<Args...> f, Args&&... args) {
  internal::Write(spdlog::level::info, {}, f, std::forward<Args>(args)...);
}
template <typename... Args>
void Warn(fmt::format_string<Args...> f, Args&&... args) {
  internal::Write(spdlog::level::warn, {}, f, std::forward<Args>(args)...);
}
template <typename... Args>
void Error(fmt::format_string<Args...> f, Args&&... args) {
  internal::Write(spdlog::level::err, {}, f, std::forward<Args>(args)...);
}

template <typename... Args>
void Debug(Request r, fmt::format_string<Args...> f, Args&&... args) {
  internal::Write(spdlog::level::debug, r.id, f, std::forward<Args>(args)...);
}
template <typename... Args>
void Info(Request r, fmt::format_string<Args...> f, Args&&... args) {
  internal::Write(spdlog::level::info, r.id, f, std::forward<Args>(args)...);
}
template <typename... Args>
void Warn(Request r, fmt::format_string<Args...> f, Args&&... args) {
  internal::Write(spdlog::level::warn, r.id, f, std::forward<Args>(args)...);
}
template <typename... Args>
void Error(Request r, fmt::format_string<Args...> f, Args&&... args) {
  internal::Write(spdlog::level::err, r.id, f, std::forward<Args>(args)...);
}

}  // namespace preft::log

// absl::Status in log lines: "{}" prints its ToString().
template <>
struct fmt::formatter<absl::Status> : fmt::formatter<std::string_view> {
  template <typename Context>
  auto format(const absl::Status& s, Context& ctx) const {
    return fmt::formatter<std::string_view>::format(s.ToString(), ctx);
  }
};
