#pragma once

// Request types (sampling, logprobs, adapter positions, finish reasons) <-> their protos
// (preft.v1), converted once at the edge of every service. The router links this alone.

#include <optional>

#include "common/engine/request.h"
#include "common/engine/request_params.h"
#include "common/model/adapter_weights.h"
#include "proto/preft/v1/preft.pb.h"

namespace preft::wire {

// Unset fields take the engine's defaults. Values are range-checked later by
// SamplingParams::Validate (which names the field).
engine::SamplingParams FromProto(const v1::SamplingParams& p);
// Every field set (seed included when known), so the far side uses exactly these.
v1::SamplingParams ToProto(const engine::SamplingParams& s);

engine::TokenLogprob FromProto(const v1::TokenLogprob& p);
v1::TokenLogprob ToProto(const engine::TokenLogprob& l);

// UNSPECIFIED: nullopt (the adapter's default).
std::optional<model::AdapterPositions> FromProto(v1::AdapterPositions p);
v1::AdapterPositions ToProto(std::optional<model::AdapterPositions> p);

// kNone and kError have no proto value (an error is the call's status): UNSPECIFIED.
v1::FinishReason ToProto(engine::FinishReason r);
// "length", "stop", "abort"; "" for unspecified.
const char* FinishReasonName(v1::FinishReason r);

}  // namespace preft::wire
