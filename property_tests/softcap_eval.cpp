#include "softcap_eval.h"

#include <cstdint>

#include "mha/support.h"

#if defined(__x86_64__)
MHA_TARGET_BEGIN("avx2,fma")
#endif
namespace mha::test {

void softcap_fma(const mha::support::Softcap& cap, float* x, std::int64_t n) { cap.apply(x, n); }

}  // namespace mha::test
#if defined(__x86_64__)
MHA_TARGET_END
#endif
