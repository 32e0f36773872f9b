#include "common/rpc/server.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"
#include "proto/preft/v1/preft.grpc.pb.h"
#include "tests/rpc/fake_preft_service.h"

namespace preft::rpc {
namespace {

using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

ServerOptions Serving(grpc::Service* service, const std::string& address = "127.0.0.1:0") {
  ServerOptions options;
  options.address = address;
  options.services = {service};
  return options;
}

// Every client call carries a deadline, so a broken server fails the test instead of hanging.
void SetDeadline(grpc::ClientContext* context) {
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
}

std::shared_ptr<grpc::Channel> Dial(const Server& server) {
  return grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials());
}

grpc::Status Check(Health::Stub* stub, const std::string& service, HealthCheckResponse* out) {
  grpc::ClientContext context;
  SetDeadline(&context);
  HealthCheckRequest request;
  request.set_service(service);
  return stub->Check(&context, request, out);
}

TEST(RpcServerTest, BindsAFreePortAndAnswersHealthServing) {
  fakes::FakePreftService preft;
  auto server = Server::Start(Serving(&preft));
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_GT((*server)->port(), 0);
  EXPECT_EQ((*server)->address(), "127.0.0.1:" + std::to_string((*server)->port()));

  auto stub = Health::NewStub(Dial(**server));
  HealthCheckResponse response;
  grpc::Status status = Check(stub.get(), "", &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.status(), HealthCheckResponse::SERVING);
}

TEST(RpcServerTest, HealthFollowsSetServingPerService) {
  fakes::FakePreftService preft;
  auto server = Server::Start(Serving(&preft));
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = Health::NewStub(Dial(**server));
  HealthCheckResponse response;
  EXPECT_EQ(Check(stub.get(), "preft.v1.Preft", &response).error_code(),
            grpc::StatusCode::NOT_FOUND);

  (*server)->SetServing("preft.v1.Preft", true);
  ASSERT_TRUE(Check(stub.get(), "preft.v1.Preft", &response).ok());
  EXPECT_EQ(response.status(), HealthCheckResponse::SERVING);

  (*server)->SetServing("preft.v1.Preft", false);
  ASSERT_TRUE(Check(stub.get(), "preft.v1.Preft", &response).ok());
  EXPECT_EQ(response.status(), HealthCheckResponse::NOT_SERVING);
  ASSERT_TRUE(Check(stub.get(), "", &response).ok());
  EXPECT_EQ(response.status(), HealthCheckResponse::SERVING);
}

TEST(RpcServerTest, RefusesBadOptions) {
  fakes::FakePreftService preft;
  EXPECT_EQ(Server::Start(Serving(&preft, "")).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Server::Start(Serving(&preft, "localhost")).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Server::Start(ServerOptions()).status().code(), absl::StatusCode::kInvalidArgument);
  ServerOptions no_size = Serving(&preft);
  no_size.max_receive_message_bytes = 0;
  EXPECT_EQ(Server::Start(no_size).status().code(), absl::StatusCode::kInvalidArgument);
  // Not an address of this machine.
  auto not_local = Server::Start(Serving(&preft, "192.0.2.1:0"));
  EXPECT_EQ(not_local.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(not_local.status().message().find("192.0.2.1:0"), absl::string_view::npos);
}

TEST(RpcServerTest, PortInUseIsUnavailable) {
  fakes::FakePreftService preft;
  auto first = Server::Start(Serving(&preft));
  ASSERT_TRUE(first.ok()) << first.status();
  fakes::FakePreftService other;
  auto second = Server::Start(Serving(&other, (*first)->address()));
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << second.status();
  EXPECT_NE(second.status().message().find((*first)->address()), absl::string_view::npos);
}

TEST(RpcServerTest, OversizedMessagesAreRefused) {
  fakes::FakePreftService preft;
  ServerOptions options = Serving(&preft);
  options.max_receive_message_bytes = 1024;
  auto server = Server::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = v1::Preft::NewStub(Dial(**server));
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::GenerateRequest request;
  request.set_text(std::string(4096, 'x'));
  auto reader = stub->Generate(&context, request);
  v1::GenerateResponse response;
  EXPECT_FALSE(reader->Read(&response));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
}

// A stream the server never ends by itself: Shutdown must cancel it after the grace period
// and return.
TEST(RpcServerTest, ShutdownCancelsStreamsAndDoesNotHang) {
  fakes::FakePreftService preft;
  auto server = Server::Start(Serving(&preft));
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = v1::Preft::NewStub(Dial(**server));

  absl::Notification first_read;
  grpc::Status stream_status;
  std::thread client([&] {
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::GenerateRequest request;
    request.set_request_id("hang");
    request.set_text("hi");
    auto reader = stub->Generate(&context, request);
    v1::GenerateResponse response;
    EXPECT_TRUE(reader->Read(&response));
    EXPECT_EQ(response.request_id(), "hang");
    first_read.Notify();
    while (reader->Read(&response)) {
    }
    stream_status = reader->Finish();
  });
  first_read.WaitForNotification();

  const absl::Time start = absl::Now();
  (*server)->Shutdown(absl::Milliseconds(200));
  const absl::Duration took = absl::Now() - start;
  client.join();
  EXPECT_LT(took, absl::Seconds(10));
  EXPECT_FALSE(stream_status.ok());
  EXPECT_NE(stream_status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << "the client's deadline ran out: Shutdown did not cancel the stream";

  // Idempotent, and the destructor after it is a no-op.
  (*server)->Shutdown(absl::Seconds(5));
  server->reset();
}

TEST(RpcServerTest, ShutdownRefusesNewCalls) {
  fakes::FakePreftService preft;
  auto server = Server::Start(Serving(&preft));
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = Health::NewStub(Dial(**server));
  (*server)->Shutdown(absl::ZeroDuration());
  HealthCheckResponse response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  HealthCheckRequest request;
  EXPECT_FALSE(stub->Check(&context, request, &response).ok());
}

}  // namespace
}  // namespace preft::rpc
