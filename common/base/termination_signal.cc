#include "common/base/termination_signal.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>

namespace preft::base {
namespace {

int signal_pipe[2] = {-1, -1};

void OnTerminationSignal(int sig) {
  const unsigned char b = static_cast<unsigned char>(sig);
  (void)!write(signal_pipe[1], &b, 1);  // async-signal-safe
}

}  // namespace

void InstallTerminationHandler() {
  if (signal_pipe[0] >= 0) return;
  if (pipe(signal_pipe) != 0) return;
  struct sigaction sa {};
  sa.sa_handler = OnTerminationSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
}

int WaitForTerminationSignal() {
  unsigned char b = 0;
  while (read(signal_pipe[0], &b, 1) < 0 && errno == EINTR) {
  }
  return b;
}

}  // namespace preft::base
