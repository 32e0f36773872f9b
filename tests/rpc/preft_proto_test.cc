// The generated preft.v1 and preft.worker.v1 code compiles and works end to end: a fake
// Preft service streams two responses through a real server on loopback.

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>

#include "common/rpc/server.h"
#include "proto/preft/v1/preft.grpc.pb.h"
#include "proto/preft/v1/worker.grpc.pb.h"
#include "tests/rpc/fake_preft_service.h"

namespace preft::rpc {
namespace {

void SetDeadline(grpc::ClientContext* context) {
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
}

TEST(RpcPreftProtoTest, FakePreftStreamsTwoResponses) {
  fakes::FakePreftService preft;
  ServerOptions options;
  options.services = {&preft};
  auto server = Server::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = v1::Preft::NewStub(
      grpc::CreateChannel((*server)->address(), grpc::InsecureChannelCredentials()));

  grpc::ClientContext context;
  SetDeadline(&context);
  v1::GenerateRequest request;
  request.set_request_id("r1");
  request.mutable_token_ids()->add_ids(1);
  request.mutable_token_ids()->add_ids(2);
  request.set_model("alice-lorap");
  request.set_adapter_positions(v1::ADAPTER_POSITIONS_PROMPT);
  request.mutable_sampling()->set_seed(42);
  request.mutable_sampling()->set_logprobs(2);
  request.set_stream(true);
  auto reader = stub->Generate(&context, request);

  v1::GenerateResponse first;
  ASSERT_TRUE(reader->Read(&first));
  EXPECT_EQ(first.request_id(), "r1");
  EXPECT_EQ(first.token_ids_size(), 2);
  EXPECT_EQ(first.text(), "he");
  EXPECT_FALSE(first.has_finish());

  v1::GenerateResponse second;
  ASSERT_TRUE(reader->Read(&second));
  EXPECT_EQ(second.token_ids_size(), 1);
  EXPECT_EQ(second.text(), "llo");
  ASSERT_TRUE(second.has_finish());
  EXPECT_EQ(second.finish().reason(), v1::FINISH_REASON_STOP);
  EXPECT_EQ(second.finish().usage().prompt_tokens(), 2);
  EXPECT_EQ(second.finish().usage().completion_tokens(), 3);
  EXPECT_EQ(second.finish().adapter(), "alice-lorap");
  EXPECT_EQ(second.finish().adapter_version(), 7);

  v1::GenerateResponse none;
  EXPECT_FALSE(reader->Read(&none));
  const grpc::Status status = reader->Finish();
  EXPECT_TRUE(status.ok()) << status.error_message();
}

TEST(RpcPreftProtoTest, UnimplementedMethodsAnswerUnimplemented) {
  fakes::FakePreftService preft;
  ServerOptions options;
  options.services = {&preft};
  auto server = Server::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = grpc::CreateChannel((*server)->address(), grpc::InsecureChannelCredentials());

  // A method of the served service the fake does not override.
  {
    auto stub = v1::Preft::NewStub(channel);
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::ListModelsResponse response;
    EXPECT_EQ(stub->ListModels(&context, v1::ListModelsRequest(), &response).error_code(),
              grpc::StatusCode::UNIMPLEMENTED);
  }
  // The worker services' stubs compile and reach the server (which does not serve them).
  {
    auto stub = worker::v1::DecodeWorker::NewStub(channel);
    grpc::ClientContext context;
    SetDeadline(&context);
    worker::v1::ReserveRequest request;
    request.set_num_tokens(17);
    request.set_lease_ms(1000);
    worker::v1::ReserveResponse response;
    EXPECT_EQ(stub->Reserve(&context, request, &response).error_code(),
              grpc::StatusCode::UNIMPLEMENTED);
  }
  {
    auto stub = worker::v1::PrefillWorker::NewStub(channel);
    grpc::ClientContext context;
    SetDeadline(&context);
    worker::v1::PrefillStatusResponse response;
    EXPECT_EQ(stub->Status(&context, worker::v1::PrefillStatusRequest(), &response).error_code(),
              grpc::StatusCode::UNIMPLEMENTED);
  }
}

TEST(RpcPreftProtoTest, UpdateAdapterRequestsSerialiseRoundTrip) {
  v1::UpdateAdapterRequest header;
  header.mutable_header()->set_name("alice");
  header.mutable_header()->set_expected_version(3);
  v1::UpdateAdapterRequest chunk;
  chunk.mutable_chunk()->set_file_name("adapter_model.safetensors");
  chunk.mutable_chunk()->set_data(std::string("\0\1\2", 3));

  v1::UpdateAdapterRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(header.SerializeAsString()));
  EXPECT_EQ(parsed.kind_case(), v1::UpdateAdapterRequest::kHeader);
  EXPECT_TRUE(parsed.header().has_expected_version());
  ASSERT_TRUE(parsed.ParseFromString(chunk.SerializeAsString()));
  EXPECT_EQ(parsed.kind_case(), v1::UpdateAdapterRequest::kChunk);
  EXPECT_EQ(parsed.chunk().data().size(), 3u);

  // proto3 `optional`: an unset seed is distinguishable from seed 0.
  v1::SamplingParams sampling;
  EXPECT_FALSE(sampling.has_seed());
  sampling.set_seed(0);
  EXPECT_TRUE(sampling.has_seed());
}

}  // namespace
}  // namespace preft::rpc
