#include "services/router/generate_call.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "common/log/log.h"
#include "common/rpc/status.h"
#include "services/wire/kv_path.h"
#include "services/wire/request_convert.h"

namespace preft::router {

GenerateCall::GenerateCall(RouterService::Impl* router, const v1::GenerateRequest& request,
                           Caller caller, std::chrono::system_clock::time_point deadline,
                           GenerateClient* client)
    : router_(router),
      client_(client),
      request_(request),
      arrival_(absl::Now()) {
  client->call_ = this;
  // At arrival (cheap: a token compare, a count), so the call keeps no copy of its caller.
  access_ = router->access->Authorize(caller, Scope::kApi);
  if (access_.ok()) {
    absl::StatusOr<Access::Slot> slot = router->access->OpenStream(caller);
    if (slot.ok()) {
      slot_ = std::move(slot).value();
    } else {
      access_ = slot.status();
    }
  }
  client_deadline_ = deadline;
  has_deadline_ = client_deadline_ <
                  std::chrono::system_clock::time_point::max() - std::chrono::hours(24 * 365);
  // Waiting for capacity ends before the client's deadline, so the client hears
  // RESOURCE_EXHAUSTED (no room) rather than a bare DEADLINE_EXCEEDED.
  admission_deadline_ = absl::Now() + router->options.admission_timeout;
  if (has_deadline_) {
    const absl::Time deadline = absl::FromChrono(client_deadline_);
    const absl::Duration margin = std::max(absl::Milliseconds(20), (deadline - absl::Now()) / 10);
    admission_deadline_ = std::min(admission_deadline_, deadline - margin);
  }
  Drive();  // runs until its first wait, then from callbacks
}

void GenerateCall::WriteDone(bool ok) {
  write_ok_ = ok;
  write_.Complete();
}

void GenerateCall::Cancel() { Interrupt(&cancelled_); }

void GenerateCall::Abort() { Interrupt(&aborted_); }

void GenerateCall::WatchDeadline() {
  if (!has_deadline_) return;
  deadline_watch_ = std::make_shared<DeadlineWatch>();
  deadline_watch_->call = this;
  deadline_alarm_ = std::make_unique<grpc::Alarm>();
  deadline_alarm_->Set(client_deadline_, [watch = deadline_watch_](bool fired) {
    if (!fired) return;  // cancelled: the call ended first
    std::lock_guard<std::mutex> lock(watch->mu);
    GenerateCall* call = watch->call;
    if (call == nullptr) return;
    {
      std::lock_guard<std::mutex> call_lock(call->mu_);
      call->expired_ = true;
    }
    call->Interrupt(&call->cancelled_);  // starts nothing inline (see Interrupt)
  });
}

void GenerateCall::UnwatchDeadline() {
  if (deadline_watch_ == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(deadline_watch_->mu);
    deadline_watch_->call = nullptr;
  }
  deadline_alarm_.reset();  // cancels it; its callback holds only the watch
}

void GenerateCall::Interrupt(bool* reason) {
  std::shared_ptr<grpc::Alarm> waiting;
  std::shared_ptr<DecodeStream> stream;
  {
    std::lock_guard<std::mutex> lock(mu_);
    *reason = true;
    if (current_ != nullptr) current_->TryCancel();
    waiting = waiting_;
    stream = stream_;
  }
  if (waiting != nullptr) waiting->Cancel();
  // Cancelling a stream resumes the relay reading it on the cancelling thread: not this one,
  // which may hold locks the call takes on its way out (the router's, for Abort; the OpenAI
  // door's choice).
  if (stream != nullptr) router_->cpu->Post([stream] { stream->Cancel(); });
}

void GenerateCall::Track(grpc::ClientContext* ctx) {
  if (has_deadline_) ctx->set_deadline(client_deadline_);
  std::lock_guard<std::mutex> lock(mu_);
  current_ = ctx;
  if (cancelled_ || aborted_) ctx->TryCancel();
}

void GenerateCall::Track(const std::shared_ptr<DecodeStream>& stream) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stream_ = stream;
    if (!cancelled_ && !aborted_) return;
  }
  stream->Cancel();
}

void GenerateCall::ReserveDeadline(grpc::ClientContext* ctx) const {
  const auto bound = std::chrono::system_clock::now() + std::chrono::seconds(10);
  ctx->set_deadline(has_deadline_ ? std::min(client_deadline_, bound) : bound);
}

void GenerateCall::Untrack() {
  std::lock_guard<std::mutex> lock(mu_);
  current_ = nullptr;
  stream_ = nullptr;
}

bool GenerateCall::stopped() {
  std::lock_guard<std::mutex> lock(mu_);
  return cancelled_ || aborted_;
}

rpc::Task<bool> GenerateCall::Write(const v1::GenerateResponse& response) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (cancelled_) co_return false;  // nobody reads
  }
  struct Awaiter {
    GenerateCall* call;
    const v1::GenerateResponse* msg;
    bool await_ready() const noexcept { return false; }
    bool await_suspend(std::coroutine_handle<> h) {
      call->write_.Reset();
      call->client_->StartWrite(msg);
      return call->write_.Suspend(h);
    }
    void await_resume() const noexcept {}
  };
  co_await Awaiter{this, &response};
  std::lock_guard<std::mutex> lock(mu_);
  co_return write_ok_ && !cancelled_;
}

rpc::Detached GenerateCall::Drive() {
  router_->metrics->Started();
  {
    std::lock_guard<std::mutex> lock(router_->mu);
    ++router_->threads;  // work in flight: the service's destructor waits for it
  }
  WatchDeadline();
  // Admission tokenises and may read the registry: CPU and disk work, off the callback thread.
  co_await rpc::ResumeOn(router_->cpu.get());
  absl::Status status = co_await Run();
  UnwatchDeadline();
  // Before the client hears the end: it may open its next stream at once, while gRPC destroys
  // this call (and would free the slot) only later.
  slot_ = Access::Slot();
  router_->metrics->Ended(status, positions_, absl::Now() - arrival_, prompt_tokens_,
                          completion_tokens_);
  {
    std::lock_guard<std::mutex> lock(router_->mu);
    auto it = router_->active.find(id_);
    if (it != router_->active.end() && it->second == this) router_->active.erase(it);
  }
  RouterService::Impl* router = router_;
  client_->Finish(status);  // `this` may be deleted from here on
  std::lock_guard<std::mutex> lock(router->mu);
  if (--router->threads == 0) router->idle.notify_all();
}

void GenerateCall::ObserveTokens(int n) {
  const absl::Time now = absl::Now();
  RouterMetrics& m = *router_->metrics;
  const bool first = last_token_at_ == absl::InfinitePast();
  if (first) {
    m.FirstToken(positions_, now - arrival_);
    if (prefilled_at_ != absl::InfinitePast()) m.Stage("decode_start", now - prefilled_at_);
    --n;  // the first token has no gap before it
  }
  // Tokens that arrive together share the gap since the previous message.
  const absl::Duration gap = first || n == 0 ? absl::ZeroDuration() : (now - last_token_at_) / n;
  for (int i = 0; i < n; ++i) m.InterToken(gap);
  last_token_at_ = now;
}

rpc::Task<absl::Status> GenerateCall::AbortedResult() {
  bool cancelled, expired;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled = cancelled_;
    expired = expired_;
  }
  if (expired) co_return absl::DeadlineExceededError("Deadline Exceeded");
  if (cancelled) co_return absl::CancelledError("cancelled by the client");
  // Abort RPC: an ordinary end with finish ABORT.
  v1::GenerateResponse last;
  last.set_request_id(id_);
  last.mutable_finish()->set_reason(v1::FINISH_REASON_ABORT);
  last.mutable_finish()->mutable_usage()->set_completion_tokens(completion_tokens_);
  co_await Write(last);
  co_return absl::OkStatus();
}

absl::Status GenerateCall::Admit(std::vector<int32_t>* prompt,
                                 std::optional<RegisteredAdapter>* adapter,
                                 engine::SamplingParams* sampling) {
  const model::ModelConfig& c = router_->config;
  switch (request_.prompt_case()) {
    case v1::GenerateRequest::kText: {
      if (router_->tokenizer == nullptr) {
        return absl::FailedPreconditionError("the base model has no tokenizer: send token_ids");
      }
      PREFT_ASSIGN_OR_RETURN(*prompt, router_->tokenizer->Encode(request_.text()));
      break;
    }
    case v1::GenerateRequest::kTokenIds:
      prompt->assign(request_.token_ids().ids().begin(), request_.token_ids().ids().end());
      break;
    default:
      return absl::InvalidArgumentError("prompt: set text or token_ids");
  }
  PREFT_RETURN_IF_ERROR(engine::ValidatePrompt(*prompt, c));
  const int64_t n = static_cast<int64_t>(prompt->size());
  const int64_t max_prompt = router_->options.max_prompt_tokens;
  if (max_prompt > 0 && n > max_prompt) {
    return absl::InvalidArgumentError(absl::StrCat("prompt has ", n,
                                                   " tokens; this server accepts at most ",
                                                   max_prompt, " (--max-prompt-tokens)"));
  }
  if (!request_.model().empty() && request_.model() != router_->options.base_name) {
    PREFT_ASSIGN_OR_RETURN(RegisteredAdapter a, router_->registry->Get(request_.model()));
    *adapter = std::move(a);
  }
  if (!v1::AdapterPositions_IsValid(request_.adapter_positions())) {
    return absl::InvalidArgumentError(absl::StrCat("adapter_positions ",
                                                   request_.adapter_positions(),
                                                   " is not an AdapterPositions"));
  }
  if (!v1::LogprobsMode_IsValid(request_.sampling().logprobs_mode())) {
    return absl::InvalidArgumentError(absl::StrCat("sampling.logprobs_mode ",
                                                   request_.sampling().logprobs_mode(),
                                                   " is not a LogprobsMode"));
  }
  *sampling = wire::FromProto(request_.sampling());
  if (!request_.sampling().has_max_tokens())
    sampling->max_tokens = router_->options.default_max_tokens;
  PREFT_RETURN_IF_ERROR(sampling->Validate(c.vocab_size));
  if (n + sampling->max_tokens > c.max_position_embeddings) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_tokens ", sampling->max_tokens, " + prompt of ", n,
                     " tokens exceeds the context of ", c.max_position_embeddings));
  }
  if (!sampling->seed) {
    std::lock_guard<std::mutex> lock(router_->mu);
    sampling->seed = router_->rng();
  }
  return absl::OkStatus();
}

int64_t GenerateCall::LeaseMs() const {
  // Long enough for the prompt to wait its turn on a busy prefill worker: the configured lease,
  // or the client's whole deadline when that is longer (decode workers clip it to their maximum).
  absl::Duration lease = router_->options.lease;
  if (has_deadline_) lease = std::max(lease, absl::FromChrono(client_deadline_) - absl::Now());
  return absl::ToInt64Milliseconds(lease);
}

worker::v1::ReserveRequest GenerateCall::ReserveRequestFor(int64_t prompt_tokens, int64_t max_new,
                                                           uint64_t retry_of) const {
  worker::v1::ReserveRequest req;
  req.set_request_id(id_);
  req.set_num_tokens(static_cast<int32_t>(prompt_tokens));
  req.set_max_new_tokens(static_cast<int32_t>(max_new));
  req.set_lease_ms(LeaseMs());
  req.set_retry_of(retry_of);
  return req;
}

absl::StatusOr<GenerateCall::DecodeChoice> GenerateCall::DecodeCandidates(int64_t prompt_tokens,
                                                                         int64_t max_new) {
  DecodeChoice c;
  c.workers = router_->pool->decode();
  for (const auto& w : c.workers) {
    absl::MutexLock lock(&w->mu);
    c.views.push_back(w->view);
    c.views.back().kv_path_suspect = absl::Now() < w->kv_path_suspect_until;
  }
  const DecodeNeeds needs{router_->options.colocated, needs_decode_adapter_, prompt_tokens,
                          max_new};
  PREFT_ASSIGN_OR_RETURN(c.blocks, EligibleDecode(&c.views, needs));
  return c;
}

rpc::Task<absl::StatusOr<GenerateCall::Reservation>> GenerateCall::Reserve(int64_t prompt_tokens,
                                                                          int64_t max_new) {
  std::string last_error = "no decode worker is known";
  for (;;) {
    if (stopped()) co_return absl::CancelledError("cancelled");
    PREFT_CO_ASSIGN_OR_RETURN(const DecodeChoice c, DecodeCandidates(prompt_tokens, max_new));
    const auto& workers = c.workers;
    for (size_t i : RankDecode(c.views, c.blocks)) {
      grpc::ClientContext ctx;
      ReserveDeadline(&ctx);
      const worker::v1::ReserveRequest req = ReserveRequestFor(prompt_tokens, max_new, 0);
      Reservation res;
      const grpc::Status reserved = co_await rpc::Unary([&](auto done) {
        workers[i]->stub->async()->Reserve(&ctx, &req, &res.r, std::move(done));
      });
      const absl::Status s = rpc::FromGrpcStatus(reserved);
      if (s.ok()) {
        router_->metrics->Routed("decode", "most_free");
        res.worker = workers[i];
        {
          absl::MutexLock lock(&workers[i]->mu);  // until the next poll says otherwise
          workers[i]->view.free_blocks -= res.r.block_ids_size();
          ++workers[i]->view.queue_depth;
        }
        if (stopped()) {  // cancelled or aborted while reserving
          Release(res, "cancelled");
          co_return absl::CancelledError("cancelled");
        }
        co_return res;
      }
      if (stopped()) co_return absl::CancelledError("cancelled");
      last_error = absl::StrCat(workers[i]->address, ": ", s.message());
      router_->metrics->Retried("decode", s);
      if (s.code() == absl::StatusCode::kUnavailable) WorkerPool::MarkUnhealthy(*workers[i]);
      if (s.code() == absl::StatusCode::kDeadlineExceeded && has_deadline_) co_return s;
    }
    if (absl::Now() >= admission_deadline_) {
      co_return absl::ResourceExhaustedError(absl::StrCat(
          "no decode worker had room for the request before the deadline (last: ", last_error,
          ")"));
    }
    co_await WaitForCapacity();
  }
}

rpc::Task<bool> GenerateCall::WaitForCapacity() {
  router_->metrics->WaitingForCapacity(true);
  auto alarm = std::make_shared<grpc::Alarm>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (cancelled_ || aborted_) {
      router_->metrics->WaitingForCapacity(false);
      co_return false;
    }
    waiting_ = alarm;
  }
  // Cancel() from OnCancel or Abort ends the wait early.
  const bool waited = co_await rpc::Sleep(absl::Milliseconds(20), alarm.get());
  {
    std::lock_guard<std::mutex> lock(mu_);
    waiting_ = nullptr;
  }
  router_->metrics->WaitingForCapacity(false);
  co_return waited;
}

std::vector<uint64_t> GenerateCall::PrefixKeys(const std::optional<RegisteredAdapter>& adapter,
                                               const std::vector<int32_t>& prompt,
                                               int64_t block_tokens) {
  return adapter ? PrefixAffinity::Keys(adapter->name, adapter->version, prompt, block_tokens)
                 : PrefixAffinity::Keys("", 0, prompt, block_tokens);
}

rpc::Task<absl::StatusOr<worker::v1::PrefillResponse>> GenerateCall::Prefill(
    Reservation* res, const std::vector<int32_t>& prompt,
    const std::optional<RegisteredAdapter>& adapter, const engine::SamplingParams& sampling) {
  WorkerAttempts attempts(router_->options.max_prefill_attempts, "no prefill worker is available");
  // Where the prompt's prefix was sent last, its KV is probably cached.
  const std::vector<uint64_t> keys = PrefixKeys(adapter, prompt, res->r.block_tokens());
  while (!attempts.exhausted()) {
    if (stopped()) co_return absl::CancelledError("cancelled");
    const auto workers = router_->pool->prefill();
    const auto match = router_->prefix_affinity.Match(keys);
    std::vector<PrefillView> views;
    for (const auto& w : workers) {
      absl::MutexLock lock(&w->mu);
      PrefillView v = w->view;
      if (const auto it = match.find(w->address); it != match.end()) v.prefix_blocks = it->second;
      if (adapter) {
        for (const auto& a : w->status.adapters()) {
          if (a.name() != adapter->name || a.version() != adapter->version) continue;
          v.adapter_resident = a.residency() == v1::ADAPTER_RESIDENCY_RESIDENT;
          v.adapter_loading = a.residency() == v1::ADAPTER_RESIDENCY_LOADING;
        }
      }
      views.push_back(v);
    }
    attempts.ExcludeTried(workers, &views);
    const std::vector<size_t> order =
        RankPrefill(views, adapter.has_value(), adapter ? adapter->bytes : 0);
    if (order.empty()) {
      if (absl::Now() >= admission_deadline_) {
        co_return absl::UnavailableError(
            absl::StrCat("no prefill worker could run the prompt (last: ", attempts.last_error(),
                         ")"));
      }
      co_await WaitForCapacity();
      attempts.ForgetTriedIfAllFailed(workers.size());
      continue;
    }
    const auto& w = workers[order.front()];
    router_->prefix_affinity.Record(keys, w->address);
    router_->metrics->Routed(
        "prefill", adapter ? ResidencyName(Classify(views[order.front()], true, adapter->bytes))
                   : views[order.front()].prefix_blocks > 0 ? "prefix"
                                                             : "base");
    worker::v1::PrefillRequest req;
    req.set_request_id(id_);
    for (int32_t t : prompt) req.add_prompt_ids(t);
    if (adapter) {
      req.set_adapter(adapter->name);
      req.set_adapter_path(adapter->path);
      req.set_adapter_version(adapter->version);
      req.set_adapter_positions(request_.adapter_positions());
    }
    *req.mutable_sampling() = wire::ToProto(sampling);
    req.set_reservation_id(res->r.reservation_id());
    req.set_generation(res->r.generation());
    *req.mutable_block_ids() = res->r.block_ids();
    req.set_block_tokens(res->r.block_tokens());
    *req.mutable_decode_endpoint() = res->r.endpoint();
    {
      absl::MutexLock lock(&w->mu);
      ++w->view.queue_depth;  // until the next poll
    }
    grpc::ClientContext ctx;
    Track(&ctx);
    worker::v1::PrefillResponse out;
    const grpc::Status prefilled = co_await rpc::Unary(
        [&](auto done) { w->stub->async()->Prefill(&ctx, &req, &out, std::move(done)); });
    const absl::Status s = rpc::FromGrpcStatus(prefilled);
    Untrack();
    if (s.ok()) co_return out;
    if (stopped()) co_return absl::CancelledError("cancelled");
    // The request itself is bad: no other worker helps.
    if (!RetryElsewhere(s, /*client_saw_output=*/false)) co_return s;
    if (ctx.GetServerTrailingMetadata().count(wire::kKvPathFailedKey) > 0) {
      // The decode worker's side of the KV path failed, not this prefill worker: hold that
      // decode worker back and move the reservation (over shared memory a sender killed
      // mid-message can leave a receiver deaf for good: docs/ARCHITECTURE.md).
      router_->metrics->Retried("kv_path", s);
      attempts.FailedElsewhere(w->address, s);
      log::Warn(log::Request{id_},
                "KV could not reach decode worker {} ({}); holding it back for {} and retrying "
                "elsewhere",
                res->worker->address, s, absl::FormatDuration(router_->options.kv_path_suspect));
      res->worker->SuspectKvPath(router_->options.kv_path_suspect);
      const absl::Status moved = co_await MoveReservation(res, prompt.size(), sampling.max_tokens,
                                                          s, "KV path failed; re-reserving");
      PREFT_CO_RETURN_IF_ERROR(moved);
      continue;
    }
    AttemptFailed("prefill", *w, s, &attempts);
    // Same reservation, next generation: late writes of the failed attempt cannot land in it.
    grpc::ClientContext rctx;
    ReserveDeadline(&rctx);
    const worker::v1::ReserveRequest rr = ReserveRequestFor(
        static_cast<int64_t>(prompt.size()), sampling.max_tokens, res->r.reservation_id());
    worker::v1::ReserveResponse next;
    const grpc::Status again = co_await rpc::Unary([&](auto done) {
      res->worker->stub->async()->Reserve(&rctx, &rr, &next, std::move(done));
    });
    const absl::Status rs = rpc::FromGrpcStatus(again);
    if (rs.ok()) {
      res->r = std::move(next);
      continue;
    }
    if (stopped()) co_return absl::CancelledError("cancelled");
    // No fresh blocks there right now: queue for room again, on any decode worker.
    const absl::Status moved = co_await MoveReservation(res, prompt.size(), sampling.max_tokens,
                                                        s, "prefill failed; re-reserving");
    PREFT_CO_RETURN_IF_ERROR(moved);
  }
  co_return absl::UnavailableError(absl::StrCat("prefill failed on ", attempts.max_attempts(),
                                             " workers (last: ", attempts.last_error(), ")"));
}

rpc::Task<absl::Status> GenerateCall::MoveReservation(Reservation* res, int64_t prompt_tokens,
                                                     int64_t max_new, const absl::Status& failure,
                                                     const std::string& reason) {
  Release(*res, reason);  // its blocks are quarantined there against late writes
  absl::StatusOr<Reservation> again = co_await Reserve(prompt_tokens, max_new);
  if (!again.ok()) {
    co_return absl::Status(again.status().code(),
                           absl::StrCat("prefill failed (", failure.message(),
                                        ") and its retry found no KV room: ",
                                        again.status().message()));
  }
  *res = std::move(again).value();
  co_return absl::OkStatus();
}

void GenerateCall::Release(const Reservation& res, const std::string& reason) {
  // Not tracked (it must run even when the call was cancelled) and not awaited: the call lives
  // on the heap until its answer, keeping the worker's stub alive.
  struct Call {
    grpc::ClientContext ctx;
    worker::v1::ReleaseRequest req;
    worker::v1::ReleaseResponse out;
    std::shared_ptr<DecodeWorker> worker;
  };
  auto* call = new Call;
  call->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  call->req.set_reservation_id(res.r.reservation_id());
  call->req.set_generation(res.r.generation());
  call->req.set_reason(reason);
  call->worker = res.worker;
  call->worker->stub->async()->Release(&call->ctx, &call->req, &call->out,
                                       [call](grpc::Status) { delete call; });
}

rpc::Task<absl::Status> GenerateCall::Decode(const Reservation& res,
                                            const std::vector<int32_t>& prompt,
                                            const std::optional<RegisteredAdapter>& adapter,
                                            const engine::SamplingParams& sampling,
                                            const worker::v1::PrefillResponse& first) {
  worker::v1::StreamOpen open;
  worker::v1::StartRequest& req = *open.mutable_start();
  req.set_reservation_id(res.r.reservation_id());
  req.set_generation(res.r.generation());
  req.set_request_id(id_);
  for (int32_t t : prompt) req.add_prompt_ids(t);
  req.set_first_token_id(first.first_token_id());
  req.set_cached_tokens(first.cached_tokens());
  if (first.has_first_logprob()) *req.mutable_first_logprob() = first.first_logprob();
  *req.mutable_sampling() = wire::ToProto(sampling);
  if (adapter) {
    req.set_adapter_version(first.adapter_version());
    req.set_adapter_positions(first.adapter_positions());
    // Only the all-position baseline decodes with the adapter; PreFT decode never sees it.
    if (first.adapter_positions() == v1::ADAPTER_POSITIONS_ALL) {
      req.set_adapter(adapter->name);
      req.set_adapter_path(adapter->path);
    }
  }
  const std::shared_ptr<DecodeStream> stream = res.worker->OpenStream(std::move(open));
  Track(stream);
  std::optional<FinishAdapter> finish;
  if (adapter) finish = FinishAdapter{adapter->name, first.adapter_version(), first.adapter_positions()};
  Relayed relayed;
  co_await Relay(*stream, finish, &relayed);
  Untrack();
  // A Start that ended before it took the reservation (refused, or cancelled before the decode
  // worker saw it) leaves it held: give it back now rather than at lease expiry. A no-op for a
  // reservation the stream had started.
  if (completion_tokens_ == 0 && (relayed.client_gone || stopped() || !relayed.status.ok())) {
    Release(res, relayed.status.ok() || relayed.client_gone || stopped() ? "cancelled"
                                                                          : "start failed");
  }
  const absl::Status end = co_await RelayEnd(relayed, *res.worker);
  co_return end;
}

rpc::Task<bool> GenerateCall::Relay(DecodeStream& stream,
                                   const std::optional<FinishAdapter>& adapter, Relayed* relayed) {
  Relayed& out = *relayed;
  out.all.set_request_id(id_);
  v1::GenerateResponse msg;
  for (;;) {
    const bool more = co_await stream.Read(&msg);
    if (!more) break;
    msg.set_request_id(id_);
    completion_tokens_ += msg.token_ids_size();
    if (msg.token_ids_size() > 0) ObserveTokens(msg.token_ids_size());
    if (adapter && msg.has_finish()) {
      msg.mutable_finish()->set_adapter(adapter->name);
      msg.mutable_finish()->set_adapter_version(adapter->version);
      msg.mutable_finish()->set_adapter_positions(adapter->positions);
    }
    if (request_.stream()) {
      if (!out.client_gone) {
        const bool written = co_await Write(msg);
        if (!written) {
          out.client_gone = true;
          stream.Cancel();
        }
      }
    } else {
      out.all.mutable_token_ids()->MergeFrom(msg.token_ids());
      out.all.mutable_text()->append(msg.text());
      out.all.mutable_logprobs()->MergeFrom(msg.logprobs());
      if (msg.has_finish()) *out.all.mutable_finish() = msg.finish();
    }
  }
  out.status = stream.status();
  co_return true;
}

rpc::Task<absl::Status> GenerateCall::RelayEnd(const Relayed& relayed, DecodeWorker& worker) {
  if (stopped()) {  // first: a deadline also makes writes fail as if the client had gone
    const absl::Status aborted = co_await AbortedResult();
    co_return aborted;
  }
  if (relayed.client_gone) co_return absl::CancelledError("the client went away");
  const absl::Status& s = relayed.status;
  if (!s.ok()) {
    if (s.code() == absl::StatusCode::kUnavailable) {
      WorkerPool::MarkUnhealthy(worker);
      co_return absl::UnavailableError(
          absl::StrCat("decode worker ", worker.address, " failed mid-stream: ", s.message()));
    }
    co_return s;
  }
  if (!request_.stream()) co_await Write(relayed.all);
  co_return absl::OkStatus();
}

rpc::Task<absl::Status> GenerateCall::Run() {
  {
    std::lock_guard<std::mutex> lock(router_->mu);
    if (router_->draining) co_return absl::UnavailableError("the router is draining");
    id_ = request_.request_id().empty()
              ? absl::StrCat("req-", ++router_->next_id, "-", router_->rng() % 1000000)
              : request_.request_id();
    if (!router_->active.emplace(id_, this).second) {
      const std::string taken = id_;
      id_.clear();  // not ours to remove
      co_return absl::InvalidArgumentError(
          absl::StrCat("request id '", taken, "' is already running"));
    }
  }
  PREFT_CO_RETURN_IF_ERROR(access_);
  std::vector<int32_t> prompt;
  std::optional<RegisteredAdapter> adapter;
  engine::SamplingParams sampling;
  PREFT_CO_RETURN_IF_ERROR(Admit(&prompt, &adapter, &sampling));
  prompt_tokens_ = static_cast<int64_t>(prompt.size());
  if (adapter) {
    const std::optional<model::AdapterPositions> asked =
        wire::FromProto(request_.adapter_positions());
    needs_decode_adapter_ =
        asked.value_or(adapter->default_positions) == model::AdapterPositions::kAll;
    positions_ = needs_decode_adapter_ ? "all" : "prompt";
  }
  RouterMetrics& m = *router_->metrics;
  const absl::Time admitted = absl::Now();
  m.Stage("admit", admitted - arrival_);
  if (router_->options.colocated) {
    const absl::Status ran = co_await RunColocated(prompt, adapter, sampling);
    co_return ran;
  }

  const absl::Status ran = co_await RunDisaggregated(prompt, adapter, sampling, admitted);
  co_return ran;
}

rpc::Task<absl::Status> GenerateCall::RunDisaggregated(
    const std::vector<int32_t>& prompt, const std::optional<RegisteredAdapter>& adapter,
    const engine::SamplingParams& sampling, absl::Time admitted) {
  RouterMetrics& m = *router_->metrics;
  absl::StatusOr<Reservation> res =
      co_await Reserve(static_cast<int64_t>(prompt.size()), sampling.max_tokens);
  if (!res.ok()) {
    if (!stopped()) co_return res.status();
    const absl::Status aborted = co_await AbortedResult();
    co_return aborted;
  }
  const absl::Time reserved = absl::Now();
  m.QueueTime(reserved - arrival_);
  m.Stage("reserve", reserved - admitted);
  absl::StatusOr<worker::v1::PrefillResponse> first =
      co_await Prefill(&*res, prompt, adapter, sampling);
  if (!first.ok()) {
    Release(*res, stopped() ? "cancelled" : "prefill failed");
    if (!stopped()) co_return first.status();
    const absl::Status aborted = co_await AbortedResult();
    co_return aborted;
  }
  prefilled_at_ = absl::Now();
  const absl::Duration queue = absl::Microseconds(first->queue_us());
  const absl::Duration compute = absl::Microseconds(first->compute_us());
  const absl::Duration transfer = absl::Microseconds(first->transfer_us());
  m.Stage("prefill_queue", queue);
  m.Stage("prefill_compute", compute);
  m.Stage("kv_transfer", transfer);
  m.Stage("prefill_rpc",
          std::max(absl::ZeroDuration(), prefilled_at_ - reserved - queue - compute - transfer));
  const absl::Status decoded = co_await Decode(*res, prompt, adapter, sampling, *first);
  co_return decoded;
}

}  // namespace preft::router
