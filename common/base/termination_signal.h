#pragma once

// SIGTERM and SIGINT as an event main can wait for: how every preft process shuts down.

namespace preft::base {

// Routes SIGTERM and SIGINT to WaitForTerminationSignal: a handler (whichever thread the
// kernel picks, including threads libraries started before main) writes the signal to a pipe.
// Call it early in main ...
void InstallTerminationHandler();
// ... then wait for one; returns its number.
int WaitForTerminationSignal();

}  // namespace preft::base
