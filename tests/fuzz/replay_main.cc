// A stand-in for libFuzzer's driver where the compiler has none (g++): runs the target over every
// file of a corpus folder, then over deterministic random mutations of those files, so ordinary
// ctest runs exercise the fuzz targets. Usage: <target> CORPUS_DIR [NUM_MUTATIONS]

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

// xoshiro-style generator kept tiny: splitmix64 over a counter.
struct Rng {
  uint64_t state;
  uint64_t Next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  size_t Below(size_t n) { return n == 0 ? 0 : static_cast<size_t>(Next() % n); }
};

// Tokens that steer JSON and safetensors parsers into their interesting branches.
const char* const kDictionary[] = {
    "{",
    "}",
    "[",
    "]",
    "\"",
    ":",
    ",",
    "-1",
    "0",
    "1e308",
    "18446744073709551615",
    "9223372036854775807",
    "-9223372036854775808",
    "null",
    "true",
    "false",
    "\"F32\"",
    "\"BF16\"",
    "\"F16\"",
    "\"I64\"",
    "\"shape\"",
    "\"dtype\"",
    "\"data_offsets\"",
    "\"__metadata__\"",
    "\"rope_scaling\"",
    "\"rope_type\"",
    "\"llama3\"",
    "\"yarn\"",
    "\"eos_token_id\"",
    "\"head_dim\"",
    "\"num_key_value_heads\"",
    "\"hidden_size\"",
    "\"architectures\"",
    "\"Qwen2ForCausalLM\"",
    "\"MistralForCausalLM\"",
    "4294967296",
    "\\u0000",
    "\xff\xfe",
};

void Mutate(Rng& rng, const std::vector<std::string>& corpus, std::string* s) {
  const int steps = 1 + static_cast<int>(rng.Below(4));
  for (int k = 0; k < steps; ++k) {
    switch (rng.Below(8)) {
      case 0:  // flip a bit
        if (!s->empty()) (*s)[rng.Below(s->size())] ^= static_cast<char>(1u << rng.Below(8));
        break;
      case 1:  // set a random byte
        if (!s->empty()) (*s)[rng.Below(s->size())] = static_cast<char>(rng.Next());
        break;
      case 2:  // erase a range
        if (!s->empty()) {
          size_t at = rng.Below(s->size());
          s->erase(at, 1 + rng.Below(std::min<size_t>(16, s->size() - at)));
        }
        break;
      case 3:  // truncate
        s->resize(rng.Below(s->size() + 1));
        break;
      case 4: {  // insert a dictionary token
        const char* tok = kDictionary[rng.Below(std::size(kDictionary))];
        s->insert(rng.Below(s->size() + 1), tok);
        break;
      }
      case 5:  // replace a digit run's digit
        for (size_t i = rng.Below(s->size() + 1); i < s->size(); ++i) {
          if ((*s)[i] >= '0' && (*s)[i] <= '9') {
            (*s)[i] = static_cast<char>('0' + rng.Below(10));
            break;
          }
        }
        break;
      case 6: {  // splice another corpus file
        const std::string& other = corpus[rng.Below(corpus.size())];
        if (!other.empty()) {
          size_t from = rng.Below(other.size());
          s->insert(rng.Below(s->size() + 1), other.substr(from, 1 + rng.Below(64)));
        }
        break;
      }
      case 7:  // poke the 8-byte length prefix (safetensors)
        if (s->size() >= 8) (*s)[rng.Below(8)] = static_cast<char>(rng.Next());
        break;
    }
  }
}

void Run(const std::string& input) {
  // A fresh heap copy of exactly the input's size, so overreads hit the end of the buffer.
  std::vector<uint8_t> copy(input.begin(), input.end());
  LLVMFuzzerTestOneInput(copy.data(), copy.size());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR [NUM_MUTATIONS]\n", argv[0]);
    return 2;
  }
  const long mutations = argc > 2 ? std::strtol(argv[2], nullptr, 10) : 5000;
  std::vector<std::filesystem::path> paths;
  for (const auto& e : std::filesystem::directory_iterator(argv[1])) {
    if (e.is_regular_file()) paths.push_back(e.path());
  }
  std::sort(paths.begin(), paths.end());  // order matters for determinism
  std::vector<std::string> corpus;
  for (const auto& p : paths) {
    std::ifstream in(p, std::ios::binary);
    corpus.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    Run(corpus.back());
  }
  if (corpus.empty()) {
    std::fprintf(stderr, "%s: empty corpus\n", argv[1]);
    return 2;
  }
  Rng rng{0x5eed};
  for (long i = 0; i < mutations; ++i) {
    std::string s = corpus[rng.Below(corpus.size())];
    Mutate(rng, corpus, &s);
    Run(s);
  }
  std::printf("replayed %zu corpus files and %ld mutations\n", corpus.size(), mutations);
  return 0;
}
