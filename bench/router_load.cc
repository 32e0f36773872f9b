// router_load: holds N concurrent streaming generations open against one server, on a few
// threads, and reports how many got tokens and how fast the first one came. Driven by
// bench/router_load.py; the Python grpc.aio client of router_streams.py could not open 5,000
// streams on two cores, this one spends a reactor (a few hundred bytes) per stream, no thread.
//
//   --api grpc    preft.v1.Preft/Generate (stream) on the router
//   --api http    POST /v1/completions with "stream": true on the router's OpenAI door, one
//                 HTTP/1.1 connection per stream (what SSE clients do)
//   --api direct  preft.worker.v1.DecodeWorker/Run on colocated decode workers, as the router
//                 sends it in --colocated mode: the workers' own TTFT, so the router's added
//                 TTFT is p50(grpc or http) - p50(direct) at the same N
//
// Once every stream has its first token (or --settle-s passes) it writes "router_load:
// settled ..." to stderr, keeps the streams open --hold-s more (the driver samples the router
// then; tokens/s is counted over that window), cancels them all and prints one JSON object.

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <cinttypes>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "proto/preft/v1/preft.grpc.pb.h"
#include "proto/preft/v1/worker.grpc.pb.h"

namespace preft::bench {
namespace {

using Clock = std::chrono::steady_clock;
namespace asio = boost::asio;
namespace http = boost::beast::http;
using asio::ip::tcp;

struct Flags {
  std::string api = "grpc";
  std::vector<std::string> targets;  // direct: several workers, streams spread round robin
  int streams = 100;
  int streams_per_connection = 100;  // gRPC only
  int prompt_tokens = 4;
  int max_tokens = 400;
  std::string model = "model";  // HTTP only: the router's base name
  double settle_s = 30;
  double hold_s = 2;
  int probes = 20;
  int max_connecting = 256;  // HTTP connects in flight: a burst of 5,000 overflows the backlog
  std::vector<std::string> channel_args;  // NAME=INT on every gRPC channel (memory experiments)
};

// This process's resident set, KiB: what the streams cost the client side (in direct mode,
// the same calls the router makes to its workers).
int64_t RssKib() {
  FILE* f = std::fopen("/proc/self/status", "r");
  char line[256];
  int64_t kib = -1;
  while (f != nullptr && std::fgets(line, sizeof line, f) != nullptr)
    if (std::sscanf(line, "VmRSS: %" SCNd64, &kib) == 1) break;
  if (f != nullptr) std::fclose(f);
  return kib;
}

std::vector<int32_t> Prompt(int i, int n) {
  std::vector<int32_t> p;  // distinct per stream, below the tiny vocabulary's special ids
  for (int k = 0; k < n; ++k) p.push_back(1 + (i * 7 + k * 13) % 250);
  return p;
}

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += static_cast<unsigned char>(c) < 0x20 ? ' ' : c;
  }
  return out;
}

// What every stream reports, from gRPC's or Asio's threads. A stream's own callbacks never run
// concurrently, so its TTFT slot has one writer; the main thread reads it once all have ended.
class Tally {
 public:
  struct Ends {
    int all = 0;
    int without_tokens = 0;  // failed before a token: the settle wait stops waiting for them
    int errors = 0;
    std::string first_error;
  };

  explicit Tally(int n) : ttft_ns_(n, -1) {}

  void FirstToken(int i, Clock::duration ttft) {
    ttft_ns_[i] = std::chrono::duration_cast<std::chrono::nanoseconds>(ttft).count();
    with_tokens_.fetch_add(1, std::memory_order_relaxed);
  }
  void Tokens(int64_t k) { tokens_.fetch_add(k, std::memory_order_relaxed); }
  // `error` empty: the stream finished, or we cancelled it.
  void Ended(bool got_tokens, const std::string& error) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error.empty() && ends_.errors++ == 0) ends_.first_error = error;
      if (!got_tokens) ++ends_.without_tokens;
      ++ends_.all;
    }
    cv_.notify_all();
  }
  void BeginCancel() { cancelling_.store(true); }
  bool cancelling() const { return cancelling_.load(); }
  int with_tokens() const { return with_tokens_.load(std::memory_order_relaxed); }
  int64_t tokens() const { return tokens_.load(std::memory_order_relaxed); }
  Ends ends() {
    std::lock_guard<std::mutex> lock(mu_);
    return ends_;
  }
  bool WaitAllEnded(int n, std::chrono::seconds limit) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, limit, [&] { return ends_.all >= n; });
  }

  // Over all N streams, one without a token counting as infinitely late: a percentile that
  // lands on such a stream is unknown (null), never an optimistic figure over the lucky ones.
  std::string PercentileMs(double q) const {
    std::vector<int64_t> v = ttft_ns_;
    for (int64_t& x : v) x = x < 0 ? INT64_MAX : x;
    std::sort(v.begin(), v.end());
    const int64_t x = v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))];
    if (x == INT64_MAX) return "null";
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.2f", x / 1e6);
    return buf;
  }

 private:
  std::vector<int64_t> ttft_ns_;  // -1 until the first token
  std::atomic<int> with_tokens_{0};
  std::atomic<int64_t> tokens_{0};
  std::atomic<bool> cancelling_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  Ends ends_;
};

// ---- gRPC: one callback reactor per stream, many streams per channel (HTTP/2 connection).

class GrpcStream final : public grpc::ClientReadReactor<v1::GenerateResponse> {
 public:
  using Bind = std::function<void(grpc::ClientContext*, GrpcStream*)>;
  // `bind` calls the stub's async method; it holds the request, which must outlive the call.
  GrpcStream(Bind bind, int index, Tally* tally)
      : bind_(std::move(bind)), index_(index), tally_(tally) {
    bind_(&ctx_, this);
    StartRead(&msg_);
    t0_ = Clock::now();
    StartCall();
  }
  void Cancel() { ctx_.TryCancel(); }
  void OnReadDone(bool ok) override {
    if (!ok) return;  // OnDone follows
    if (msg_.token_ids_size() > 0) {
      if (!got_first_) tally_->FirstToken(index_, Clock::now() - t0_);
      got_first_ = true;
      tally_->Tokens(msg_.token_ids_size());
    }
    StartRead(&msg_);
  }
  void OnDone(const grpc::Status& s) override {
    const bool ours = tally_->cancelling() && s.error_code() == grpc::StatusCode::CANCELLED;
    tally_->Ended(got_first_, s.ok() || ours
                                  ? ""
                                  : "stream " + std::to_string(index_) + ": code " +
                                        std::to_string(s.error_code()) + ", " + s.error_message());
  }

 private:
  const Bind bind_;
  grpc::ClientContext ctx_;
  const int index_;
  Tally* const tally_;
  v1::GenerateResponse msg_;
  Clock::time_point t0_;
  bool got_first_ = false;
};

// Channels, stubs and streams; destroyed in reverse, streams first.
struct GrpcLoad {
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::unique_ptr<v1::Preft::Stub>> routers;
  std::vector<std::unique_ptr<worker::v1::DecodeWorker::Stub>> workers;
  std::vector<std::unique_ptr<GrpcStream>> streams;
};

std::shared_ptr<grpc::Channel> Connect(const Flags& f, const std::string& target, int i) {
  grpc::ChannelArguments args;
  for (const std::string& kv : f.channel_args)
    args.SetInt(kv.substr(0, kv.find('=')), std::stoi(kv.substr(kv.find('=') + 1)));
  // Distinct args and a local pool: each channel its own TCP connection, as separate clients
  // would have, instead of gRPC sharing one subchannel among equal channels.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt("preft.router_load.channel", i);
  auto ch = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
  // Connected before the clock starts, so no stream's TTFT includes a TCP handshake.
  if (!ch->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10))) {
    std::fprintf(stderr, "router_load: cannot connect to %s within 10 s\n", target.c_str());
    std::exit(1);
  }
  return ch;
}

void ConnectGrpc(const Flags& f, GrpcLoad* load) {
  const int targets = static_cast<int>(f.targets.size());
  // A multiple of the targets, so stream i lands on target i % targets: evenly spread.
  const int wanted = (f.streams + f.streams_per_connection - 1) / f.streams_per_connection;
  for (int c = 0; c < targets * std::max(1, (wanted + targets - 1) / targets); ++c) {
    load->channels.push_back(Connect(f, f.targets[c % targets], c));
    if (f.api == "direct") {
      load->workers.push_back(worker::v1::DecodeWorker::NewStub(load->channels.back()));
    } else {
      load->routers.push_back(v1::Preft::NewStub(load->channels.back()));
    }
  }
}

// Request `seq` (prompt, seed, connection; probes follow the N streams), reporting as `slot`.
GrpcStream* StartGrpc(const Flags& f, GrpcLoad* load, int seq, int slot, Tally* tally) {
  v1::SamplingParams sampling;
  sampling.set_max_tokens(f.max_tokens);
  sampling.set_ignore_eos(true);
  sampling.set_seed(static_cast<uint64_t>(seq));  // the router always sets one; so do we
  const size_t c = seq % load->channels.size();
  GrpcStream::Bind bind;
  if (f.api == "direct") {
    worker::v1::RunRequest req;
    // Unique across runs too: a worker may still hold the last run's cancelled ids.
    req.set_request_id("router-load-" + std::to_string(getpid()) + "-" + std::to_string(seq));
    for (int32_t t : Prompt(seq, f.prompt_tokens)) req.add_prompt_ids(t);
    *req.mutable_sampling() = sampling;
    bind = [stub = load->workers[c].get(), req](grpc::ClientContext* ctx, GrpcStream* s) {
      stub->async()->Run(ctx, &req, s);
    };
  } else {
    v1::GenerateRequest req;
    req.set_stream(true);
    for (int32_t t : Prompt(seq, f.prompt_tokens)) req.mutable_token_ids()->add_ids(t);
    *req.mutable_sampling() = sampling;
    bind = [stub = load->routers[c].get(), req](grpc::ClientContext* ctx, GrpcStream* s) {
      stub->async()->Generate(ctx, &req, s);
    };
  }
  load->streams.push_back(std::make_unique<GrpcStream>(std::move(bind), slot, tally));
  return load->streams.back().get();
}

// ---- HTTP: one connection per stream; the SSE body is scanned, not parsed, for its events.

class HttpStream : public std::enable_shared_from_this<HttpStream> {
 public:
  // Every completion chunk names its finish_reason (null until the last); the usage chunk and
  // [DONE] do not. One event per router message, so events, not tokens, are counted (a
  // message carries one token, or a few when they arrive together).
  static constexpr std::string_view kEvent = "\"finish_reason\"";

  HttpStream(asio::io_context& io, int index, std::string request, Tally* tally)
      : socket_(asio::make_strand(io)),
        index_(index),
        request_(std::move(request)),
        tally_(tally) {}

  // `connected` runs once the connect completes either way, to start the next one. On the
  // stream's strand, so a Cancel cannot race it.
  void Start(const tcp::endpoint& ep, std::function<void()> connected) {
    asio::dispatch(socket_.get_executor(), [self = shared_from_this(), ep, connected] {
      self->t0_ = Clock::now();
      self->socket_.async_connect(ep, [self, connected](boost::system::error_code ec) {
        connected();
        if (ec) return self->End("connect: " + ec.message());
        asio::async_write(self->socket_, asio::buffer(self->request_),
                          [self](boost::system::error_code ec, size_t) {
                            if (ec) return self->End("write: " + ec.message());
                            self->Read();
                          });
      });
    });
  }
  // From any thread. Ends the stream on its strand (one never started has no handler left to
  // end it); its aborted handlers then find it ended.
  void Cancel() {
    asio::post(socket_.get_executor(), [self = shared_from_this()] { self->End(""); });
  }

 private:
  void Read() {
    socket_.async_read_some(asio::buffer(buf_),
                            [self = shared_from_this()](boost::system::error_code ec, size_t n) {
                              if (!ec) return self->OnData(std::string_view(self->buf_.data(), n));
                              if (self->tally_->cancelling()) return self->End("");
                              self->End(ec == asio::error::eof ? "connection closed before [DONE]"
                                                               : "read: " + ec.message());
                            });
  }
  void OnData(std::string_view data) {
    std::string scan = tail_;  // a marker may straddle two reads
    scan.append(data);
    if (!header_checked_) {
      if (scan.size() < 12) {
        tail_ = scan;
        return Read();
      }
      header_checked_ = true;
      if (scan.compare(0, 12, "HTTP/1.1 200") != 0) return End("answer: " + scan.substr(0, 300));
    }
    int64_t events = 0;
    for (size_t at = scan.find(kEvent); at != std::string::npos;
         at = scan.find(kEvent, at + kEvent.size()))
      ++events;
    if (events > 0) {
      if (!got_first_) tally_->FirstToken(index_, Clock::now() - t0_);
      got_first_ = true;
      tally_->Tokens(events);
    }
    // A call failing mid-stream is an error event, then [DONE].
    if (const size_t at = scan.find("{\"error\""); at != std::string::npos)
      return End("error event: " + scan.substr(at, 300));
    // The router keeps the connection alive after [DONE]: the stream ends here, not at EOF.
    if (scan.find("[DONE]") != std::string::npos) return End("");
    tail_ = scan.substr(scan.size() - std::min(scan.size(), kEvent.size() - 1));  // no recount
    Read();
  }
  void End(const std::string& error) {
    if (ended_) return;
    ended_ = true;
    boost::system::error_code ignored;
    socket_.close(ignored);
    tally_->Ended(got_first_,
                  error.empty() ? "" : "stream " + std::to_string(index_) + ": " + error);
  }

  tcp::socket socket_;
  const int index_;
  const std::string request_;
  Tally* const tally_;
  std::array<char, 4096> buf_;
  std::string tail_;
  Clock::time_point t0_;
  bool header_checked_ = false, got_first_ = false, ended_ = false;
};

std::string HttpRequest(const Flags& f, const std::string& host, int i) {
  std::string prompt;
  for (int32_t t : Prompt(i, f.prompt_tokens))
    prompt += (prompt.empty() ? "" : ",") + std::to_string(t);
  http::request<http::string_body> req{http::verb::post, "/v1/completions", 11};
  req.set(http::field::host, host);
  req.set(http::field::content_type, "application/json");
  req.body() = "{\"model\":\"" + JsonEscape(f.model) + "\",\"prompt\":[" + prompt +
               "],\"max_tokens\":" + std::to_string(f.max_tokens) +
               ",\"ignore_eos\":true,\"stream\":true,\"seed\":" + std::to_string(i) + "}";
  req.prepare_payload();
  std::ostringstream out;
  out << req;
  return out.str();
}

std::optional<tcp::endpoint> ParseEndpoint(const std::string& target) {
  const size_t colon = target.rfind(':');
  boost::system::error_code ec;
  const auto addr = asio::ip::make_address(target.substr(0, colon), ec);
  if (colon == std::string::npos || ec) return std::nullopt;
  try {
    return tcp::endpoint(addr, static_cast<unsigned short>(std::stoi(target.substr(colon + 1))));
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

int Run(const Flags& f) {
  Tally tally(f.streams);
  GrpcLoad grpc_load;
  asio::io_context io;
  auto work = asio::make_work_guard(io);
  std::thread io_thread;  // HTTP: one is plenty (gRPC runs reactors on its own small pool)
  std::vector<std::shared_ptr<HttpStream>> http_streams;
  std::atomic<size_t> next_http{0};
  // Starts the next HTTP stream; each connect that completes calls it again, so at most
  // --max-connecting are in flight.
  std::function<void()> launch_next = [&] {
    const size_t i = next_http.fetch_add(1);
    if (i < http_streams.size() && !tally.cancelling())
      http_streams[i]->Start(*ParseEndpoint(f.targets[0]), launch_next);
  };

  const int64_t rss_before_kib = RssKib();
  Clock::time_point start;
  if (f.api == "http") {
    for (int i = 0; i < f.streams; ++i)
      http_streams.push_back(
          std::make_shared<HttpStream>(io, i, HttpRequest(f, f.targets[0], i), &tally));
    io_thread = std::thread([&io] { io.run(); });  // 0.1 core at 5,000 streams
    start = Clock::now();
    for (int k = 0; k < std::min(f.max_connecting, f.streams); ++k) asio::post(io, launch_next);
  } else {
    ConnectGrpc(f, &grpc_load);
    start = Clock::now();
    for (int i = 0; i < f.streams; ++i) StartGrpc(f, &grpc_load, i, i, &tally);
  }

  const auto settle_limit = start + std::chrono::duration<double>(f.settle_s);
  while (tally.with_tokens() + tally.ends().without_tokens < f.streams &&
         Clock::now() < settle_limit)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const double settled_s = std::chrono::duration<double>(Clock::now() - start).count();
  const int with_tokens = tally.with_tokens();
  const int64_t rss_settled_kib = RssKib();
  std::fprintf(stderr, "router_load: settled %d/%d streams with tokens after %.2f s\n", with_tokens,
               f.streams, settled_s);
  std::fflush(stderr);

  const int64_t tokens_before = tally.tokens();
  const int ended_before = tally.ends().all;
  std::this_thread::sleep_for(std::chrono::duration<double>(f.hold_s));
  const int64_t tokens_in_hold = tally.tokens() - tokens_before;
  const int open_at_end = f.streams - tally.ends().all;

  // Steady-state TTFT: with the N streams open, --probes more, one at a time, each cancelled
  // at its first token. A burst's TTFT grows with N by construction (the last of N calls waits
  // for the N-1 before it); a probe's shows what N open streams cost a new request.
  Tally probes(std::max(1, f.probes));
  probes.BeginCancel();  // every probe ends by our cancel: CANCELLED is no error
  for (int p = 0; p < f.probes; ++p) {
    std::function<void()> cancel;
    if (f.api == "http") {
      auto s =
          std::make_shared<HttpStream>(io, p, HttpRequest(f, f.targets[0], f.streams + p), &probes);
      s->Start(*ParseEndpoint(f.targets[0]), [] {});
      cancel = [s] { s->Cancel(); };
    } else {
      GrpcStream* s = StartGrpc(f, &grpc_load, f.streams + p, p, &probes);
      cancel = [s] { s->Cancel(); };
    }
    const auto limit = Clock::now() + std::chrono::seconds(10);
    while (probes.with_tokens() <= p && probes.ends().all <= p && Clock::now() < limit)
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    cancel();
    probes.WaitAllEnded(p + 1, std::chrono::seconds(10));
  }

  tally.BeginCancel();
  for (auto& s : grpc_load.streams) s->Cancel();
  for (auto& s : http_streams) s->Cancel();
  if (!tally.WaitAllEnded(f.streams, std::chrono::seconds(30)) ||
      !probes.WaitAllEnded(f.probes, std::chrono::seconds(1))) {
    std::fprintf(stderr, "router_load: %d streams still open 30 s after cancelling\n",
                 f.streams - tally.ends().all);
    for (auto& s : grpc_load.streams) s.release();  // a reactor must outlive its call: leak
  }
  work.reset();
  io.stop();
  if (io_thread.joinable()) io_thread.join();

  const Tally::Ends ends = tally.ends(), probe_ends = probes.ends();
  std::printf(
      "{\"api\":\"%s\",\"n\":%d,\"streams_with_tokens\":%d,\"settled\":%s,\"settle_s\":%.2f,"
      "\"ttft_ms\":{\"p50\":%s,\"p99\":%s},\"tokens_per_s\":%.1f,\"token_unit\":\"%s\","
      "\"ended_before_sample\":%d,\"open_at_end_of_hold\":%d,\"connections\":%zu,"
      "\"client_rss_kib\":{\"before\":%" PRId64 ",\"settled\":%" PRId64
      ",\"per_stream\":%.1f},\"probe_ttft_ms\":{\"n\":%d,\"with_tokens\":%d,\"p50\":%s,"
      "\"p99\":%s},\"errors\":{\"count\":%d,\"first\":\"%s\"}}\n",
      f.api.c_str(), f.streams, with_tokens, with_tokens == f.streams ? "true" : "false", settled_s,
      tally.PercentileMs(0.5).c_str(), tally.PercentileMs(0.99).c_str(),
      f.hold_s > 0 ? tokens_in_hold / f.hold_s : 0.0, f.api == "http" ? "events" : "tokens",
      ended_before, open_at_end, f.api == "http" ? http_streams.size() : grpc_load.channels.size(),
      rss_before_kib, rss_settled_kib,
      static_cast<double>(rss_settled_kib - rss_before_kib) / f.streams, f.probes,
      probes.with_tokens(), f.probes > 0 ? probes.PercentileMs(0.5).c_str() : "null",
      f.probes > 0 ? probes.PercentileMs(0.99).c_str() : "null", ends.errors + probe_ends.errors,
      JsonEscape(ends.errors > 0 ? ends.first_error : probe_ends.first_error).c_str());
  return ends.errors + probe_ends.errors > 0 ? 1 : 0;
}

}  // namespace
}  // namespace preft::bench

int main(int argc, char** argv) {
  using preft::bench::Flags;
  Flags f;
  CLI::App app{
      "router_load: N concurrent streaming generations against a preft router (gRPC or "
      "HTTP) or straight to colocated decode workers; prints one JSON object"};
  app.option_defaults()->always_capture_default();
  app.add_option("--api", f.api,
                 "grpc (router Generate), http (router /v1/completions, SSE) or direct "
                 "(DecodeWorker.Run on colocated workers)")
      ->check(CLI::IsMember({"grpc", "http", "direct"}));
  app.add_option("--target", f.targets,
                 "host:port to load: the router's gRPC or HTTP address, or for direct the "
                 "decode workers (repeatable or comma-separated; streams spread round robin)")
      ->required()
      ->delimiter(',');
  app.add_option("--streams", f.streams, "concurrent streams")->check(CLI::Range(1, 100000));
  app.add_option("--streams-per-connection", f.streams_per_connection,
                 "gRPC streams multiplexed per channel (HTTP always opens one connection each)")
      ->check(CLI::PositiveNumber);
  app.add_option("--prompt-tokens", f.prompt_tokens, "prompt length in tokens")
      ->check(CLI::Range(1, 1000));
  app.add_option("--max-tokens", f.max_tokens, "tokens each stream generates (ignore_eos)")
      ->check(CLI::PositiveNumber);
  app.add_option("--model", f.model, "model name in the HTTP body (the router's base name)");
  app.add_option("--settle-s", f.settle_s, "stop waiting for every stream's first token after")
      ->check(CLI::PositiveNumber);
  app.add_option("--hold-s", f.hold_s, "keep the streams open this long after settling")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--probes", f.probes,
                 "after the hold, this many more requests one at a time (each cancelled at its "
                 "first token): the TTFT of a new request while N streams are open")
      ->check(CLI::Range(0, 10000));
  app.add_option("--max-connecting", f.max_connecting, "HTTP connects in flight at once")
      ->check(CLI::PositiveNumber);
  app.add_option("--channel-arg", f.channel_args,
                 "NAME=INT on every gRPC channel (repeatable), e.g. grpc.minimal_stack=1: what "
                 "it saves a stream shows in client_rss_kib")
      ->check([](const std::string& kv) {
        return std::regex_match(kv, std::regex("[A-Za-z0-9_.]+=-?[0-9]{1,9}"))
                   ? std::string()
                   : "want NAME=INT (an integer channel argument), got '" + kv + "'";
      });
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (f.api == "http" &&
      (f.targets.size() != 1 || !preft::bench::ParseEndpoint(f.targets[0]).has_value())) {
    std::fprintf(stderr,
                 "router_load: --api http takes one --target IP:PORT, the router's HTTP address "
                 "(e.g. 127.0.0.1:8080); got '%s'\n",
                 f.targets.empty() ? "" : f.targets[0].c_str());
    return 2;
  }
  return preft::bench::Run(f);
}
