// Renders a template file with a JSON context file (for oracle_test.py): the output on stdout,
// or "ERROR: <message>" and exit 1.
#include <cstdio>
#include <fstream>
#include <sstream>

#include "common/text/jinja.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: jinja_render TEMPLATE CONTEXT_JSON\n");
    return 2;
  }
  auto read = [](const char* path) {
    std::ifstream in(path, std::ios::binary);
    std::ostringstream s;
    s << in.rdbuf();
    return s.str();
  };
  auto t = preft::text::jinja::Template::Parse(read(argv[1]));
  if (!t.ok()) {
    std::printf("ERROR: %s", std::string(t.status().message()).c_str());
    return 1;
  }
  auto out = t->Render(preft::text::jinja::Value::parse(read(argv[2])));
  if (!out.ok()) {
    std::printf("ERROR: %s", std::string(out.status().message()).c_str());
    return 1;
  }
  std::fwrite(out->data(), 1, out->size(), stdout);
  return 0;
}
