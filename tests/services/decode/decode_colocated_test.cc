// Colocated decode workers: Run computes the prompt and decodes it in one engine.

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "common/adapters/adapter_loader.h"
#include "common/engine/engine.h"
#include "services/wire/convert.h"
#include "tests/services/decode/decode_test_fixture.h"
#include "tests/testing/fixtures.h"

namespace preft::decode {
namespace {

TEST_F(ColocatedDecodeTest, RunEqualsOneEngineWithAndWithoutAdapters) {
  auto lora = adapters::LoadAdapter(testing::TinyLlamaFixture() + "/lora", loaded_->model->config());
  auto direft =
      adapters::LoadAdapter(testing::TinyLlamaFixture() + "/direft", loaded_->model->config());
  ASSERT_TRUE(lora.ok() && direft.ok());
  struct Case {
    const char* id;
    const char* adapter;  // "" for the base model
    v1::AdapterPositions positions;
    float temperature;
  };
  const std::shared_ptr<const model::AdapterWeights> lora_w = std::move(lora).value();
  const std::shared_ptr<const model::AdapterWeights> direft_w = std::move(direft).value();
  struct Call {
    worker::v1::RunRequest run;
    engine::GenerationResult ref;
    v1::AdapterPositions positions;  // what the finish reports
  };
  std::vector<Call> calls;
  for (const Case& c : {Case{"base", "", v1::ADAPTER_POSITIONS_UNSPECIFIED, 0.f},
                        Case{"lora", "lora", v1::ADAPTER_POSITIONS_ALL, 0.f},
                        Case{"lorap", "lora", v1::ADAPTER_POSITIONS_PROMPT, 0.8f},
                        Case{"direft", "direft", v1::ADAPTER_POSITIONS_UNSPECIFIED, 0.f},
                        Case{"direftp", "direft", v1::ADAPTER_POSITIONS_PROMPT, 0.8f}}) {
    engine::Request r = MakeRequest(c.id, 33, 14, c.temperature, 21);
    const std::string adapter = c.adapter;
    Call call{MakeRun(r), {}, v1::ADAPTER_POSITIONS_UNSPECIFIED};
    if (!adapter.empty()) {
      r.adapter = engine::RequestAdapter{adapter == "lora" ? lora_w : direft_w, adapter, 1,
                                         wire::FromProto(c.positions)};
      call.run.set_adapter(adapter);
      call.run.set_adapter_version(1);
      call.run.set_adapter_path(adapter);
      call.run.set_adapter_positions(c.positions);
      call.positions =
          wire::ToProto(r.adapter.positions.value_or(r.adapter.weights->default_positions));
    }
    // All before the calls: the reference engine shares the service's model and its scratch.
    call.ref = Reference(r);
    calls.push_back(std::move(call));
  }
  std::vector<std::future<void>> running;
  for (const Call& call : calls) {
    running.push_back(std::async(std::launch::async, [this, &call] {
      SCOPED_TRACE(call.run.request_id());
      const StreamResult got = CallRun(call.run);
      ExpectSameTokens(got, call.ref);
      ASSERT_FALSE(got.messages.empty());
      const v1::Finish& f = got.messages.back().finish();
      EXPECT_EQ(f.reason(), v1::FINISH_REASON_LENGTH);
      EXPECT_EQ(f.usage().prompt_tokens(), 33);
      EXPECT_EQ(f.usage().completion_tokens(), 14);
      EXPECT_EQ(f.adapter(), call.run.adapter());
      EXPECT_EQ(f.adapter_positions(), call.positions);
    }));
  }
  for (auto& f : running) f.get();
  EXPECT_TRUE(WaitAllFree());
  EXPECT_TRUE(WaitNoStreams());
  worker::v1::DecodeStatusResponse status;
  ASSERT_TRUE(CallStatus(&status).ok());
  EXPECT_TRUE(status.colocated());
  EXPECT_EQ(status.free_blocks(), kDecodeBlocks);
}

TEST_F(ColocatedDecodeTest, BadRunsAndReserveAreRefused) {
  const engine::Request r = MakeRequest("bad", 10, 4, 0.f, 1);
  auto expect = [&](const worker::v1::RunRequest& run, grpc::StatusCode code,
                    const std::string& part) {
    const StreamResult got = CallRun(run);
    EXPECT_EQ(got.status.error_code(), code) << got.status.error_message();
    EXPECT_THAT(got.status.error_message(), HasSubstr(part));
  };
  worker::v1::RunRequest run = MakeRun(r);
  run.clear_request_id();
  expect(run, grpc::StatusCode::INVALID_ARGUMENT, "request_id is empty");
  run = MakeRun(r);
  run.clear_prompt_ids();
  expect(run, grpc::StatusCode::INVALID_ARGUMENT, "prompt_ids is empty");
  run = MakeRun(r);
  for (int i = 0; i < 2048; ++i) run.add_prompt_ids(1);
  expect(run, grpc::StatusCode::INVALID_ARGUMENT, "the model's context is 2048");
  run = MakeRun(r);
  run.set_prompt_ids(3, 99999);
  expect(run, grpc::StatusCode::INVALID_ARGUMENT, "prompt_ids[3] = 99999");
  run = MakeRun(r);
  run.mutable_sampling()->set_top_p(3.f);
  expect(run, grpc::StatusCode::INVALID_ARGUMENT, "top_p");
  run = MakeRun(r);
  run.set_adapter("lora");
  run.set_adapter_version(1);
  expect(run, grpc::StatusCode::INVALID_ARGUMENT, "without adapter_path");
  run.set_adapter_path("no-such-adapter");
  expect(run, grpc::StatusCode::NOT_FOUND, "no-such-adapter");
  run.set_adapter_path("../../../../etc");
  expect(run, grpc::StatusCode::INVALID_ARGUMENT, "outside the adapter root");
  ReserveResponse res;
  const grpc::Status reserve = Reserve(10, 4, &res);
  EXPECT_EQ(reserve.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(reserve.error_message(), HasSubstr("colocated decode worker: send Run"));
  service_->StartDrain();
  expect(MakeRun(r), grpc::StatusCode::UNAVAILABLE, "draining");
  EXPECT_TRUE(WaitAllFree());
  EXPECT_TRUE(WaitNoStreams());
}

// Its blocks count as filled while it runs (Status and metrics see them), and cancelling the
// call aborts the engine request and frees them.
TEST_F(ColocatedDecodeTest, CancellingARunFreesItsBlocks) {
  engine::Request r = MakeRequest("long", 40, 1500, 0.f, 2);
  grpc::ClientContext ctx;
  auto reader = stub_->Run(&ctx, MakeRun(r));
  v1::GenerateResponse m;
  ASSERT_TRUE(reader->Read(&m));
  EXPECT_TRUE(WaitForCounts([](const DecodeService::BlockCounts& c) {
    return c.sequences == 1 && c.filled >= 3 && c.free + c.filled == c.total;
  }));
  worker::v1::DecodeStatusResponse status;
  ASSERT_TRUE(CallStatus(&status).ok());
  EXPECT_EQ(status.running(), 1);
  EXPECT_LT(status.free_blocks(), kDecodeBlocks);
  ctx.TryCancel();
  const StreamResult got = Collect(*reader, {m});
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_LT(got.tokens.size(), 1500u);
  EXPECT_TRUE(WaitAllFree());
  EXPECT_TRUE(WaitNoStreams());
}

TEST_F(DecodeServiceTest, RunNeedsAColocatedWorker) {
  worker::v1::RunRequest run;
  run.set_request_id("r");
  run.add_prompt_ids(1);
  grpc::ClientContext ctx;
  auto reader = stub_->Run(&ctx, run);
  const StreamResult got = Collect(*reader);
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(got.status.error_message(), HasSubstr("start it with --colocated"));
  worker::v1::DecodeStatusResponse status;
  ASSERT_TRUE(CallStatus(&status).ok());
  EXPECT_FALSE(status.colocated());
  EXPECT_TRUE(WaitNoStreams());
}

}  // namespace
}  // namespace preft::decode
