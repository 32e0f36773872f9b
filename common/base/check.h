#pragma once

// PREFT_CHECK aborts on a broken invariant (never on bad input: that is a Status).

#include <cstdio>
#include <cstdlib>

#define PREFT_CHECK(cond)                                                      \
  do {                                                                         \
    if (!(cond)) {                                                             \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                            \
    }                                                                          \
  } while (0)

#ifdef NDEBUG
#define PREFT_DCHECK(cond) \
  do {                     \
  } while (0)
#else
#define PREFT_DCHECK(cond) PREFT_CHECK(cond)
#endif
