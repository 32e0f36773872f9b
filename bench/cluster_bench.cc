// What disaggregation costs: the same workload on one in-process engine, on the embedded
// cluster (router + prefill + decode over loopback gRPC, in-process KV transport) and on the
// multi-process cluster (scripts/local-cluster.sh: 2 prefill + 2 decode + router, UCX).
// Prints time to first token at low load (one request at a time) and aggregate throughput at
// `--concurrency`, each cluster as a ratio / difference against the engine measured in the same
// run. On a 2-core machine the cluster's workers share the cores the engine had to itself, so
// the ratio includes that contention, not only RPC and transfer costs.

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <thread>

#include "CLI/CLI.hpp"
#include "bench/bench_util.h"
#include "common/engine/engine_loop.h"
#include "proto/preft/v1/preft.grpc.pb.h"
#include "tools/preft/embedded_cluster.h"

namespace preft::bench {
namespace {

struct Workload {
  int requests = 64;
  int concurrency = 16;
  int prompt = 128;
  int max_tokens = 64;
  int ttft_samples = 10;
};

std::vector<int32_t> Prompt(int i, int n, int64_t vocab) {
  std::vector<int32_t> p;
  for (int k = 0; k < n; ++k) p.push_back(static_cast<int32_t>((k * 131 + i * 17) % (vocab - 2)));
  return p;
}

struct Result {
  double ttft_ms = 0;  // median
  double tok_per_s = 0;
};

Result RunEngine(const std::string& model_dir, const Workload& w) {
  auto m = model::Model::Load(model_dir);
  if (!m.ok()) {
    std::fprintf(stderr, "%s\n", m.status().ToString().c_str());
    std::exit(1);
  }
  engine::EngineOptions o;
  o.kv_bytes = int64_t{1} << 30;
  auto e = engine::Engine::Create(m->get(), nullptr, o);
  engine::EngineLoop loop(std::move(e).value());
  const int64_t vocab = (*m)->config().vocab_size;
  auto run = [&](int first, int count, int concurrency, std::vector<double>* ttft) {
    std::mutex mu;
    std::condition_variable cv;
    int in_flight = 0, done = 0;
    for (int i = first; i < first + count; ++i) {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return in_flight < concurrency; });
      ++in_flight;
      lock.unlock();
      engine::Request r;
      r.id = std::to_string(i);
      r.prompt_ids = Prompt(i, w.prompt, vocab);
      r.sampling.max_tokens = w.max_tokens;
      r.sampling.ignore_eos = true;
      const auto start = Clock::now();
      auto first_seen = std::make_shared<bool>(false);
      r.on_token = [&, start, first_seen](const engine::TokenEvent& ev) {
        std::lock_guard<std::mutex> l(mu);
        if (!*first_seen && ttft) ttft->push_back(Seconds(start, Clock::now()) * 1e3);
        *first_seen = true;
        if (ev.finish != engine::FinishReason::kNone) {
          --in_flight;
          ++done;
          cv.notify_all();
        }
      };
      loop.Post([r = std::move(r)](engine::Engine& eng) mutable { (void)eng.Add(std::move(r)); });
    }
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done == count; });
  };
  Result res;
  std::vector<double> ttft;
  run(0, w.ttft_samples, 1, &ttft);
  res.ttft_ms = Median(ttft);
  const auto t0 = Clock::now();
  run(1000, w.requests, w.concurrency, nullptr);
  res.tok_per_s = static_cast<double>(w.requests) * w.max_tokens / Seconds(t0, Clock::now());
  return res;
}

Result RunCluster(const std::string& address, int64_t vocab, const Workload& w) {
  auto stub = v1::Preft::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  auto one = [&](int i, double* ttft_ms) {
    v1::GenerateRequest req;
    for (int32_t t : Prompt(i, w.prompt, vocab)) req.mutable_token_ids()->add_ids(t);
    req.set_stream(true);
    req.mutable_sampling()->set_max_tokens(w.max_tokens);
    req.mutable_sampling()->set_ignore_eos(true);
    grpc::ClientContext ctx;
    const auto start = Clock::now();
    auto reader = stub->Generate(&ctx, req);
    v1::GenerateResponse msg;
    bool first = true;
    while (reader->Read(&msg)) {
      if (first && ttft_ms) *ttft_ms = Seconds(start, Clock::now()) * 1e3;
      first = false;
    }
    const grpc::Status s = reader->Finish();
    if (!s.ok()) std::fprintf(stderr, "request %d: %s\n", i, s.error_message().c_str());
  };
  Result res;
  std::vector<double> ttft;
  for (int i = 0; i < w.ttft_samples; ++i) {
    double t = 0;
    one(i, &t);
    ttft.push_back(t);
  }
  res.ttft_ms = Median(ttft);
  std::atomic<int> next{0};
  const auto t0 = Clock::now();
  std::vector<std::thread> threads;
  for (int c = 0; c < w.concurrency; ++c) {
    threads.emplace_back([&] {
      for (int i; (i = next++) < w.requests;) one(1000 + i, nullptr);
    });
  }
  for (auto& t : threads) t.join();
  res.tok_per_s = static_cast<double>(w.requests) * w.max_tokens / Seconds(t0, Clock::now());
  return res;
}

void Report(const char* name, const Result& r, const Result& engine) {
  std::printf("%-26s TTFT %8.2f ms (+%7.2f ms vs engine)   %9.1f tok/s (%.2fx engine)\n", name,
              r.ttft_ms, r.ttft_ms - engine.ttft_ms, r.tok_per_s, r.tok_per_s / engine.tok_per_s);
}

}  // namespace
}  // namespace preft::bench

int main(int argc, char** argv) {
  using namespace preft;
  CLI::App app{"cluster_bench: the cost of disaggregation, against one engine in the same run"};
  std::string model = "models/demo-tiny", build = "build";
  bench::Workload w;
  bool multiprocess = true;
  app.add_option("--model", model);
  app.add_option("--build-dir", build, "where the service binaries are (multi-process run)");
  app.add_option("--requests", w.requests);
  app.add_option("--concurrency", w.concurrency);
  app.add_option("--prompt", w.prompt);
  app.add_option("--max-tokens", w.max_tokens);
  app.add_flag("!--no-multiprocess", multiprocess, "skip the multi-process cluster");
  CLI11_PARSE(app, argc, argv);

  auto config = model::ModelConfig::FromFile(model + "/config.json");
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", config.status().ToString().c_str());
    return 1;
  }
  std::printf("model %s: %d requests, %d concurrent, prompt %d, %d new tokens\n", model.c_str(),
              w.requests, w.concurrency, w.prompt, w.max_tokens);
  const bench::Result engine = bench::RunEngine(model, w);
  std::printf("%-26s TTFT %8.2f ms                      %9.1f tok/s\n", "engine (one process)",
              engine.ttft_ms, engine.tok_per_s);
  {
    tools::EmbeddedClusterOptions o;
    o.model_dir = model;
    o.prefill_kv_bytes = int64_t{256} << 20;
    o.decode_kv_bytes = int64_t{1} << 30;
    auto c = tools::EmbeddedCluster::Start(o);
    if (!c.ok()) {
      std::fprintf(stderr, "%s\n", c.status().ToString().c_str());
      return 1;
    }
    bench::Report("embedded cluster (inproc)", bench::RunCluster((*c)->address(), config->vocab_size, w), engine);
  }
  if (multiprocess) {
    const std::string run = "/tmp/preft-cluster-bench";
    const std::string start = "RUN_DIR=" + run + " scripts/local-cluster.sh start " + build + " " + model + " > /dev/null";
    if (std::system(start.c_str()) != 0) return 1;
    std::ifstream in(run + "/router.addr");
    std::string address;
    in >> address;
    bench::Report("multi-process (UCX shm)", bench::RunCluster(address, config->vocab_size, w), engine);
    std::system(("RUN_DIR=" + run + " scripts/local-cluster.sh stop").c_str());
  }
  return 0;
}
