// The event-driven HTTP server over real sockets: keep-alive, streams written from other
// threads, a client leaving mid-stream, and the defences (header deadline against slow
// clients, caps that still let /health through, 413 before the body, malformed requests).

#include "common/http/event_server.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace preft::http {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// A raw client socket: what a hostile or slow client can do, byte for byte.
class RawClient {
 public:
  explicit RawClient(const std::string& address) {
    const size_t colon = address.rfind(':');
    int port = 0;
    EXPECT_TRUE(absl::SimpleAtoi(address.substr(colon + 1), &port));
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  }
  ~RawClient() { Close(); }
  void Close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  bool connected() const { return connected_; }

  bool Send(const std::string& s) {
    return ::send(fd_, s.data(), s.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(s.size());
  }
  // Reads until `until` is in what was read, the peer closes, or `timeout` passes.
  std::string Read(absl::Duration timeout, const std::string& until = "") {
    const absl::Time end = absl::Now() + timeout;
    while (absl::Now() < end) {
      if (!until.empty() && got_.find(until) != std::string::npos) break;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 20) <= 0) continue;
      char buf[65536];
      const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
      if (n <= 0) {
        closed_by_peer_ = true;
        break;
      }
      got_.append(buf, static_cast<size_t>(n));
    }
    return got_;
  }
  bool closed_by_peer() const { return closed_by_peer_; }
  void Clear() { got_.clear(); }

 private:
  int fd_ = -1;
  bool connected_ = false;
  bool closed_by_peer_ = false;
  std::string got_;
};

// Polls `done` for up to 5 s (a busy machine may take a while to run the server's callbacks).
template <typename F>
void WaitFor(F done) {
  const absl::Time until = absl::Now() + absl::Seconds(5);
  while (!done() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(10));
}

std::string Get(const std::string& path, bool keep_alive = true) {
  return absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: x\r\n",
                      keep_alive ? "" : "Connection: close\r\n", "\r\n");
}

// Answers /health and /echo (the body and method back), and streams on /stream from a thread
// of its own; counts clients that left.
class EventServerTest : public ::testing::Test {
 protected:
  void StartServer(EventServerOptions o = {}) {
    o.address = "127.0.0.1:0";
    auto s = EventServer::Start(o, [this](std::shared_ptr<HttpExchange> ex) { Handle(ex); });
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
  }
  void TearDown() override {
    {
      absl::MutexLock lock(&mu_);
      for (std::thread& t : threads_) t.join();
    }
    server_.reset();
  }

  void Handle(const std::shared_ptr<HttpExchange>& ex) {
    const HttpRequest& r = ex->request();
    if (r.path == "/health") return ex->Reply(200, "application/json", "{}");
    if (r.path == "/echo") {
      return ex->Reply(200, "text/plain", absl::StrCat(r.method, " ", r.target, " ", r.body, " ",
                                                       r.Header("x-test")));
    }
    if (r.path == "/stream") {
      auto left = std::make_shared<std::atomic<bool>>(false);
      ex->OnClientGone([this, left] {
        ++gone_;
        *left = true;
      });
      const int pieces = r.body.empty() ? 3 : std::stoi(r.body);
      absl::MutexLock lock(&mu_);
      threads_.emplace_back([ex, pieces, left] {
        ex->StartStream(200, "text/event-stream");
        for (int i = 0; i < pieces && !*left; ++i) {
          ex->Write(absl::StrCat("data: ", i, "\n\n"));
          absl::SleepFor(absl::Milliseconds(20));
        }
        ex->End();
      });
      return;
    }
    ex->Reply(404, "text/plain", "no");
  }

  std::unique_ptr<EventServer> server_;
  absl::Mutex mu_;
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
  std::atomic<int> gone_{0};
};

TEST_F(EventServerTest, ServesRequestsOnAKeptAliveConnection) {
  StartServer();
  RawClient c(server_->address());
  ASSERT_TRUE(c.connected());
  ASSERT_TRUE(c.Send("POST /echo?x=1 HTTP/1.1\r\nHost: x\r\nX-Test: yes\r\nContent-Length: 5\r\n\r\nhello"));
  std::string r = c.Read(absl::Seconds(5), "yes");
  EXPECT_THAT(r, StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(r, HasSubstr("Connection: keep-alive"));
  EXPECT_THAT(r, HasSubstr("\r\n\r\nPOST /echo?x=1 hello yes"));
  c.Clear();
  ASSERT_TRUE(c.Send(Get("/health", /*keep_alive=*/false)));
  r = c.Read(absl::Seconds(5));
  EXPECT_THAT(r, StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(r, HasSubstr("Connection: close"));
  EXPECT_TRUE(c.closed_by_peer());
}

TEST_F(EventServerTest, StreamsChunksWrittenFromAnotherThread) {
  StartServer();
  RawClient c(server_->address());
  ASSERT_TRUE(c.Send("POST /stream HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n3"));
  const std::string r = c.Read(absl::Seconds(5), "0\r\n\r\n");
  EXPECT_THAT(r, HasSubstr("Transfer-Encoding: chunked"));
  EXPECT_THAT(r, HasSubstr("9\r\ndata: 0\n\n\r\n9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n"));
  EXPECT_EQ(gone_, 0);
}

TEST_F(EventServerTest, AClientLeavingMidStreamIsNoticed) {
  StartServer();
  {
    RawClient c(server_->address());
    ASSERT_TRUE(c.Send("POST /stream HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n200"));
    c.Read(absl::Seconds(5), "data: 1");
  }
  const absl::Time until = absl::Now() + absl::Seconds(5);
  while (gone_ == 0 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(gone_, 1);
}

// 200 clients sending a header line every 200 ms hold no thread: /health is answered at once
// while they trickle, and the header deadline closes every one of them.
TEST_F(EventServerTest, SlowClientsCannotHoldTheDoor) {
  EventServerOptions o;
  o.header_timeout = absl::Seconds(3);
  StartServer(o);
  std::vector<std::unique_ptr<RawClient>> slow;
  for (int i = 0; i < 200; ++i) {
    slow.push_back(std::make_unique<RawClient>(server_->address()));
    ASSERT_TRUE(slow.back()->Send("GET /echo HTTP/1.1\r\n"));
  }
  const absl::Time start = absl::Now();
  int answered = 0;
  int asked = 0;
  while (absl::Now() - start < absl::Milliseconds(2000)) {
    ++asked;
    for (auto& s : slow) s->Send("X-Slow: 1\r\n");
    RawClient probe(server_->address());
    probe.Send(Get("/health", false));
    const absl::Time asked = absl::Now();
    if (absl::StrContains(probe.Read(absl::Seconds(1)), "200 OK") &&
        absl::Now() - asked < absl::Milliseconds(500)) {
      ++answered;
    }
    absl::SleepFor(absl::Milliseconds(200));
  }
  // Every probe, or all but one on a machine busy with other tests.
  EXPECT_GE(answered, asked - 1) << answered << " of " << asked << " probes answered in 0.5 s";
  EXPECT_GE(asked, 5);
  int closed = 0;
  for (auto& s : slow) {
    s->Read(absl::Seconds(5));
    closed += s->closed_by_peer();
  }
  EXPECT_EQ(closed, 200);
  EXPECT_GE(server_->stats().timed_out, 200);
  // The client sees the close a moment before the server counts it.
  WaitFor([&] { return server_->stats().connections == 0; });
  EXPECT_EQ(server_->stats().connections, 0);
}

// Past the per-client cap a connection may still ask for /health; anything else is 503, and
// past max_over_cap new connections are closed at accept.
TEST_F(EventServerTest, CapsLetHealthThrough) {
  EventServerOptions o;
  o.max_connections_per_client = 4;
  o.max_over_cap = 2;
  StartServer(o);
  std::vector<std::unique_ptr<RawClient>> held;
  for (int i = 0; i < 4; ++i) held.push_back(std::make_unique<RawClient>(server_->address()));
  WaitFor([&] { return server_->stats().connections == 4; });
  EXPECT_EQ(server_->stats().connections, 4);
  RawClient health(server_->address());
  health.Send(Get("/health", false));
  EXPECT_THAT(health.Read(absl::Seconds(3)), StartsWith("HTTP/1.1 200 OK"));
  RawClient other(server_->address());
  other.Send(Get("/echo", false));
  const std::string refused = other.Read(absl::Seconds(3));
  EXPECT_THAT(refused, StartsWith("HTTP/1.1 503"));
  EXPECT_THAT(refused, HasSubstr("Retry-After: 1"));
  EXPECT_THAT(refused, HasSubstr("too many connections"));
  // Two idle over-cap connections fill the overflow; a third is closed at once.
  RawClient o1(server_->address()), o2(server_->address());
  WaitFor([&] { return server_->stats().over_cap == 2; });
  RawClient o3(server_->address());
  o3.Read(absl::Seconds(1));
  EXPECT_TRUE(o3.closed_by_peer());
  EXPECT_GE(server_->stats().refused, 1);
  // Freed slots are taken again.
  held.clear();
  WaitFor([&] { return server_->stats().connections == 0; });
  RawClient again(server_->address());
  again.Send(Get("/echo", false));
  EXPECT_THAT(again.Read(absl::Seconds(3)), StartsWith("HTTP/1.1 200 OK"));
}

TEST_F(EventServerTest, BadRequestsAreAnsweredNotHeld) {
  EventServerOptions o;
  o.max_body_bytes = 1000;
  o.max_header_bytes = 4096;
  StartServer(o);
  {  // Refused from Content-Length, before any of the body is sent.
    RawClient c(server_->address());
    c.Send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 18000000\r\n\r\n");
    const std::string r = c.Read(absl::Seconds(3), "}");
    EXPECT_THAT(r, StartsWith("HTTP/1.1 413"));
    EXPECT_THAT(r, HasSubstr("over the size limit (1000 bytes)"));
  }
  {  // A chunked body that grows past the limit.
    RawClient c(server_->address());
    c.Send("POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n7d0\r\n" +
           std::string(2000, 'a') + "\r\n");
    EXPECT_THAT(c.Read(absl::Seconds(3), "}"), StartsWith("HTTP/1.1 413"));
  }
  {
    RawClient c(server_->address());
    c.Send("GET /echo HTTP/1.1\r\nX-Big: " + std::string(8000, 'a') + "\r\n\r\n");
    EXPECT_THAT(c.Read(absl::Seconds(3), "}"), StartsWith("HTTP/1.1 431"));
  }
  {
    RawClient c(server_->address());
    c.Send("GARBAGE\r\n\r\n");
    EXPECT_THAT(c.Read(absl::Seconds(3), "}"), StartsWith("HTTP/1.1 400"));
  }
  {  // curl's Expect: 100-continue gets its go-ahead, then the answer.
    RawClient c(server_->address());
    c.Send("POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n");
    EXPECT_THAT(c.Read(absl::Seconds(3), "\r\n\r\n"), StartsWith("HTTP/1.1 100 Continue\r\n\r\n"));
    c.Send("abc");
    EXPECT_THAT(c.Read(absl::Seconds(3), "abc "), HasSubstr("200 OK"));
  }
}

TEST_F(EventServerTest, StopLetsStreamsInProgressFinish) {
  StartServer();
  RawClient c(server_->address());
  ASSERT_TRUE(c.Send("POST /stream HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n10"));
  c.Read(absl::Seconds(5), "data: 0");
  RawClient idle(server_->address());
  absl::SleepFor(absl::Milliseconds(50));
  server_->Stop(absl::Seconds(5));
  EXPECT_THAT(c.Read(absl::Seconds(5), "0\r\n\r\n"), HasSubstr("data: 9\n\n\r\n0\r\n\r\n"));
  idle.Read(absl::Seconds(2));
  EXPECT_TRUE(idle.closed_by_peer());
  EXPECT_EQ(gone_, 0);
  RawClient late(server_->address());
  EXPECT_FALSE(late.connected());
}

}  // namespace
}  // namespace preft::http
