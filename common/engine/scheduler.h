#pragma once

// Continuous-batching scheduler as a pure function: given the sequences and free KV blocks,
// decide which tokens run in the next forward. Decode tokens go first (bounded latency);
// prompt chunks fill the rest of the token budget (chunked prefill); admission is FCFS by
// free KV blocks, passing over prompts whose adapters are not ready yet; when running
// sequences outgrow the cache the newest is preempted (recomputed later).

#include <cstdint>
#include <vector>

namespace preft::engine {

struct SchedulerConfig {
  int64_t max_batch_tokens = 512;  // tokens per forward
  int64_t max_running = 256;       // sequences holding KV at once
  int64_t block_tokens = 16;
};

struct SequenceView {
  int64_t num_tokens = 0;    // prompt + generated so far: all must end up in the cache
  int64_t num_computed = 0;  // tokens already in the cache
  int64_t num_blocks = 0;    // blocks held
  bool ready = true;         // waiting only: its adapter can be used now (not still copying)
};

struct ScheduleItem {
  bool running = true;  // index into running (true) or waiting (false)
  int64_t index = 0;
  int64_t num_new = 0;     // tokens to compute this step
  int64_t new_blocks = 0;  // blocks to allocate first
};

struct ScheduleDecision {
  std::vector<ScheduleItem> items;
  std::vector<int64_t> preempted;  // running indices to evict (free blocks, recompute later)
  std::vector<int64_t> rejected;   // waiting indices that can never fit in the cache
};

// `running` and `waiting` are each in arrival order. Pure: same inputs, same decision.
ScheduleDecision Schedule(const SchedulerConfig& config, const std::vector<SequenceView>& running,
                          const std::vector<SequenceView>& waiting, int64_t free_blocks,
                          int64_t total_blocks);

}  // namespace preft::engine
