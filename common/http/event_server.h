#pragma once

// An HTTP/1.1 server that holds thousands of slow or long-lived exchanges on a few threads: a
// streamed response (server-sent events) holds no thread while it waits for tokens, and a
// client that sends its headers slowly holds only a socket until a deadline closes it.
//
// Built on Boost.Beast's parser and Boost.Asio's event loop. Debian also has libmicrohttpd and
// libevent's evhttp; neither bounds the time to a complete header (only the time between
// bytes, which a client sending a line every 2 s never trips), and evhttp 2.1 has no
// connection cap. Here every phase has its own deadline, a body is refused from its
// Content-Length before it is read, and the caps let health probes past them.
//
// Handlers run on a small pool of their own (parsing, templates, tokenising: CPU work, never a
// wait on I/O) and answer whenever they like, from any thread, through HttpExchange.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace preft::http {

using Headers = std::vector<std::pair<std::string, std::string>>;

// The body of an error the server answers itself (400, 408, 413, 431, 503): a JSON API
// passes its own shape.
using ErrorBody = std::function<std::string(int status, const std::string& message)>;

struct EventServerOptions {
  std::string address = "127.0.0.1:0";  // host:port; port 0 picks one
  int io_threads = 2;                   // the event loop
  int handler_threads = 2;              // run handlers
  // Deadlines: from accept to the end of the first request's headers; from the end of a
  // response to the end of the next request's headers on a kept-alive connection; from the
  // headers to the end of the body; for one write that the client does not take.
  absl::Duration header_timeout = absl::Seconds(10);
  absl::Duration idle_timeout = absl::Seconds(30);
  absl::Duration body_timeout = absl::Seconds(60);
  absl::Duration write_timeout = absl::Seconds(60);
  uint32_t max_header_bytes = 64 << 10;  // beyond: 431
  int64_t max_body_bytes = 16 << 20;     // beyond: 413, before the body is read
  int max_connections = 10000;
  int max_connections_per_client = 512;  // by the peer's address
  // A connection past a cap is not refused outright: it may still ask for these paths (a
  // liveness probe must not fail because clients hold every slot), under a 2 s header
  // deadline; any other request gets 503. At most `max_over_cap` such connections at once;
  // beyond that, new ones are closed at accept.
  std::vector<std::string> always_served = {"/health"};
  int max_over_cap = 64;
  ErrorBody error_body;  // null: a JSON {"error": {"message": ...}}
};

struct HttpRequest {
  std::string method;
  std::string target;  // as sent, query included
  std::string path;    // the target without its query
  std::string body;
  std::string peer;    // the client's address
  Headers headers;
  // The first header of that name (case-insensitive); "" when absent.
  std::string Header(absl::string_view name) const;
  bool HasHeader(absl::string_view name) const;
};

// One request and its response. Every method is thread-safe; calls are written in the order
// they are made. A call after the response ended, or after the client left, does nothing.
class HttpExchange {
 public:
  virtual ~HttpExchange() = default;
  virtual const HttpRequest& request() const = 0;
  // A whole response (Content-Length).
  virtual void Reply(int status, const std::string& content_type, std::string body,
                     Headers extra = {}) = 0;
  // A streamed response: status and headers now (chunked), then Write pieces, then End.
  virtual void StartStream(int status, const std::string& content_type, Headers extra = {}) = 0;
  virtual void Write(std::string data) = 0;
  virtual void End() = 0;
  // `f` runs once if the connection closes before the response ended (the client left, a
  // write timed out, the server stopped): stop the work behind it. At once if it already has.
  virtual void OnClientGone(std::function<void()> f) = 0;
};

using HttpHandler = std::function<void(std::shared_ptr<HttpExchange>)>;

class EventServer {
 public:
  struct Stats {
    int connections = 0;           // open, within the caps
    int over_cap = 0;              // open past a cap (always_served only)
    int busy = 0;                  // with a response in progress
    int64_t refused = 0;           // closed at accept: past a cap and max_over_cap
    int64_t timed_out = 0;         // closed by a deadline
  };

  // InvalidArgument for a malformed address; Unavailable, naming it, when it cannot bind.
  static absl::StatusOr<std::unique_ptr<EventServer>> Start(EventServerOptions options,
                                                            HttpHandler handler);
  // Stop(zero), then waits for every connection to close and joins the threads.
  ~EventServer();

  const std::string& address() const;
  // Stops accepting and closes idle connections; responses in progress may end until `grace`
  // passes, then every connection closes (their OnClientGone callbacks run). Returns then.
  void Stop(absl::Duration grace);
  Stats stats() const;

  struct Impl;

 private:
  explicit EventServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace preft::http
