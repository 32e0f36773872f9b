#include "common/text/tokenizer_unicode.h"

#include <vector>

namespace preft::text::tokenizer_internal {
namespace {

struct ByteTables {
  std::array<char32_t, 256> to_cp{};
  std::array<std::string, 256> to_surface;
  std::vector<int16_t> from_cp;  // indexed by code point, up to U+0143
};

ByteTables BuildTables() {
  ByteTables t;
  auto printable = [](int b) {
    return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
  };
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    t.to_cp[b] = printable(b) ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + n++);
  }
  t.from_cp.assign(256 + n, -1);
  for (int b = 0; b < 256; ++b) {
    t.from_cp[t.to_cp[b]] = static_cast<int16_t>(b);
    AppendUtf8(t.to_cp[b], &t.to_surface[b]);
  }
  return t;
}

const ByteTables& Tables() {
  static const ByteTables* tables = new ByteTables(BuildTables());
  return *tables;
}

}  // namespace

const std::array<char32_t, 256>& ByteToCodePoint() { return Tables().to_cp; }
const std::array<std::string, 256>& ByteToSurface() { return Tables().to_surface; }

int ByteOfCodePoint(char32_t cp) {
  const auto& from = Tables().from_cp;
  return cp < from.size() ? from[cp] : -1;
}

size_t DecodeUtf8(std::string_view s, char32_t* cp, size_t* prefix_len, bool* truncated) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  *truncated = false;
  *prefix_len = 1;
  const unsigned char b0 = p[0];
  if (b0 < 0x80) {
    *cp = b0;
    return 1;
  }
  size_t len;
  char32_t value;
  // Bounds of the second byte, which exclude overlongs, surrogates and > U+10FFFF.
  unsigned char lo = 0x80, hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    len = 2;
    value = b0 & 0x1F;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    len = 3;
    value = b0 & 0x0F;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    len = 4;
    value = b0 & 0x07;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  for (size_t i = 1; i < len; ++i) {
    if (i >= n) {
      *truncated = true;
      return 0;
    }
    const unsigned char b = p[i];
    const unsigned char min = i == 1 ? lo : 0x80, max = i == 1 ? hi : 0xBF;
    if (b < min || b > max) return 0;
    value = (value << 6) | (b & 0x3F);
    *prefix_len = i + 1;
  }
  *cp = value;
  return len;
}

std::optional<size_t> FirstInvalidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    char32_t cp;
    size_t prefix;
    bool truncated;
    const size_t len = DecodeUtf8(s.substr(i), &cp, &prefix, &truncated);
    if (len == 0) return i;
    i += len;
  }
  return std::nullopt;
}

void AppendUtf8(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

size_t AppendUtf8Lossy(std::string_view bytes, bool hold_incomplete_tail, std::string* out) {
  static constexpr std::string_view kReplacement = "\xEF\xBF\xBD";
  size_t i = 0;
  size_t run_start = 0;  // start of the pending run of valid bytes
  while (i < bytes.size()) {
    if (static_cast<unsigned char>(bytes[i]) < 0x80) {
      ++i;
      continue;
    }
    char32_t cp;
    size_t prefix;
    bool truncated;
    const size_t len = DecodeUtf8(bytes.substr(i), &cp, &prefix, &truncated);
    if (len > 0) {
      i += len;
      continue;
    }
    out->append(bytes.substr(run_start, i - run_start));
    if (truncated && hold_incomplete_tail) return i;
    out->append(kReplacement);
    i += prefix;
    run_start = i;
  }
  out->append(bytes.substr(run_start, i - run_start));
  return i;
}

std::optional<std::string> SurfaceToBytes(std::string_view surface) {
  std::string out;
  out.reserve(surface.size());
  size_t i = 0;
  while (i < surface.size()) {
    char32_t cp;
    size_t prefix;
    bool truncated;
    const size_t len = DecodeUtf8(surface.substr(i), &cp, &prefix, &truncated);
    if (len == 0) return std::nullopt;
    const int b = ByteOfCodePoint(cp);
    if (b < 0) return std::nullopt;
    out.push_back(static_cast<char>(b));
    i += len;
  }
  return out;
}

std::string BytesToSurface(std::string_view bytes) {
  const auto& table = ByteToSurface();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char b : bytes) out += table[b];
  return out;
}

}  // namespace preft::text::tokenizer_internal
