#include "common/model/adapter_weights.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <regex>

#include "absl/strings/str_cat.h"
#include "common/base/check.h"

namespace preft::model {
namespace {

uint64_t NextSerial() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

const char* AdapterKindName(AdapterKind k) { return k == AdapterKind::kLora ? "lora" : "direft"; }

const char* AdapterPositionsName(AdapterPositions p) {
  return p == AdapterPositions::kPrompt ? "prompt" : "all";
}

bool ParseAdapterPositions(const std::string& s, AdapterPositions* out) {
  if (s == "prompt") {
    *out = AdapterPositions::kPrompt;
  } else if (s == "all") {
    *out = AdapterPositions::kAll;
  } else {
    return false;
  }
  return true;
}

const char* ProjectionName(Projection p) {
  static const char* const kNames[kNumProjections] = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                                      "gate_proj", "up_proj", "down_proj"};
  return kNames[static_cast<int>(p)];
}

ProjectionDims DimsOf(const ModelConfig& c, Projection p) {
  const int64_t q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  switch (p) {
    case Projection::kQ:
      return {c.hidden_size, q};
    case Projection::kK:
    case Projection::kV:
      return {c.hidden_size, kv};
    case Projection::kO:
      return {q, c.hidden_size};
    case Projection::kGate:
    case Projection::kUp:
      return {c.hidden_size, c.intermediate_size};
    case Projection::kDown:
      return {c.intermediate_size, c.hidden_size};
  }
  return {};
}

bool PromptSelection::Selected(int64_t position, int64_t prompt_len) const {
  if (all) return true;
  const int64_t first_n = std::min(prompt_len / 2, first);
  const int64_t last_n = std::min(prompt_len / 2, last);
  return position < first_n || (position >= prompt_len - last_n && position < prompt_len);
}

std::string PromptSelection::ToString() const {
  if (all) return "all";
  std::string s;
  if (first > 0) s = absl::StrCat("f", first);
  if (last > 0) absl::StrAppend(&s, s.empty() ? "" : "+", "l", last);
  return s.empty() ? "f0" : s;
}

bool PromptSelection::Parse(const std::string& s, PromptSelection* out) {
  if (s == "all") {
    *out = PromptSelection{};
    return true;
  }
  static const std::regex kSpec("(?:f([0-9]{1,9}))?\\+?(?:l([0-9]{1,9}))?");
  std::smatch m;
  if (s.empty() || !std::regex_match(s, m, kSpec) || (!m[1].matched && !m[2].matched)) return false;
  // "fN+lM" needs its '+', "fN" and "lM" must not have one.
  if ((s.find('+') != std::string::npos) != (m[1].matched && m[2].matched)) return false;
  PromptSelection sel;
  sel.all = false;
  sel.first = m[1].matched ? std::stoll(m[1].str()) : 0;
  sel.last = m[2].matched ? std::stoll(m[2].str()) : 0;
  *out = sel;
  return true;
}

AdapterWeights::AdapterWeights(AdapterKind kind, int64_t num_layers)
    : kind_(kind), num_layers_(num_layers), serial_(NextSerial()) {
  if (kind == AdapterKind::kLora) {
    lora_.resize(num_layers);
  } else {
    direft_.resize(num_layers);
  }
}

kernels::MatrixView AdapterWeights::AllocateMatrix(kernels::DType dtype, int64_t rows,
                                                   int64_t cols) {
  if (!has_matrix_) dtype_ = dtype;
  has_matrix_ = true;
  PREFT_CHECK(dtype == dtype_);  // one dtype per adapter
  const size_t n = static_cast<size_t>(rows * cols) * kernels::DTypeSize(dtype);
  return {AllocateZeroed(n), dtype, rows, cols};
}

float* AdapterWeights::AllocateFloats(int64_t n) {
  return reinterpret_cast<float*>(AllocateZeroed(static_cast<size_t>(n) * sizeof(float)));
}

namespace {

// Below this an arena is not worth a huge page: a 0.3 MB DiReFT adapter would hold 2 MiB.
constexpr size_t kMinHugeArena = size_t{4} << 20;

}  // namespace

AdapterWeights::Arena::~Arena() {
  if (base != nullptr) ::munmap(base, size);
}

void AdapterWeights::ReserveStorage(size_t bytes) {
  if (bytes == 0 || arena_.base != nullptr) return;
  if (bytes < kMinHugeArena) {
    const size_t size = (bytes + 4095) & ~size_t{4095};
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return;
    ::madvise(p, size, MADV_NOHUGEPAGE);
    arena_.base = static_cast<uint8_t*>(p);
    arena_.size = size;
    return;
  }
  // Start on a 2 MiB boundary, or the first and last partial 2 MiB of the arena stay in 4 KiB
  // pages: map a little more, then give back the unaligned head and the tail.
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t size = (bytes + kHuge - 1) & ~(kHuge - 1);
  void* p = ::mmap(nullptr, size + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
  if (p == MAP_FAILED) return;  // the buffers serve instead
  auto* raw = static_cast<uint8_t*>(p);
  auto* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + kHuge - 1) & ~(kHuge - 1));
  if (base > raw) ::munmap(raw, base - raw);
  if (raw + size + kHuge > base + size) ::munmap(base + size, raw + size + kHuge - (base + size));
  ::madvise(base, size, MADV_HUGEPAGE);
  arena_.base = base;
  arena_.size = size;
}

uint8_t* AdapterWeights::AllocateZeroed(size_t bytes) {
  bytes_ += bytes;
  const size_t piece = StoragePiece(bytes);
  if (arena_.base != nullptr && arena_.used + piece <= arena_.size) {
    uint8_t* p = arena_.base + arena_.used;  // fresh anonymous pages: zero
    arena_.used += piece;
    return p;
  }
  // calloc: large blocks come zeroed from fresh pages, without a memset before the caller
  // overwrites them.
  buffers_.emplace_back(static_cast<uint8_t*>(std::calloc(bytes > 0 ? bytes : 1, 1)));
  PREFT_CHECK(buffers_.back() != nullptr);
  return buffers_.back().get();
}

int64_t AdapterWeights::max_rank() const {
  int64_t r = 0;
  for (const auto& layer : lora_)
    for (const LowRank& lr : layer) r = std::max(r, lr.rank());
  for (const LowRank& lr : direft_) r = std::max(r, lr.rank());
  return r;
}

namespace {

kernels::MatrixView CopyMatrix(const kernels::MatrixView& src, kernels::DType dtype,
                               AdapterWeights* dst) {
  kernels::MatrixView out = dst->AllocateMatrix(dtype, src.rows, src.cols);
  const int64_t n = src.rows * src.cols;
  void* data = const_cast<void*>(out.data);
  if (src.dtype == dtype) {
    std::memcpy(data, src.data, n * kernels::DTypeSize(dtype));
    out.chunked = src.chunked;
    out.paired = src.paired;
    return out;
  }
  // Only bf16 is kept chunked: another dtype is written row-major.
  for (int64_t r = 0; r < src.rows; ++r) {
    for (int64_t c = 0; c < src.cols; ++c) {
      const int64_t i =
          src.chunked ? kernels::ChunkedAt(r, c, src.rows, src.paired) : r * src.cols + c;
      kernels::StoreFromF32(data, dtype, r * src.cols + c,
                            kernels::LoadAsF32(src.data, src.dtype, i));
    }
  }
  return out;
}

LowRank CopyLowRank(const LowRank& src, kernels::DType dtype, AdapterWeights* dst) {
  LowRank out;
  if (src.empty()) return out;
  out.shrink = CopyMatrix(src.shrink, dtype, dst);
  out.expand = CopyMatrix(src.expand, dtype, dst);
  out.scale = src.scale;
  if (src.shrink_bias != nullptr) {
    float* b = dst->AllocateFloats(src.rank());
    std::memcpy(b, src.shrink_bias, src.rank() * sizeof(float));
    out.shrink_bias = b;
  }
  return out;
}

}  // namespace

std::unique_ptr<AdapterWeights> AdapterWeights::ConvertTo(kernels::DType dtype) const {
  auto out = std::make_unique<AdapterWeights>(kind_, num_layers_);
  size_t arena = 0;
  auto size_of = [&](const LowRank& lr) {
    if (lr.empty()) return;
    const size_t esize = kernels::DTypeSize(dtype);
    arena += StoragePiece(lr.shrink.rows * lr.shrink.cols * esize) +
             StoragePiece(lr.expand.rows * lr.expand.cols * esize);
    if (lr.shrink_bias != nullptr) arena += StoragePiece(lr.rank() * sizeof(float));
  };
  for (const auto& layer : lora_)
    for (const LowRank& lr : layer) size_of(lr);
  for (const LowRank& lr : direft_) size_of(lr);
  out->ReserveStorage(arena);
  out->default_positions = default_positions;
  out->prompt_selection = prompt_selection;
  out->dtype_ = dtype;
  for (int64_t l = 0; l < num_layers_; ++l) {
    if (kind_ == AdapterKind::kLora) {
      for (int p = 0; p < kNumProjections; ++p)
        out->lora_[l][p] = CopyLowRank(lora_[l][p], dtype, out.get());
    } else {
      out->direft_[l] = CopyLowRank(direft_[l], dtype, out.get());
    }
  }
  return out;
}

}  // namespace preft::model
