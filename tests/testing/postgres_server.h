#pragma once

// A real PostgreSQL server for tests: initdb into a temporary folder, started on a Unix socket
// there (no TCP port), stopped and removed at destruction. The server refuses to run as root,
// so under root (CI containers) it runs as `nobody` through setpriv. Debian's postgresql
// package (scripts/install-deps.sh) provides the binaries.

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace preft::testing {

class PostgresServer {
 public:
  // NotFound when the server binaries are not installed; Internal when it does not start.
  static absl::StatusOr<std::unique_ptr<PostgresServer>> Start(const std::string& dir) {
    namespace fs = std::filesystem;
    std::string bin;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator("/usr/lib/postgresql", ec)) {
      if (fs::exists(e.path() / "bin" / "pg_ctl")) bin = (e.path() / "bin").string();
    }
    if (bin.empty()) {
      return absl::NotFoundError(
          "PostgreSQL server binaries not found under /usr/lib/postgresql (scripts/install-deps.sh "
          "installs the postgresql package)");
    }
    fs::remove_all(dir, ec);
    fs::create_directories(dir);
    std::unique_ptr<PostgresServer> s(new PostgresServer(bin, dir));
    if (::geteuid() == 0) {
      // The server will not run as root: hand it the folder and run it as nobody.
      if (::chown(dir.c_str(), 65534, 65534) != 0) {
        return absl::InternalError(absl::StrCat("cannot chown ", dir, " to nobody"));
      }
      s->as_ = "setpriv --reuid=65534 --regid=65534 --clear-groups -- ";
    }
    if (s->Run(absl::StrCat(s->bin_, "/initdb -D ", s->data(), " -U preft -A trust --no-sync "
                            "--no-instructions -E UTF8 --locale=C.UTF-8 > ", dir,
                            "/initdb.log 2>&1")) != 0) {
      return absl::InternalError(absl::StrCat("initdb failed; see ", dir, "/initdb.log"));
    }
    if (s->Run(absl::StrCat(s->bin_, "/pg_ctl -D ", s->data(), " -l ", dir, "/server.log -w -o \"-k ",
                            dir, " -c listen_addresses='' -c fsync=off\" start > /dev/null 2>&1")) !=
        0) {
      return absl::InternalError(absl::StrCat("the server did not start; see ", dir, "/server.log"));
    }
    s->running_ = true;
    return s;
  }

  ~PostgresServer() {
    if (running_) Stop();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  // Stops it (data kept): the next Restart comes back with the same databases.
  void Stop() {
    Run(absl::StrCat(bin_, "/pg_ctl -D ", data(), " -m immediate -w stop > /dev/null 2>&1"));
    running_ = false;
  }
  bool Restart() {
    running_ = Run(absl::StrCat(bin_, "/pg_ctl -D ", data(), " -l ", dir_, "/server.log -w -o \"-k ",
                                dir_, " -c listen_addresses='' -c fsync=off\" start > /dev/null 2>&1")) == 0;
    return running_;
  }

  // A libpq URI for database `db` ("postgres" exists from the start).
  std::string Uri(const std::string& db = "postgres") const {
    // A Unix socket folder goes in the host parameter, percent-encoded.
    std::string host;
    for (char c : dir_) host += c == '/' ? std::string("%2F") : std::string(1, c);
    return absl::StrCat("postgresql://preft@", host, "/", db);
  }

  // Runs SQL through psql on database "postgres"; true on success.
  bool Sql(const std::string& sql) const {
    return std::system(absl::StrCat(bin_, "/psql -q -h ", dir_, " -U preft -d postgres -c \"", sql,
                                    "\" > /dev/null 2>&1")
                           .c_str()) == 0;
  }

 private:
  PostgresServer(std::string bin, std::string dir) : bin_(std::move(bin)), dir_(std::move(dir)) {}
  std::string data() const { return dir_ + "/data"; }
  int Run(const std::string& command) const { return std::system((as_ + command).c_str()); }

  const std::string bin_;
  const std::string dir_;
  std::string as_;  // "setpriv ... -- " under root
  bool running_ = false;
};

}  // namespace preft::testing
