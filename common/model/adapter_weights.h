#pragma once

// An adapter's weights as the forward pass consumes them: LoRA low-rank pairs on any of the
// seven projections of each layer, or DiReFT low-rank updates on layer outputs. Both are
// "y += scale * ((x S^T + b) E)" with S = shrink [rank, in] and E = expand [rank, out];
// LoRA: S = A, E = B^T, b = 0, scale = alpha/r (or alpha/sqrt(r)); DiReFT: S = W1, b = b1,
// E = W2, scale = 1, applied in place to the layer's output residual stream.
// Loading and validation live in common/adapters; this is only the in-memory form.

#include <array>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "common/kernels/dtype.h"
#include "common/kernels/matrix.h"
#include "common/model/config.h"

namespace preft::model {

enum class AdapterKind { kLora, kDireft };
const char* AdapterKindName(AdapterKind k);  // "lora", "direft"

// Where a request's adapter applies: prompt tokens only (PreFT: LoRAP, DiReFTP) or every token.
enum class AdapterPositions { kPrompt, kAll };
const char* AdapterPositionsName(AdapterPositions p);  // "prompt", "all"
bool ParseAdapterPositions(const std::string& s, AdapterPositions* out);

// The projections LoRA may target, in Hugging Face module order.
enum class Projection : int { kQ, kK, kV, kO, kGate, kUp, kDown };
inline constexpr int kNumProjections = 7;
const char* ProjectionName(Projection p);  // "q_proj", ..., "down_proj"
// Input and output widths of a projection of a model of `c` (nn.Linear in / out features).
struct ProjectionDims {
  int64_t in = 0;
  int64_t out = 0;
};
ProjectionDims DimsOf(const ModelConfig& c, Projection p);

struct LowRank {
  kernels::MatrixView shrink;          // [rank, in]
  kernels::MatrixView expand;          // [rank, out]
  const float* shrink_bias = nullptr;  // [rank], f32; null = none
  float scale = 1.0f;

  bool empty() const { return shrink.data == nullptr; }
  int64_t rank() const { return shrink.rows; }
};

// Which prompt positions are intervened: all, or pyreft's "fN+lM" (the first N and the last M,
// each clamped to prompt_len / 2 as pyreft's get_intervention_locations does).
struct PromptSelection {
  bool all = true;
  int64_t first = 0;
  int64_t last = 0;

  bool Selected(int64_t position, int64_t prompt_len) const;
  std::string ToString() const;  // "all" or "f3+l2"
  // "all", "fN+lM", "fN", "lM"; false on anything else.
  static bool Parse(const std::string& s, PromptSelection* out);
};

class AdapterWeights {
 public:
  AdapterWeights(AdapterKind kind, int64_t num_layers);

  AdapterKind kind() const { return kind_; }
  int64_t num_layers() const { return num_layers_; }
  kernels::DType dtype() const { return dtype_; }

  // Default positions (from the config's "preft_positions"; a request may override them).
  AdapterPositions default_positions = AdapterPositions::kAll;
  // DiReFT only: which prompt tokens are intervened.
  PromptSelection prompt_selection;

  // LoRA: lora(layer, p); empty() when the projection is not targeted in that layer.
  const LowRank& lora(int64_t layer, Projection p) const {
    return lora_[layer][static_cast<int>(p)];
  }
  LowRank& mutable_lora(int64_t layer, Projection p) { return lora_[layer][static_cast<int>(p)]; }
  // DiReFT: direft(layer); empty() when the layer is not intervened.
  const LowRank& direft(int64_t layer) const { return direft_[layer]; }
  LowRank& mutable_direft(int64_t layer) { return direft_[layer]; }

  // Zeroed storage owned by this object, for the views above.
  kernels::MatrixView AllocateMatrix(kernels::DType dtype, int64_t rows, int64_t cols);
  // Reserves one zeroed mapping that later allocations (up to about `bytes`, each rounded to
  // StoragePiece) are carved from: no per-matrix allocation, no memset, 2 MiB pages when big.
  // Loaders size it from the file; a second call, or allocations past it, use the heap.
  void ReserveStorage(size_t bytes);
  // Pieces start on a cache line, as the kernels' vector loads prefer.
  static size_t StoragePiece(size_t bytes) { return (bytes + 63) & ~size_t{63}; }
  float* AllocateFloats(int64_t n);

  // A deep copy with every matrix converted to `dtype` (biases stay f32): what a compute slot
  // holds for a model whose matrices are in `dtype`.
  std::unique_ptr<AdapterWeights> ConvertTo(kernels::DType dtype) const;

  int64_t max_rank() const;
  // Bytes of storage (what the adapter store budgets).
  size_t bytes() const { return bytes_; }
  // Unique to this object in the process (never reused, unlike its address): caches of
  // derived copies, such as device slots, key on it.
  uint64_t serial() const { return serial_; }

 private:
  AdapterKind kind_;
  int64_t num_layers_;
  uint64_t serial_;
  kernels::DType dtype_ = kernels::DType::kF32;  // of the matrices (set by AllocateMatrix)
  bool has_matrix_ = false;
  std::vector<std::array<LowRank, kNumProjections>> lora_;
  std::vector<LowRank> direft_;
  struct FreeDeleter {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::deque<std::unique_ptr<uint8_t, FreeDeleter>> buffers_;
  size_t bytes_ = 0;

  // One zeroed mapping that ConvertTo and the loaders size, advised into 2 MiB pages when it
  // spans at least kMinHugeArena (a multi-LoRA decode step streams every slot's matrices; in
  // a VM a TLB miss is a two-level walk); smaller ones (DiReFT) stay in 4 KiB pages, which a
  // huge page would multiply. Storage is carved from it first, then from buffers_.
  struct Arena {
    Arena() = default;
    Arena(const Arena&) = delete;
    Arena& operator=(const Arena&) = delete;
    ~Arena();
    uint8_t* base = nullptr;
    size_t size = 0;
    size_t used = 0;
  };
  uint8_t* AllocateZeroed(size_t bytes);
  Arena arena_;
};

}  // namespace preft::model
