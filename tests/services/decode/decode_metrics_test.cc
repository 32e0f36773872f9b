// Decode worker metrics: GET /metrics shows KV block states and the adapter store.

#include "services/decode/decode_metrics.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "common/adapters/adapter_loader.h"
#include "common/metrics/metrics_server.h"
#include "tests/services/decode/decode_test_fixture.h"
#include "tests/testing/fixtures.h"
#include "tests/testing/http_get.h"

namespace preft::decode {
namespace {

// The value of the sample named exactly `series` in a Prometheus text exposition, or -1.
double Sample(const std::string& exposition, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(exposition, '\n')) {
    if (absl::ConsumePrefix(&line, series) && absl::ConsumePrefix(&line, " ")) {
      double v = -1;
      return absl::SimpleAtod(line, &v) ? v : -1;
    }
  }
  return -1;
}

// Refreshes `m` and returns the exposition served at `address`.
std::string Scrape(DecodeMetrics& m, const std::string& address) {
  m.Refresh();
  auto body = testing::HttpGet(address, "/metrics");
  EXPECT_TRUE(body.ok()) << body.status();
  return body.ok() ? *body : std::string();
}

// GET /metrics shows the KV block states and usage the service reports.
TEST_F(DecodeServiceTest, MetricsEndpointShowsKvBlockStates) {
  auto server = metrics::MetricsServer::Start("127.0.0.1:0");
  ASSERT_TRUE(server.ok()) << server.status();
  DecodeMetrics m((*server)->registry(), service_.get(), absl::Hours(1));
  auto scrape = [&] { return Scrape(m, (*server)->address()); };
  std::string text = scrape();
  EXPECT_EQ(Sample(text, "preft:kv_blocks{state=\"free\"}"), kDecodeBlocks) << text;
  EXPECT_EQ(Sample(text, "preft:kv_cache_usage_perc"), 0);
  EXPECT_EQ(Sample(text, "preft:num_requests_running"), 0);
  EXPECT_EQ(Sample(text, "preft:num_requests_waiting"), 0);
  ReserveResponse res;
  ASSERT_TRUE(Reserve(40, 8, &res).ok());  // 48 tokens: 3 blocks
  text = scrape();
  EXPECT_EQ(Sample(text, "preft:num_requests_waiting"), 1) << text;
  EXPECT_EQ(Sample(text, "preft:kv_blocks{state=\"reserved\"}"), 3) << text;
  EXPECT_EQ(Sample(text, "preft:kv_blocks{state=\"free\"}"), kDecodeBlocks - 3);
  EXPECT_NEAR(Sample(text, "preft:kv_cache_usage_perc"), 3.0 / kDecodeBlocks, 1e-9);
  EXPECT_FALSE(testing::HttpGet((*server)->address(), "/nothing").ok());
  EXPECT_EQ(metrics::MetricsServer::Start("nonsense").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(metrics::MetricsServer::Start("256.0.0.1:0").status().code(),
            absl::StatusCode::kUnavailable);  // not an address of this host
  // Destroyed at once (a worker whose engine failed after its endpoint started): the listening
  // thread ends; it used to stay in accept() 1-5% of the time, hanging the destructor's join.
  for (int i = 0; i < 200; ++i) {
    auto brief = metrics::MetricsServer::Start("127.0.0.1:0");
    ASSERT_TRUE(brief.ok()) << brief.status();
  }
}

// A worker serving adapters (the all-position baseline) also exports its adapter store: the
// first request's adapter is a disk load, the second a compute hit.
TEST_F(DecodeServiceTest, MetricsShowTheAdapterStoreOfABaselineWorker) {
  DecodeServiceOptions o;
  o.all_position_adapters = true;
  o.adapter_root = testing::TinyLlamaFixture();
  o.store.compute_bytes = int64_t{3} << 20;
  StartService(o);
  auto server = metrics::MetricsServer::Start("127.0.0.1:0");
  ASSERT_TRUE(server.ok()) << server.status();
  DecodeMetrics m((*server)->registry(), service_.get(), absl::Hours(1));
  auto scrape = [&] { return Scrape(m, (*server)->address()); };
  std::string text = scrape();
  EXPECT_EQ(Sample(text, "preft:adapter_capacity_bytes{tier=\"compute\"}"), 3 << 20) << text;
  EXPECT_EQ(Sample(text, "preft:adapter_acquires_total{result=\"disk_load\"}"), 0) << text;
  EXPECT_EQ(Sample(text, "preft:adapter_disk_load_seconds_total"), 0) << text;
  auto w = adapters::LoadAdapter(testing::TinyLlamaFixture() + "/lora", loaded_->model->config());
  ASSERT_TRUE(w.ok()) << w.status();
  const std::shared_ptr<const model::AdapterWeights> weights = std::move(w).value();
  for (int i = 0; i < 2; ++i) {
    engine::Request r = MakeRequest(absl::StrCat("lora-all-", i), 20, 4, 0.f, 3);
    r.adapter = engine::RequestAdapter{weights, "lora", 1, model::AdapterPositions::kAll};
    ReserveResponse res;
    ASSERT_TRUE(RunStart(BaselineStart(r, &res)).status.ok());
  }
  EXPECT_TRUE(WaitAllFree());
  text = scrape();
  EXPECT_EQ(Sample(text, "preft:adapter_acquires_total{result=\"disk_load\"}"), 1) << text;
  EXPECT_EQ(Sample(text, "preft:adapter_acquires_total{result=\"compute_hit\"}"), 1) << text;
  EXPECT_GT(Sample(text, "preft:adapter_disk_load_seconds_total"), 0) << text;
  EXPECT_EQ(Sample(text, "preft:adapters{state=\"compute\"}"), 1) << text;
  EXPECT_GT(Sample(text, "preft:adapter_bytes{tier=\"compute\"}"), 0) << text;
}

}  // namespace
}  // namespace preft::decode
