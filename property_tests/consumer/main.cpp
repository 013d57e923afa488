// Runs one attention problem through the installed library and checks a known answer:
// with constant values every output equals that constant.
#include <mha/attention.h>
#include <mha/registry.h>

#include <cmath>
#include <cstdio>
#include <vector>

int main() {
  const mha::Problem p = mha::make_problem(1, 4, 6, 4, 2, 32, true);
  std::vector<float> q(mha::q_extent(p), 0.1f), k(mha::k_extent(p), -0.2f),
      v(mha::v_extent(p), 3.0f), o(mha::o_extent(p)), lse(mha::lse_extent(p));
  mha::attention(p, q.data(), k.data(), v.data(), o.data(), lse.data());
  for (float x : o) {
    if (std::fabs(x - 3.0f) > 1e-5f) {
      std::printf("wrong output %g\n", x);
      return 1;
    }
  }
  std::printf("ok: %s kernel, %zu outputs\n", mha::best_kernel().name, o.size());
  return 0;
}
