#pragma once

// Worker processes for multi-process cluster tests: spawned with posix_spawn, output to a log
// file, address read from their "listening on ADDR" line, killed with any signal.

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

extern char** environ;

namespace preft::testing {

class ChildProcess {
 public:
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Spawn(std::vector<std::string> argv,
                                                             const std::string& log_path) {
    std::unique_ptr<ChildProcess> p(new ChildProcess());
    p->log_path_ = log_path;
    p->name_ = argv.front();
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    std::vector<char*> args;
    for (std::string& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    const int rc = posix_spawn(&p->pid_, args[0], &actions, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) return absl::InternalError(absl::StrCat("cannot spawn ", argv[0], ": ", rc));
    return p;
  }

  ~ChildProcess() {
    if (pid_ > 0) {
      Signal(SIGKILL);
      Wait();
    }
  }

  // The address after "listening on " in the log, once it appears.
  absl::StatusOr<std::string> WaitForAddress(absl::Duration timeout) {
    const absl::Time until = absl::Now() + timeout;
    while (absl::Now() < until) {
      const std::string log = Log();
      const size_t at = log.find("listening on ");
      if (at != std::string::npos) {
        const size_t start = at + 13;
        const size_t end = log.find_first_of(" \n", start);
        if (end != std::string::npos) return log.substr(start, end - start);
      }
      if (pid_ > 0 && waitpid(pid_, &status_, WNOHANG) == pid_) {
        pid_ = -1;
        return absl::InternalError(absl::StrCat(name_, " exited before listening:\n", log));
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    return absl::DeadlineExceededError(absl::StrCat(name_, " did not start:\n", Log()));
  }

  void Signal(int sig) {
    if (pid_ > 0) kill(pid_, sig);
  }
  // Exit status as waitpid reports it.
  int Wait() {
    if (pid_ > 0) {
      waitpid(pid_, &status_, 0);
      pid_ = -1;
    }
    return status_;
  }
  std::string Log() const {
    std::ifstream in(log_path_);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }

 private:
  ChildProcess() = default;
  pid_t pid_ = -1;
  int status_ = 0;
  std::string log_path_;
  std::string name_;
};

}  // namespace preft::testing
