#pragma once

// State shared by the router's calls (internal to services/router).

#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>

#include "common/base/thread_pool.h"
#include "services/router/prefix_affinity.h"
#include "services/router/router_metrics.h"
#include "services/router/router_service.h"

namespace preft::router {

class GenerateCall;

struct RouterService::Impl {
  model::ModelConfig config;
  const text::Tokenizer* tokenizer;
  WorkerPool* pool;
  AdapterRegistry* registry;
  RouterOptions options;
  std::shared_ptr<prometheus::Registry> own_registry;  // when options.metrics is null
  std::unique_ptr<RouterMetrics> metrics;
  std::unique_ptr<Access> access;
  // CPU work of calls (admission: tokenising, the registry): a few threads, however many calls.
  std::unique_ptr<base::ThreadPool> cpu;
  // Admin work that blocks on disk or on workers (RegisterAdapter reads the adapter, loads wait
  // for every worker, preloads onto a rejoining worker): a few threads of its own, so it never
  // holds up admission; more admin calls than threads queue.
  std::unique_ptr<base::ThreadPool> admin;
  // Which worker each prompt prefix went to last (prefix-affinity routing).
  PrefixAffinity prefix_affinity;

  std::mutex mu;
  std::condition_variable idle;  // threads == 0
  int64_t threads = 0;           // work in flight: Generate calls and admin work
  bool draining = false;
  std::map<std::string, GenerateCall*> active;  // by request id
  uint64_t next_id = 0;
  std::mt19937_64 rng{std::random_device{}()};

  // Runs `fn` on the admin pool, counted so the destructor can wait for it.
  void RunAdmin(std::function<void()> fn);
};

}  // namespace preft::router
