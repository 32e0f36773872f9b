#include "common/text/tokenizer_json.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace preft::text::tokenizer_internal {
namespace {

using json = nlohmann::json;

// Forwards SAX events to nlohmann's DOM builder, except inside root.model.vocab (an object)
// and root.model.merges (a list), whose entries are captured into RawBpe; the DOM gets a null
// in their place.
class Handler {
 public:
  Handler(json* root, RawBpe* bpe) : dom_(*root, /*allow_exceptions=*/false), bpe_(bpe) {}

  const absl::Status& status() const { return status_; }

  bool null() { return mode_ == Mode::kDom ? dom_.null() : Fail("null"); }
  bool boolean(bool value) { return mode_ == Mode::kDom ? dom_.boolean(value) : Fail("a boolean"); }
  bool number_integer(json::number_integer_t value) {
    if (mode_ == Mode::kVocab) return AddVocab(value);
    return mode_ == Mode::kDom ? dom_.number_integer(value) : Fail("a number");
  }
  bool number_unsigned(json::number_unsigned_t value) {
    if (mode_ == Mode::kVocab) {
      return AddVocab(value > static_cast<uint64_t>(INT64_MAX) ? -1 : static_cast<int64_t>(value));
    }
    return mode_ == Mode::kDom ? dom_.number_unsigned(value) : Fail("a number");
  }
  bool number_float(json::number_float_t value, const std::string& text) {
    return mode_ == Mode::kDom ? dom_.number_float(value, text) : Fail("a number");
  }
  bool binary(json::binary_t& value) { return mode_ == Mode::kDom ? dom_.binary(value) : false; }
  bool string(std::string& value) {
    if (mode_ == Mode::kDom) return dom_.string(value);
    if (mode_ == Mode::kVocab) return Fail("a string");
    if (in_pair_) {
      pair_.push_back(std::move(value));
      return true;
    }
    const size_t space = value.find(' ');
    if (space == std::string::npos) {
      return FailWith(absl::StrFormat("model.merges[%d] = \"%s\" is not \"left right\"",
                                      bpe_->merges.size(), value));
    }
    bpe_->merges.emplace_back(value.substr(0, space), value.substr(space + 1));
    return true;
  }
  bool start_object(std::size_t size) {
    if (mode_ != Mode::kDom) return Fail("an object");
    if (AtModelKey("vocab")) {
      mode_ = Mode::kVocab;
      bpe_->has_vocab = true;
      bpe_->vocab.clear();
      return true;
    }
    frames_.push_back({key_in_parent(), ""});
    return dom_.start_object(size);
  }
  bool key(std::string& value) {
    if (mode_ == Mode::kVocab) {
      vocab_key_ = std::move(value);
      return true;
    }
    if (!frames_.empty()) frames_.back().last_key = value;
    return dom_.key(value);
  }
  bool end_object() {
    if (mode_ == Mode::kVocab) {
      mode_ = Mode::kDom;
      return dom_.null();
    }
    frames_.pop_back();
    return dom_.end_object();
  }
  bool start_array(std::size_t size) {
    if (mode_ == Mode::kMerges) {
      if (in_pair_) return Fail("a nested list");
      in_pair_ = true;
      pair_.clear();
      return true;
    }
    if (mode_ == Mode::kVocab) return Fail("a list");
    if (AtModelKey("merges")) {
      mode_ = Mode::kMerges;
      bpe_->has_merges = true;
      bpe_->merges.clear();
      return true;
    }
    frames_.push_back({key_in_parent(), ""});
    return dom_.start_array(size);
  }
  bool end_array() {
    if (mode_ == Mode::kMerges) {
      if (!in_pair_) {
        mode_ = Mode::kDom;
        return dom_.null();
      }
      in_pair_ = false;
      if (pair_.size() != 2) {
        return FailWith(
            absl::StrFormat("model.merges[%d] must be a pair [left, right]", bpe_->merges.size()));
      }
      bpe_->merges.emplace_back(std::move(pair_[0]), std::move(pair_[1]));
      return true;
    }
    frames_.pop_back();
    return dom_.end_array();
  }
  template <class Exception>
  bool parse_error(std::size_t position, const std::string& last_token, const Exception& e) {
    return FailWith(e.what());
  }

 private:
  enum class Mode { kDom, kVocab, kMerges };
  struct Frame {
    std::string key_in_parent;  // "" for list elements and the root
    std::string last_key;       // latest key seen in this object
  };

  std::string key_in_parent() const { return frames_.empty() ? "" : frames_.back().last_key; }
  // Whether the value about to start is root.model.<name>.
  bool AtModelKey(std::string_view name) const {
    return frames_.size() == 2 && frames_[1].key_in_parent == "model" &&
           frames_[1].last_key == name;
  }
  bool AddVocab(int64_t id) {
    bpe_->vocab.emplace_back(std::move(vocab_key_), id);
    return true;
  }
  // Stops the parse on an entry of the wrong type inside model.vocab or model.merges.
  bool Fail(const char* what) {
    if (mode_ == Mode::kVocab) {
      return FailWith(absl::StrFormat("model.vocab: id of \"%s\" must be an integer, got %s",
                                      vocab_key_, what));
    }
    return FailWith(
        absl::StrFormat("model.merges[%d] must be \"left right\" or [left, right], got %s",
                        bpe_->merges.size(), what));
  }
  bool FailWith(std::string message) {
    if (status_.ok()) status_ = absl::InvalidArgumentError(std::move(message));
    return false;
  }

  nlohmann::detail::json_sax_dom_parser<json> dom_;
  RawBpe* bpe_;
  Mode mode_ = Mode::kDom;
  std::vector<Frame> frames_;
  std::string vocab_key_;
  bool in_pair_ = false;
  std::vector<std::string> pair_;
  absl::Status status_;
};

}  // namespace

absl::StatusOr<ParsedTokenizerJson> ParseTokenizerJson(std::string_view text) {
  ParsedTokenizerJson parsed;
  Handler handler(&parsed.root, &parsed.bpe);
  bool ok = false;
  try {
    ok = json::sax_parse(text.begin(), text.end(), &handler);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(e.what());
  }
  if (!handler.status().ok()) return handler.status();
  if (!ok) return absl::InvalidArgumentError("not valid JSON");
  return parsed;
}

}  // namespace preft::text::tokenizer_internal
