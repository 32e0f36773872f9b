#include "services/router/worker_pool.h"

#include <netdb.h>
#include <sys/socket.h>

#include <arpa/inet.h>
#include <map>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace preft::router {

absl::StatusOr<std::vector<std::string>> ResolveSpec(const std::string& spec) {
  const bool dns = spec.rfind("dns:", 0) == 0;
  const std::string rest = dns ? spec.substr(4) : spec;  // NAME:PORT or host:port
  const size_t colon = rest.rfind(':');
  int port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(rest.substr(colon + 1), &port) || port <= 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "worker '", spec, dns ? "' is not dns:NAME:PORT" : "' is not host:port or dns:NAME:PORT"));
  }
  if (!dns) return std::vector<std::string>{spec};
  const std::string name = rest.substr(0, colon);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(name.c_str(), nullptr, &hints, &res);
  if (rc != 0) {
    return absl::UnavailableError(absl::StrCat("cannot resolve '", name, "': ", gai_strerror(rc)));
  }
  std::set<std::string> out;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    char buf[INET6_ADDRSTRLEN] = {};
    if (a->ai_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr, buf, sizeof buf);
      out.insert(absl::StrCat(buf, ":", port));
    } else if (a->ai_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, buf, sizeof buf);
      out.insert(absl::StrCat("[", buf, "]:", port));
    }
  }
  freeaddrinfo(res);
  return std::vector<std::string>(out.begin(), out.end());
}

namespace {

std::shared_ptr<grpc::Channel> DefaultChannel(
    const std::string& address, const std::shared_ptr<grpc::ChannelCredentials>& credentials) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(16 << 20);
  // gRPC's reconnect backoff grows to 120 s: a worker restarted after a crash stayed unreachable
  // (its status polls failing fast on the channel) for ~45 s. Workers come back within seconds;
  // so does the router's view of them.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 250);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 250);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  // The router retries on other workers itself (routing.h); gRPC's transparent-retry state
  // costs every open call ~6 KiB (bench/NOTES.md step 27).
  args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
  return grpc::CreateCustomChannel(
      address, credentials != nullptr ? credentials : grpc::InsecureChannelCredentials(), args);
}

// Resolves every spec; a spec that fails to resolve keeps its previous addresses.
std::vector<std::string> ResolveAll(const std::vector<std::string>& specs,
                                    const std::vector<std::string>& previous) {
  std::set<std::string> out;
  for (const std::string& spec : specs) {
    auto r = ResolveSpec(spec);
    if (r.ok()) {
      out.insert(r->begin(), r->end());
    } else {
      for (const std::string& p : previous) out.insert(p);  // keep what we had
    }
  }
  return std::vector<std::string>(out.begin(), out.end());
}

}  // namespace

// Nice 10: a relay thread gets ~1/10 of a core that admission, first tokens or gRPC's own
// threads also want (CFS weights 110 vs 1024), so on a saturated router a new request no longer
// queues behind thousands of other streams' tokens.
constexpr int kRelayNice = 10;

WorkerPool::WorkerPool(WorkerPoolOptions options)
    : options_(std::move(options)),
      relay_(options_.relay_threads > 0
                 ? std::make_unique<base::ThreadPool>(options_.relay_threads, kRelayNice)
                 : nullptr) {
  Refresh();
  PollNow();
  thread_ = std::thread([this] { Run(); });
}

WorkerPool::~WorkerPool() {
  stop_.Notify();
  thread_.join();
  for (const auto& w : decode()) w->ShutdownStreams();
  relay_.reset();  // after the calls: a last read may still post relays
}

std::shared_ptr<DecodeStream> DecodeWorker::OpenStream(worker::v1::StreamOpen open) {
  // A second try when the call was found ending between the check and the open (a draining
  // worker's idle call closed, a broken connection noticed). A call marked to close when idle
  // (its worker drains) still takes Starts for reservations made before the drain.
  for (int attempt = 0; attempt < 2; ++attempt) {
    std::shared_ptr<DecodeStreams> call;
    {
      absl::MutexLock lock(&streams_mu);
      if (streams == nullptr || streams->ending()) {
        streams = DecodeStreams::Open(stub.get(), address, relay);
      }
      call = streams;
    }
    if (std::shared_ptr<DecodeStream> s = call->Start(&open)) return s;
  }
  return DecodeStream::Failed(absl::UnavailableError(
      absl::StrCat("decode worker ", address, ": no Streams call could be opened")));
}

void DecodeWorker::CloseStreamsWhenIdle() {
  absl::MutexLock lock(&streams_mu);
  if (streams != nullptr && streams->CloseWhenIdle()) streams = nullptr;
}

void DecodeWorker::ShutdownStreams() {
  std::shared_ptr<DecodeStreams> call;
  {
    absl::MutexLock lock(&streams_mu);
    call = std::move(streams);
  }
  if (call != nullptr) call->Shutdown();
}

DecodeWorker::~DecodeWorker() {
  // Normally ShutdownStreams has run. A worker dropped from membership may still have a call:
  // cancel it; it holds itself until gRPC is done with it.
  absl::MutexLock lock(&streams_mu);
  if (streams != nullptr) streams->Cancel();
}

std::vector<std::shared_ptr<DecodeWorker>> WorkerPool::decode() const {
  absl::MutexLock lock(&mu_);
  return decode_;
}

std::vector<std::shared_ptr<PrefillWorker>> WorkerPool::prefill() const {
  absl::MutexLock lock(&mu_);
  return prefill_;
}

void WorkerPool::MarkUnhealthy(DecodeWorker& w) {
  absl::MutexLock lock(&w.mu);
  w.view.healthy = false;
}

void WorkerPool::MarkUnhealthy(PrefillWorker& w) {
  absl::MutexLock lock(&w.mu);
  w.view.healthy = false;
}

void WorkerPool::Refresh() {
  auto channel = [&](const std::string& a) {
    return options_.make_channel ? options_.make_channel(a) : DefaultChannel(a, options_.credentials);
  };
  std::vector<std::string> old_decode, old_prefill;
  std::map<std::string, std::shared_ptr<DecodeWorker>> decode_by;
  std::map<std::string, std::shared_ptr<PrefillWorker>> prefill_by;
  {
    absl::MutexLock lock(&mu_);
    for (auto& w : decode_) {
      old_decode.push_back(w->address);
      decode_by[w->address] = w;
    }
    for (auto& w : prefill_) {
      old_prefill.push_back(w->address);
      prefill_by[w->address] = w;
    }
  }
  std::vector<std::shared_ptr<DecodeWorker>> decode;
  for (const std::string& a : ResolveAll(options_.decode, old_decode)) {
    auto it = decode_by.find(a);
    if (it != decode_by.end()) {
      decode.push_back(it->second);
      continue;
    }
    auto w = std::make_shared<DecodeWorker>();
    w->address = a;
    w->stub = worker::v1::DecodeWorker::NewStub(channel(a));
    w->relay = relay_.get();
    decode.push_back(std::move(w));
  }
  std::vector<std::shared_ptr<PrefillWorker>> prefill;
  for (const std::string& a : ResolveAll(options_.prefill, old_prefill)) {
    auto it = prefill_by.find(a);
    if (it != prefill_by.end()) {
      prefill.push_back(it->second);
      continue;
    }
    auto w = std::make_shared<PrefillWorker>();
    w->address = a;
    w->stub = worker::v1::PrefillWorker::NewStub(channel(a));
    prefill.push_back(std::move(w));
  }
  absl::MutexLock lock(&mu_);
  decode_ = std::move(decode);
  prefill_ = std::move(prefill);
  last_refresh_ = absl::Now();
}

void WorkerPool::OnPrefillRejoin(RejoinCallback fn) {
  absl::MutexLock lock(&rejoin_mu_);
  rejoin_ = std::move(fn);
}

void WorkerPool::PollNow() {
  for (const auto& w : decode()) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.poll_timeout));
    worker::v1::DecodeStatusResponse r;
    const grpc::Status s = w->stub->Status(&ctx, worker::v1::DecodeStatusRequest(), &r);
    if (s.ok() && r.draining()) w->CloseStreamsWhenIdle();
    absl::MutexLock lock(&w->mu);
    w->view.healthy = s.ok();
    if (!s.ok()) continue;
    w->view.draining = r.draining();
    w->view.free_blocks = r.free_blocks();
    w->view.total_blocks = r.total_blocks();
    w->view.block_tokens = r.block_tokens();
    w->view.running = r.running();
    w->view.queue_depth = r.queue_depth();
    w->view.max_running = r.max_running();
    w->view.adapters = r.all_position_adapters();
    w->view.colocated = r.colocated();
    w->status = std::move(r);
  }
  std::vector<std::shared_ptr<PrefillWorker>> rejoined;
  for (const auto& w : prefill()) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.poll_timeout));
    worker::v1::PrefillStatusResponse r;
    const grpc::Status s = w->stub->Status(&ctx, worker::v1::PrefillStatusRequest(), &r);
    absl::MutexLock lock(&w->mu);
    if (s.ok() && !w->view.healthy) rejoined.push_back(w);
    w->view.healthy = s.ok();
    if (!s.ok()) continue;
    w->view.draining = r.draining();
    w->view.queue_depth = r.queue_depth();
    w->view.running = r.running();
    w->view.adapter_bytes_free = r.adapter_bytes_free();
    w->status = std::move(r);
  }
  if (rejoined.empty()) return;
  absl::MutexLock lock(&rejoin_mu_);
  if (rejoin_) {
    for (const auto& w : rejoined) rejoin_(w);
  }
}

void WorkerPool::Run() {
  while (!stop_.WaitForNotificationWithTimeout(options_.poll_interval)) {
    if (absl::Now() - last_refresh_ >= options_.dns_refresh) Refresh();
    PollNow();
  }
}

}  // namespace preft::router
