#include "common/rpc/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>
#include <grpcpp/support/channel_arguments.h>

#include <algorithm>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace preft::rpc {

absl::StatusOr<std::unique_ptr<Server>> Server::Start(const ServerOptions& options) {
  if (options.address.empty()) return absl::InvalidArgumentError("server address is empty");
  const size_t colon = options.address.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("server address \"", options.address, "\" has no port (host:port)"));
  }
  // gRPC adds its health service only after the builder has checked that something polls
  // its completion queues, so a server of health alone fails to build.
  if (options.services.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("no service to serve on ", options.address));
  }
  for (grpc::Service* service : options.services) {
    if (service == nullptr) return absl::InvalidArgumentError("null service in ServerOptions");
  }
  if (options.max_receive_message_bytes <= 0 || options.max_send_message_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("message size limits must be positive (max_receive_message_bytes = ",
                     options.max_receive_message_bytes,
                     ", max_send_message_bytes = ", options.max_send_message_bytes, ")"));
  }

  // Process-wide, read when a builder is made: must precede the builder. Reflection lets
  // generic tools (grpcurl, Postman, grpc_cli) discover every service without the .proto files.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(
      options.address,
      options.credentials != nullptr ? options.credentials : grpc::InsecureServerCredentials(),
      &port);
  // gRPC sets SO_REUSEPORT by default, so a second server on a taken port would silently
  // share it; refuse instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(options.max_receive_message_bytes);
  builder.SetMaxSendMessageSize(options.max_send_message_bytes);
  for (grpc::Service* service : options.services) builder.RegisterService(service);

  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve on ", options.address,
                     " (address in use, not local or malformed, or a service registered twice)"));
  }
  std::string address = absl::StrCat(options.address.substr(0, colon), ":", port);
  return std::unique_ptr<Server>(new Server(std::move(server), port, std::move(address)));
}

Server::Server(std::unique_ptr<grpc::Server> server, int port, std::string address)
    : server_(std::move(server)), port_(port), address_(std::move(address)) {}

Server::~Server() { Shutdown(absl::ZeroDuration()); }

std::shared_ptr<grpc::Channel> Server::InProcessChannel() {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
  return server_->InProcessChannel(args);
}

void Server::SetServing(const std::string& service, bool serving) {
  // The default health service ignores updates once shut down, so no lock of ours is needed
  // (and none may be held here: a reactor calling this must not wait on Shutdown).
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  if (health != nullptr) health->SetServingStatus(service, serving);
}

void Server::Shutdown(absl::Duration grace) {
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_started_) {
      mu_.Await(absl::Condition(&shut_down_));
      return;
    }
    shutdown_started_ = true;
  }
  // Every service NOT_SERVING, and later SetServing calls ignored.
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  if (health != nullptr) health->Shutdown();
  if (grace == absl::InfiniteDuration()) {
    server_->Shutdown();
  } else {
    server_->Shutdown(absl::ToChronoTime(absl::Now() + std::max(grace, absl::ZeroDuration())));
  }
  server_->Wait();
  absl::MutexLock lock(&mu_);
  shut_down_ = true;
}

}  // namespace preft::rpc
