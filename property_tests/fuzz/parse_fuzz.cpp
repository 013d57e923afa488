// Fuzz target: the text the library parses, each parser against an independent model of what
// the text means. The first byte picks the parser; the rest of the input is the text, up to
// its first NUL (an environment variable's value cannot hold one):
//
//   0  MHA_MAX_ISA      mha::detail::parse_max_isa; then through the environment:
//                       max_isa_rank(), best_kernel()
//   1  MHA_NUM_THREADS  mha::detail::parse_num_threads; then default_threads()
//   2  MHA_CACHES       mha::support::detail::parse_caches; then read_caches()
//   3  a cache size as sysfs writes it (support::detail::parse_cache_size)
//   4  a CPU list as sysfs writes it (support::detail::count_cpus)
//   5  a kernel name: find_kernel, mha::attention(name, ...) on a small problem, find_gemm
//
// A value is accepted exactly when the model accepts it, and then means what the model says;
// otherwise the parser throws std::invalid_argument with its documented message.
#include <mha/attention.h>
#include <mha/parallel.h>
#include <mha/registry.h>
#include <mha/support.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "fuzz_input.h"
#include "reference.h"
#include "tolerance.h"

namespace mha::fuzz {
namespace {

// Sets an environment variable for one scope and restores what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) {
      had_ = true;
      old_ = old;
    }
    setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (had_) {
      setenv(name_, old_.c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};

bool is_digit(char c) { return c >= '0' && c <= '9'; }

// strtol's white space in the "C" locale.
bool is_space(char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }

// Decimal digits s[i, j) as a number, saturated at `cap` + 1 (anything above cap is too big).
std::int64_t digits_value(const std::string& s, std::size_t i, std::size_t j, std::int64_t cap) {
  std::int64_t n = 0;
  for (; i < j; ++i) {
    n = n * 10 + (s[i] - '0');
    if (n > cap) return cap + 1;
  }
  return n;
}

void max_isa(const std::string& text) {
  int expected = -1;
  int highest = 0;
  std::string accepted;
  for (Isa isa : all_isas) {
    highest = std::max(highest, isa_rank(isa));
    accepted += (accepted.empty() ? "" : ", ") + std::string(isa_name(isa));
    if (text == isa_name(isa)) expected = isa_rank(isa);
  }
  if (text.empty()) expected = highest;  // unset: no cap
  const std::string what = "MHA_MAX_ISA=\"" + text + "\"";
  const std::string message = "MHA_MAX_ISA=" + text + " is not one of " + accepted;
  if (expected < 0) {
    expect_rejected([&] { detail::parse_max_isa(text.c_str()); }, message, what);
    const ScopedEnv env("MHA_MAX_ISA", text);
    expect_rejected([&] { max_isa_rank(); }, message, what + " in the environment");
    expect_rejected([&] { best_kernel(); }, message, what + ": best_kernel()");
    return;
  }
  expect_accepted(
      [&] {
        const int rank = detail::parse_max_isa(text.c_str());
        expect(rank == expected,
               what + ": rank " + std::to_string(rank) + ", expected " + std::to_string(expected));
        const ScopedEnv env("MHA_MAX_ISA", text);
        expect(max_isa_rank() == expected, what + ": max_isa_rank() differs from the parser");
        // The best kernel is the last one the cap and the CPU allow.
        const KernelInfo* last = &all_kernels().front();
        for (const KernelInfo& k : all_kernels()) {
          if (isa_rank(k.isa) <= expected && cpu_supports(k.isa)) last = &k;
        }
        expect(&best_kernel() == last,
               what + ": best_kernel() is " + best_kernel().name + ", expected " + last->name);
      },
      what);
}

void num_threads(const std::string& text) {
  // strtol's grammar: white space, a sign, decimal digits, and nothing after them.
  std::size_t i = 0;
  while (i < text.size() && is_space(text[i])) ++i;
  bool negative = false;
  if (i < text.size() && (text[i] == '+' || text[i] == '-')) negative = text[i++] == '-';
  std::size_t j = i;
  while (j < text.size() && is_digit(text[j])) ++j;
  const std::int64_t n = digits_value(text, i, j, 4096);
  const bool valid = j > i && j == text.size() && !negative && n >= 1 && n <= 4096;
  const std::string what = "MHA_NUM_THREADS=\"" + text + "\"";
  if (text.empty()) {
    expect(detail::parse_num_threads("") == 0 && detail::parse_num_threads(nullptr) == 0,
           "an unset MHA_NUM_THREADS must parse as 0");
    return;
  }
  if (!valid) {
    const std::string message = "MHA_NUM_THREADS=" + text + " is not a positive integer (1..4096)";
    expect_rejected([&] { detail::parse_num_threads(text.c_str()); }, message, what);
    const ScopedEnv env("MHA_NUM_THREADS", text);
    expect_rejected([&] { default_threads(); }, message, what + " in the environment");
    return;
  }
  expect_accepted(
      [&] {
        expect(detail::parse_num_threads(text.c_str()) == n,
               what + ": parsed as " + std::to_string(detail::parse_num_threads(text.c_str())));
        const ScopedEnv env("MHA_NUM_THREADS", text);
        expect(default_threads() == n, what + ": default_threads() differs");
      },
      what);
}

// A size as parse_cache_size reads it: digits, an optional K or M, then only blanks and
// newlines; not zero, at most 1 GiB. -1 otherwise.
std::int64_t model_cache_size(const std::string& s) {
  std::size_t j = 0;
  while (j < s.size() && is_digit(s[j])) ++j;
  if (j == 0) return -1;
  std::int64_t unit = 1;
  std::size_t k = j;
  if (k < s.size() && (s[k] == 'K' || s[k] == 'k')) unit = std::int64_t{1} << 10;
  if (k < s.size() && (s[k] == 'M' || s[k] == 'm')) unit = std::int64_t{1} << 20;
  if (unit != 1) ++k;
  while (k < s.size() && (s[k] == '\n' || s[k] == ' ')) ++k;
  const std::int64_t limit = (std::int64_t{1} << 30) / unit;
  const std::int64_t n = digits_value(s, 0, j, limit);
  if (k != s.size() || n == 0 || n > limit) return -1;
  return n * unit;
}

void cache_size(const std::string& text) {
  const std::int64_t got = support::detail::parse_cache_size(text.c_str());
  const std::int64_t want = model_cache_size(text);
  expect(got == want, "parse_cache_size(\"" + text + "\") = " + std::to_string(got) +
                          ", expected " + std::to_string(want));
}

void caches(const std::string& text) {
  // Two or three sizes between commas: L1d, L2 and optionally the L3 (none: 0).
  std::vector<std::string> fields(1);
  for (const char c : text) {
    if (c == ',') {
      fields.emplace_back();
    } else {
      fields.back() += c;
    }
  }
  const bool counted = fields.size() == 2 || fields.size() == 3;
  const std::int64_t l1d = counted ? model_cache_size(fields[0]) : -1;
  const std::int64_t l2 = counted ? model_cache_size(fields[1]) : -1;
  const std::int64_t l3 = counted && fields.size() == 3 ? model_cache_size(fields[2]) : 0;
  const bool valid = l1d >= (4 << 10) && l2 >= l1d && l3 >= 0;
  const std::string what = "MHA_CACHES=\"" + text + "\"";
  if (!valid) {
    const std::string message = "MHA_CACHES=" + text +
                                " is not L1D,L2 or L1D,L2,L3 sizes such as 32K,512K or "
                                "32K,512K,4M (L1D at least 4K, L2 at least L1D, each at most "
                                "1024M)";
    expect_rejected([&] { support::detail::parse_caches(text.c_str()); }, message, what);
    if (!text.empty()) {  // empty is unset: the system's sizes
      const ScopedEnv env("MHA_CACHES", text);
      expect_rejected([&] { support::detail::read_caches(); }, message,
                      what + " in the environment");
    }
    return;
  }
  expect_accepted(
      [&] {
        const support::Caches c = support::detail::parse_caches(text.c_str());
        expect(c.l1d == l1d && c.l2 == l2 && c.l3 == l3,
               what + ": parsed as " + std::to_string(c.l1d) + ", " + std::to_string(c.l2) + ", " +
                   std::to_string(c.l3));
        const ScopedEnv env("MHA_CACHES", text);
        const support::Caches e = support::detail::read_caches();
        expect(e.l1d == l1d && e.l2 == l2 && e.l3 == l3, what + ": read_caches() differs");
      },
      what);
}

// The largest CPU number count_cpus takes (Linux's NR_CPUS is at most 8192).
constexpr std::int64_t kMaxCpu = std::int64_t{1} << 22;

void cpu_list(const std::string& text) {
  const std::int64_t got = support::detail::count_cpus(text);
  const std::string what = "count_cpus(\"" + text + "\") = " + std::to_string(got);
  expect(got >= 1, what + ": not a CPU count");
  // A list as sysfs writes it, "a" or "a-b" items joined by commas, counts its CPUs; any other
  // text is unreadable, and then only a count of at least 1 is required.
  std::int64_t want = 0;
  std::size_t i = 0;
  while (true) {
    std::size_t j = i;
    while (j < text.size() && is_digit(text[j])) ++j;
    if (j == i) return;
    const std::int64_t first = digits_value(text, i, j, kMaxCpu);
    std::int64_t last = first;
    if (j < text.size() && text[j] == '-') {
      i = j + 1;
      j = i;
      while (j < text.size() && is_digit(text[j])) ++j;
      if (j == i) return;
      last = digits_value(text, i, j, kMaxCpu);
    }
    if (first > kMaxCpu || last > kMaxCpu || last < first) {
      expect(got == 1, what + ": expected 1 for CPU numbers out of order or above 2^22");
      return;
    }
    want += last - first + 1;
    if (j == text.size()) break;
    if (text[j] != ',') return;
    i = j + 1;
  }
  expect(got == want, what + ", expected " + std::to_string(want));
}

void kernel_name(const std::string& text) {
  const KernelInfo* want = nullptr;
  for (const KernelInfo& k : all_kernels()) {
    if (text == k.name) want = &k;
  }
  expect(find_kernel(text) == want, "find_kernel(\"" + text + "\") found the wrong kernel");
  const GemmInfo* want_gemm = nullptr;
  for (const GemmInfo& g : all_gemms()) {
    if (text == g.name) want_gemm = &g;
  }
  expect(find_gemm(text) == want_gemm, "find_gemm(\"" + text + "\") found the wrong kernel");

  // A small GQA problem, causal with a longer KV range, so that every row sees keys.
  const Problem p = make_problem(1, 3, 5, 4, 2, 9, true);
  std::vector<float> q(static_cast<std::size_t>(q_extent(p))),
      k(static_cast<std::size_t>(k_extent(p))), v(static_cast<std::size_t>(v_extent(p))),
      o(static_cast<std::size_t>(o_extent(p))), lse(static_cast<std::size_t>(lse_extent(p)));
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::sin(static_cast<float>(i));
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = std::cos(static_cast<float>(i));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i % 7) - 3.0f;
  const auto call = [&] {
    attention(text, p, q.data(), k.data(), v.data(), o.data(), lse.data(), 1);
  };
  const std::string what = "mha::attention(\"" + text + "\", ...)";
  if (want == nullptr) {
    expect_rejected(call, "unknown kernel '" + text + "'", what);
    return;
  }
  if (!available(*want)) {
    expect_rejected(call,
                    "kernel '" + text + "' needs " + isa_name(want->isa) +
                        ", which this CPU lacks or MHA_MAX_ISA excludes",
                    what);
    return;
  }
  expect_accepted(call, what);
  const ref::Result r = ref::attention(p, q.data(), k.data(), v.data());
  const ref::Tolerance tol = ref::tolerance(p, q.data(), k.data(), v.data(), want->exp_ulp);
  for (std::int64_t h = 0; h < p.q_heads; ++h) {
    for (std::int64_t i = 0; i < p.q_len; ++i) {
      const std::size_t row = tol.row(0, h, i);
      for (std::int64_t d = 0; d < p.head_dim; ++d) {
        const double got = o[static_cast<std::size_t>(i * p.o.seq + h * p.o.head + d)];
        expect(std::fabs(got - r.o_at(0, h, i, d)) <= tol.o[row],
               what + ": o differs from the reference");
      }
      const double got = lse[static_cast<std::size_t>(h * p.lse.head + i)];
      expect(std::fabs(got - r.lse_at(0, h, i)) <= tol.lse[row],
             what + ": lse differs from the reference");
    }
  }
}

}  // namespace
}  // namespace mha::fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace mha::fuzz;
  Bytes in(data, size);
  const int parser = in.u8() % 6;
  std::string text = in.rest();
  text.resize(std::strlen(text.c_str()));  // up to the first NUL
  switch (parser) {
    case 0:
      max_isa(text);
      break;
    case 1:
      num_threads(text);
      break;
    case 2:
      caches(text);
      break;
    case 3:
      cache_size(text);
      break;
    case 4:
      cpu_list(text);
      break;
    default:
      kernel_name(text);
      break;
  }
  return 0;
}
