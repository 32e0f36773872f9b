// The embedded cluster (router + prefill + decode on loopback gRPC, in-process KV transport)
// driven through the public API: outputs equal the engine's, errors carry precise codes, and
// cancellation, abort and drain free everything on both tiers.

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "clients/cpp/preft_client.h"
#include "tests/services/cluster/cluster_fixture.h"

namespace preft::tools {
namespace {

TEST_F(EmbeddedClusterTest, ReproducesEveryFixtureModeConcurrently) { ReproduceFixtureModes(); }

// Seeded sampling and text prompts: the cluster's tokens and text are one engine's.
TEST_F(EmbeddedClusterTest, SeededTextRequestsEqualOneEngine) {
  auto m = model::Model::Load(testing::TinyLlamaFixture());
  ASSERT_TRUE(m.ok());
  auto lora = adapters::LoadAdapter((*root_ / "lora").string(), (*m)->config());
  ASSERT_TRUE(lora.ok());
  std::shared_ptr<const model::AdapterWeights> lora_w = std::move(lora).value();
  engine::EngineOptions eo;
  eo.kv_blocks = 256;
  auto e = engine::Engine::Create(m->get(), cluster_->tokenizer(), eo);
  ASSERT_TRUE(e.ok());
  const std::vector<std::string> prompts = {"The quick brown fox", "Once upon a time there",
                                            "héllo wörld 🙂", "a"};
  for (size_t i = 0; i < prompts.size(); ++i) {
    for (bool adapter : {false, true}) {
      v1::GenerateRequest r;
      r.set_text(prompts[i]);
      r.set_stream(i % 2 == 0);
      r.set_model(adapter ? "lora" : "");
      r.set_adapter_positions(v1::ADAPTER_POSITIONS_PROMPT);
      r.mutable_sampling()->set_max_tokens(12);
      r.mutable_sampling()->set_temperature(0.9f);
      r.mutable_sampling()->set_top_p(0.95f);
      r.mutable_sampling()->set_seed(100 + i);
      r.mutable_sampling()->set_ignore_eos(true);
      const auto got = Generate(stub_.get(), r);
      ASSERT_TRUE(got.status.ok()) << got.status.error_message();
      if (!r.stream()) {
        EXPECT_EQ(got.messages, 1);
      }

      engine::Request er;
      er.id = "x";
      auto ids = cluster_->tokenizer()->Encode(prompts[i]);
      ASSERT_TRUE(ids.ok());
      er.prompt_ids = *ids;
      er.sampling.max_tokens = 12;
      er.sampling.temperature = 0.9f;
      er.sampling.top_p = 0.95f;
      er.sampling.seed = 100 + i;
      er.sampling.ignore_eos = true;
      if (adapter) er.adapter = {lora_w, "lora", 1, model::AdapterPositions::kPrompt};
      auto want = (*e)->Generate({er});
      ASSERT_TRUE(want.ok());
      EXPECT_EQ(got.token_ids, want->front().token_ids) << prompts[i] << " adapter " << adapter;
      EXPECT_EQ(got.text, want->front().text) << prompts[i];
      EXPECT_EQ(got.finish.usage().prompt_tokens(), static_cast<int>(ids->size()));
    }
  }
  ExpectNoLeaks();
}

TEST_F(EmbeddedClusterTest, BadRequestsGetPreciseCodes) {
  auto code_of = [&](const v1::GenerateRequest& r) { return Generate(stub_.get(), r, 10).status; };
  auto unknown = code_of(Request({1, 2, 3}, 4, "nobody"));
  EXPECT_EQ(unknown.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(unknown.error_message().find("'nobody'"), std::string::npos);
  std::vector<int32_t> huge(2048, 5);
  auto too_long = code_of(Request(huge, 4));
  EXPECT_EQ(too_long.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(too_long.error_message().find("context"), std::string::npos) << too_long.error_message();
  auto zero = code_of(Request({1, 2}, 0));
  EXPECT_EQ(zero.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(zero.error_message().find("max_tokens"), std::string::npos);
  auto over = code_of(Request({1, 2}, 5000));
  EXPECT_EQ(over.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  auto oov = code_of(Request({1, 99999}, 2));
  EXPECT_EQ(oov.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  v1::GenerateRequest bad_utf8;
  bad_utf8.set_text(std::string("abc\xff\xfe", 5));
  EXPECT_EQ(code_of(bad_utf8).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  v1::GenerateRequest empty;
  EXPECT_EQ(code_of(empty).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  v1::GenerateRequest oversized;
  oversized.set_text(std::string(20 << 20, 'a'));
  EXPECT_EQ(code_of(oversized).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  auto bad_p = Request({1, 2}, 2);
  bad_p.mutable_sampling()->set_top_p(2.f);
  EXPECT_EQ(code_of(bad_p).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // Enum values this server does not know are refused, not served as the default.
  auto bad_positions = Request({1, 2}, 2, "lora");
  bad_positions.set_adapter_positions(static_cast<v1::AdapterPositions>(99));
  const grpc::Status positions = code_of(bad_positions);
  EXPECT_EQ(positions.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(positions.error_message().find("adapter_positions 99"), std::string::npos);
  auto bad_mode = Request({1, 2}, 2);
  bad_mode.mutable_sampling()->set_logprobs_mode(static_cast<v1::LogprobsMode>(7));
  EXPECT_EQ(code_of(bad_mode).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // A deadline the request cannot meet: it ends mid-flight and leaves nothing behind.
  auto slow = Request({1, 2, 3}, 2040);
  EXPECT_EQ(Generate(stub_.get(), slow, 0.02).status.error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  ExpectNoLeaks();
}

TEST_F(EmbeddedClusterTest, NoCapacityWithinTheDeadlineIsResourceExhausted) {
  HoldDecodeKv(1600);  // most of both decode workers' KV
  auto r = Request({1, 2, 3}, 1000);
  auto s = Generate(stub_.get(), r, 60).status;  // admission timeout (2 s) < deadline
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_NE(s.error_message().find("room"), std::string::npos) << s.error_message();
  // With a client deadline shorter than the admission timeout, the answer comes before it.
  s = Generate(stub_.get(), r, 1).status;
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  // Small requests still fit beside the reservations.
  EXPECT_TRUE(Generate(stub_.get(), Request({1, 2, 3}, 8), 60).status.ok());
  ReleaseHeldKv();
  ExpectNoLeaks();
}

// A call waiting for KV room (a timer, no thread) ends at once when its client cancels or an
// Abort names it, not at the admission deadline.
TEST_F(EmbeddedClusterTest, CancellingOrAbortingAWaitForRoomEndsItAtOnce) {
  HoldDecodeKv(1600);
  v1::GenerateRequest r = Request({1, 2, 3}, 1000);
  r.set_request_id("waiting-one");
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  const absl::Time start = absl::Now();
  std::thread canceller([&] {
    absl::SleepFor(absl::Milliseconds(300));
    ctx.TryCancel();
  });
  auto reader = stub_->Generate(&ctx, r);
  v1::GenerateResponse msg;
  while (reader->Read(&msg)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  canceller.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(1.5));  // the admission timeout is 2 s
  // Abort: the stream ends OK with finish ABORT, at once. Another id: the cancelled call may
  // still be unwinding in the router (its id taken) when the client has already seen CANCELLED.
  // The abort is repeated while the router answers NOT_FOUND (on a loaded machine the request
  // may not be admitted 300 ms in).
  r.set_request_id("waiting-two");
  absl::Time aborted_at = absl::InfiniteFuture();
  std::thread aborter([&] {
    absl::SleepFor(absl::Milliseconds(300));
    const absl::Time give_up = absl::Now() + absl::Seconds(10);
    grpc::Status s;
    do {
      grpc::ClientContext actx;
      v1::AbortRequest a;
      a.set_request_id("waiting-two");
      v1::AbortResponse out;
      s = stub_->Abort(&actx, a, &out);
      if (s.error_code() == grpc::StatusCode::NOT_FOUND) absl::SleepFor(absl::Milliseconds(20));
    } while (s.error_code() == grpc::StatusCode::NOT_FOUND && absl::Now() < give_up);
    EXPECT_TRUE(s.ok()) << s.error_message();
    aborted_at = absl::Now();
  });
  const auto aborted = Generate(stub_.get(), r, 60);
  const absl::Time ended = absl::Now();
  aborter.join();
  EXPECT_TRUE(aborted.status.ok()) << aborted.status.error_message();
  EXPECT_EQ(aborted.finish.reason(), v1::FINISH_REASON_ABORT);
  EXPECT_LT(ended - aborted_at, absl::Seconds(1));  // the admission timeout is 2 s
  ReleaseHeldKv();
  ExpectNoLeaks();
}

TEST_F(EmbeddedClusterTest, CancellingMidStreamFreesBothTiers) { CancelMidStream(); }

TEST_F(EmbeddedClusterTest, AbortEndsTheStreamWithFinishAbort) { AbortMidStream(); }

TEST_F(EmbeddedClusterTest, MixedLoadEqualsOneEngine) { MixedLoadEqualsOneEngine(); }

TEST_F(EmbeddedClusterTest, RepeatedPromptsReportCachedTokens) {
  RepeatedPromptsReportCachedTokens();
}

// Both tiers store bf16 KV: the prompt's KV crosses in bf16, and every mode's tokens equal one
// engine's with bf16 KV (bf16 is not f32, so equal to that engine, not to the f32 fixture).
class Bf16KvClusterTest : public EmbeddedClusterTest {
 protected:
  void Configure(EmbeddedClusterOptions* o) override {
    o->prefill_kv_dtype = o->decode_kv_dtype = "bf16";
  }
};

TEST_F(Bf16KvClusterTest, MixedLoadEqualsOneEngineWithBf16Kv) {
  for (const auto& w : cluster_->pool().decode()) {  // what the decode tier advertises
    absl::MutexLock lock(&w->mu);
    EXPECT_NE(w->status.endpoint().layout().find("dtype=bf16"), std::string::npos)
        << w->status.endpoint().layout();
  }
  MixedLoadEqualsOneEngine(kv::KvDtype::kBF16);
}

// The same with fp8 e4m3 KV: a quarter of f32's bytes cross, and nothing changes on the way.
class Fp8KvClusterTest : public EmbeddedClusterTest {
 protected:
  void Configure(EmbeddedClusterOptions* o) override {
    o->prefill_kv_dtype = o->decode_kv_dtype = "fp8_e4m3";
  }
};

TEST_F(Fp8KvClusterTest, MixedLoadEqualsOneEngineWithFp8Kv) {
  for (const auto& w : cluster_->pool().decode()) {
    absl::MutexLock lock(&w->mu);
    EXPECT_NE(w->status.endpoint().layout().find("dtype=fp8_e4m3"), std::string::npos)
        << w->status.endpoint().layout();
  }
  MixedLoadEqualsOneEngine(kv::KvDtype::kFp8E4M3);
}

// Tiers that store KV differently are refused at once, naming both dtypes and the flag: the
// KV is never converted on the way, and nothing waits for KV that cannot come.
class MismatchedKvDtypeTest : public EmbeddedClusterTest {
 protected:
  void Configure(EmbeddedClusterOptions* o) override {
    o->prefill_kv_dtype = "f32";
    o->decode_kv_dtype = "bf16";
  }
};

TEST_F(MismatchedKvDtypeTest, RequestsAreRefusedNamingBothDtypes) {
  const testing::GenerateOutcome out = Generate(stub_.get(), Request({1, 2, 3}, 4), 10);
  EXPECT_EQ(out.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << out.status.error_message();
  EXPECT_NE(out.status.error_message().find(
                "stores KV as bf16, this worker as f32; start prefill and decode workers with "
                "the same --kv-dtype"),
            std::string::npos)
      << out.status.error_message();
  ExpectNoLeaks();
}

TEST_F(EmbeddedClusterTest, AdapterAdminListsUpdatesAndUnregisters) {
  grpc::ClientContext lctx;
  v1::ListModelsResponse models;
  ASSERT_TRUE(stub_->ListModels(&lctx, v1::ListModelsRequest(), &models).ok());
  EXPECT_EQ(models.base().architecture(), "LlamaForCausalLM");
  EXPECT_EQ(models.adapters_size(), 3);
  // Outside the root: refused.
  grpc::ClientContext rctx;
  v1::RegisterAdapterRequest reg;
  reg.set_name("evil");
  reg.set_path("../../etc");
  v1::RegisterAdapterResponse rr;
  EXPECT_EQ(stub_->RegisterAdapter(&rctx, reg, &rr).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  // LoadAdapter puts it in a compute slot on the workers asked for, before any request.
  {
    grpc::ClientContext ctx;
    v1::LoadAdapterRequest req;
    req.set_name("direft");
    req.set_num_workers(2);
    v1::LoadAdapterResponse resp;
    const grpc::Status s = stub_->LoadAdapter(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    int resident = 0;
    for (const auto& w : resp.adapter().workers())
      resident += w.residency() == v1::ADAPTER_RESIDENCY_RESIDENT && w.version() == 1;
    EXPECT_EQ(resident, 2);
    grpc::ClientContext ctx2;
    req.set_name("nobody");
    EXPECT_EQ(stub_->LoadAdapter(&ctx2, req, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  // Version 2 of "lora" carries lora_rs's weights: requests after the update see them.
  auto before = Generate(stub_.get(), Request({7, 8, 9, 10}, 8, "lora", v1::ADAPTER_POSITIONS_ALL));
  auto rs = Generate(stub_.get(), Request({7, 8, 9, 10}, 8, "lora_rs", v1::ADAPTER_POSITIONS_ALL));
  ASSERT_TRUE(before.status.ok() && rs.status.ok());
  ASSERT_NE(before.token_ids, rs.token_ids);
  {
    grpc::ClientContext ctx;
    v1::UpdateAdapterResponse resp;
    auto w = stub_->UpdateAdapter(&ctx, &resp);
    v1::UpdateAdapterRequest h;
    h.mutable_header()->set_name("lora");
    h.mutable_header()->set_expected_version(1);
    ASSERT_TRUE(w->Write(h));
    for (const char* f : {"adapter_config.json", "adapter_model.safetensors"}) {
      auto bytes = base::ReadFileToString((*root_ / "lora_rs" / f).string());
      ASSERT_TRUE(bytes.ok());
      v1::UpdateAdapterRequest c;
      c.mutable_chunk()->set_file_name(f);
      c.mutable_chunk()->set_data(*bytes);
      ASSERT_TRUE(w->Write(c));
    }
    w->WritesDone();
    ASSERT_TRUE(w->Finish().ok());
    EXPECT_EQ(resp.version(), 2);
  }
  auto after = Generate(stub_.get(), Request({7, 8, 9, 10}, 8, "lora", v1::ADAPTER_POSITIONS_ALL));
  ASSERT_TRUE(after.status.ok()) << after.status.error_message();
  EXPECT_EQ(after.token_ids, rs.token_ids);
  EXPECT_EQ(after.finish.adapter_version(), 2);

  grpc::ClientContext uctx;
  v1::UnloadAdapterRequest un;
  un.set_name("lora");
  un.set_unregister(true);
  v1::UnloadAdapterResponse ur;
  ASSERT_TRUE(stub_->UnloadAdapter(&uctx, un, &ur).ok());
  EXPECT_EQ(Generate(stub_.get(), Request({1, 2}, 2, "lora")).status.error_code(),
            grpc::StatusCode::NOT_FOUND);
  ExpectNoLeaks();
}

TEST_F(EmbeddedClusterTest, DrainFinishesRunningStreamsAndRefusesNewOnes) {
  std::thread running([&] {
    auto out = Generate(stub_.get(), Request({1, 2, 3}, 60));
    EXPECT_TRUE(out.status.ok()) << out.status.error_message();
    EXPECT_EQ(out.token_ids.size(), 60u);
  });
  absl::SleepFor(absl::Milliseconds(200));
  cluster_->router().StartDrain();
  EXPECT_EQ(Generate(stub_.get(), Request({1, 2}, 2)).status.error_code(),
            grpc::StatusCode::UNAVAILABLE);
  running.join();
  cluster_->Drain(absl::Seconds(5));
}

// PreFT-only decode workers (no adapters at all): LoRAP and DiReFTP work; a request whose
// adapter must also run on generated tokens is refused up front, naming the fix.
class PreftOnlyClusterTest : public EmbeddedClusterTest {
 protected:
  void Configure(EmbeddedClusterOptions* o) override { o->decode.all_position_adapters = false; }
};

TEST_F(PreftOnlyClusterTest, PromptOnlyAdaptersServeAllPositionAdaptersAreRefused) {
  for (const char* a : {"lora", "direft"}) {
    auto ok = Generate(stub_.get(), Request({5, 6, 7}, 6, a, v1::ADAPTER_POSITIONS_PROMPT));
    EXPECT_TRUE(ok.status.ok()) << a << ": " << ok.status.error_message();
    EXPECT_EQ(ok.finish.adapter_positions(), v1::ADAPTER_POSITIONS_PROMPT);
    auto refused = Generate(stub_.get(), Request({5, 6, 7}, 6, a, v1::ADAPTER_POSITIONS_ALL));
    EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << a;
    EXPECT_NE(refused.status.error_message().find("--adapters all-positions"), std::string::npos)
        << refused.status.error_message();
  }
  ExpectNoLeaks();
}

// The same through the "grpc" KV transport (the fallback where UCX is absent): blocks stream
// over DecodeWorker.WriteKv on the decode workers' own servers.
class GrpcTransportClusterTest : public EmbeddedClusterTest {
 protected:
  void Configure(EmbeddedClusterOptions* o) override { o->transport.kind = "grpc"; }
};

TEST_F(GrpcTransportClusterTest, ReproducesEveryFixtureModeConcurrently) {
  ReproduceFixtureModes();
  EXPECT_EQ(cluster_->decode(0).endpoint().transport(), "grpc");
}

// Hostile WriteKv streams are refused with precise codes and write nothing.
TEST_F(GrpcTransportClusterTest, BadKvChunksAreRefused) {
  auto decode = cluster_->pool().decode().front();
  auto send = [&](const std::vector<worker::v1::KvChunk>& chunks) {
    grpc::ClientContext ctx;
    worker::v1::KvWriteAck ack;
    auto w = decode->stub->WriteKv(&ctx, &ack);
    for (const auto& c : chunks) w->Write(c);
    w->WritesDone();
    return w->Finish();
  };
  worker::v1::KvChunk wrong_layout;
  wrong_layout.set_layout_hash(12345);
  const grpc::Status a = send({wrong_layout});
  EXPECT_EQ(a.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(a.error_message().find("layout"), std::string::npos) << a.error_message();
  // The right hash (from the worker's advertised address), then a block out of range.
  const std::string address = cluster_->decode(0).endpoint().address();
  const std::vector<std::string> parts = absl::StrSplit(address, absl::MaxSplits('|', 3));
  ASSERT_EQ(parts.size(), 4u);
  worker::v1::KvChunk bad_block;
  uint64_t hash = 0;
  ASSERT_TRUE(absl::SimpleAtoi(parts[2], &hash));
  bad_block.set_layout_hash(hash);
  bad_block.set_layer(0);
  bad_block.set_block(1 << 30);
  bad_block.set_data("xx");
  const grpc::Status b = send({bad_block});
  EXPECT_EQ(b.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(b.error_message().find("out of range"), std::string::npos) << b.error_message();
  ExpectNoLeaks();
}

TEST_F(EmbeddedClusterTest, WriteKvNeedsTheGrpcTransport) {
  grpc::ClientContext ctx;
  worker::v1::KvWriteAck ack;
  auto w = cluster_->pool().decode().front()->stub->WriteKv(&ctx, &ack);
  w->WritesDone();
  EXPECT_EQ(w->Finish().error_code(), grpc::StatusCode::FAILED_PRECONDITION);
}

// UpdateAdapter streams that break the protocol are refused and change nothing.
TEST_F(EmbeddedClusterTest, HostileUpdateStreamsAreRefused) {
  auto update = [&](const std::vector<v1::UpdateAdapterRequest>& msgs) {
    grpc::ClientContext ctx;
    v1::UpdateAdapterResponse resp;
    auto w = stub_->UpdateAdapter(&ctx, &resp);
    for (const auto& m : msgs) w->Write(m);
    w->WritesDone();
    return w->Finish();
  };
  v1::UpdateAdapterRequest header;
  header.mutable_header()->set_name("lora");
  auto chunk = [](const std::string& file, const std::string& data) {
    v1::UpdateAdapterRequest c;
    c.mutable_chunk()->set_file_name(file);
    c.mutable_chunk()->set_data(data);
    return c;
  };
  auto expect = [](const grpc::Status& s, grpc::StatusCode code, const std::string& part) {
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    EXPECT_NE(s.error_message().find(part), std::string::npos) << s.error_message();
  };
  expect(update({chunk("adapter_config.json", "{}")}), grpc::StatusCode::INVALID_ARGUMENT,
         "first message must be the header");
  expect(update({}), grpc::StatusCode::INVALID_ARGUMENT, "no header");
  expect(update({header}), grpc::StatusCode::INVALID_ARGUMENT, "no files");
  expect(update({header, chunk("../../evil.sh", "x")}), grpc::StatusCode::INVALID_ARGUMENT,
         "is not adapter_config.json");
  expect(update({header, header}), grpc::StatusCode::INVALID_ARGUMENT, "only the first");
  expect(update({header, chunk("adapter_config.json", "{"), chunk("adapter_model.safetensors", "x"),
                 chunk("adapter_config.json", "}")}),
         grpc::StatusCode::INVALID_ARGUMENT, "interleaved");
  v1::UpdateAdapterRequest stale = header;
  stale.mutable_header()->set_expected_version(7);
  expect(update({stale, chunk("adapter_config.json", "{}")}),
         grpc::StatusCode::FAILED_PRECONDITION, "version 1");
  // Garbage files: validated before the swap, so version 1 stays.
  EXPECT_FALSE(update({header, chunk("adapter_config.json", "not json"),
                       chunk("adapter_model.safetensors", "garbage")})
                   .ok());
  grpc::ClientContext ctx;
  v1::ListAdaptersRequest req;
  req.set_name("lora");
  v1::ListAdaptersResponse resp;
  ASSERT_TRUE(stub_->ListAdapters(&ctx, req, &resp).ok());
  EXPECT_EQ(resp.adapters(0).version(), 1);
}


// Bearer tokens and limits at the router (issue 5's security points).
class AccessClusterTest : public EmbeddedClusterTest {
 protected:
  static constexpr char kApi[] = "api-secret-1";
  static constexpr char kAdmin[] = "admin-secret-2";
  void Configure(EmbeddedClusterOptions* o) override {
    o->router.access.api_token = kApi;
    o->router.access.admin_token = kAdmin;
    o->router.access.max_streams_per_client = 2;
    o->router.max_prompt_tokens = 8;
    o->router.admission_timeout = absl::Seconds(20);
    o->max_request_bytes = 4096;
  }

  grpc::Status Register(const std::string& bearer, const std::string& name) {
    grpc::ClientContext ctx;
    if (!bearer.empty()) ctx.AddMetadata("authorization", bearer);
    v1::RegisterAdapterRequest req;
    req.set_name(name);
    req.set_path("lora");
    v1::RegisterAdapterResponse r;
    return stub_->RegisterAdapter(&ctx, req, &r);
  }
};

TEST_F(AccessClusterTest, TokensGuardGenerationAndAdmin) {
  const auto r = Request({1, 2, 3}, 4);
  auto code = [&](const std::string& token) {
    return Generate(stub_.get(), r, 60, nullptr, token).status.error_code();
  };
  EXPECT_EQ(code(""), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(code("wrong"), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(code(std::string(kApi) + "x"), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(code(kApi), grpc::StatusCode::OK);
  EXPECT_EQ(code(kAdmin), grpc::StatusCode::OK);
  auto missing = Generate(stub_.get(), r, 60);
  EXPECT_NE(missing.status.error_message().find("authorization: Bearer"), std::string::npos)
      << missing.status.error_message();
  {
    grpc::ClientContext ctx;
    v1::ListModelsResponse m;
    EXPECT_EQ(stub_->ListModels(&ctx, v1::ListModelsRequest(), &m).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", std::string("bearer ") + kApi);  // any case
    v1::ListModelsResponse m;
    EXPECT_TRUE(stub_->ListModels(&ctx, v1::ListModelsRequest(), &m).ok());
  }
  // Admin: the API token is not enough.
  EXPECT_EQ(Register("", "x1").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Register(std::string("Bearer ") + kApi, "x1").error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(Register("Basic dXNlcjpwYXNz", "x1").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(Register(std::string("Bearer ") + kAdmin, "x1").ok());
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", std::string("Bearer ") + kApi);
    v1::UpdateAdapterResponse r;
    auto writer = stub_->UpdateAdapter(&ctx, &r);
    v1::UpdateAdapterRequest header;
    header.mutable_header()->set_name("x1");
    writer->Write(header);
    writer->WritesDone();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::PERMISSION_DENIED);
  }
  {
    grpc::ClientContext ctx;
    v1::UnloadAdapterRequest req;
    req.set_name("x1");
    v1::UnloadAdapterResponse r;
    EXPECT_EQ(stub_->UnloadAdapter(&ctx, req, &r).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  ExpectNoLeaks();
}

TEST_F(AccessClusterTest, PromptAndRequestSizeLimits) {
  auto at_limit = Generate(stub_.get(), Request({1, 2, 3, 4, 5, 6, 7, 8}, 2), 60, nullptr, kApi);
  EXPECT_TRUE(at_limit.status.ok()) << at_limit.status.error_message();
  auto over = Generate(stub_.get(), Request({1, 2, 3, 4, 5, 6, 7, 8, 9}, 2), 60, nullptr, kApi);
  EXPECT_EQ(over.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(over.status.error_message().find("at most 8 (--max-prompt-tokens)"), std::string::npos)
      << over.status.error_message();
  v1::GenerateRequest big = Request({1}, 2);
  big.set_text(std::string(5000, 'a'));  // over the 4096-byte message limit
  auto huge = Generate(stub_.get(), big, 60, nullptr, kApi);
  EXPECT_EQ(huge.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << huge.status.error_message();
  ExpectNoLeaks();
}

TEST_F(AccessClusterTest, ConcurrentStreamsPerClientAreCapped) {
  HoldDecodeKv(2040);  // every decode block: the client's streams wait for room, open
  std::vector<testing::GenerateOutcome> waiting(2);
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; ++i) {
    threads.emplace_back(
        [&, i] { waiting[i] = Generate(stub_.get(), Request({1, 2, 3}, 40), 60, nullptr, kApi); });
  }
  // Both streams are in (waiting for KV) before the third is tried.
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (cluster_->router().active_requests() < 2 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(cluster_->router().active_requests(), 2);
  auto third = Generate(stub_.get(), Request({1, 2, 3}, 4), 60, nullptr, kApi);
  EXPECT_EQ(third.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(third.status.error_message().find("already has 2 streams open"), std::string::npos)
      << third.status.error_message();
  ReleaseHeldKv();
  for (auto& t : threads) t.join();
  for (const auto& w : waiting) EXPECT_TRUE(w.status.ok()) << w.status.error_message();
  // The slots were given back: the client may open streams again.
  EXPECT_TRUE(Generate(stub_.get(), Request({1, 2, 3}, 4), 60, nullptr, kApi).status.ok());
  ExpectNoLeaks();
}


// Without tokens configured, a made-up bearer value names no one: the stream cap counts the
// peer, so inventing a token per request does not get past it.
class OpenAccessClusterTest : public EmbeddedClusterTest {
 protected:
  void Configure(EmbeddedClusterOptions* o) override {
    o->router.access.max_streams_per_client = 2;
    o->router.admission_timeout = absl::Seconds(20);
  }
};

TEST_F(OpenAccessClusterTest, InventedTokensDoNotMakeNewClients) {
  HoldDecodeKv(2040);
  std::vector<testing::GenerateOutcome> waiting(2);
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; ++i) {
    threads.emplace_back([&, i] {
      waiting[i] = Generate(stub_.get(), Request({1, 2, 3}, 40), 60, nullptr,
                            "made-up-" + std::to_string(i));
    });
  }
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (cluster_->router().active_requests() < 2 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(cluster_->router().active_requests(), 2);
  auto third = Generate(stub_.get(), Request({1, 2, 3}, 4), 60, nullptr, "made-up-2");
  EXPECT_EQ(third.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << third.status.error_message();
  ReleaseHeldKv();
  for (auto& t : threads) t.join();
  for (const auto& w : waiting) EXPECT_TRUE(w.status.ok()) << w.status.error_message();
  ExpectNoLeaks();
}

// The C++ SDK (clients/cpp) against the cluster.
class ClientSdkTest : public EmbeddedClusterTest {};

TEST_F(ClientSdkTest, GeneratesStreamsCancelsAndAdministers) {
  client::ClientOptions o;
  o.address = cluster_->address();
  auto sdk = client::Client::Connect(o);
  ASSERT_TRUE(sdk.ok()) << sdk.status();
  client::Client& c = **sdk;
  // Every fixture case the SDK can ask for, equal to transformers + PEFT + pyreft.
  auto text = base::ReadFileToString(testing::TinyLlamaFixture() + "/reference.json");
  ASSERT_TRUE(text.ok());
  for (const auto& ref : nlohmann::json::parse(*text)["cases"]) {
    client::GenerateParams p;
    if (!ref["adapter"].is_null()) {
      p.model = ref["adapter"];
      p.positions = ref["adapter_positions"] == "prompt" ? v1::ADAPTER_POSITIONS_PROMPT
                                                         : v1::ADAPTER_POSITIONS_ALL;
    }
    p.max_tokens = static_cast<int32_t>(ref["token_ids"].size());
    p.ignore_eos = true;
    int deltas = 0;
    auto out = c.Generate(client::Prompt::Ids(ref["prompt_ids"].get<std::vector<int32_t>>()), p,
                          [&](const v1::GenerateResponse&) { return ++deltas > 0; });
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->token_ids, ref["token_ids"].get<std::vector<int32_t>>()) << ref["adapter"];
    EXPECT_GE(deltas, 1);
    EXPECT_EQ(out->finish.reason(), v1::FINISH_REASON_LENGTH);
  }
  // A callback that says stop cancels the generation; both tiers let go.
  client::GenerateParams long_run;
  long_run.max_tokens = 1500;
  long_run.ignore_eos = true;
  auto stopped = c.Generate(client::Prompt::Text("stop me"), long_run,
                            [](const v1::GenerateResponse&) { return false; });
  EXPECT_EQ(stopped.status().code(), absl::StatusCode::kCancelled);
  // Abort from another thread ends the stream with reason ABORT.
  long_run.request_id = "sdk-abort";
  std::thread aborter([&] {
    // NotFound until the router has taken the request.
    const absl::Time until = absl::Now() + absl::Seconds(10);
    absl::Status s = c.Abort("sdk-abort");
    while (absl::IsNotFound(s) && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(1));
      s = c.Abort("sdk-abort");
    }
    EXPECT_TRUE(s.ok()) << s;
  });
  auto aborted = c.Generate(client::Prompt::Text("abort me"), long_run);
  aborter.join();
  ASSERT_TRUE(aborted.ok()) << aborted.status();
  EXPECT_EQ(aborted->finish.reason(), v1::FINISH_REASON_ABORT);
  EXPECT_EQ(c.Abort("no-such-request").code(), absl::StatusCode::kNotFound);
  // Adapter admin and errors as absl statuses.
  auto models = c.ListModels();
  ASSERT_TRUE(models.ok());
  EXPECT_EQ(models->adapters_size(), 3);
  auto info = c.RegisterAdapter("sdk", "lora");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->version(), 1);
  int64_t last_sent = 0, last_total = -1;
  auto updated = c.UpdateAdapter("sdk", testing::TinyLlamaFixture() + "/lora",
                                 [&](int64_t sent, int64_t total) {
                                   EXPECT_GT(sent, last_sent);
                                   last_sent = sent;
                                   last_total = total;
                                 });
  ASSERT_TRUE(updated.ok()) << updated.status();
  EXPECT_EQ(updated->version(), 2);
  EXPECT_EQ(last_sent, last_total);
  EXPECT_EQ(updated->bytes_received(), last_total);
  EXPECT_EQ(c.UpdateAdapter("sdk", "/no/such/dir").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(c.UnloadAdapter("sdk", /*unregister=*/true).ok());
  EXPECT_EQ(c.UnloadAdapter("sdk").code(), absl::StatusCode::kNotFound);
  client::GenerateParams unknown;
  unknown.model = "nobody";
  EXPECT_EQ(c.Generate(client::Prompt::Text("x"), unknown).status().code(),
            absl::StatusCode::kNotFound);
  auto healthy = c.Healthy();
  ASSERT_TRUE(healthy.ok());
  EXPECT_TRUE(*healthy);
  ExpectNoLeaks();
}

}  // namespace
}  // namespace preft::tools
