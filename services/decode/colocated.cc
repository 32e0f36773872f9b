// The colocated path (DecodeServiceOptions::colocated): Run takes a whole request, leases its
// adapter and hands the engine a local request, whose prompt it computes in the same continuous
// batch as every other request's decode. What vLLM runs without disaggregation; benchmarks
// compare it with the disaggregated path on the same engine and the same code.

#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "common/rpc/status.h"
#include "services/decode/decode_impl.h"
#include "services/wire/convert.h"

namespace preft::decode {

absl::Status DecodeService::Impl::BeginRun(const std::shared_ptr<StartStream>& stream,
                                           const worker::v1::RunRequest& req) {
  if (!options.colocated) {
    return absl::FailedPreconditionError(
        "this decode worker is not colocated: it decodes prompts prefill workers computed "
        "(Reserve, Start); start it with --colocated to serve Run");
  }
  PREFT_RETURN_IF_ERROR(ValidatePrompt(req.request_id(), req.prompt_ids()));
  const engine::SamplingParams sampling = wire::FromProto(req.sampling());
  PREFT_RETURN_IF_ERROR(sampling.Validate(config.vocab_size));
  const bool with_adapter = !req.adapter().empty();
  if (with_adapter && req.adapter_path().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("adapter '", req.adapter(), "' is given without adapter_path"));
  }
  if (with_adapter && req.adapter_version() < 1) {
    return absl::InvalidArgumentError(absl::StrCat("adapter_version of adapter '", req.adapter(),
                                                   "' is ", req.adapter_version(),
                                                   "; versions start at 1"));
  }
  engine::Request request;
  request.id = req.request_id();
  request.prompt_ids.assign(req.prompt_ids().begin(), req.prompt_ids().end());
  request.sampling = sampling;
  {
    absl::MutexLock lock(&mu);
    if (stopping) return absl::UnavailableError("decode worker is shutting down");
    if (draining) return absl::UnavailableError("decode worker is draining: run elsewhere");
    Start& start = starts.at(stream.get());
    start.request = std::move(request);
    start.adapter_pending = with_adapter;
    if (!with_adapter && !start.cancelled) CommitRunLocked(start);
  }
  if (with_adapter) {
    // Loads off the engine thread; on a compute hit the callback runs here, at once.
    versioned->Acquire(req.adapter(), req.adapter_version(), req.adapter_path(),
                       [this, stream, positions = wire::FromProto(req.adapter_positions())](
                           absl::StatusOr<adapters::AdapterPin> pin) {
                         OnRunAdapter(stream, positions, std::move(pin));
                       });
  }
  return absl::OkStatus();
}

void DecodeService::Impl::OnRunAdapter(const std::shared_ptr<StartStream>& stream,
                                       std::optional<model::AdapterPositions> positions,
                                       absl::StatusOr<adapters::AdapterPin> pin) {
  if (!pin.ok()) {
    stream->Fail(pin.status());
    return;
  }
  stream->ResolveAdapterPositions(
      wire::ToProto(positions.value_or(pin->weights->default_positions)));
  absl::MutexLock lock(&mu);
  auto it = starts.find(stream.get());
  // Ended or cancelled meanwhile: the pin is dropped, nothing reaches the engine.
  if (it == starts.end() || it->second.cancelled || stopping) return;
  Start& start = it->second;
  start.request.adapter =
      engine::RequestAdapter{pin->weights, pin->name, pin->version, positions};
  start.adapter_pending = false;
  CommitRunLocked(start);
}

void DecodeService::Impl::CommitRunLocked(Start& start) {
  start.committed = true;
  engine::Request request = std::move(start.request);
  std::shared_ptr<StartStream> stream = start.stream;
  request.on_token = [stream](const engine::TokenEvent& e) { stream->OnEvent(e); };
  loop->Post([request = std::move(request), stream](engine::Engine& e) mutable {
    const absl::Status s = e.Add(std::move(request));
    if (!s.ok()) stream->Fail(s);
  });
}

}  // namespace preft::decode
