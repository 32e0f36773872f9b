// The adapter store feeding the engine, as a prefill worker will: requests across 2,000
// adapters under small budgets, acquired asynchronously (loads on the store's threads while
// the engine keeps stepping), each request holding its pin until it finishes. Outputs must
// equal the same request run alone with a directly loaded adapter; nothing may leak.

#include <gtest/gtest.h>

#include <deque>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "common/adapters/adapter_loader.h"
#include "common/adapters/adapter_store.h"
#include "common/adapters/make_adapter.h"
#include "common/engine/engine.h"
#include "common/model/make_model.h"
#include "common/model/model.h"

namespace preft {
namespace {

namespace fs = std::filesystem;

constexpr int kAdapters = 2000;
constexpr int kRequests = 240;

struct Served {
  std::vector<int32_t> tokens;
  engine::FinishReason finish = engine::FinishReason::kNone;
  int64_t version = 0;
};

TEST(AdapterServingTest, TwoThousandAdaptersUnderSmallBudgetsServeExactOutputs) {
  const std::string dir = ::testing::TempDir() + "/preft_adapter_serving";
  fs::remove_all(dir);
  model::MakeModelOptions mo;
  mo.preset = "tiny";
  mo.seed = 5;
  mo.out_dir = dir + "/model";
  ASSERT_TRUE(model::MakeModel(mo).ok());
  auto m = model::Model::Load(mo.out_dir);
  ASSERT_TRUE(m.ok()) << m.status();
  const model::ModelConfig& c = (*m)->config();

  // 2,000 small adapters: LoRA ranks 1-4 on two projections, DiReFT ranks 1-2.
  std::vector<std::string> dirs;
  for (int i = 0; i < kAdapters; ++i) {
    adapters::RandomAdapterSpec spec;
    spec.seed = i;
    spec.rank = 1 + i % 4;
    if (i % 3 == 2) {
      spec.kind = model::AdapterKind::kDireft;
      spec.rank = 1 + i % 2;
    } else {
      spec.targets = {model::Projection::kQ, model::Projection::kDown};
    }
    dirs.push_back(dir + "/a" + std::to_string(i));
    ASSERT_TRUE(adapters::WriteRandomAdapter(c, spec, dirs.back()).ok()) << i;
  }
  auto one = adapters::LoadAdapter(dirs[0], c);
  ASSERT_TRUE(one.ok());
  const int64_t unit = static_cast<int64_t>((*one)->bytes());  // a rank-1 LoRA

  adapters::AdapterStoreOptions so;
  so.compute_bytes = 24 * unit;  // a handful of adapters pinned at once
  so.host_bytes = 64 * unit;
  so.loader_threads = 2;
  adapters::AdapterStore store(c, so);
  for (int i = 0; i < kAdapters; ++i) ASSERT_TRUE(store.Register("a" + std::to_string(i), dirs[i]).ok());

  // Random requests; a few adapters are popular so that hits happen too.
  std::mt19937 rng(42);
  std::vector<engine::Request> requests;
  for (int r = 0; r < kRequests; ++r) {
    engine::Request req;
    req.id = "r" + std::to_string(r);
    const int n = 2 + static_cast<int>(rng() % 30);
    for (int k = 0; k < n; ++k) req.prompt_ids.push_back(static_cast<int32_t>(rng() % (c.vocab_size - 2)));
    req.sampling.max_tokens = 6;
    req.sampling.ignore_eos = true;
    req.sampling.seed = r;
    req.sampling.temperature = (r % 2) ? 0.8f : 0.f;
    const int a = (rng() % 4 == 0) ? static_cast<int>(rng() % 8) : static_cast<int>(rng() % kAdapters);
    req.adapter.name = "a" + std::to_string(a);
    req.adapter.positions = (r % 3 == 0) ? model::AdapterPositions::kAll : model::AdapterPositions::kPrompt;
    requests.push_back(std::move(req));
  }

  engine::EngineOptions eo;
  eo.kv_blocks = 96;
  eo.scheduler.max_batch_tokens = 64;
  auto eng = engine::Engine::Create(m->get(), nullptr, eo);
  ASSERT_TRUE(eng.ok());

  // Pins arrive on loader threads (or at once, on a hit) and queue for the engine thread.
  std::mutex mu;
  std::deque<std::pair<int, absl::StatusOr<adapters::AdapterPin>>> ready;
  std::map<std::string, Served> served;
  int finished = 0, issued = 0;
  auto issue = [&](int r) {
    store.Acquire(requests[r].adapter.name, [&, r](absl::StatusOr<adapters::AdapterPin> pin) {
      std::lock_guard<std::mutex> lock(mu);
      ready.emplace_back(r, std::move(pin));
    });
  };
  // Keep up to 16 requests in flight (acquiring or running).
  while (finished < kRequests) {
    while (issued < kRequests && issued - finished < 16) issue(issued++);
    std::deque<std::pair<int, absl::StatusOr<adapters::AdapterPin>>> batch;
    {
      std::lock_guard<std::mutex> lock(mu);
      batch.swap(ready);
    }
    for (auto& [r, pin] : batch) {
      ASSERT_TRUE(pin.ok()) << pin.status();
      engine::Request req = requests[r];
      req.adapter.weights = pin->weights;
      req.adapter.version = pin->version;
      req.on_token = [&served, &finished, version = pin->version](const engine::TokenEvent& e) {
        Served& s = served[e.request_id];
        if (e.token_id >= 0) s.tokens.push_back(e.token_id);
        s.version = version;
        if (e.finish != engine::FinishReason::kNone) {
          s.finish = e.finish;
          ++finished;
        }
      };
      ASSERT_TRUE((*eng)->Add(std::move(req)).ok());
    }
    if ((*eng)->HasWork()) {
      ASSERT_TRUE((*eng)->Step().ok());
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  // Every request finished with its tokens, and they equal a run alone with the adapter
  // loaded directly from its folder.
  for (int r = 0; r < kRequests; ++r) {
    const Served& s = served[requests[r].id];
    ASSERT_EQ(s.finish, engine::FinishReason::kLength) << r;
    EXPECT_EQ(s.version, 1);
    engine::Request req = requests[r];
    auto a = adapters::LoadAdapter(dirs[std::stoi(req.adapter.name.substr(1))], c);
    ASSERT_TRUE(a.ok());
    req.adapter.weights = std::move(a).value();
    auto alone = engine::Engine::Create(m->get(), nullptr, eo);
    auto out = (*alone)->Generate({req});
    ASSERT_TRUE(out.ok());
    EXPECT_EQ(out->at(0).token_ids, s.tokens) << requests[r].id << " on " << req.adapter.name;
  }

  // No leak: no pin left, budgets held, every KV block back, counters add up.
  const adapters::AdapterStoreStats st = store.stats();
  EXPECT_EQ(st.pinned, 0);
  EXPECT_LE(st.compute_bytes_used, so.compute_bytes);
  EXPECT_LE(st.host_bytes_used, so.host_bytes);
  EXPECT_EQ(st.compute_hits + st.joined + st.host_hits + st.disk_loads + st.load_failures, kRequests);
  EXPECT_EQ(st.load_failures, 0);
  EXPECT_GT(st.compute_hits + st.joined, 0);
  EXPECT_GT(st.compute_evictions, 0);
  EXPECT_EQ((*eng)->allocator().num_free(), (*eng)->allocator().num_blocks());
  std::printf("store: %lld compute hits, %lld joined, %lld host hits, %lld disk loads, %lld compute evictions, %lld host evictions\n",
              (long long)st.compute_hits, (long long)st.joined, (long long)st.host_hits,
              (long long)st.disk_loads, (long long)st.compute_evictions, (long long)st.host_evictions);
}

}  // namespace
}  // namespace preft
