// The one tolerance every kernel is held to, derived from the inputs. Its only per-kernel
// input is the declared error of the kernel's exp (registry.inc).
//
// Model: every fp32 operation rounds with relative error at most u = 2^-24, and
// gamma(n) = n u / (1 - n u) bounds the relative error of n chained roundings (Higham,
// "Accuracy and Stability of Numerical Algorithms", 3.1). The reference is double and its
// own error (about 2^-53 relative) is negligible against these bounds. For one output row
// (batch b, head h, query i) with n >= 1 visible keys:
//
// 1. Logits. With A = |scale| * max_j sum_d |q_d k_jd| over the visible keys, a kernel's
//    computed exponent x_j = s_j - m (or its base-2 form) is off by at most
//      delta = gamma(Z + 5) * A
//    from the exact one: Z <= D roundings in the dot product, Z the most nonzero products
//    q_d k_jd of any key (a product or sum with an exact zero is exact), one for the scale
//    (or for pre-scaling q), two for a log2(e) factor and its rounded constant, and the
//    subtraction of the max, whose result is at most 2A in magnitude (counted as two more).
//    Any common shift of all x_j cancels in the softmax, so which max is subtracted (the
//    true one or a running one) does not matter.
// 2. Weights. w_j = exp(x_j) then has relative error at most
//      eta = exp(delta) * (1 + exp_ulp * 2^-23) - 1,
//    since one ulp is at most 2^-23 relative. Normalized weights p_j = w_j / sum w then
//    move by at most sum_j |p'_j - p_j| <= min(2, 2 eta / (1 - eta)), so with V = the largest |v|
//    over the visible keys and all columns, the exact softmax of the perturbed weights is
//    within that times V of the true output. (The cap 2 only matters when the logits are so
//    large against 2^24 / D that fp32 cannot resolve them; such rows are still checked for
//    finiteness, range and lse.)
// 3. Accumulation. The numerator sum_j w_j v_j and the denominator sum_j w_j are each
//    computed with relative error gamma(M), M = 2n + 2: n - 1 additions, the products,
//    and up to n rescalings by a running-max correction (online softmax applies the same
//    factor to both, so the factor's own exp error cancels; its roundings do not). Their
//    quotient is then within 2 e / (1 - e) * V of step 2's value, e = gamma(M), and the
//    division rounds once more (u * (1 + that) * V).
//    Keys far below the row's top logit tighten this. An addition in round-to-nearest errs
//    by at most u |a + b| and by at most min(|a|, |b|) (a and b are representable). Split
//    the keys at a depth T below the top exact logit: a key is small when x_j < -T, big
//    otherwise (also within 4 delta + 1e-3 below -T: its computed logit may still raise the
//    running max). In any order of summation only additions of two partial sums that both
//    hold a big key can err by u |a + b|, at most n_big - 1 of them; the others add a partial
//    sum of small keys, and err by at most its value. The running max rises only at big
//    keys once one was seen, and a rescale before that scales small keys alone (a rescale by
//    exp(0) = 1 is exact). So e = gamma(2 n_big + 2) + (1 + 2 gamma(2n + 2)) P_small, with
//    P_small the small keys' share of the weights (their exact share, times
//    (1 + eta) / (1 - eta) for step 2's perturbation). The bound takes the depth T (from 8 to
//    88, or none: every key big, P_small = 0) that gives the smallest e. With uniform inputs
//    no key is small and e = gamma(2n + 2) ~ 4 n u; with a few keys per row within reach of
//    the top, e depends on those only, and a check at 131072 keys can see one of a few
//    hundred keys go missing (bench/main.cpp, reference/sensitive.h).
// 4. Underflow. Weights below 2^-126 may flush to zero in vectorized exps; relative to the
//    largest weight (1) each loses at most 2^-125, so n * 2^-125 * V more.
//
//    tol_o   = [min(2, 2 eta/(1-eta)) + 2 e/(1-e) + u (1 + 2 e/(1-e)) + n 2^-125] * V
//
// 5. lse = m + log(sum_j w_j). The log of the perturbed sum is off by at most
//    log(1 + eta) - log(1 - gamma(M)); adding m and taking the log (and a base change for
//    exp2-based kernels) round a few times more on values at most |m| + log(n) <= A + log n:
//
//    tol_lse = log(1 + eta) - log(1 - e) + (4 + exp_ulp) * 2u * (A + log(n) + 1)
//
// 6. K and V of a reduced type (p.kv_type). f16 and bf16 widen to fp32 exactly: nothing
//    changes. An i8 element's value q s is formed in fp32 with one rounding (or the scale
//    multiplies a finished dot product: one rounding too), which the reference does not
//    make: one more rounding per product in step 1 (gamma(Z + 6)), and every v moved by at
//    most u |v|, which moves the weighted mean by at most u V: tol_o gains u V. (For
//    normal products q s; the property tests' scales keep them so.)
//
// 7. Sinks (Problem::sinks). A row's sink is one more key of logit sinks[h] and value 0: it
//    joins A (|sink|), the top logit, the key count n (one more term of the denominator, which
//    also covers the rounding of l + exp(sink - m) to fp32) and step 3's split; V is unchanged.
//    Folding it into lse (a log-add-exp in double, rounded once) rounds once more: (5 +
//    exp_ulp) in tol_lse.
//
// 8. Soft-capping (Problem::softcap = c). A logit's cap c tanh(s / c) has slope at most 1, so
//    step 1's error of s passes through it no larger; the kernels' tanh (and their rounding of
//    c to the logits' units) adds at most kSoftcapError u c (mha::support::Softcap, measured
//    in property_tests/softcap_test.cpp): delta gains that. A capped logit is at most c in
//    magnitude, less than A allows for, so every other term stands; the exact logits (the top,
//    step 3's split) are the capped ones.
//
// 9. ALiBi (Problem::alibi). A kernel forms a key's bias -slope |d| from the slope in its
//    logit units (one rounding), the distance d in float (two: float(d0) and d0 - k) and
//    their product (one), adds it to the logit (one, on at most A + B), and the subtraction of
//    the max now acts on values up to 2 (A + B) (two more on B): delta gains gamma(7) B, B the
//    largest |bias| over the row's visible keys (support::Alibi). The exact logits (the top,
//    step 3's split) are the biased ones; the top may now lie anywhere in the row, which step
//    3 never assumed otherwise. lse = m + log(sum) holds values up to A + B: tol_lse's last
//    term takes A + B for A.
//
// 10. ALiBi's reach (mha::support::AlibiReach). A kernel may skip keys whose exact weight is
//    below 2^-40 of the row's top one (a causal call's far keys under steep ALiBi slopes). Its
//    result is then within this bound of the exact attention over the keys it kept (fewer
//    keys: no term grows), which differs from the whole row's by at most 2 P V in o and
//    -log(1 - P) in lse, P the skipped keys' share of the weights. The bound over all the
//    keys already holds that much more: under step 3's split a small key's whole weight is in
//    P_small, and a big one adds 2 to gamma's count, at least 2 u to e, more than twice its
//    weight (< 2^-40). Nothing is added.
//
// Every step is a worst-case bound, so a correct kernel never exceeds it; it is far from
// loose enough to hide a real bug: a wrong mask, a missing max subtraction, a wrong GQA
// head mapping, a doubled scale, a skipped key, a dropped tail of D or lse in the wrong
// base all fail it (the mutant tests prove it for each).
#pragma once

#include <mha/attention.h>

#include <cstdint>
#include <vector>

namespace mha::ref {

/// Per-row bounds, indexed like ref::Result's lse: [batch][q_heads][q_len].
struct Tolerance {
  std::int64_t q_heads = 0, q_len = 0;
  std::vector<double> o;             ///< bound on |o - o_exact| for every column of the row
  std::vector<double> lse;           ///< bound on |lse - lse_exact|
  std::vector<double> accumulation;  ///< steps 3 and 4 alone (for weight-free checks)
  std::vector<double> v_max;         ///< V: largest |v| over the row's visible keys

  std::size_t row(std::int64_t b, std::int64_t h, std::int64_t i) const {
    return static_cast<std::size_t>((b * q_heads + h) * q_len + i);
  }
};

/// Step 8's bound on a kernel's soft-cap, in units of u c: the most any kernel's tanh (and
/// rounding of c) moves a capped logit from c tanh(s / c) of its computed s.
extern const double kSoftcapError;

/// gamma(n) = n u / (1 - n u) with u = 2^-24.
double gamma(double n);

/// Step 2's bound on sum_j |p'_j - p_j| for weights perturbed by at most eta (relative):
/// 2 eta / (1 - eta), never more than 2 (two distributions differ by at most 2 in total).
double weight_shift(double eta);

/// Steps 3 and 4 as a relative factor, for n terms: the accumulation bound divided by V.
double accumulation_factor(double n);

/// The same with `big` of the n keys big and the small ones' share of the weights
/// `small_mass` (step 3's split); 2 (no information) when e reaches 1/2.
double accumulation_factor(double n, double big, double small_mass);

/// tol_o of one row with n >= 1 visible keys, A and V as above, head_dim D and the kernel's
/// exp_ulp, K and V stored as kv_type (i8: step 6's rounding of q s, one more per product
/// and u V more); what tolerance() computes per row with Z = D.
double o_bound(double a, double v_max, std::int64_t n, std::int64_t head_dim, double exp_ulp,
               KvType kv_type = KvType::f32);

/// The bounds above for every row of p over its inputs (only rows [row_begin, row_end) of
/// every head when given; the others stay 0).
Tolerance tolerance(const Problem& p, const float* q, KvView k, KvView v, double exp_ulp,
                    std::int64_t row_begin = 0, std::int64_t row_end = -1);

/// The tolerance of a result merged from `parts` partial results (split-KV): each part is
/// within the whole problem's tolerance (fewer keys, same maxima); merging perturbs the
/// part weights exp(lse_c - m) by at most twice the lse tolerance and adds the
/// accumulation error of `parts` terms.
Tolerance merged_tolerance(Tolerance tol, double parts);

}  // namespace mha::ref
