#include "common/model/checkpoint.h"

#include <exception>
#include <filesystem>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/mapped_file.h"
#include "common/base/status_macros.h"
#include "nlohmann/json.hpp"

namespace preft::model {
namespace {

using Json = nlohmann::json;

constexpr char kSingleFile[] = "model.safetensors";
constexpr char kIndexFile[] = "model.safetensors.index.json";

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

std::string JoinPath(const std::string& dir, const std::string& name) {
  return (std::filesystem::path(dir) / name).string();
}

// The shard file names of an index's weight_map, as {tensor: file}.
absl::StatusOr<std::map<std::string, std::string>> ReadIndex(const std::string& path) {
  PREFT_ASSIGN_OR_RETURN(std::string text, base::ReadFileToString(path));
  Json j;
  try {
    j = Json::parse(text);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not valid JSON: ", e.what()));
  }
  if (!j.is_object() || !j.contains("weight_map") || !j.at("weight_map").is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": no \"weight_map\" object"));
  }
  std::map<std::string, std::string> map;
  for (const auto& [tensor, file] : j.at("weight_map").items()) {
    if (!file.is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": weight_map entry for '", tensor, "' is not a file name"));
    }
    std::string f = file.get<std::string>();
    // Shards live beside the index; anything else is a mistake or an attempt to escape.
    if (f.empty() || f.find('/') != std::string::npos || f.find('\\') != std::string::npos ||
        f == "." || f == "..") {
      return absl::InvalidArgumentError(absl::StrCat(path, ": weight_map entry for '", tensor,
                                                     "' names invalid shard '", f, "'"));
    }
    map.emplace(tensor, std::move(f));
  }
  if (map.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": empty weight_map"));
  return map;
}

}  // namespace

std::vector<ExpectedTensor> ExpectedTensors(const ModelConfig& c) {
  const int64_t d = c.hidden_size;
  const int64_t q = c.num_heads * c.head_dim;
  const int64_t kv = c.num_kv_heads * c.head_dim;
  const int64_t inter = c.intermediate_size;
  std::vector<ExpectedTensor> out;
  out.push_back({"model.embed_tokens.weight", {c.vocab_size, d}});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    out.push_back({p + "input_layernorm.weight", {d}, /*is_norm=*/true});
    out.push_back({p + "self_attn.q_proj.weight", {q, d}});
    out.push_back({p + "self_attn.k_proj.weight", {kv, d}});
    out.push_back({p + "self_attn.v_proj.weight", {kv, d}});
    out.push_back({p + "self_attn.o_proj.weight", {d, q}});
    if (c.attention_bias) {
      out.push_back({p + "self_attn.q_proj.bias", {q}, false, /*is_bias=*/true});
      out.push_back({p + "self_attn.k_proj.bias", {kv}, false, true});
      out.push_back({p + "self_attn.v_proj.bias", {kv}, false, true});
      // Llama's attention_bias also puts a bias on o_proj; Qwen2's o_proj has none.
      if (c.architecture == Architecture::kLlama) {
        out.push_back({p + "self_attn.o_proj.bias", {d}, false, true});
      }
    }
    out.push_back({p + "post_attention_layernorm.weight", {d}, /*is_norm=*/true});
    out.push_back({p + "mlp.gate_proj.weight", {inter, d}});
    out.push_back({p + "mlp.up_proj.weight", {inter, d}});
    out.push_back({p + "mlp.down_proj.weight", {d, inter}});
  }
  out.push_back({"model.norm.weight", {d}, /*is_norm=*/true});
  if (!c.tie_word_embeddings) out.push_back({"lm_head.weight", {c.vocab_size, d}});
  return out;
}

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& dir) {
  auto ckpt = std::unique_ptr<Checkpoint>(new Checkpoint());
  ckpt->dir_ = dir;
  const std::string index_path = JoinPath(dir, kIndexFile);
  const std::string single_path = JoinPath(dir, kSingleFile);
  std::error_code ec;
  if (std::filesystem::exists(index_path, ec)) {
    PREFT_ASSIGN_OR_RETURN(auto weight_map, ReadIndex(index_path));
    std::map<std::string, const SafetensorsFile*> shards;
    for (const auto& [tensor, file] : weight_map) shards.emplace(file, nullptr);
    for (auto& [file, opened] : shards) {
      auto f = SafetensorsFile::Open(JoinPath(dir, file));
      if (!f.ok()) {
        return absl::Status(f.status().code(),
                            absl::StrCat(index_path, ": shard '", file,
                                         "' cannot be loaded: ", f.status().message()));
      }
      opened = f->get();
      ckpt->files_.push_back(*std::move(f));
    }
    for (const auto& [tensor, file] : weight_map) {
      const SafetensorsFile* shard = shards.at(file);
      const TensorInfo* t = shard->Find(tensor);
      if (t == nullptr) {
        return absl::NotFoundError(absl::StrCat(index_path, ": tensor '", tensor,
                                                "' is listed in shard ", shard->path(),
                                                " but that file does not contain it"));
      }
      ckpt->tensors_.emplace(tensor, t);
    }
    return ckpt;
  }
  if (!std::filesystem::exists(single_path, ec)) {
    return absl::NotFoundError(
        absl::StrCat(dir, ": neither ", kSingleFile, " nor ", kIndexFile, " found"));
  }
  PREFT_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(single_path));
  for (const auto& [name, info] : file->tensors()) ckpt->tensors_.emplace(name, &info);
  ckpt->files_.push_back(std::move(file));
  return ckpt;
}

absl::StatusOr<const TensorInfo*> Checkpoint::Get(std::string_view name,
                                                  const std::vector<int64_t>& shape) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    std::vector<std::string> files;
    for (const auto& f : files_) files.push_back(f->path());
    return absl::NotFoundError(absl::StrCat("tensor '", std::string(name), "' (expected shape ",
                                            ShapeString(shape), ") not found in ",
                                            absl::StrJoin(files, ", ")));
  }
  const TensorInfo* t = it->second;
  if (t->shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat(t->file, ": tensor '", std::string(name),
                                                   "' has shape ", ShapeString(t->shape),
                                                   ", expected ", ShapeString(shape)));
  }
  return t;
}

bool Checkpoint::Has(std::string_view name) const { return tensors_.find(name) != tensors_.end(); }

absl::Status Checkpoint::CheckTensors(const ModelConfig& config) const {
  for (const ExpectedTensor& e : ExpectedTensors(config)) {
    PREFT_RETURN_IF_ERROR(Get(e.name, e.shape).status());
  }
  return absl::OkStatus();
}

size_t Checkpoint::total_bytes() const {
  size_t n = 0;
  for (const auto& f : files_) n += f->size_bytes();
  return n;
}

size_t Checkpoint::huge_page_bytes() const {
  size_t n = 0;
  for (const auto& f : files_) n += f->huge_page_bytes();
  return n;
}

}  // namespace preft::model
