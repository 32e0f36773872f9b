#include "services/wire/request_convert.h"

namespace preft::wire {

engine::SamplingParams FromProto(const v1::SamplingParams& p) {
  engine::SamplingParams s;
  s.temperature = p.temperature();
  if (p.has_top_p()) s.top_p = p.top_p();
  s.top_k = p.top_k();
  s.min_p = p.min_p();
  if (p.has_seed()) s.seed = p.seed();
  if (p.has_max_tokens()) s.max_tokens = p.max_tokens();
  s.stop.assign(p.stop().begin(), p.stop().end());
  s.stop_token_ids.assign(p.stop_token_ids().begin(), p.stop_token_ids().end());
  s.ignore_eos = p.ignore_eos();
  if (p.has_logprobs()) s.logprobs = p.logprobs();
  s.logprobs_mode = p.logprobs_mode() == v1::LOGPROBS_MODE_PROCESSED
                        ? engine::LogprobsMode::kProcessed
                        : engine::LogprobsMode::kRaw;
  return s;
}

v1::SamplingParams ToProto(const engine::SamplingParams& s) {
  v1::SamplingParams p;
  p.set_temperature(s.temperature);
  p.set_top_p(s.top_p);
  p.set_top_k(s.top_k);
  p.set_min_p(s.min_p);
  if (s.seed) p.set_seed(*s.seed);
  p.set_max_tokens(s.max_tokens);
  for (const std::string& stop : s.stop) p.add_stop(stop);
  for (int32_t id : s.stop_token_ids) p.add_stop_token_ids(id);
  p.set_ignore_eos(s.ignore_eos);
  if (s.logprobs) p.set_logprobs(*s.logprobs);
  p.set_logprobs_mode(s.logprobs_mode == engine::LogprobsMode::kProcessed
                          ? v1::LOGPROBS_MODE_PROCESSED
                          : v1::LOGPROBS_MODE_RAW);
  return p;
}

engine::TokenLogprob FromProto(const v1::TokenLogprob& p) {
  engine::TokenLogprob l;
  l.token_id = p.token_id();
  l.logprob = p.logprob();
  for (const v1::TopLogprob& t : p.top()) l.top.emplace_back(t.token_id(), t.logprob());
  return l;
}

v1::TokenLogprob ToProto(const engine::TokenLogprob& l) {
  v1::TokenLogprob p;
  p.set_token_id(l.token_id);
  p.set_logprob(l.logprob);
  for (const auto& [id, lp] : l.top) {
    v1::TopLogprob* t = p.add_top();
    t->set_token_id(id);
    t->set_logprob(lp);
  }
  return p;
}

std::optional<model::AdapterPositions> FromProto(v1::AdapterPositions p) {
  switch (p) {
    case v1::ADAPTER_POSITIONS_PROMPT:
      return model::AdapterPositions::kPrompt;
    case v1::ADAPTER_POSITIONS_ALL:
      return model::AdapterPositions::kAll;
    default:
      return std::nullopt;
  }
}

v1::AdapterPositions ToProto(std::optional<model::AdapterPositions> p) {
  if (!p) return v1::ADAPTER_POSITIONS_UNSPECIFIED;
  return *p == model::AdapterPositions::kPrompt ? v1::ADAPTER_POSITIONS_PROMPT
                                                : v1::ADAPTER_POSITIONS_ALL;
}

v1::FinishReason ToProto(engine::FinishReason r) {
  switch (r) {
    case engine::FinishReason::kLength:
      return v1::FINISH_REASON_LENGTH;
    case engine::FinishReason::kStop:
      return v1::FINISH_REASON_STOP;
    case engine::FinishReason::kAbort:
      return v1::FINISH_REASON_ABORT;
    default:
      return v1::FINISH_REASON_UNSPECIFIED;
  }
}

const char* FinishReasonName(v1::FinishReason r) {
  switch (r) {
    case v1::FINISH_REASON_LENGTH:
      return "length";
    case v1::FINISH_REASON_STOP:
      return "stop";
    case v1::FINISH_REASON_ABORT:
      return "abort";
    default:
      return "";
  }
}

}  // namespace preft::wire
