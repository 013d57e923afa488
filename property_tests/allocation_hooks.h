// What the test executable's replacement of the global operator new (allocation_test.cpp)
// can be told, for the calling thread only: so that a test fails exactly the allocations
// of the call it runs, whatever other threads do.
#pragma once

#include <cstddef>

namespace mha::test::alloc {

/// Allocations operator new has been asked for on this thread so far.
long count();

/// The n-th allocation from now on this thread (0: the next) returns no memory, once; a
/// negative n: none does.
void fail_at(long n);

/// Every allocation of more than `bytes` on this thread returns no memory (SIZE_MAX: none),
/// as an address-space limit would make it.
void limit(std::size_t bytes);

}  // namespace mha::test::alloc
