#include "common/model/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <limits>
#include <tuple>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/status_macros.h"
#include "nlohmann/json.hpp"

namespace preft::model {
namespace {

using Json = nlohmann::json;

// As in the reference implementation: larger headers are refused rather than parsed.
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;
// A valid header is {name: {"shape": [..]}}: depth 3. Deeper nesting is hostile input.
constexpr int kMaxJsonDepth = 8;

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Shape product times element size, or -1 on a negative dimension or overflow.
int64_t CheckedBytes(const std::vector<int64_t>& shape, kernels::DType dtype) {
  int64_t n = static_cast<int64_t>(kernels::DTypeSize(dtype));
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, d, &n)) return -1;
  }
  return n;
}

// Reads a non-negative JSON integer that fits int64.
bool NonNegativeInt(const Json& v, int64_t* out) {
  if (!v.is_number_integer()) return false;
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    *out = static_cast<int64_t>(u);
    return true;
  }
  int64_t s = v.get<int64_t>();
  if (s < 0) return false;
  *out = s;
  return true;
}

std::string Show(const Json& v) {
  std::string s = v.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (s.size() > 64) s = s.substr(0, 61) + "...";
  return s;
}

}  // namespace

int64_t TensorSpec::num_bytes() const { return CheckedBytes(shape, dtype); }

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::FromImage(
    absl::StatusOr<std::unique_ptr<base::MappedFile>> image) {
  PREFT_ASSIGN_OR_RETURN(std::unique_ptr<base::MappedFile> mapped, std::move(image));
  PREFT_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file,
                         Parse(mapped->path(), mapped->data(), mapped->size()));
  file->file_ = std::move(mapped);
  return file;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  return FromImage(base::MappedFile::Open(path));
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Read(const std::string& path) {
  return FromImage(base::MappedFile::Read(path));
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::ReadOpened(
    int fd, const std::string& path) {
  return FromImage(base::MappedFile::ReadOpened(fd, path));
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Parse(std::string source,
                                                                        const uint8_t* data,
                                                                        size_t size) {
  auto invalid = [&source](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", parts...));
  };
  auto data_loss = [&source](auto&&... parts) {
    return absl::DataLossError(absl::StrCat(source, ": ", parts...));
  };
  if (size < 8) {
    return data_loss("file is ", size,
                     " bytes, too short for the 8-byte header length (truncated?)");
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | data[i];
  if (header_len > size - 8) {
    return data_loss("header length ", header_len, " exceeds the ", size - 8,
                     " bytes after the length field (truncated file or not safetensors)");
  }
  if (header_len > kMaxHeaderBytes) {
    return invalid("header length ", header_len, " exceeds the limit of ", kMaxHeaderBytes);
  }
  const char* header = reinterpret_cast<const char*>(data + 8);
  const uint8_t* data_start = data + 8 + header_len;
  const uint64_t data_size = size - 8 - header_len;

  Json j;
  try {
    Json::parser_callback_t limit_depth = [](int depth, Json::parse_event_t, Json&) {
      if (depth > kMaxJsonDepth) throw std::length_error("JSON nested too deeply");
      return true;
    };
    j = Json::parse(header, header + header_len, limit_depth);
  } catch (const std::exception& e) {
    return invalid("header is not valid JSON: ", e.what());
  }
  if (!j.is_object()) return invalid("header is not a JSON object");

  auto file = std::unique_ptr<SafetensorsFile>(new SafetensorsFile());
  file->path_ = source;
  file->size_bytes_ = size;
  // (begin, end, name) of every non-empty tensor, for the overlap check.
  std::vector<std::tuple<int64_t, int64_t, const std::string*>> spans;
  for (const auto& [name, entry] : j.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) return invalid("\"__metadata__\" is not an object");
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string())
          return invalid("\"__metadata__\" value for \"", k, "\" is not a string");
        file->metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    if (!entry.is_object()) return invalid("tensor '", name, "' entry is not an object");
    TensorInfo t;
    t.name = name;
    t.file = source;
    if (!entry.contains("dtype") || !entry.at("dtype").is_string()) {
      return invalid("tensor '", name, "' has no string \"dtype\"");
    }
    std::string dtype = entry.at("dtype").get<std::string>();
    if (!kernels::ParseDType(dtype, &t.dtype)) {
      return invalid("tensor '", name, "' has unsupported dtype ", dtype,
                     " (supported: F32, F16, BF16)");
    }
    if (!entry.contains("shape") || !entry.at("shape").is_array()) {
      return invalid("tensor '", name, "' has no \"shape\" list");
    }
    for (const Json& d : entry.at("shape")) {
      int64_t dim = 0;
      if (!NonNegativeInt(d, &dim)) {
        return invalid("tensor '", name, "' has invalid dimension ", Show(d), " in shape ",
                       Show(entry.at("shape")));
      }
      t.shape.push_back(dim);
    }
    int64_t num_bytes = CheckedBytes(t.shape, t.dtype);
    if (num_bytes < 0) {
      return invalid("tensor '", name, "' shape ", ShapeString(t.shape), " overflows");
    }
    const Json* offsets = entry.contains("data_offsets") ? &entry.at("data_offsets") : nullptr;
    int64_t begin = 0, end = 0;
    if (offsets == nullptr || !offsets->is_array() || offsets->size() != 2 ||
        !NonNegativeInt(offsets->at(0), &begin) || !NonNegativeInt(offsets->at(1), &end)) {
      return invalid("tensor '", name,
                     "' needs \"data_offsets\": [begin, end] of non-negative "
                     "integers, got ",
                     offsets ? Show(*offsets) : "nothing");
    }
    if (begin > end) {
      return invalid("tensor '", name, "' data_offsets [", begin, ", ", end, "] end before begin");
    }
    if (static_cast<uint64_t>(end) > data_size) {
      return data_loss("tensor '", name, "' data_offsets [", begin, ", ", end,
                       "] run past the data section of ", data_size, " bytes (truncated file?)");
    }
    if (end - begin != num_bytes) {
      return invalid("tensor '", name, "' of shape ", ShapeString(t.shape), " and dtype ", dtype,
                     " needs ", num_bytes, " bytes but data_offsets [", begin, ", ", end, "] span ",
                     end - begin);
    }
    t.data = data_start + begin;
    t.num_bytes = static_cast<size_t>(num_bytes);
    auto it = file->tensors_.emplace(name, std::move(t)).first;
    if (num_bytes > 0) spans.emplace_back(begin, end, &it->first);
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    const auto& [pb, pe, pname] = spans[i - 1];
    const auto& [b, e, tname] = spans[i];
    if (b < pe) {
      return invalid("tensors '", *pname, "' [", pb, ", ", pe, ") and '", *tname, "' [", b, ", ", e,
                     ") overlap");
    }
  }
  return file;
}

const TensorInfo* SafetensorsFile::Find(std::string_view name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

absl::StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    const std::string& path, std::vector<TensorSpec> specs,
    const std::map<std::string, std::string>& metadata) {
  std::sort(specs.begin(), specs.end(),
            [](const TensorSpec& a, const TensorSpec& b) { return a.name < b.name; });
  Json header = Json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  int64_t offset = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const TensorSpec& s = specs[i];
    if (s.name.empty() || s.name == "__metadata__") {
      return absl::InvalidArgumentError(absl::StrCat(path, ": invalid tensor name '", s.name, "'"));
    }
    if (i > 0 && specs[i - 1].name == s.name) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": duplicate tensor '", s.name, "'"));
    }
    int64_t n = s.num_bytes();
    if (n < 0 || __builtin_add_overflow(offset, n, &n)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor '", s.name, "' has invalid shape ", ShapeString(s.shape)));
    }
    header[s.name] = {
        {"dtype", kernels::DTypeName(s.dtype)}, {"shape", s.shape}, {"data_offsets", {offset, n}}};
    offset = n;
  }
  std::string text = header.dump();
  // Pad with spaces so the data section starts 8-byte aligned, as Hugging Face does.
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string prefix(8, '\0');
  uint64_t len = text.size();
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<char>((len >> (8 * i)) & 0xff);

  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::PermissionDeniedError(
        absl::StrCat(path, ": cannot create: ", std::strerror(errno)));
  }
  auto writer = std::unique_ptr<SafetensorsWriter>(new SafetensorsWriter());
  writer->path_ = path;
  writer->specs_ = std::move(specs);
  writer->fd_ = fd;
  prefix += text;
  PREFT_RETURN_IF_ERROR(writer->WriteAll(prefix.data(), prefix.size()));
  return writer;
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status SafetensorsWriter::WriteAll(const void* data, size_t num_bytes) {
  const char* p = static_cast<const char*>(data);
  while (num_bytes > 0) {
    ssize_t n = ::write(fd_, p, std::min<size_t>(num_bytes, size_t{1} << 30));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::DataLossError(absl::StrCat(path_, ": write failed: ", std::strerror(errno)));
    }
    p += n;
    num_bytes -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Append(const void* data, size_t num_bytes) {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, ": writer is closed"));
  const TensorSpec* s = next();
  if (s == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(path_, ": all tensors already written"));
  }
  if (static_cast<int64_t>(num_bytes) != s->num_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": tensor '", s->name, "' needs ",
                                                   s->num_bytes(), " bytes, got ", num_bytes));
  }
  PREFT_RETURN_IF_ERROR(WriteAll(data, num_bytes));
  ++next_;
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Close() {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, ": writer is closed"));
  if (next_ != specs_.size()) {
    return absl::FailedPreconditionError(absl::StrCat(path_, ": closed after ", next_, " of ",
                                                      specs_.size(), " tensors; next is '",
                                                      specs_[next_].name, "'"));
  }
  int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0)
    return absl::DataLossError(absl::StrCat(path_, ": close failed: ", std::strerror(errno)));
  return absl::OkStatus();
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  std::vector<TensorSpec> specs;
  std::map<std::string_view, const void*> data;
  for (const TensorToWrite& t : tensors) {
    specs.push_back(TensorSpec{t.name, t.dtype, t.shape});
    data[t.name] = t.data;
  }
  PREFT_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsWriter> writer,
                         SafetensorsWriter::Create(path, std::move(specs), metadata));
  while (const TensorSpec* s = writer->next()) {
    const void* p = data[s->name];
    size_t n = static_cast<size_t>(s->num_bytes());
    if (p == nullptr && n > 0) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", s->name, "' has no data"));
    }
    PREFT_RETURN_IF_ERROR(writer->Append(p, n));
  }
  return writer->Close();
}

}  // namespace preft::model
