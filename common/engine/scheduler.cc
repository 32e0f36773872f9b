#include "common/engine/scheduler.h"

#include <algorithm>

#include "common/kv/blocks.h"

namespace preft::engine {
namespace {

using kv::BlocksFor;

}  // namespace

ScheduleDecision Schedule(const SchedulerConfig& config, const std::vector<SequenceView>& running,
                          const std::vector<SequenceView>& waiting, int64_t free_blocks,
                          int64_t total_blocks) {
  ScheduleDecision d;
  int64_t budget = config.max_batch_tokens;
  const int64_t bt = config.block_tokens;

  // Running sequences, oldest first; the newest are preempted when blocks run out.
  int64_t last = static_cast<int64_t>(running.size());  // running[last..) are preempted
  std::vector<ScheduleItem> decode, prefill;
  for (int64_t i = 0; i < last && budget > 0; ++i) {
    const SequenceView& s = running[i];
    const int64_t remaining = s.num_tokens - s.num_computed;
    if (remaining <= 0) continue;
    const int64_t n = std::min(remaining, budget);
    const int64_t need = std::max<int64_t>(0, BlocksFor(s.num_computed + n, bt) - s.num_blocks);
    while (need > free_blocks && last > i + 1) {
      --last;  // evict the newest running sequence and reuse its blocks
      d.preempted.push_back(last);
      free_blocks += running[last].num_blocks;  // nothing was planned for it yet
    }
    if (need > free_blocks) {  // even alone it cannot grow: preempt itself
      d.preempted.push_back(i);
      free_blocks += s.num_blocks;
      continue;
    }
    free_blocks -= need;
    budget -= n;
    (remaining == 1 ? decode : prefill).push_back({true, i, n, need});
  }
  int64_t num_running = static_cast<int64_t>(running.size() - d.preempted.size());

  // Waiting sequences, FCFS: stop at the first that does not fit (no overtaking), but pass
  // over one whose adapter is still on its way (it costs the others nothing to wait for).
  for (int64_t j = 0; j < static_cast<int64_t>(waiting.size()); ++j) {
    const SequenceView& s = waiting[j];
    if (BlocksFor(s.num_tokens + 1, bt) > total_blocks) {  // prompt + first token
      d.rejected.push_back(j);
      continue;
    }
    if (budget <= 0 || num_running >= config.max_running) break;
    if (!s.ready) continue;
    const int64_t remaining = s.num_tokens - s.num_computed;
    const int64_t n = std::min(remaining, budget);
    const int64_t need = std::max<int64_t>(0, BlocksFor(s.num_computed + n, bt) - s.num_blocks);
    if (need > free_blocks) break;
    free_blocks -= need;
    budget -= n;
    ++num_running;
    prefill.push_back({false, j, n, need});
  }
  d.items = std::move(decode);
  d.items.insert(d.items.end(), prefill.begin(), prefill.end());
  return d;
}

}  // namespace preft::engine
