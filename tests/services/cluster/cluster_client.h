#pragma once

// A blocking client of the public API for cluster tests: one Generate call, every message.

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "proto/preft/v1/preft.grpc.pb.h"

namespace preft::testing {

struct GenerateOutcome {
  grpc::Status status;
  std::vector<int32_t> token_ids;
  std::string text;
  std::vector<v1::TokenLogprob> logprobs;
  v1::Finish finish;
  int messages = 0;
};

inline std::unique_ptr<v1::Preft::Stub> PreftStub(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(64 << 20);
  return v1::Preft::NewStub(
      grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
}

// `on_message` (optional) sees each message as it arrives and may cancel `ctx`; `bearer`
// (optional) is sent as the authorization token.
inline GenerateOutcome Generate(v1::Preft::Stub* stub, const v1::GenerateRequest& request,
                                double timeout_s = 120,
                                std::function<void(const v1::GenerateResponse&,
                                                   grpc::ClientContext*)> on_message = nullptr,
                                const std::string& bearer = "") {
  grpc::ClientContext ctx;
  if (!bearer.empty()) ctx.AddMetadata("authorization", "Bearer " + bearer);
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
  auto reader = stub->Generate(&ctx, request);
  GenerateOutcome out;
  v1::GenerateResponse msg;
  while (reader->Read(&msg)) {
    ++out.messages;
    out.token_ids.insert(out.token_ids.end(), msg.token_ids().begin(), msg.token_ids().end());
    out.text += msg.text();
    out.logprobs.insert(out.logprobs.end(), msg.logprobs().begin(), msg.logprobs().end());
    if (msg.has_finish()) out.finish = msg.finish();
    if (on_message) on_message(msg, &ctx);
  }
  out.status = reader->Finish();
  return out;
}

}  // namespace preft::testing
