#include "train/sft_trainer.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/adapters/loader_util.h"
#include "common/base/mapped_file.h"
#include "common/base/status_macros.h"
#include "nlohmann/json.hpp"
#include "train/data.h"
#include "train/example_batch.h"
#include "train/torch_model.h"
#include "train/trainable_adapter.h"

namespace preft::train {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// Examples packed into micro-batches of at most batch_tokens padded tokens, in a seeded order
// per epoch; step s takes micro-batches [s * grad_accum, (s + 1) * grad_accum) of the endless
// stream of epochs, so a resumed run replays exactly the batches it would have seen.
class BatchPlan {
 public:
  BatchPlan(const std::vector<Example>& data, const SftOptions& o) : data_(data), o_(o) {}

  // Micro-batches in the first `epochs` epochs (each epoch's packing depends on its order, so
  // epochs may differ by a micro-batch or two).
  int64_t MicroBatches(int64_t epochs) {
    while (static_cast<int64_t>(ends_.size()) < epochs) Extend();
    return epochs == 0 ? 0 : ends_[epochs - 1];
  }
  std::vector<std::vector<const Example*>> Step(int64_t step) {
    std::vector<std::vector<const Example*>> out;
    for (int64_t m = step * o_.grad_accum; m < (step + 1) * o_.grad_accum; ++m) {
      while (ends_.empty() || ends_.back() <= m) Extend();
      const int64_t epoch = std::upper_bound(ends_.begin(), ends_.end(), m) - ends_.begin();
      const int64_t start = epoch == 0 ? 0 : ends_[epoch - 1];
      out.push_back(Epoch(epoch)[m - start]);
    }
    return out;
  }

 private:
  const std::vector<std::vector<const Example*>>& Epoch(int64_t epoch) {
    if (epoch == cached_epoch_) return cached_;
    std::vector<size_t> order(data_.size());
    std::iota(order.begin(), order.end(), 0);
    std::mt19937_64 rng(o_.seed * 1000003 + static_cast<uint64_t>(epoch));
    for (size_t i = order.size(); i > 1; --i) {  // Fisher-Yates: the same on every libstdc++
      std::swap(order[i - 1], order[rng() % i]);
    }
    cached_.clear();
    std::vector<const Example*> batch;
    int64_t longest = 0;
    for (size_t i : order) {
      const Example* e = &data_[i];
      const int64_t len = std::max(longest, e->num_tokens());
      if (!batch.empty() && len * static_cast<int64_t>(batch.size() + 1) > o_.batch_tokens) {
        cached_.push_back(std::move(batch));
        batch.clear();
        longest = 0;
      }
      batch.push_back(e);
      longest = std::max(longest, e->num_tokens());
    }
    cached_.push_back(std::move(batch));
    cached_epoch_ = epoch;
    return cached_;
  }

  // The next epoch's micro-batch count, as a running total.
  void Extend() {
    const int64_t epoch = static_cast<int64_t>(ends_.size());
    const int64_t before = ends_.empty() ? 0 : ends_.back();
    ends_.push_back(before + static_cast<int64_t>(Epoch(epoch).size()));
  }

  const std::vector<Example>& data_;
  const SftOptions& o_;
  std::vector<int64_t> ends_;  // micro-batches through epoch e, cumulative
  int64_t cached_epoch_ = -1;
  std::vector<std::vector<const Example*>> cached_;
};

double LearningRate(const SftOptions& o, int64_t step, int64_t total) {
  if (step < o.warmup_steps) return o.lr * static_cast<double>(step + 1) / (o.warmup_steps + 1);
  if (o.schedule == "constant") return o.lr;
  const double left = static_cast<double>(total - step) / std::max<int64_t>(1, total - o.warmup_steps);
  return o.lr * left;
}

// The options a checkpoint must share with a run that resumes it.
Json ResumeKey(const SftOptions& o, size_t examples) {
  return {{"data", o.data_path},         {"examples", examples},
          {"seed", o.seed},              {"batch_tokens", o.batch_tokens},
          {"grad_accum", o.grad_accum},  {"kind", model::AdapterKindName(o.adapter.kind)},
          {"rank", o.adapter.rank},      {"positions", model::AdapterPositionsName(o.positions)}};
}

std::string CheckpointDir(const std::string& out_dir, int64_t step) {
  return absl::StrCat(out_dir, "/checkpoints/step-", step);
}

// The newest complete checkpoint (its trainer_state.json is written last), or "".
std::string NewestCheckpoint(const std::string& out_dir, int64_t* step) {
  std::error_code ec;
  std::string best;
  *step = -1;
  for (const auto& entry : fs::directory_iterator(out_dir + "/checkpoints", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("step-", 0) != 0 || !fs::exists(entry.path() / "trainer_state.json")) continue;
    const int64_t s = std::strtoll(name.c_str() + 5, nullptr, 10);
    if (s > *step) {
      *step = s;
      best = entry.path().string();
    }
  }
  return best;
}

absl::Status SaveCheckpoint(const std::string& out_dir, int64_t step, const TrainableAdapter& a,
                            torch::optim::AdamW& optimizer, const Json& key) {
  const std::string dir = CheckpointDir(out_dir, step);
  const std::string tmp = dir + ".tmp";
  std::error_code ec;
  fs::remove_all(tmp, ec);
  PREFT_RETURN_IF_ERROR(a.Write(tmp));
  try {
    torch::save(optimizer, tmp + "/optimizer.pt");
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(tmp, "/optimizer.pt: ", e.what()));
  }
  Json state = {{"step", step}, {"resume_key", key}};
  PREFT_RETURN_IF_ERROR(base::WriteStringToFile(tmp + "/trainer_state.json", state.dump(2)));
  fs::remove_all(dir, ec);
  fs::rename(tmp, dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot rename ", tmp, ": ", ec.message()));
  return absl::OkStatus();
}

absl::Status CheckRank(const model::ModelConfig& c, const adapters::AdapterSpec& s,
                       int64_t max_rank) {
  if (s.rank > max_rank) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", s.rank, " is over the servers' --max-rank ", max_rank));
  }
  int64_t narrowest = c.hidden_size;
  if (s.kind == model::AdapterKind::kLora) {
    for (model::Projection p : s.targets) {
      const model::ProjectionDims d = model::DimsOf(c, p);
      narrowest = std::min({narrowest, d.in, d.out});
    }
  }
  if (s.rank > narrowest) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", s.rank, " is over the model's ",
                                                   narrowest, "-wide adapted matrices"));
  }
  return adapters::CheckAdapterSpec(c, s);
}

// Mean token loss over `data` (no gradients).
double EvalLoss(const TorchModel& m, const TrainableAdapter& a, const std::vector<Example>& data,
                const AdapterMasking& masking, int64_t batch_tokens) {
  torch::NoGradGuard no_grad;
  double sum = 0;
  int64_t n = 0;
  std::vector<const Example*> batch;
  int64_t longest = 0;
  auto flush = [&] {
    if (batch.empty()) return;
    ExampleBatch b = MakeExampleBatch(batch, masking, m.dtype());
    sum -= CompletionLogprobs(m, &a, b).sum().item<double>();
    n += b.targets.size(0);
    batch.clear();
    longest = 0;
  };
  for (const Example& e : data) {
    longest = std::max(longest, e.num_tokens());
    if (!batch.empty() && longest * static_cast<int64_t>(batch.size() + 1) > batch_tokens) {
      flush();
      longest = e.num_tokens();
    }
    batch.push_back(&e);
  }
  flush();
  return n > 0 ? sum / n : 0;
}

std::string Duration(double seconds) {
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  return absl::StrFormat("%d:%02d:%02d", s / 3600, s / 60 % 60, s % 60);
}

}  // namespace

absl::StatusOr<SftResult> RunSft(const SftOptions& o, std::FILE* progress) {
  auto invalid = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  if (o.out_dir.empty()) return invalid("--out is required");
  if (!(o.lr > 0)) return invalid("--lr must be positive, got ", o.lr);
  if (o.epochs < 1 && o.steps < 1) return invalid("--epochs or --steps must be at least 1");
  if (o.batch_tokens < 1) return invalid("--batch-tokens must be at least 1");
  if (o.grad_accum < 1) return invalid("--grad-accum must be at least 1");
  if (o.schedule != "linear" && o.schedule != "constant") {
    return invalid("--schedule must be linear or constant, got ", o.schedule);
  }
  PREFT_ASSIGN_OR_RETURN(model::ModelConfig config,
                         model::ModelConfig::FromFile(o.model_dir + "/config.json"));
  adapters::AdapterSpec spec = o.adapter;
  spec.preft_positions = o.positions;
  spec.dtype = kernels::DType::kF32;
  if (o.init_dir.empty()) PREFT_RETURN_IF_ERROR(CheckRank(config, spec, o.max_rank));
  PREFT_ASSIGN_OR_RETURN(auto tokenizer, text::Tokenizer::LoadFromModelDir(o.model_dir));
  std::unique_ptr<text::ChatTemplate> chat;
  if (auto t = text::ChatTemplate::FromModelDir(o.model_dir); t.ok()) {
    chat = std::make_unique<text::ChatTemplate>(*std::move(t));
  } else if (!absl::IsNotFound(t.status())) {
    return t.status();
  }
  SftDataOptions data_options{o.max_length, o.append_eos, config.vocab_size};
  PREFT_ASSIGN_OR_RETURN(std::vector<Example> data,
                         ReadSftData(o.data_path, *tokenizer, chat.get(), data_options));
  std::vector<Example> eval;
  if (!o.eval_path.empty()) {
    PREFT_ASSIGN_OR_RETURN(eval, ReadSftData(o.eval_path, *tokenizer, chat.get(), data_options));
  }
  const Json key = ResumeKey(o, data.size());
  int64_t start_step = 0;
  std::string resume_dir;
  if (o.resume) {
    resume_dir = NewestCheckpoint(o.out_dir, &start_step);
    if (resume_dir.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("--resume: no checkpoint in ", o.out_dir, "/checkpoints"));
    }
    PREFT_ASSIGN_OR_RETURN(std::string text,
                           base::ReadFileToString(resume_dir + "/trainer_state.json"));
    const Json state = Json::parse(text, nullptr, false);
    if (state.is_discarded() || state.value("resume_key", Json()) != key) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--resume: ", resume_dir, " was written with other options (",
          state.is_discarded() ? "unreadable state" : state.value("resume_key", Json()).dump(),
          ") than these (", key.dump(), ")"));
    }
  }

  SetComputeThreads(o.threads);
  PREFT_ASSIGN_OR_RETURN(auto m, TorchModel::Load(o.model_dir, torch::kFloat32));
  std::unique_ptr<TrainableAdapter> adapter;
  if (o.resume) {
    PREFT_ASSIGN_OR_RETURN(adapter, TrainableAdapter::Load(resume_dir, config, torch::kFloat32));
  } else if (!o.init_dir.empty()) {
    PREFT_ASSIGN_OR_RETURN(adapter, TrainableAdapter::Load(o.init_dir, config, torch::kFloat32));
    adapter->set_positions(o.positions);
  } else {
    PREFT_ASSIGN_OR_RETURN(adapter,
                           TrainableAdapter::Create(config, spec, o.seed, torch::kFloat32));
  }
  AdapterMasking masking{o.positions, adapter->prompt_selection()};
  torch::optim::AdamW optimizer(adapter->parameters(), torch::optim::AdamWOptions(o.lr)
                                                           .betas({0.9, 0.999})
                                                           .eps(1e-8)
                                                           .weight_decay(o.weight_decay));
  if (o.resume) {
    try {
      torch::load(optimizer, resume_dir + "/optimizer.pt");
    } catch (const std::exception& e) {
      return absl::DataLossError(absl::StrCat(resume_dir, "/optimizer.pt: ", e.what()));
    }
  }

  BatchPlan plan(data, o);
  // Steps of --epochs passes over the data (the last step may reach into the next epoch's first
  // micro-batches to fill its --grad-accum); per epoch, for the log's fractional epoch.
  const int64_t epoch_steps = (plan.MicroBatches(std::max<int64_t>(1, o.epochs)) + o.grad_accum - 1) /
                              o.grad_accum;
  const int64_t total = o.steps > 0 ? o.steps : epoch_steps;
  const int64_t per_epoch = std::max<int64_t>(1, epoch_steps / std::max<int64_t>(1, o.epochs));
  std::error_code ec;
  fs::create_directories(o.out_dir, ec);
  if (ec) return absl::PermissionDeniedError(absl::StrCat(o.out_dir, ": ", ec.message()));
  std::ofstream log(o.out_dir + "/train_log.jsonl", o.resume ? std::ios::app : std::ios::trunc);
  if (progress != nullptr) {
    std::fprintf(progress,
                 "preft train sft: %zu examples, %s rank %lld (%s positions), %lld steps "
                 "(%lld per epoch), %lld base parameters frozen\n",
                 data.size(), model::AdapterKindName(adapter->spec().kind),
                 static_cast<long long>(adapter->spec().rank),
                 model::AdapterPositionsName(o.positions),
                 static_cast<long long>(total), static_cast<long long>(per_epoch),
                 static_cast<long long>(m->num_parameters()));
  }

  SftResult result;
  result.examples = static_cast<int64_t>(data.size());
  const auto start = Clock::now();
  int64_t tokens_done = 0;
  for (int64_t step = start_step; step < total; ++step) {
    const double lr = LearningRate(o, step, total);
    for (auto& group : optimizer.param_groups()) {
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
    }
    const auto micro = plan.Step(step);
    int64_t targets = 0, tokens = 0;
    for (const auto& mb : micro) {
      for (const Example* e : mb) {
        targets += static_cast<int64_t>(e->completion_ids.size());
        tokens += e->num_tokens();
      }
    }
    optimizer.zero_grad();
    double loss_sum = 0;
    for (const auto& mb : micro) {
      ExampleBatch b = MakeExampleBatch(mb, masking, m->dtype());
      torch::Tensor loss = -CompletionLogprobs(*m, adapter.get(), b).sum() / targets;
      loss.backward();
      loss_sum += loss.item<double>();
    }
    double grad_norm = 0;
    if (o.max_grad_norm > 0) {
      grad_norm = torch::nn::utils::clip_grad_norm_(adapter->parameters(), o.max_grad_norm);
    }
    optimizer.step();
    tokens_done += tokens;
    result.steps = step + 1;
    result.last_loss = loss_sum;
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    const int64_t done = step + 1 - start_step;
    const double eta = elapsed / done * (total - step - 1);
    result.tokens_per_s = tokens_done / std::max(elapsed, 1e-9);
    Json entry = {{"step", step + 1},
                  {"epoch", static_cast<double>(step + 1) / per_epoch},
                  {"loss", loss_sum},
                  {"lr", lr},
                  {"grad_norm", grad_norm},
                  {"tokens", tokens},
                  {"tokens_per_s", result.tokens_per_s},
                  {"elapsed_s", elapsed},
                  {"eta_s", eta}};
    const bool last = step + 1 == total;
    if (!eval.empty() && (last || (o.eval_every > 0 && (step + 1) % o.eval_every == 0))) {
      result.eval_loss = EvalLoss(*m, *adapter, eval, masking, o.batch_tokens);
      entry["eval_loss"] = result.eval_loss;
    }
    log << entry.dump() << "\n" << std::flush;
    if (progress != nullptr && (last || (step + 1) % std::max<int64_t>(1, o.log_every) == 0)) {
      std::fprintf(progress, "step %lld/%lld  loss %.4f%s  lr %.3g  %.0f tok/s  eta %s\n",
                   static_cast<long long>(step + 1), static_cast<long long>(total), loss_sum,
                   entry.contains("eval_loss")
                       ? absl::StrFormat("  eval %.4f", result.eval_loss).c_str()
                       : "",
                   lr, result.tokens_per_s, Duration(eta).c_str());
      std::fflush(progress);
    }
    if (o.save_every > 0 && (step + 1) % o.save_every == 0 && !last) {
      PREFT_RETURN_IF_ERROR(SaveCheckpoint(o.out_dir, step + 1, *adapter, optimizer, key));
    }
  }
  PREFT_RETURN_IF_ERROR(adapter->Write(o.out_dir));
  if (progress != nullptr) std::fprintf(progress, "wrote %s\n", o.out_dir.c_str());
  return result;
}

}  // namespace preft::train
