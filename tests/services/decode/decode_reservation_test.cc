// Decode reservations: Reserve and Release, leases, quarantine, retry fencing, exhaustion, drain.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <future>
#include <set>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "tests/services/decode/decode_test_fixture.h"

namespace preft::decode {
namespace {

TEST_F(DecodeServiceTest, StartWithoutDoneFailsAtLeaseEndAndQuarantines) {
  const engine::Request r = MakeRequest("never", 20, 4, 0.f, 1);
  ReserveResponse res;
  ASSERT_TRUE(Reserve(20, 4, &res, /*lease_ms=*/300).ok());
  EXPECT_EQ(res.lease_ms(), 300);
  const engine::PrefilledPrompt p = Prefill(r);
  const absl::Time t0 = absl::Now();
  const StreamResult got = RunStart(MakeStart(r, p, res));
  const absl::Time failed = absl::Now();
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(got.status.error_message(), HasSubstr("no DONE notice"));
  EXPECT_GE(failed - t0, absl::Milliseconds(250));
  EXPECT_TRUE(got.tokens.empty());
  const int32_t n = res.block_ids_size();
  EXPECT_TRUE(WaitForCounts([&](const DecodeService::BlockCounts& c) {
    return c.quarantined == n && c.reserved == 0 && c.free == kDecodeBlocks - n;
  }));
  // The quarantine started when the Start failed: no block is free before it ends.
  EXPECT_TRUE(WaitAllFree());
  EXPECT_GE(absl::Now() - failed, kQuarantine - absl::Milliseconds(50));
  // The reservation is gone: a second Start says so.
  const StreamResult again = RunStart(MakeStart(r, p, res));
  EXPECT_EQ(again.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(again.status.error_message(), HasSubstr("lease of 300 ms expired"));
  ASSERT_TRUE(prefill_->ReleasePrefilled(p.request_id).ok());
}

TEST_F(DecodeServiceTest, ReleaseQuarantinesThenFreesAndLeaseExpiryFrees) {
  ReserveResponse res;
  ASSERT_TRUE(Reserve(40, 24, &res).ok());
  const int32_t n = res.block_ids_size();
  EXPECT_EQ(n, 4);
  EXPECT_EQ(service_->block_counts().reserved, n);
  // Generation 0 is proto3's "not set": refused, not taken for a stale Release.
  EXPECT_EQ(Release(res.reservation_id(), 0).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(service_->block_counts().reserved, res.block_ids_size());
  ASSERT_TRUE(Release(res.reservation_id(), res.generation()).ok());
  EXPECT_GE(TimeUntilAllFree(), kQuarantine - absl::Milliseconds(50));
  EXPECT_TRUE(Release(res.reservation_id(), res.generation()).ok());  // idempotent
  const grpc::Status unknown = Release(res.reservation_id() + 1000, 1);
  EXPECT_EQ(unknown.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(unknown.error_message(), HasSubstr("is unknown"));

  ReserveResponse leased;
  ASSERT_TRUE(Reserve(40, 24, &leased, /*lease_ms=*/150).ok());
  EXPECT_NE(leased.reservation_id(), res.reservation_id());
  EXPECT_EQ(service_->block_counts().reserved, n);
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(service_->block_counts().reserved, n);  // still within its lease
  EXPECT_TRUE(WaitAllFree());
  EXPECT_TRUE(Release(leased.reservation_id(), leased.generation()).ok());
}

TEST_F(DecodeServiceTest, RetryFencesTheOldGeneration) {
  const engine::Request r = MakeRequest("retry", 33, 10, 0.8f, 9);
  const engine::GenerationResult ref = Reference(r);
  ReserveResponse first;
  ASSERT_TRUE(Reserve(33, 10, &first).ok());
  ReserveResponse second;
  ASSERT_TRUE(Reserve(33, 10, &second, 0, /*retry_of=*/first.reservation_id()).ok());
  EXPECT_EQ(second.reservation_id(), first.reservation_id());
  EXPECT_EQ(second.generation(), 2u);
  const std::set<int32_t> old_blocks(first.block_ids().begin(), first.block_ids().end());
  for (int32_t b : second.block_ids()) EXPECT_EQ(old_blocks.count(b), 0u) << b;
  const int32_t n = second.block_ids_size();
  EXPECT_TRUE(WaitForCounts([&](const DecodeService::BlockCounts& c) {
    return c.reserved == n && c.quarantined == first.block_ids_size();
  }));

  // Another prompt's KV, written by a late prefill of generation 1 into the old blocks.
  const engine::PrefilledPrompt stale = Prefill(MakeRequest("stale", 33, 10, 0.f, 2));
  const engine::PrefilledPrompt p = Prefill(r);
  auto started = std::async(std::launch::async, [&] { return RunStart(MakeStart(r, p, second)); });
  ASSERT_TRUE(Transfer(stale, first.reservation_id(), 1, first.block_ids()).ok());
  EXPECT_EQ(started.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout)
      << "a DONE of generation 1 committed generation 2";
  ASSERT_TRUE(Transfer(p, second.reservation_id(), 2, second.block_ids()).ok());
  // And once more, racing the decode.
  ASSERT_TRUE(Transfer(stale, first.reservation_id(), 1, first.block_ids()).ok());
  ExpectSameAsReference(started.get(), ref);
  ASSERT_TRUE(prefill_->ReleasePrefilled("stale").ok());
  ASSERT_TRUE(prefill_->ReleasePrefilled(p.request_id).ok());
  EXPECT_TRUE(WaitAllFree());

  // Started reservations cannot be retried; a stale Release of generation 1 is ignored.
  EXPECT_TRUE(Release(first.reservation_id(), 1).ok());
  ReserveResponse third;
  const grpc::Status s = Reserve(33, 10, &third, 0, first.reservation_id());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(s.error_message(), HasSubstr("was started"));
}

TEST_F(DecodeServiceTest, ExhaustionAndDrain) {
  ReserveResponse big;
  ASSERT_TRUE(Reserve(1000, 600, &big).ok());  // 100 of 160 blocks
  ReserveResponse more;
  const grpc::Status s = Reserve(1000, 600, &more);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("need 100 KV blocks"));
  EXPECT_THAT(s.error_message(), HasSubstr("60 of 160 blocks are free (100 reserved"));
  worker::v1::DecodeStatusResponse status;
  ASSERT_TRUE(CallStatus(&status).ok());
  EXPECT_EQ(status.free_blocks(), 60);
  EXPECT_EQ(status.total_blocks(), 160);
  EXPECT_EQ(status.reserved_blocks(), 100);
  EXPECT_EQ(status.block_tokens(), 16);
  EXPECT_FALSE(status.draining());
  EXPECT_EQ(status.endpoint().transport(), "inproc");
  ASSERT_TRUE(Release(big.reservation_id(), big.generation()).ok());

  // A stream started before the drain runs to its end.
  const engine::Request r = MakeRequest("drained", 25, 40, 0.f, 8);
  const engine::GenerationResult ref = Reference(r);
  ReserveResponse res;
  ASSERT_TRUE(Reserve(25, 40, &res).ok());
  const engine::PrefilledPrompt p = Prefill(r);
  ASSERT_TRUE(Transfer(p, res.reservation_id(), 1, res.block_ids()).ok());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  auto reader = stub_->Start(&ctx, MakeStart(r, p, res));
  v1::GenerateResponse m;
  ASSERT_TRUE(reader->Read(&m));
  service_->StartDrain();
  const grpc::Status refused = Reserve(10, 10, &more);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(refused.error_message(), HasSubstr("draining"));
  ASSERT_TRUE(CallStatus(&status).ok());
  EXPECT_TRUE(status.draining());
  ExpectSameAsReference(Collect(*reader, {m}), ref);
  EXPECT_TRUE(WaitAllFree());
  EXPECT_TRUE(WaitNoStreams());
}

}  // namespace
}  // namespace preft::decode
