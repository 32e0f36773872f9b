// Decode workers that run adapters: the all-position baseline and LoadAdapter/UnloadAdapter.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>

#include "common/adapters/adapter_loader.h"
#include "common/engine/engine.h"
#include "tests/services/decode/decode_test_fixture.h"
#include "tests/testing/fixtures.h"

namespace preft::decode {
namespace {

// The all-position baseline: decode applies the request's adapter to the tokens it generates,
// so its output equals one engine running the adapter everywhere (and differs from PreFT's
// prompt-only run).
TEST_F(DecodeServiceTest, AllPositionBaselineRunsTheAdapterOnGeneratedTokens) {
  DecodeServiceOptions o;
  o.all_position_adapters = true;
  o.adapter_root = testing::TinyLlamaFixture();
  StartService(o);
  auto w = adapters::LoadAdapter(testing::TinyLlamaFixture() + "/lora", loaded_->model->config());
  ASSERT_TRUE(w.ok()) << w.status();
  const std::shared_ptr<const model::AdapterWeights> weights = std::move(w).value();
  engine::Request r = MakeRequest("lora-all", 30, 10, 0.f, 3);
  r.adapter = engine::RequestAdapter{weights, "lora", 1, model::AdapterPositions::kAll};
  const engine::GenerationResult ref = Reference(r);
  engine::Request prompt_only = r;
  prompt_only.adapter.positions = model::AdapterPositions::kPrompt;
  ASSERT_NE(Reference(prompt_only).token_ids, ref.token_ids)
      << "the fixture cannot tell them apart";

  ReserveResponse res;
  StartRequest start = BaselineStart(r, &res);
  const StreamResult got = RunStart(start);
  ExpectSameAsReference(got, ref);
  ASSERT_FALSE(got.messages.empty());
  const v1::Finish& f = got.messages.back().finish();
  EXPECT_EQ(f.adapter(), "lora");
  EXPECT_EQ(f.adapter_version(), 1);
  EXPECT_EQ(f.adapter_positions(), v1::ADAPTER_POSITIONS_ALL);
  EXPECT_TRUE(WaitAllFree());

  // An adapter outside the root fails the Start and aborts its reservation.
  ASSERT_TRUE(Reserve(30, 10, &res).ok());
  start.set_reservation_id(res.reservation_id());
  start.set_adapter_path("../../../../etc");
  const StreamResult bad = RunStart(start);
  EXPECT_EQ(bad.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(bad.status.error_message(), HasSubstr("outside the adapter root"));
  EXPECT_TRUE(WaitAllFree());
}

// LoadAdapter warms a worker that runs adapters (one disk load, then requests hit), and is
// refused, naming why, by a PreFT decode worker, which never reads adapters.
TEST_F(DecodeServiceTest, LoadAdapterWarmsOnlyWorkersThatRunAdapters) {
  worker::v1::WorkerAdapterRequest req;
  req.set_name("lora");
  req.set_version(1);
  req.set_path("lora");
  worker::v1::AdapterState state;
  {
    grpc::ClientContext ctx;
    const grpc::Status s = stub_->LoadAdapter(&ctx, req, &state);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(s.error_message(), HasSubstr("runs no adapters"));
    grpc::ClientContext uctx;
    worker::v1::UnloadWorkerAdapterResponse unloaded;
    EXPECT_TRUE(stub_->UnloadAdapter(&uctx, req, &unloaded).ok());
  }
  DecodeServiceOptions o;
  o.all_position_adapters = true;
  o.adapter_root = testing::TinyLlamaFixture();
  StartService(o);
  {
    grpc::ClientContext ctx;
    const grpc::Status s = stub_->LoadAdapter(&ctx, req, &state);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_EQ(state.name(), "lora");
  EXPECT_EQ(state.version(), 1);
  EXPECT_EQ(state.residency(), v1::ADAPTER_RESIDENCY_RESIDENT);
  EXPECT_GT(state.bytes(), 0);
  worker::v1::DecodeStatusResponse status;
  ASSERT_TRUE(CallStatus(&status).ok());
  ASSERT_EQ(status.adapters_size(), 1);
  EXPECT_EQ(status.adapters(0).name(), "lora");
  EXPECT_EQ(status.adapters(0).residency(), v1::ADAPTER_RESIDENCY_RESIDENT);
  EXPECT_EQ(status.adapters(0).bytes(), state.bytes());
  const adapters::AdapterStoreStats loaded = service_->adapter_store()->stats();
  EXPECT_EQ(loaded.disk_loads, 1);
  EXPECT_EQ(loaded.compute_bytes_used, state.bytes());
  EXPECT_EQ(loaded.pinned, 0);  // resident, not leased

  // A request on it is a compute hit: no second load.
  auto w = adapters::LoadAdapter(testing::TinyLlamaFixture() + "/lora", loaded_->model->config());
  ASSERT_TRUE(w.ok()) << w.status();
  engine::Request r = MakeRequest("warm", 20, 4, 0.f, 5);
  r.adapter = engine::RequestAdapter{std::move(w).value(), "lora", 1,
                                     model::AdapterPositions::kAll};
  const engine::GenerationResult ref = Reference(r);
  ReserveResponse res;
  ExpectSameAsReference(RunStart(BaselineStart(r, &res)), ref);
  const adapters::AdapterStoreStats after = service_->adapter_store()->stats();
  EXPECT_EQ(after.disk_loads, 1);
  EXPECT_EQ(after.compute_hits, loaded.compute_hits + 1);

  // Unloading forgets it (its copy leaves once the finished request's lease is gone); a
  // missing folder is the store's NOT_FOUND.
  ASSERT_TRUE(WaitAllFree());
  grpc::ClientContext uctx;
  worker::v1::UnloadWorkerAdapterResponse unloaded;
  ASSERT_TRUE(stub_->UnloadAdapter(&uctx, req, &unloaded).ok());
  EXPECT_TRUE(WaitForCounts([&](const DecodeService::BlockCounts&) {
    return service_->adapter_store()->stats().compute_bytes_used == 0;
  }));
  EXPECT_TRUE(service_->adapter_store()->List().empty());
  status.Clear();
  ASSERT_TRUE(CallStatus(&status).ok());
  EXPECT_EQ(status.adapters_size(), 0);
  req.set_name("gone");
  req.set_path("no-such-adapter");
  grpc::ClientContext gctx;
  EXPECT_EQ(stub_->LoadAdapter(&gctx, req, &state).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(WaitAllFree());
}

}  // namespace
}  // namespace preft::decode
