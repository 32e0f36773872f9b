// The reservation life cycle (DESIGN.md §4): Reserve and retry, DONE notices, commit to the
// engine, Release, lease expiry and quarantine.

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "common/kv/blocks.h"
#include "common/rpc/status.h"
#include "services/decode/decode_impl.h"

namespace preft::decode {
namespace {

// How long a released or started reservation is remembered: Release stays idempotent and a
// late Start is told what happened instead of "unknown".
constexpr absl::Duration kRememberEnded = absl::Minutes(1);

}  // namespace

absl::StatusOr<DecodeService::Impl::ReservePlan> DecodeService::Impl::PlanReserve(
    const worker::v1::ReserveRequest& req) {
  if (options.colocated) {
    // Its local sequences grow and get preempted; an imported prompt must never be.
    return absl::FailedPreconditionError(
        "colocated decode worker: send Run (it computes prompts itself and takes no imported "
        "KV, so Reserve, Prefill and Start are not served here)");
  }
  const int64_t context = config.max_position_embeddings;
  if (req.num_tokens() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_tokens must be positive, got ", req.num_tokens()));
  }
  if (req.num_tokens() >= context) {
    return absl::InvalidArgumentError(absl::StrCat("num_tokens = ", req.num_tokens(),
                                                   " leaves no room in the model's context of ",
                                                   context, " tokens"));
  }
  if (req.max_new_tokens() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens must not be negative, got ", req.max_new_tokens()));
  }
  if (req.lease_ms() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("lease_ms must not be negative, got ", req.lease_ms()));
  }
  ReservePlan plan;
  // At least the first token, at most the context (the engine stops there).
  plan.max_new_tokens = std::clamp<int64_t>(req.max_new_tokens(), 1, context - req.num_tokens());
  plan.blocks = kv::BlocksFor(req.num_tokens() + plan.max_new_tokens, block_tokens);
  plan.lease = req.lease_ms() == 0
                   ? options.default_lease
                   : std::min(absl::Milliseconds(req.lease_ms()), options.max_lease);
  absl::MutexLock lock(&mu);
  if (stopping) return absl::UnavailableError("decode worker is shutting down");
  if (draining) return absl::UnavailableError("decode worker is draining: reserve elsewhere");
  return plan;
}

absl::Status DecodeService::Impl::ReserveOnEngine(engine::Engine& e,
                                                  const worker::v1::ReserveRequest& req,
                                                  const ReservePlan& plan,
                                                  worker::v1::ReserveResponse* resp,
                                                  Failures* failures) {
  absl::MutexLock lock(&mu);
  uint64_t id = req.retry_of();
  Reservation* retried = nullptr;
  if (id != 0) {
    auto it = reservations.find(id);
    if (it == reservations.end()) {
      return absl::NotFoundError(absl::StrCat("retry_of: reservation ", id, " is unknown"));
    }
    if (it->second.state == State::kStarted) {
      return absl::NotFoundError(
          absl::StrCat("retry_of: reservation ", id, " was started and cannot be retried"));
    }
    if (it->second.state == State::kReleased) {
      return absl::NotFoundError(absl::StrCat("retry_of: reservation ", id, " was released (",
                                              it->second.why_released, ")"));
    }
    retried = &it->second;
  }
  const int64_t free = e.allocator().num_free();
  if (plan.blocks > free) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "need ", plan.blocks, " KV blocks (", req.num_tokens(), " prompt + ", plan.max_new_tokens,
        " new tokens, ", block_tokens, " tokens per block); ", free, " of ", total_blocks,
        " blocks are free (", reserved_blocks, " reserved, ", quarantined_blocks, " quarantined)"));
  }
  PREFT_ASSIGN_OR_RETURN(std::vector<int32_t> blocks, e.ReserveBlocks(plan.blocks));
  reserved_blocks += plan.blocks;
  Reservation* r = retried;
  if (retried != nullptr) {
    if (r->waiter != nullptr) {
      Start& start = starts.at(r->waiter);
      start.claimed = false;
      failures->emplace_back(
          start.stream,
          absl::AbortedError(absl::StrCat("reservation ", id, " generation ", r->generation,
                                          " was superseded by generation ", r->generation + 1,
                                          " (retry)")));
      r->waiter = nullptr;
    }
    // Late writes of the old generation may still land in the old blocks.
    QuarantineLocked(std::move(r->blocks));
    ++r->generation;
    r->done = false;
  } else {
    id = next_id++;
    r = &reservations[id];
  }
  r->blocks = std::move(blocks);
  r->lease = plan.lease;
  r->lease_deadline = absl::Now() + plan.lease;
  timer_cv.Signal();

  resp->set_reservation_id(id);
  resp->set_generation(r->generation);
  for (int32_t b : r->blocks) resp->add_block_ids(b);
  resp->set_block_tokens(static_cast<int32_t>(block_tokens));
  resp->set_lease_ms(absl::ToInt64Milliseconds(plan.lease));
  *resp->mutable_endpoint() = endpoint;
  return absl::OkStatus();
}

void DecodeService::Impl::CommitLocked(Reservation& r, Start& start) {
  r.state = State::kStarted;
  r.waiter = nullptr;
  r.forget_at = absl::Now() + kRememberEnded;
  start.claimed = false;
  start.committed = true;
  const std::vector<int32_t> blocks = std::move(r.blocks);
  r.blocks.clear();
  engine::Request request = std::move(start.request);
  start.imported.blocks = blocks;
  request.imported.emplace(std::move(start.imported));
  std::shared_ptr<StartStream> stream = start.stream;
  request.on_token = [stream](const engine::TokenEvent& e) { stream->OnEvent(e); };
  loop->Post([this, request = std::move(request), blocks, stream](engine::Engine& e) mutable {
    {
      absl::MutexLock lock(&mu);
      reserved_blocks -= static_cast<int64_t>(blocks.size());
    }
    const absl::Status s = e.Add(std::move(request));
    if (!s.ok()) {
      e.FreeBlocks(blocks);  // DONE arrived: no write can still land in them
      stream->Fail(s);
    }
  });
}

void DecodeService::Impl::AbortLocked(uint64_t id, Reservation& r, const std::string& why,
                                      const absl::Status& waiter_status, Failures* failures) {
  if (r.waiter != nullptr) {
    Start& start = starts.at(r.waiter);
    start.claimed = false;
    failures->emplace_back(start.stream, waiter_status);
    r.waiter = nullptr;
  }
  r.state = State::kReleased;
  r.why_released = why;
  r.forget_at = absl::Now() + kRememberEnded;
  r.done = false;
  std::vector<int32_t> blocks = std::move(r.blocks);
  r.blocks.clear();
  loop->Post([this, blocks = std::move(blocks)](engine::Engine&) mutable {
    absl::MutexLock lock(&mu);
    QuarantineLocked(std::move(blocks));
  });
}

void DecodeService::Impl::QuarantineLocked(std::vector<int32_t> blocks) {
  const int64_t n = static_cast<int64_t>(blocks.size());
  reserved_blocks -= n;
  quarantined_blocks += n;
  quarantine.push_back(Quarantined{absl::Now() + options.quarantine, std::move(blocks)});
  timer_cv.Signal();
}

absl::Status DecodeService::Impl::Release(const worker::v1::ReleaseRequest& req,
                                          Failures* failures) {
  const uint64_t id = req.reservation_id();
  if (req.generation() == 0) {  // proto3's default: the caller forgot it, not a stale Release
    return absl::InvalidArgumentError(absl::StrCat(
        "Release of reservation ", id, " has generation 0; generations start at 1"));
  }
  absl::MutexLock lock(&mu);
  auto it = reservations.find(id);
  if (it == reservations.end()) {
    return absl::NotFoundError(absl::StrCat("reservation ", id, " is unknown"));
  }
  Reservation& r = it->second;
  // Released: idempotent. Started: the Start call owns it now (cancel that call instead).
  // An older generation's Release is stale.
  if (r.state != State::kReserved || req.generation() < r.generation) return absl::OkStatus();
  if (req.generation() > r.generation) {
    return absl::InvalidArgumentError(absl::StrCat("reservation ", id, " is at generation ",
                                                   r.generation, ", not ", req.generation()));
  }
  const std::string why = req.reason().empty() ? "released" : "released: " + req.reason();
  AbortLocked(
      id, r, why,
      absl::AbortedError(absl::StrCat("reservation ", id, " was ", why)),
      failures);
  return absl::OkStatus();
}

void DecodeService::Impl::OnDoneNotice(uint64_t id, uint32_t generation) {
  absl::MutexLock lock(&mu);
  auto it = reservations.find(id);
  if (it == reservations.end() || it->second.state != State::kReserved ||
      it->second.generation != generation) {
    ++stale_done_notices;
    return;
  }
  Reservation& r = it->second;
  r.done = true;
  if (r.waiter != nullptr) {
    Start& start = starts.at(r.waiter);
    if (!start.adapter_pending) CommitLocked(r, start);
  }
}

void DecodeService::Impl::TimerLoop() {
  absl::MutexLock lock(&mu);
  while (!stopping) {
    const absl::Time now = absl::Now();
    absl::Time next = absl::InfiniteFuture();
    Failures failures;
    for (auto it = reservations.begin(); it != reservations.end();) {
      Reservation& r = it->second;
      if (r.state == State::kReserved) {
        if (r.lease_deadline <= now) {
          const std::string why =
              absl::StrCat("lease of ", absl::ToInt64Milliseconds(r.lease), " ms expired");
          AbortLocked(it->first, r, why,
                      absl::DeadlineExceededError(
                          absl::StrCat("no DONE notice for reservation ", it->first,
                                       " generation ", r.generation, " before its ", why)),
                      &failures);
        }
        next = std::min(next, r.state == State::kReserved ? r.lease_deadline : r.forget_at);
      } else if (r.forget_at <= now) {
        it = reservations.erase(it);
        continue;
      } else {
        next = std::min(next, r.forget_at);
      }
      ++it;
    }
    for (auto it = quarantine.begin(); it != quarantine.end();) {
      if (it->free_at <= now) {
        loop->Post([this, blocks = std::move(it->blocks)](engine::Engine& e) {
          e.FreeBlocks(blocks);
          absl::MutexLock lock(&mu);
          quarantined_blocks -= static_cast<int64_t>(blocks.size());
        });
        it = quarantine.erase(it);
      } else {
        next = std::min(next, it->free_at);
        ++it;
      }
    }
    if (!failures.empty()) {
      mu.Unlock();
      Fail(failures);
      mu.Lock();
      continue;
    }
    timer_cv.WaitWithDeadline(&mu, next);
  }
}

}  // namespace preft::decode
