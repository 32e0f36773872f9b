#pragma once

// A fixed-width, length-prefixed encoding for the addresses transports hand to their peers
// (both ends are this code, so host byte order). Reader never reads past its input and refuses
// any length field above kMaxField.

#include <cstdint>
#include <cstring>
#include <string>

namespace preft::transport {

class AddressWriter {
 public:
  template <typename T>
  void Put(T value) {
    out_.append(reinterpret_cast<const char*>(&value), sizeof(value));
  }
  void PutString(const std::string& s) {
    Put<uint64_t>(s.size());
    out_ += s;
  }
  std::string& out() { return out_; }

 private:
  std::string out_;
};

class AddressReader {
 public:
  static constexpr uint64_t kMaxField = uint64_t{1} << 20;  // no legitimate field is near a MiB

  explicit AddressReader(const std::string& in) : in_(in) {}
  template <typename T>
  bool Get(T* value) {
    if (in_.size() - pos_ < sizeof(T)) return false;
    std::memcpy(value, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  bool GetString(std::string* s) {
    uint64_t size = 0;
    if (!Get(&size) || size > kMaxField || in_.size() - pos_ < size) return false;
    s->assign(in_.data() + pos_, size);
    pos_ += size;
    return true;
  }
  bool done() const { return pos_ == in_.size(); }

 private:
  const std::string& in_;
  size_t pos_ = 0;
};

}  // namespace preft::transport
