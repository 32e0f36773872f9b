// libFuzzer target: ModelConfig::FromJson on arbitrary text must return a Status, never crash;
// any config it accepts must survive ToJson -> FromJson unchanged.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "common/model/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  auto config = preft::model::ModelConfig::FromJson(text, "fuzz/config.json");
  if (!config.ok()) return 0;
  const std::string json = config->ToJson();
  auto again = preft::model::ModelConfig::FromJson(json, "roundtrip");
  if (!again.ok() || again->ToJson() != json) std::abort();
  return 0;
}
