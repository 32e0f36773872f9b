// libFuzzer target: SafetensorsFile::Parse on arbitrary bytes must return a Status, never crash,
// and every tensor it accepts must lie inside the input.

#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "common/model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto file = preft::model::SafetensorsFile::Parse("fuzz.safetensors", data, size);
  if (!file.ok()) return 0;
  for (const auto& [name, t] : (*file)->tensors()) {
    const auto* p = static_cast<const uint8_t*>(t.data);
    if (t.num_bytes > 0 && (p < data || p + t.num_bytes > data + size)) std::abort();
    if (static_cast<int64_t>(t.num_bytes) !=
        t.num_elements() * static_cast<int64_t>(preft::kernels::DTypeSize(t.dtype))) {
      std::abort();
    }
    // Touch first and last byte so ASan sees any out-of-bounds span.
    volatile uint8_t sink = 0;
    if (t.num_bytes > 0) sink = sink + p[0] + p[t.num_bytes - 1];
  }
  return 0;
}
