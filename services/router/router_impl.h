#pragma once

// State shared by the router's calls (internal to services/router).

#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>

#include "services/router/router_metrics.h"
#include "services/router/router_service.h"

namespace preft::router {

class GenerateCall;

struct RouterService::Impl {
  model::ModelConfig config;
  const model::Tokenizer* tokenizer;
  WorkerPool* pool;
  AdapterRegistry* registry;
  RouterOptions options;
  std::shared_ptr<prometheus::Registry> own_registry;  // when options.metrics is null
  std::unique_ptr<RouterMetrics> metrics;
  std::unique_ptr<Access> access;

  std::mutex mu;
  std::condition_variable idle;  // threads == 0
  int64_t threads = 0;           // driver threads of calls in flight
  bool draining = false;
  std::map<std::string, GenerateCall*> active;  // by request id
  uint64_t next_id = 0;
  std::mt19937_64 rng{std::random_device{}()};

  // Runs `fn` on its own thread, counted so the destructor can wait for it.
  void Spawn(std::function<void()> fn);
};

}  // namespace preft::router
