#pragma once

// UTF-8 helpers and GPT-2's byte<->unicode table for byte-level BPE (internal to preft_model).

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace preft::text::tokenizer_internal {

// GPT-2's reversible map from each byte to a printable code point: printable Latin-1 bytes map
// to themselves, the other 68 bytes to U+0100 and up, in byte order.
const std::array<char32_t, 256>& ByteToCodePoint();
// The UTF-8 encoding of ByteToCodePoint()[b], e.g. "Ġ" for ' '.
const std::array<std::string, 256>& ByteToSurface();
// Inverse of ByteToCodePoint; -1 for code points outside it.
int ByteOfCodePoint(char32_t cp);

// Byte offset of the first byte that does not begin a valid UTF-8 sequence (overlongs,
// surrogates and code points over U+10FFFF are invalid), or nullopt when all of `s` is valid.
std::optional<size_t> FirstInvalidUtf8(std::string_view s);

// Appends the UTF-8 encoding of `cp` (which must be a valid scalar value).
void AppendUtf8(char32_t cp, std::string* out);

// Decodes one code point at the start of `s` (non-empty). Returns its length, or 0 when `s`
// does not start with a valid sequence; `*prefix_len` is then the length of the maximal
// prefix of a valid sequence (at least 1), and `*truncated` says whether that prefix runs to
// the end of `s` (so more bytes might complete it).
size_t DecodeUtf8(std::string_view s, char32_t* cp, size_t* prefix_len, bool* truncated);

// Appends `bytes` with each maximal invalid subpart replaced by U+FFFD (the WHATWG rule, as
// Rust's String::from_utf8_lossy). With `hold_incomplete_tail`, a trailing truncated-but-valid
// prefix is not converted; returns the number of bytes consumed.
size_t AppendUtf8Lossy(std::string_view bytes, bool hold_incomplete_tail, std::string* out);

// Byte-level surface string (e.g. "Ġthe") to raw bytes (" the"); nullopt when a character is
// outside the GPT-2 table or `surface` is not valid UTF-8.
std::optional<std::string> SurfaceToBytes(std::string_view surface);
// Raw bytes to the byte-level surface string.
std::string BytesToSurface(std::string_view bytes);

}  // namespace preft::text::tokenizer_internal
