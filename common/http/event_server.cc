#include "common/http/event_server.h"

#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cstdio>
#include <deque>
#include <future>
#include <optional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/log/log.h"
#include "nlohmann/json.hpp"

namespace preft::http {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = net::ip::tcp;

std::string HttpRequest::Header(absl::string_view name) const {
  for (const auto& [k, v] : headers) {
    if (absl::EqualsIgnoreCase(k, name)) return v;
  }
  return "";
}

bool HttpRequest::HasHeader(absl::string_view name) const {
  for (const auto& [k, v] : headers) {
    if (absl::EqualsIgnoreCase(k, name)) return true;
  }
  return false;
}

namespace {

class Connection;

// A connection past a cap has this long to send its headers.
constexpr absl::Duration kOverCapHeaderTimeout = absl::Seconds(2);

std::string StatusLine(int status) {
  const auto reason = bhttp::obsolete_reason(static_cast<bhttp::status>(status));
  return absl::StrCat("HTTP/1.1 ", status, " ", absl::string_view(reason.data(), reason.size()),
                      "\r\n");
}

std::string HeaderBlock(const std::string& content_type, const Headers& extra, bool keep_alive) {
  std::string out = absl::StrCat("Content-Type: ", content_type, "\r\n");
  for (const auto& [k, v] : extra) absl::StrAppend(&out, k, ": ", v, "\r\n");
  absl::StrAppend(&out, "Connection: ", keep_alive ? "keep-alive" : "close", "\r\n");
  return out;
}

}  // namespace

struct EventServer::Impl {
  Impl(EventServerOptions o, HttpHandler h)
      : options(std::move(o)),
        handler(std::move(h)),
        ioc(std::max(1, options.io_threads)),
        work(net::make_work_guard(ioc)),
        accept_strand(net::make_strand(ioc)),
        acceptor(accept_strand),
        handlers(static_cast<size_t>(std::max(1, options.handler_threads))) {}

  void Accept();
  // Admits a connection from `peer`: false to close it at once; *over_cap when past a cap.
  bool Admit(const std::string& peer, bool* over_cap);
  void Register(const std::shared_ptr<Connection>& c);
  void Release(Connection* c, const std::string& peer, bool over_cap);
  void SetBusy(bool busy);
  std::string ErrorBody(int status, const std::string& message) const;
  template <typename F>
  void ForEachLive(F f);

  const EventServerOptions options;
  const HttpHandler handler;
  net::io_context ioc;
  net::executor_work_guard<net::io_context::executor_type> work;
  net::strand<net::io_context::executor_type> accept_strand;
  tcp::acceptor acceptor;
  net::thread_pool handlers;
  std::vector<std::thread> threads;
  std::string address;
  std::atomic<int64_t> objects{0};  // Connection objects alive (exchanges keep theirs)
  std::atomic<int64_t> refused{0};
  std::atomic<int64_t> timed_out{0};
  std::atomic<bool> stopping{false};

  mutable absl::Mutex mu;
  int total ABSL_GUARDED_BY(mu) = 0;
  int over_cap ABSL_GUARDED_BY(mu) = 0;
  int busy ABSL_GUARDED_BY(mu) = 0;
  absl::flat_hash_map<std::string, int> per_client ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<Connection*, std::weak_ptr<Connection>> live ABSL_GUARDED_BY(mu);
};

namespace {

// One exchange's view of its connection: what it writes goes to the connection's strand.
class Exchange;

// A socket's life: read a request (header deadline), maybe its body (body deadline), hand it
// to the handler, write what the exchange sends (write deadline), then the next request
// (idle deadline) or close. While a response is in progress it watches the socket for the
// client leaving. Every member is touched on the connection's strand only.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(EventServer::Impl* server, tcp::socket socket, std::string peer, bool over_cap)
      : server_(server),
        socket_(std::move(socket)),
        timer_(socket_.get_executor()),
        peer_(std::move(peer)),
        over_cap_(over_cap) {
    ++server_->objects;
  }
  ~Connection() { --server_->objects; }

  void Start() {
    ReadRequest(over_cap_ ? std::min(kOverCapHeaderTimeout, server_->options.header_timeout)
                          : server_->options.header_timeout);
  }

  // From any thread: run `f` on the strand, keeping the connection alive until then.
  template <typename F>
  void Post(F f) {
    net::post(socket_.get_executor(), [self = shared_from_this(), f = std::move(f)]() mutable {
      f(*self);
    });
  }

  // A piece of the response in progress; `ends` marks its last.
  void Send(std::string bytes, bool ends) {
    if (closed_) return;
    out_.push_back({std::move(bytes), ends});
    WriteNext();
  }

  // Closes unless a response is in progress (the server stops: idle keep-alives go now).
  void CloseIfIdle() {
    if (exchange_ == nullptr) Close();
  }
  void Close();

 private:
  struct Piece {
    std::string bytes;
    bool ends;
  };

  void Arm(absl::Duration d) {
    const uint64_t generation = ++timer_generation_;
    timer_.expires_after(absl::ToChronoNanoseconds(d));
    timer_.async_wait([self = shared_from_this(), generation](beast::error_code ec) {
      if (ec || generation != self->timer_generation_) return;
      ++self->server_->timed_out;
      self->Close();
    });
  }
  void Disarm() {
    ++timer_generation_;
    timer_.cancel();
  }

  void ReadRequest(absl::Duration deadline) {
    parser_.emplace();
    parser_->header_limit(server_->options.max_header_bytes);
    parser_->body_limit(static_cast<uint64_t>(std::max<int64_t>(0, server_->options.max_body_bytes)));
    Arm(deadline);
    bhttp::async_read_header(socket_, buffer_, *parser_,
                             [self = shared_from_this()](beast::error_code ec, size_t) {
                               self->OnHeader(ec);
                             });
  }

  void OnHeader(beast::error_code ec) {
    if (closed_) return;
    if (ec) return OnReadError(ec);
    const auto& req = parser_->get();
    const std::string target(req.target().data(), req.target().size());
    const std::string path = target.substr(0, target.find('?'));
    if (over_cap_) {
      const auto& always = server_->options.always_served;
      if (std::find(always.begin(), always.end(), path) == always.end()) {
        return Refuse(503, "too many connections from this client or in all; retry shortly");
      }
    }
    if (parser_->is_done()) return Dispatch();
    Arm(server_->options.body_timeout);
    const auto expect = req[bhttp::field::expect];
    if (absl::EqualsIgnoreCase(absl::string_view(expect.data(), expect.size()), "100-continue")) {
      // curl asks before sending a body over 1 KiB; it would wait a second otherwise.
      continue_ = "HTTP/1.1 100 Continue\r\n\r\n";
      net::async_write(socket_, net::buffer(continue_),
                       [self = shared_from_this()](beast::error_code ec, size_t) {
                         if (ec) return self->Close();
                         self->ReadBody();
                       });
      return;
    }
    ReadBody();
  }

  void ReadBody() {
    bhttp::async_read(socket_, buffer_, *parser_,
                      [self = shared_from_this()](beast::error_code ec, size_t) {
                        if (self->closed_) return;
                        if (ec) return self->OnReadError(ec);
                        self->Dispatch();
                      });
  }

  void OnReadError(beast::error_code ec) {
    if (ec == bhttp::error::body_limit) {
      return Refuse(413, absl::StrCat("the request body is over the size limit (",
                                      server_->options.max_body_bytes, " bytes)"));
    }
    if (ec == bhttp::error::header_limit) {
      return Refuse(431, "the request's headers are over the size limit");
    }
    if (ec.category() == bhttp::make_error_code(bhttp::error::end_of_stream).category() &&
        ec != bhttp::error::end_of_stream &&
        ec != bhttp::error::partial_message) {
      return Refuse(400, absl::StrCat("malformed HTTP request: ", ec.message()));
    }
    Close();  // the client left, or a deadline closed the socket
  }

  // Answers an error and closes: the rest of what the client sent is not read.
  void Refuse(int status, const std::string& message) {
    Disarm();
    const std::string body = server_->ErrorBody(status, message);
    Send(absl::StrCat(StatusLine(status), HeaderBlock("application/json", {}, false),
                      status == 503 ? "Retry-After: 1\r\n" : "", "Content-Length: ", body.size(),
                      "\r\n\r\n", body),
         true);
    keep_alive_ = false;
  }

  void Dispatch();
  void OnResponseEnd();

  // Closing a socket with unread input resets the connection, and the client may lose the
  // response it has not read yet (a 413 sent while its body is still arriving): stop sending,
  // read and drop what still comes for a while, then close.
  void LingerClose() {
    beast::error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_send, ignored);
    Arm(kLinger);
    Drain();
  }
  void Drain() {
    // Only a closing connection needs it: 16 KiB held by every open stream otherwise.
    if (drain_ == nullptr) drain_ = std::make_unique<char[]>(kDrainChunk);
    socket_.async_read_some(net::buffer(drain_.get(), kDrainChunk), [self = shared_from_this()](
                                                     beast::error_code ec, size_t n) {
      if (self->closed_) return;
      self->drained_ += n;
      if (ec || self->drained_ > kMaxDrainBytes) return self->Close();
      self->Drain();
    });
  }
  static constexpr absl::Duration kLinger = absl::Seconds(2);
  static constexpr size_t kMaxDrainBytes = size_t{64} << 20;
  static constexpr size_t kDrainChunk = 16384;

  void WatchForLeaving() {
    if (buffer_.size() > 0) return;  // a pipelined request is already here: the client is alive
    watching_ = true;
    // A streamed response may last minutes: keep no request-sized buffer for it. What arrives
    // meanwhile (a pipelined request, mostly nothing) is read in small pieces.
    buffer_.shrink_to_fit();
    socket_.async_read_some(buffer_.prepare(512),
                            [self = shared_from_this()](beast::error_code ec, size_t n) {
                              self->watching_ = false;
                              if (!ec) self->buffer_.commit(n);
                              if (self->closed_) return;
                              if (self->resume_after_watch_) {
                                self->resume_after_watch_ = false;
                                return self->ReadRequest(self->server_->options.idle_timeout);
                              }
                              // EOF or a reset while the response is in progress: the client
                              // left (a client that half-closes after its request is taken to
                              // have left too; HTTP clients do not).
                              if (ec) self->Close();
                            });
  }

  void WriteNext() {
    if (writing_ || out_.empty() || closed_) return;
    writing_ = true;
    Arm(server_->options.write_timeout);
    net::async_write(socket_, net::buffer(out_.front().bytes),
                     [self = shared_from_this()](beast::error_code ec, size_t) {
                       self->writing_ = false;
                       if (self->closed_) return;
                       if (ec) return self->Close();
                       self->Disarm();
                       const bool ends = self->out_.front().ends;
                       self->out_.pop_front();
                       if (ends) return self->OnResponseEnd();
                       self->WriteNext();
                     });
  }

  EventServer::Impl* const server_;
  tcp::socket socket_;  // its executor is the connection's strand
  net::steady_timer timer_;
  uint64_t timer_generation_ = 0;
  const std::string peer_;
  const bool over_cap_;
  beast::flat_buffer buffer_;
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  std::string continue_;
  std::unique_ptr<char[]> drain_;  // LingerClose's, allocated when it starts
  size_t drained_ = 0;
  std::shared_ptr<Exchange> exchange_;  // the response in progress
  std::deque<Piece> out_;
  bool writing_ = false;
  bool keep_alive_ = true;
  bool watching_ = false;
  bool resume_after_watch_ = false;
  bool closed_ = false;
  bool released_ = false;
};

class Exchange final : public HttpExchange {
 public:
  Exchange(std::shared_ptr<Connection> connection, HttpRequest request, bool keep_alive)
      : connection_(std::move(connection)), request_(std::move(request)), keep_alive_(keep_alive) {}

  const HttpRequest& request() const override { return request_; }

  void Reply(int status, const std::string& content_type, std::string body,
             Headers extra) override {
    if (Begin(false)) {
      Push(absl::StrCat(StatusLine(status), HeaderBlock(content_type, extra, keep_alive_),
                        "Content-Length: ", body.size(), "\r\n\r\n", body),
           true);
    }
  }
  void StartStream(int status, const std::string& content_type, Headers extra) override {
    if (Begin(true)) {
      Push(absl::StrCat(StatusLine(status), HeaderBlock(content_type, extra, keep_alive_),
                        "Transfer-Encoding: chunked\r\n\r\n"),
           false);
    }
  }
  void Write(std::string data) override {
    absl::MutexLock lock(&mu_);
    if (state_ != State::kStreaming || data.empty()) return;  // an empty chunk would end it
    Push(absl::StrCat(absl::Hex(data.size()), "\r\n", data, "\r\n"), false);
  }
  void End() override {
    absl::MutexLock lock(&mu_);
    if (state_ != State::kStreaming) return;
    state_ = State::kEnded;
    Push("0\r\n\r\n", true);
  }
  void OnClientGone(std::function<void()> f) override {
    {
      absl::MutexLock lock(&mu_);
      if (!gone_) {
        on_gone_ = std::move(f);
        return;
      }
    }
    f();
  }

  // The connection closed (on its strand).
  void ClientGone() {
    std::function<void()> f;
    {
      absl::MutexLock lock(&mu_);
      if (gone_) return;
      gone_ = true;
      f = std::move(on_gone_);
    }
    if (f) f();
  }

  // The response went out whole: the connection lets go of the exchange (and the callback).
  void Ended() {
    absl::MutexLock lock(&mu_);
    gone_ = true;
    on_gone_ = nullptr;
  }

 private:
  enum class State { kNew, kStreaming, kEnded };

  bool Begin(bool stream) {
    absl::MutexLock lock(&mu_);
    if (state_ != State::kNew) return false;
    state_ = stream ? State::kStreaming : State::kEnded;
    return true;
  }
  // Posted under mu_ (or right after Begin): the strand runs pieces in the order pushed.
  void Push(std::string bytes, bool ends) {
    connection_->Post([bytes = std::move(bytes), ends](Connection& c) mutable {
      c.Send(std::move(bytes), ends);
    });
  }

  const std::shared_ptr<Connection> connection_;
  const HttpRequest request_;
  const bool keep_alive_;
  absl::Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_) = State::kNew;
  bool gone_ ABSL_GUARDED_BY(mu_) = false;
  std::function<void()> on_gone_ ABSL_GUARDED_BY(mu_);
};

void Connection::Dispatch() {
  Disarm();
  auto& req = parser_->get();
  HttpRequest r;
  r.method = std::string(req.method_string());
  r.target = std::string(req.target());
  r.path = r.target.substr(0, r.target.find('?'));
  r.body = std::move(req.body());
  r.peer = peer_;
  for (const auto& field : req) {
    r.headers.emplace_back(std::string(field.name_string()), std::string(field.value()));
  }
  keep_alive_ = req.keep_alive() && !server_->stopping;
  parser_.reset();
  exchange_ = std::make_shared<Exchange>(shared_from_this(), std::move(r), keep_alive_);
  server_->SetBusy(true);
  WatchForLeaving();
  net::post(server_->handlers, [handler = &server_->handler, exchange = exchange_] {
    try {
      (*handler)(exchange);
    } catch (...) {
      exchange->Reply(500, "application/json", "{\"error\":{\"message\":\"internal error\"}}", {});
    }
  });
}

void Connection::OnResponseEnd() {
  if (exchange_ != nullptr) {
    exchange_->Ended();
    exchange_.reset();
    server_->SetBusy(false);
  }
  if (!keep_alive_ || server_->stopping) {
    // While watching, everything the client sent was read: nothing to linger for.
    return watching_ ? Close() : LingerClose();
  }
  if (watching_) {  // the next request is read when the watch stops
    resume_after_watch_ = true;
    socket_.cancel();
    return;
  }
  ReadRequest(server_->options.idle_timeout);
}

void Connection::Close() {
  if (closed_) return;
  closed_ = true;
  Disarm();
  beast::error_code ignored;
  socket_.close(ignored);
  out_.clear();
  if (exchange_ != nullptr) {
    exchange_->ClientGone();
    exchange_.reset();
    server_->SetBusy(false);
  }
  if (!released_) {
    released_ = true;
    server_->Release(this, peer_, over_cap_);
  }
}

}  // namespace

void EventServer::Impl::Accept() {
  acceptor.async_accept(net::make_strand(ioc), [this](beast::error_code ec, tcp::socket socket) {
    if (ec == net::error::operation_aborted || !acceptor.is_open()) return;
    if (!ec) {
      beast::error_code peer_ec;
      const tcp::endpoint remote = socket.remote_endpoint(peer_ec);
      const std::string peer = peer_ec ? "" : remote.address().to_string();
      bool over_cap = false;
      if (!Admit(peer, &over_cap)) {
        ++refused;
        socket.close(peer_ec);
      } else {
        socket.set_option(tcp::no_delay(true), peer_ec);
        auto c = std::make_shared<Connection>(this, std::move(socket), peer, over_cap);
        Register(c);
        c->Post([](Connection& self) { self.Start(); });
      }
    }
    Accept();
  });
}

bool EventServer::Impl::Admit(const std::string& peer, bool* over) {
  absl::MutexLock lock(&mu);
  if (stopping) return false;
  int& mine = per_client[peer];
  *over = total >= options.max_connections || mine >= options.max_connections_per_client;
  if (*over) {
    if (mine == 0) per_client.erase(peer);
    if (over_cap >= options.max_over_cap) return false;
    ++over_cap;
    return true;
  }
  ++total;
  ++mine;
  return true;
}

void EventServer::Impl::Register(const std::shared_ptr<Connection>& c) {
  absl::MutexLock lock(&mu);
  live[c.get()] = c;
}

void EventServer::Impl::Release(Connection* c, const std::string& peer, bool over) {
  absl::MutexLock lock(&mu);
  live.erase(c);
  if (over) {
    --over_cap;
    return;
  }
  --total;
  auto it = per_client.find(peer);
  if (it != per_client.end() && --it->second <= 0) per_client.erase(it);
}

void EventServer::Impl::SetBusy(bool b) {
  absl::MutexLock lock(&mu);
  busy += b ? 1 : -1;
}

std::string EventServer::Impl::ErrorBody(int status, const std::string& message) const {
  if (options.error_body) return options.error_body(status, message);
  return nlohmann::json({{"error", {{"message", message}, {"code", status}}}}).dump();
}

template <typename F>
void EventServer::Impl::ForEachLive(F f) {
  std::vector<std::shared_ptr<Connection>> all;
  {
    absl::MutexLock lock(&mu);
    for (const auto& [raw, weak] : live) {
      if (auto c = weak.lock()) all.push_back(std::move(c));
    }
  }
  for (auto& c : all) c->Post(f);
}

EventServer::EventServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

absl::StatusOr<std::unique_ptr<EventServer>> EventServer::Start(EventServerOptions options,
                                                                HttpHandler handler) {
  const size_t colon = options.address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || !absl::SimpleAtoi(options.address.substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", options.address, "' is not host:port"));
  }
  std::string host = options.address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  auto impl = std::make_unique<Impl>(std::move(options), std::move(handler));
  beast::error_code ec;
  tcp::resolver resolver(impl->ioc);
  const auto resolved = resolver.resolve(host.empty() ? "0.0.0.0" : host, std::to_string(port),
                                         tcp::resolver::passive, ec);
  if (ec || resolved.empty()) {
    return absl::UnavailableError(absl::StrCat("cannot resolve '", host, "': ", ec.message()));
  }
  const tcp::endpoint endpoint = resolved.begin()->endpoint();
  impl->acceptor.open(endpoint.protocol(), ec);
  if (!ec) impl->acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) impl->acceptor.bind(endpoint, ec);
  if (!ec) impl->acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", impl->options.address, ": ", ec.message()));
  }
  const tcp::endpoint bound = impl->acceptor.local_endpoint();
  impl->address = endpoint.address().is_v6()
                      ? absl::StrCat("[", bound.address().to_string(), "]:", bound.port())
                      : absl::StrCat(bound.address().to_string(), ":", bound.port());
  Impl* raw = impl.get();
  net::post(raw->accept_strand, [raw] { raw->Accept(); });
  for (int i = 0; i < std::max(1, raw->options.io_threads); ++i) {
    raw->threads.emplace_back([raw] { raw->ioc.run(); });
  }
  return std::unique_ptr<EventServer>(new EventServer(std::move(impl)));
}

const std::string& EventServer::address() const { return impl_->address; }

void EventServer::Stop(absl::Duration grace) {
  Impl* s = impl_.get();
  if (!s->stopping.exchange(true)) {
    std::promise<void> closed;
    net::post(s->accept_strand, [s, &closed] {
      beast::error_code ignored;
      s->acceptor.close(ignored);
      closed.set_value();
    });
    closed.get_future().wait();
  }
  s->ForEachLive([](Connection& c) { c.CloseIfIdle(); });
  const absl::Time until = absl::Now() + grace;
  for (;;) {
    {
      absl::MutexLock lock(&s->mu);
      if (s->busy == 0 || absl::Now() >= until) break;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  s->ForEachLive([](Connection& c) { c.Close(); });
}

EventServer::Stats EventServer::stats() const {
  Stats st;
  absl::MutexLock lock(&impl_->mu);
  st.connections = impl_->total;
  st.over_cap = impl_->over_cap;
  st.busy = impl_->busy;
  st.refused = impl_->refused;
  st.timed_out = impl_->timed_out;
  return st;
}

EventServer::~EventServer() {
  Stop(absl::ZeroDuration());
  // Queued handlers hold exchanges (and so connections): run none of them.
  impl_->handlers.stop();
  impl_->handlers.join();
  // Connections go once their last handler on the loop has run and every exchange a caller
  // held is released; the loop runs until then, since a socket must not outlive it.
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (impl_->objects > 0 && absl::Now() < until) {
    impl_->ForEachLive([](Connection& c) { c.Close(); });
    absl::SleepFor(absl::Milliseconds(5));
  }
  impl_->work.reset();
  impl_->ioc.stop();
  for (std::thread& t : impl_->threads) t.join();
  if (impl_->objects > 0) {
    // An exchange still held elsewhere would point into a destroyed loop: keep the loop.
    log::Error("EventServer: {} exchanges still held at shutdown; leaking the loop",
               impl_->objects.load());
    (void)impl_.release();
  }
}

}  // namespace preft::http
