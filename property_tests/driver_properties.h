// The parallel driver's properties, over a driver given as its two entry points (run.h's
// ParallelDriver): parallel_test.cpp runs them on mha/parallel.h's driver with every registry
// kernel, and the driver mutants must fail them (mutants/mutant_test.cpp).
#pragma once

#include <mha/registry.h>
#include <rapidcheck.h>

#include <functional>
#include <string>

#include "cases.h"
#include "run.h"

namespace mha::test {

/// Decode-like problems: few (batch x KV head) units and a long KV range, so the driver
/// splits the keys into chunks.
rc::Gen<Case> gen_split_case();

/// The driver running `kernel` on `threads` threads matches the reference on one case, within
/// the tolerance of a result merged from plan(p).chunks parts.
void check_driver(const KernelInfo& kernel, const Case& c, int threads,
                  const ParallelDriver& driver = ParallelDriver());

/// The properties' bodies, for check_property (each draws its case):
/// the driver matches the reference on gen_case()'s problems,
void driver_matches_reference(const KernelInfo& kernel,
                              const ParallelDriver& driver = ParallelDriver());
/// and on gen_split_case()'s (split-KV decoding),
void split_kv_decoding_matches_reference(const KernelInfo& kernel,
                                         const ParallelDriver& driver = ParallelDriver());
/// and gives the same bits on 1 thread and on 2 to 4.
void thread_count_does_not_change_a_bit(const KernelInfo& kernel,
                                        const ParallelDriver& driver = ParallelDriver());
/// and gives a sequence the same bits alone and first in a batch of others.
void batch_does_not_change_a_sequence(const KernelInfo& kernel,
                                      const ParallelDriver& driver = ParallelDriver());
/// and gives each sequence of a ragged batch the bits of its call alone (the driver on
/// 1 to 4 threads),
void ragged_batch_equals_separate_calls(const KernelInfo& kernel,
                                        const ParallelDriver& driver = ParallelDriver());
/// as any `call(threads)` must (a kernel, called directly, whatever the thread count); `name`
/// names it in failures.
void ragged_batch_equals_separate_calls(const std::function<Call(int threads)>& call,
                                        const std::string& name);

}  // namespace mha::test
