// The thread-parallel driver with every registry kernel as its worker: equivalence to the
// reference (including split-KV decoding, merged by lse), bit-identical output for any
// thread count and for a sequence whatever its batch (the properties are in
// driver_properties.cpp).
#include "driver_properties.h"
#include "kernel_test.h"
#include "run.h"

namespace mha::test {
namespace {

class Driver : public KernelTest {};

TEST_P(Driver, MatchesReference) {
  check_property([&] { driver_matches_reference(kernel()); });
}

TEST_P(Driver, SplitKvDecodingMatchesReference) {
  check_property([&] { split_kv_decoding_matches_reference(kernel()); });
}

TEST_P(Driver, ThreadCountDoesNotChangeABit) {
  check_property([&] { thread_count_does_not_change_a_bit(kernel()); });
}

TEST_P(Driver, BatchDoesNotChangeASequence) {
  check_property([&] { batch_does_not_change_a_sequence(kernel()); });
}

TEST_P(Driver, RaggedBatchEqualsSeparateCalls) {
  check_property([&] { ragged_batch_equals_separate_calls(kernel()); });
}

MHA_INSTANTIATE_FOR_KERNELS(Driver);

}  // namespace
}  // namespace mha::test
