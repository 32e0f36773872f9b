// The colocated embedded cluster (router + decode workers that run whole requests, no prefill
// tier) through the public API: the same outputs as the disaggregated cluster and one engine,
// every block free afterwards, and precise errors when the router and its workers disagree on
// the deployment.

#include "prometheus/registry.h"
#include "tests/services/cluster/cluster_fixture.h"

namespace preft::tools {
namespace {

// `s` has `code` and says `part`.
void ExpectStatus(const grpc::Status& s, grpc::StatusCode code, const std::string& part) {
  EXPECT_EQ(s.error_code(), code) << s.error_message();
  EXPECT_NE(s.error_message().find(part), std::string::npos) << s.error_message();
}

class ColocatedClusterTest : public EmbeddedClusterTest {
 protected:
  void Configure(EmbeddedClusterOptions* o) override {
    o->colocated = true;
    o->decode.all_position_adapters = false;  // a colocated worker runs every adapter itself
    o->router.metrics = &registry_;
  }

  // Observations of the router's histogram `name` whose labels include `label`.
  uint64_t HistogramCount(const std::string& name, const prometheus::ClientMetric::Label& label) {
    uint64_t n = 0;
    for (const auto& family : registry_.Collect()) {
      if (family.name != name) continue;
      for (const auto& m : family.metric) {
        for (const auto& l : m.label)
          if (l.name == label.name && l.value == label.value) n += m.histogram.sample_count;
      }
    }
    return n;
  }

  prometheus::Registry registry_;
};

TEST_F(ColocatedClusterTest, ReproducesEveryFixtureModeConcurrently) {
  EXPECT_EQ(cluster_->num_prefill(), 0);
  for (const auto& w : cluster_->pool().decode()) {
    grpc::ClientContext ctx;
    worker::v1::DecodeStatusResponse status;
    ASSERT_TRUE(w->stub->Status(&ctx, worker::v1::DecodeStatusRequest(), &status).ok());
    EXPECT_TRUE(status.colocated()) << w->address;
  }
  ReproduceFixtureModes();
}

TEST_F(ColocatedClusterTest, RepeatedPromptsReportCachedTokens) {
  RepeatedPromptsReportCachedTokens();
}

// Prefix affinity decides where a prompt goes: a prompt sent while worker 0 is busy lands on
// worker 1 (most free blocks); sent again when both are idle (a tie that worker 0 would win by
// index) it follows its prefix to worker 1 and finds its blocks cached there.
TEST_F(ColocatedClusterTest, APromptFollowsItsPrefixToTheWorkerThatCachedIt) {
  std::vector<int32_t> prompt(40);
  for (int i = 0; i < 40; ++i) prompt[i] = 11 + (i * 13) % 250;
  const v1::GenerateRequest p = Request(prompt, 4);
  testing::GenerateOutcome first;
  bool sent = false;
  const testing::GenerateOutcome busy = Generate(
      stub_.get(), Request({1, 2, 3, 4, 5}, 1500), 60,
      [&](const v1::GenerateResponse&, grpc::ClientContext* ctx) {
        if (sent) return;
        sent = true;  // the long request is running on a worker: send the prompt beside it
        first = Generate(stub_.get(), p);
        ctx->TryCancel();
      });
  EXPECT_EQ(busy.status.error_code(), grpc::StatusCode::CANCELLED) << busy.status.error_message();
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_EQ(first.finish.usage().cached_tokens(), 0);
  ExpectNoLeaks();
  absl::SleepFor(absl::Milliseconds(400));  // both workers' idle status reaches the router
  const testing::GenerateOutcome again = Generate(stub_.get(), p);
  ASSERT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_EQ(again.finish.usage().cached_tokens(), 32) << "it went to the other worker";
  EXPECT_EQ(again.token_ids, first.token_ids);
}

// Greedy and seeded, every adapter mode, under concurrent mixed load. TTFT is observed as
// always; the stages of the disaggregated path (reserve, prefill, KV transfer) never are.
TEST_F(ColocatedClusterTest, MixedLoadEqualsOneEngine) {
  MixedLoadEqualsOneEngine();
  EXPECT_EQ(HistogramCount("preft:router_time_to_first_token_seconds", {"positions", "all"}), 8u);
  EXPECT_EQ(HistogramCount("preft:router_time_to_first_token_seconds", {"positions", "prompt"}),
            8u);
  EXPECT_EQ(HistogramCount("preft:router_time_to_first_token_seconds", {"positions", "base"}), 4u);
  EXPECT_EQ(HistogramCount("preft:router_ttft_stage_seconds", {"stage", "admit"}), 20u);
  for (const char* stage : {"reserve", "prefill_queue", "prefill_compute", "kv_transfer",
                            "prefill_rpc", "decode_start"}) {
    EXPECT_EQ(HistogramCount("preft:router_ttft_stage_seconds", {"stage", stage}), 0u) << stage;
  }
}

TEST_F(ColocatedClusterTest, CancellingMidStreamFreesEverything) { CancelMidStream(); }

TEST_F(ColocatedClusterTest, AbortEndsTheStreamWithFinishAbort) { AbortMidStream(); }

// A worker that fails a Run before its first token is replaced. Here it is draining, which
// the router has not polled (it polls only at start): it picks that worker first.
class ColocatedRetryTest : public ColocatedClusterTest {
 protected:
  void Configure(EmbeddedClusterOptions* o) override {
    ColocatedClusterTest::Configure(o);
    o->poll_interval = absl::Hours(1);
  }
};

TEST_F(ColocatedRetryTest, AWorkerFailingBeforeTheFirstTokenIsReplaced) {
  const std::string first = cluster_->pool().decode().front()->address;  // equal views: first
  for (int i = 0; i < cluster_->num_decode(); ++i)
    if (cluster_->decode_address(i) == first) cluster_->decode(i).StartDrain();
  const auto out = Generate(stub_.get(), Request({1, 2, 3, 4}, 6, "lora"), 30);
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  EXPECT_EQ(out.token_ids.size(), 6u);
  double retries = 0;
  for (const auto& family : registry_.Collect()) {
    if (family.name != "preft:router_retries_total") continue;
    for (const auto& m : family.metric) retries += m.counter.value;
  }
  EXPECT_EQ(retries, 1);
  ExpectNoLeaks();
}

// RegisterAdapter with `load` (and LoadAdapter) reach the colocated workers, which have no
// prefill tier in front of them: each reads the adapter once, before traffic, and requests on
// it then find it resident. UnloadAdapter drops it there too.
TEST_F(ColocatedClusterTest, LoadingAnAdapterWarmsEveryColocatedWorker) {
  auto disk_loads = [&] {
    std::vector<int64_t> n;
    for (int i = 0; i < cluster_->num_decode(); ++i)
      n.push_back(cluster_->decode(i).adapter_store()->stats().disk_loads);
    return n;
  };
  const std::vector<int64_t> before = disk_loads();
  fs::copy(*root_ / "lora", *root_ / "warm");
  grpc::ClientContext rctx;
  v1::RegisterAdapterRequest reg;
  reg.set_name("warm");
  reg.set_path("warm");
  reg.set_load(true);
  v1::RegisterAdapterResponse rr;
  const grpc::Status s = stub_->RegisterAdapter(&rctx, reg, &rr);
  ASSERT_TRUE(s.ok()) << s.error_message();
  std::vector<int64_t> loaded = disk_loads();
  ASSERT_EQ(loaded.size(), before.size());
  ASSERT_GE(loaded.size(), 2u);
  for (size_t i = 0; i < loaded.size(); ++i) EXPECT_EQ(loaded[i], before[i] + 1) << i;
  // The answer lists it resident, version 1, on every colocated worker.
  std::set<std::string> resident;
  for (const auto& w : rr.adapter().workers()) {
    EXPECT_EQ(w.version(), 1);
    if (w.residency() == v1::ADAPTER_RESIDENCY_RESIDENT) resident.insert(w.worker());
  }
  EXPECT_EQ(resident.size(), loaded.size());
  for (int k = 0; k < 4; ++k) {
    const auto out = Generate(stub_.get(), Request({5, 6, 7, 8}, 3, "warm"));
    ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  }
  EXPECT_EQ(disk_loads(), loaded);

  grpc::ClientContext uctx;
  v1::UnloadAdapterRequest un;
  un.set_name("warm");
  v1::UnloadAdapterResponse ur;
  ASSERT_TRUE(stub_->UnloadAdapter(&uctx, un, &ur).ok());
  cluster_->pool().PollNow();
  grpc::ClientContext lctx;
  v1::ListAdaptersRequest list;
  list.set_name("warm");
  v1::ListAdaptersResponse listed;
  ASSERT_TRUE(stub_->ListAdapters(&lctx, list, &listed).ok());
  ASSERT_EQ(listed.adapters_size(), 1);
  EXPECT_EQ(listed.adapters(0).workers_size(), 0);  // registered still, held nowhere
  for (int i = 0; i < cluster_->num_decode(); ++i) {
    for (const auto& a : cluster_->decode(i).adapter_store()->List())
      EXPECT_EQ(a.name.find("warm"), std::string::npos) << a.name;
  }
  ExpectNoLeaks();
}

TEST_F(ColocatedClusterTest, UnknownAdaptersAndBadRequestsGetPreciseCodes) {
  ExpectStatus(Generate(stub_.get(), Request({1, 2, 3}, 4, "nobody"), 10).status,
               grpc::StatusCode::NOT_FOUND, "'nobody'");
  EXPECT_EQ(Generate(stub_.get(), Request({1, 99999}, 2), 10).status.error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  // A registered adapter whose folder is gone: the worker's store answers NOT_FOUND.
  grpc::ClientContext rctx;
  v1::RegisterAdapterRequest reg;
  reg.set_name("vanishing");
  reg.set_path("vanishing");
  fs::copy(*root_ / "lora", *root_ / "vanishing");
  v1::RegisterAdapterResponse rr;
  ASSERT_TRUE(stub_->RegisterAdapter(&rctx, reg, &rr).ok());
  fs::remove_all(*root_ / "vanishing");
  ExpectStatus(Generate(stub_.get(), Request({1, 2, 3}, 4, "vanishing"), 10).status,
               grpc::StatusCode::NOT_FOUND, "vanishing");
  // Reserve is for disaggregated workers.
  grpc::ClientContext ctx;
  worker::v1::ReserveRequest req;
  req.set_request_id("r");
  req.set_num_tokens(4);
  req.set_max_new_tokens(4);
  worker::v1::ReserveResponse res;
  ExpectStatus(cluster_->pool().decode().front()->stub->Reserve(&ctx, req, &res),
               grpc::StatusCode::FAILED_PRECONDITION, "send Run");
  ExpectNoLeaks();
}

// The router and its decode workers disagree on the deployment: requests are refused, naming
// the fix. Parameter true: a colocated router before disaggregated workers; false: the reverse.
class MismatchedDeploymentTest : public EmbeddedClusterTest,
                                 public ::testing::WithParamInterface<bool> {
 protected:
  void Configure(EmbeddedClusterOptions* o) override {
    (GetParam() ? o->router.colocated : o->decode.colocated) = true;
  }
};

TEST_P(MismatchedDeploymentTest, RequestsAreRefusedNamingTheFix) {
  ExpectStatus(Generate(stub_.get(), Request({1, 2, 3}, 4), 10).status,
               grpc::StatusCode::FAILED_PRECONDITION,
               GetParam() ? "start them with --colocated" : "start the router with --colocated");
  ExpectNoLeaks();
}

INSTANTIATE_TEST_SUITE_P(RouterOrWorkers, MismatchedDeploymentTest, ::testing::Bool());

TEST_F(EmbeddedClusterTest, DisaggregatedDecodeWorkersRefuseRun) {
  grpc::ClientContext ctx;
  worker::v1::RunRequest run;
  run.set_request_id("r");
  run.add_prompt_ids(1);
  auto reader = cluster_->pool().decode().front()->stub->Run(&ctx, run);
  v1::GenerateResponse msg;
  EXPECT_FALSE(reader->Read(&msg));
  ExpectStatus(reader->Finish(), grpc::StatusCode::FAILED_PRECONDITION, "not colocated");
  ExpectNoLeaks();
}

}  // namespace
}  // namespace preft::tools
