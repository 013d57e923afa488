// mha/tiled_loops.h: the loops of the tiled attention kernels that pack every KV tile (avx2,
// the xsimd kernels, the highway kernels), so that each of them holds only its ISA's pieces:
// a policy that packs, runs the two microkernels, takes one row's online-softmax step and one
// decode row's steps. The algorithm is kernels/avx2/avx2.cpp's header (read that first); the
// loops, the tiling rule, the packing order, the prefetch and the workspace layout are here,
// once, as gemm_loops.h holds the GEMMs' (BLIS-style: loops around a microkernel).
//
//   for each (batch, KV head, block of R = g x Br query rows, head-major: row t is head
//            t / Br, query row r0 + t % Br; all g heads share every KV tile):  for_each_block
//     pack Q: each group of MR rows into Qp[d][MR]; m, l, O empty        start_block
//     for each KV tile of Bc = kKeys keys some row of the block sees:
//       pack K^T into panels Kp[panel][d][P]                             K::pack_k
//       S = scale log2(e) Q K^T, K panel by K panel, each panel reused   tile_logits,
//         by every group from L1; soft-capped (Problem::softcap), then    K::logits_tile<MR>
//         ALiBi's bias added (Problem::alibi)
//       online softmax in base 2 per row                                 K::online_softmax
//       pack V into column panels Vp[panel][key][P]                      K::pack_v
//       O = alpha O + P V, V panel by V panel                            tile_pv, K::pv_tile<MR>
//     o = O / l, lse = (m + log2 l) ln2                                  K::finish_row
//
//   decode (fewer than kDecodeRows rows g x q_len per KV head; lanes along head_dim, K and V
//   read in place):
//   for each (batch, KV head): its g x q_len rows, O = 0                 decode_rows
//     for each tile of support::decode_tile_keys keys, the next one prefetched:
//       for each row that sees a key of the tile:
//         S, a few keys at a time, a prefetch step after each            K::decode_logits
//           (soft-capped and biased after: Problem::softcap, alibi)      shape_row
//         online softmax, base 2: m, alpha, P = 2^(S - m), l             K::decode_weights
//         O = alpha O + P V                                              K::decode_pv
//     o = O / l, lse = (m + log2 l) ln2                                  K::finish_row
//
// The policy K (P = K::panel() keys per K panel and columns per V panel, W = K::lanes()):
//   kRows                  MR, query rows per microkernel group
//   kWholeGroups           true: the microkernels always compute MR rows (the last group's
//                          padding rows are computed and never read), so they are called
//                          with MR = kRows and MR = 1 only, and the scratch rows are padded
//                          to a multiple of MR; false: called with the group's row count
//   lanes(), panel()       W, the lanes of a row's running max, and P (a multiple of W);
//                          constant expressions or, on SVE, run-time values
//   pack_k(k, k_seq, keys, dim, kp)      kp[j / P][d][j % P] = k[j][d], 0 past `keys`,
//                                        over keys rounded up to P
//   pack_v(v, v_seq, keys, dim, vp)      vp[c / P][j][c % P] = v[j][c], panel stride kKeys P,
//                                        0 past dim up to dim rounded up to P
//   pack_q(rows, nr, dim, qp)            qp[d][r] = rows[r][d] for r < nr, 0 up to MR
//   logits_tile<MR>(qp, kp, dim, c, limit, s, rowmax)
//                          s[r][0 .. P) = c sum_d qp[d][r] kp[d][0 .. P), -inf for lanes at
//                          or past limit[r]; rowmax[r][0 .. W) takes the lane maxima,
//                          ignoring NaN. Row stride of s: kKeys; of rowmax: W
//   pv_tile<MR>(p, keys, vp, alpha, o, ld_o)
//                          o[r][0 .. P) = alpha[r] o[r] + sum_{j < keys} p[r][j] vp[j][0 .. P)
//                          (alpha null: no rescale). Row stride of p: kKeys
//   online_softmax(s, cols, rowmax, m, l, alpha)  one row's step over its `cols` >= 1 logits,
//                          lanes up to the next multiple of W past cols being -inf
//   finish_row(acc, m, l, sink, visible, dim, o, lse)  o = acc / l and lse with the head's
//                          sink (support::row_end_base2), or 0 and the sink (-inf without)
//                          when the row sees no key
//   kDotKeys, decode_step()  keys per decode_logits step (one prefetch step each), and the
//                          multiple of keys a decode tile holds (a multiple of both W and it)
//   decode_logits(q, k, k_seq, cols, dim, c, w, after_step)  w[j] = c q . k_j for j < cols,
//                          calling after_step() once per kDotKeys keys; returns the max of
//                          w ignoring NaN (-inf if all are NaN). w's lanes past cols, up to
//                          the next multiple of decode_step(), may be written
//   decode_weights(w, cols, shift)  w[j] = 2^(w[j] - shift) for j < cols, 0 up to the next
//                          multiple of W; returns their sum
//   decode_pv(w, cols, v, v_seq, dim, acc, alpha)  acc = alpha acc + sum_{j < cols} w[j] v_j
//                          over dim columns (acc's length: dim rounded up to W)
//   kKvDecode              true: the policy reads K and V of every reduced type in its
//                          decode pieces, decode_logits_kv<T>(q, k, k_seq, k_scale,
//                          k_scale_seq, cols, dim, c, w, after_step) and decode_pv_kv<T>(w,
//                          cols, v, v_seq, v_scale, v_scale_seq, dim, acc, alpha) (k and v
//                          untyped, strides in elements of T, scales for i8; decode_pv_kv
//                          may rewrite w); false: the loops widen each decode tile first
//   kDecodeGroup           1, or (with kKvDecode) the most rows R (4 or 2) whose reduced-type
//                          decode runs together, each K and V vector converted once for R:
//                          decode_logits_group_kv<R, T>(q[R], k, k_seq, k_scale, k_scale_seq,
//                          cols, dim, c, w, ldw, max[R], after_step) (row r's logits to w +
//                          r ldw, up to W - 1 lanes past cols written; after_step() once per
//                          W / R keys) and decode_pv_group_kv<R, T>(w, ldw, cols, v, v_seq,
//                          v_scale, v_scale_seq, dim, acc, acc_stride, alpha[R])
//
// K and V stored as f16, bf16 or i8 (p.kv_type): each tile's rows are widened to fp32 into
// a scratch tile (widen_rows, in loops the compiler vectorizes for the includer's ISA; the
// values are mha::kv::value_at's), which the same pieces then read: prefill packs K and V
// from it, decode reads it in place of the cache, from L1, for all the KV head's rows. So
// the policy has no piece per type, the cache is read once per tile in its own type, and
// values a type holds exactly give the fp32 path's bits. fp32 takes the loops without the
// step, unchanged.
//
// Not avx512 or neon: their loops differ, not only their pieces. avx512 is transposed (query
// rows along the lanes, 32-row strips, K and V copied to an odd-cache-line stride instead of
// packed into panels, a masked second pass over the causal diagonal); neon is blocked's
// algorithm (a natural-log softmax, support::flash_tiling's blocks of at most 64 rows per
// head, only K^T packed, V read in place, decode below 8 rows).
//
// The pieces decode calls per row are inlined into one function (MHA_ALWAYS_INLINE in the
// policy): with the S loop, the prefetch step and P V in one register allocation, as
// avx2.cpp measured. The prefetch step holds copies of what it reads and one counter by
// reference, so that the S loop need not reload the loop's variables through references.
//
// How to include it. The loops are templates compiled for the ISA of the code they are
// defined in, so a kernel includes this header where its own ISA code is: inside its target
// region (MHA_TARGET_BEGIN; highway: between HWY_BEFORE_NAMESPACE and HWY_AFTER_NAMESPACE;
// xsimd: after xsimd, in a file built with its ISA's flags) and inside its own namespace,
// once per ISA (Highway re-includes its -inl.h per target), after the standard headers below
// and mha/support.h. So this header has no include guard, includes nothing and defines
// nothing but templates and constants in the includer's namespace: no symbol it makes can be
// merged with another ISA's (cmake/isa.cmake). Uses <algorithm>, <cmath>, <cstddef>,
// <cstdint>, <limits>, mha/attention.h and mha/support.h.

namespace tiled {

constexpr std::int64_t kKeys = 128;            // Bc: keys per KV tile, S's row stride
constexpr std::int64_t kBlockFloats = 131072;  // R x D rounded up to P at most this (512 KiB)
constexpr std::int64_t kDecodeRows = 16;       // rows per KV head below which a problem decodes

template <class K>
struct Loops {
  using Block = mha::support::Block;
  using Carve = mha::support::Carve;
  using RowPrefetch = mha::support::RowPrefetch;
  static constexpr int kRows = K::kRows;

  static float neg_inf() { return -std::numeric_limits<float>::infinity(); }

  // ---- K and V of a reduced type ------------------------------------------------------

  // f16 bits to fp32, exact, without a branch the vectorizer cannot flatten: the exponent and
  // fraction moved into fp32's places and scaled by 2^112 (exact for normal and subnormal
  // halves alike), infinities and NaNs given fp32's all-ones exponent, the sign put back.
  static float f16_bits_to_f32(std::uint32_t h) {
    const std::uint32_t magnitude = h & 0x7FFFu;
    const float scaled = __builtin_bit_cast(float, magnitude << 13) * 0x1p112f;
    const std::uint32_t special = 0u - static_cast<std::uint32_t>(magnitude >= 0x7C00u);
    const std::uint32_t bits = (__builtin_bit_cast(std::uint32_t, scaled) & ~special) |
                               (((magnitude << 13) | 0x7F800000u) & special);
    return __builtin_bit_cast(float, bits | ((h & 0x8000u) << 16));
  }

  // Rows [0, rows) of K or V stored as t (elements `seq` apart; i8: scales `scale_seq` apart
  // from `scales`) as fp32 rows `dim` apart in out: mha::kv::value_at's values.
  static void widen_rows(mha::KvType t, const void* src, std::int64_t seq, const float* scales,
                         std::int64_t scale_seq, std::int64_t rows, std::int64_t dim, float* out) {
    for (std::int64_t j = 0; j < rows; ++j) {
      float* o = out + j * dim;
      switch (t) {
        case mha::KvType::f16: {
          const std::uint16_t* x = static_cast<const std::uint16_t*>(src) + j * seq;
          for (std::int64_t d = 0; d < dim; ++d) o[d] = f16_bits_to_f32(x[d]);
          break;
        }
        case mha::KvType::bf16: {
          const std::uint16_t* x = static_cast<const std::uint16_t*>(src) + j * seq;
          for (std::int64_t d = 0; d < dim; ++d) {
            o[d] = __builtin_bit_cast(float, static_cast<std::uint32_t>(x[d]) << 16);
          }
          break;
        }
        case mha::KvType::i8: {
          const std::int8_t* x = static_cast<const std::int8_t*>(src) + j * seq;
          const float s = scales[j * scale_seq];
          for (std::int64_t d = 0; d < dim; ++d) o[d] = static_cast<float>(x[d]) * s;
          break;
        }
        case mha::KvType::f32: {
          const float* x = static_cast<const float*>(src) + j * seq;
          std::copy(x, x + dim, o);
          break;
        }
      }
    }
  }

  // Rows [c0, c0 + keys) of one KV head of K or V (x advanced to the head's first row) as fp32
  // rows: `rows` and their stride `seq` are set to the cache's own for f32, else to `wide`'s,
  // into which they are widened.
  static void tile_rows(const mha::Problem& p, const mha::KvView& x, const mha::Strides& st,
                        const mha::Strides& scale_st, std::int64_t c0, std::int64_t keys,
                        float* wide, const float** rows, std::int64_t* seq) {
    const mha::KvView tile = mha::advance(x, p.kv_type, c0 * st.seq, c0 * scale_st.seq);
    if (p.kv_type == mha::KvType::f32) {
      *rows = static_cast<const float*>(tile.data);
      *seq = st.seq;
      return;
    }
    widen_rows(p.kv_type, tile.data, st.seq, tile.scale, scale_st.seq, keys, p.head_dim, wide);
    *rows = wide;
    *seq = p.head_dim;
  }

  // scale log2(e), rounded once: the logits' base change (the tolerance's rounded log2(e)).
  static float logit_scale(const mha::Problem& p) {
    return static_cast<float>(static_cast<double>(p.scale) * mha::support::kLog2e);
  }

  // What becomes of the logits after Q K^T, in base-2 units: Problem::softcap's cap, then
  // Problem::alibi's bias (each off without).
  struct Shaping {
    mha::support::Softcap cap;
    mha::support::Alibi alibi;
    bool on() const { return cap.on() || alibi.on(); }
  };
  static Shaping shaping(const mha::Problem& p) {
    return {mha::support::Softcap::of(p, mha::support::kLog2e),
            mha::support::Alibi::of(p, mha::support::kLog2e)};
  }

  // The `cols` logits in w of query row `row` of head `head` from key `key` shaped in place,
  // and their max given the max `most` (ignoring NaN) of the unshaped ones: the cap of the max
  // (the cap is monotonic: the max of the caps, to the last ulps mha::support::Softcap gives),
  // or with ALiBi the biased logits' own. kShaped false: nothing. The decode loops are
  // instantiated per kShaped: with the cap's values and its test in the plain loop, avx2's fp32
  // decode from memory ran 1.19 times as long (H=32 Hkv=8 Lk=32768, 6 rounds).
  template <bool kShaped>
  static MHA_ALWAYS_INLINE float shape_row(const Shaping& shape, float* w, std::int64_t cols,
                                           float most, std::int64_t head, std::int64_t row,
                                           std::int64_t key) {
    if constexpr (!kShaped) {
      return most;
    } else {
      if (shape.cap.on()) {
        shape.cap.apply(w, cols);
        most = shape.cap(most);
      }
      if (shape.alibi.on()) {
        most = shape.alibi.add(shape.alibi.rate(head), shape.alibi.distance(row, key), w, cols);
      }
      return most;
    }
  }

  // ---- Prefill ------------------------------------------------------------------------

  // The arrays in the caller's workspace, sized for the largest block (R = g x Br rows; RM
  // = R rounded up to MR, the rows of the microkernels' arrays, R where groups may be
  // partial; each array starts on 64 bytes).
  struct Scratch {
    std::int64_t dim_p;       // head_dim rounded up to P: O's row stride, V panels x P
    float* kp;                // [Bc / P][head_dim][P]: the K tile, packed
    float* vp;                // [dim_p / P][Bc][P]: the V tile, packed
    float* qp;                // [RM / MR][head_dim][MR]: the block's Q, packed
    float* s;                 // [RM][Bc]: logits, then weights
    float* acc;               // [RM][dim_p]: O
    float* rowmax;            // [RM][W]: lane maxima of the tile's logits
    float* m;                 // [R]: running maxima (base 2)
    float* l;                 // [R]: running sums
    float* alpha;             // [RM]: this tile's rescale factors
    std::int64_t* cols;       // [R]: the end of the keys of this tile each row sees
    std::int64_t* first;      // [R]: and their first (a sliding window's; 0 without)
    std::int64_t* row_first;  // [R]: the keys of the whole KV head each row sees
    std::int64_t* row_end;
    float* wide;  // [Bc][head_dim]: a K or V tile widened (kv_type not f32; else null)
  };

  // Br: mha::support::packed_rows_per_head's rule (its comment gives the rule and its
  // measurements) over this scratch: R (D + Bc + dim_p) floats for Qp, S and O, 2 Bc dim_p
  // for Kp and Vp, and R dim_p within kBlockFloats, so that only heads wider than 256 get
  // fewer than 512 rows (R = 32 at D = 4096).
  static std::int64_t rows_per_head(const mha::Problem& p) {
    const std::int64_t dim_p = mha::support::round_up(p.head_dim, K::panel());
    return mha::support::packed_rows_per_head(p, p.head_dim + kKeys + dim_p, 2 * kKeys * dim_p,
                                              kBlockFloats / dim_p);
  }

  static std::int64_t padded_rows(std::int64_t rows) {
    return K::kWholeGroups ? mha::support::round_up(rows, kRows) : rows;
  }

  static Scratch carve(const mha::Problem& p, Carve& carve) {
    const std::int64_t dim = p.head_dim;
    const std::int64_t rows = p.q_heads / p.kv_heads * rows_per_head(p);
    const std::int64_t padded = padded_rows(rows);
    Scratch s;
    s.dim_p = mha::support::round_up(dim, K::panel());
    s.kp = carve.take<float>(kKeys * dim);
    s.vp = carve.take<float>(s.dim_p * kKeys);
    s.qp = carve.take<float>(mha::support::round_up(rows, kRows) * dim);
    s.s = carve.take<float>(padded * kKeys);
    s.acc = carve.take<float>(padded * s.dim_p);
    s.rowmax = carve.take<float>(K::lanes() * padded);
    s.m = carve.take<float>(rows);
    s.l = carve.take<float>(rows);
    s.alpha = carve.take<float>(padded);
    s.cols = carve.take<std::int64_t>(rows);
    s.first = carve.take<std::int64_t>(rows);
    s.row_first = carve.take<std::int64_t>(rows);
    s.row_end = carve.take<std::int64_t>(rows);
    s.wide = p.kv_type == mha::KvType::f32 ? nullptr : carve.take<float>(kKeys * dim);
    return s;
  }

  // The number of the block's microkernel groups of MR rows, and the rows of a group.
  static std::int64_t groups(const Block& block) { return (block.rows + kRows - 1) / kRows; }
  static int group_rows(const Block& block, std::int64_t t0) {
    return static_cast<int>(std::min<std::int64_t>(kRows, block.rows - t0));
  }

  // Qp for every group of MR block rows; m, l and O start empty.
  static void start_block(const mha::Problem& p, const Block& block, const float* q,
                          const Scratch& s) {
    for (std::int64_t t0 = 0; t0 < block.rows; t0 += kRows) {
      const int nr = group_rows(block, t0);
      const float* qr[kRows];
      for (int r = 0; r < nr; ++r) qr[r] = block.q_row(p, q, t0 + r);
      K::pack_q(qr, nr, p.head_dim, s.qp + t0 * p.head_dim);
    }
    const std::int64_t padded = padded_rows(block.rows);
    std::fill(s.m, s.m + block.rows, neg_inf());
    std::fill(s.l, s.l + block.rows, 0.0f);
    std::fill(s.alpha, s.alpha + padded, 1.0f);  // padding rows: never rescaled
    std::fill(s.acc, s.acc + padded * s.dim_p, 0.0f);
  }

  // S = scale log2(e) Q K^T for the tile of keys [c0, c0 + keys), K panel by K panel, each
  // panel reused by every group from L1; rowmax takes each row's lane maxima; then shaped
  // (soft-capped, ALiBi) by `shape`. Steps v_ahead once per microkernel call.
  static void tile_logits(const mha::Problem& p, const Block& block, std::int64_t c0,
                          std::int64_t keys, float c, const Shaping& shape, const Scratch& s,
                          RowPrefetch& v_ahead) {
    const std::int64_t panel = K::panel(), lanes = K::lanes();
    std::fill(s.rowmax, s.rowmax + lanes * padded_rows(block.rows), neg_inf());
    for (std::int64_t j0 = 0; j0 < keys; j0 += panel) {
      for (std::int64_t t0 = 0; t0 < block.rows; t0 += kRows) {
        const int nr = group_rows(block, t0);
        std::int64_t limit[kRows], most = 0;
        for (int r = 0; r < kRows; ++r) {
          limit[r] = r < nr ? s.cols[t0 + r] - j0 : 0;  // padding rows see nothing
          most = std::max(most, limit[r]);
        }
        if (most <= 0) continue;  // no row of the group sees this panel
        const float* qp = s.qp + t0 * p.head_dim;
        const float* kp = s.kp + j0 * p.head_dim;
        float* s_rows = s.s + t0 * kKeys + j0;
        float* rowmax = s.rowmax + lanes * t0;
        if constexpr (K::kWholeGroups) {
          K::template logits_tile<kRows>(qp, kp, p.head_dim, c, limit, s_rows, rowmax);
        } else {
          mha::support::with_count<kRows>(nr, [&](auto rows) {
            K::template logits_tile<decltype(rows)::value>(qp, kp, p.head_dim, c, limit, s_rows,
                                                           rowmax);
          });
        }
        v_ahead.step();
      }
    }
    // Rows whose sliding window starts within the tile: the logits before it -inf, and the
    // lane maxima taken again over the rest, so that no key outside the window (not even a
    // NaN one) weighs in.
    for (std::int64_t t = 0; t < block.rows; ++t) {
      if (s.first[t] == 0) continue;
      float* row = s.s + t * kKeys;
      std::fill(row, row + s.first[t], neg_inf());
      float most = neg_inf();
      for (std::int64_t j = s.first[t]; j < s.cols[t]; ++j) most = row[j] > most ? row[j] : most;
      float* lane = s.rowmax + lanes * t;
      std::fill(lane, lane + lanes, neg_inf());
      lane[0] = most;
    }
    // Soft-capping and ALiBi: each row's logits shaped in place, and its max with them, in
    // lane 0 (shape_row). Masked logits stay -inf, out of the weights.
    if (shape.on()) {
      for (std::int64_t t = 0; t < block.rows; ++t) {
        if (s.cols[t] == 0) continue;
        float* lane = s.rowmax + lanes * t;
        float most = lane[0];  // no lane is NaN
        for (std::int64_t w = 1; w < lanes; ++w) most = lane[w] > most ? lane[w] : most;
        std::fill(lane, lane + lanes, neg_inf());
        lane[0] = shape_row<true>(shape, s.s + t * kKeys + s.first[t], s.cols[t] - s.first[t], most,
                                  block.head(t), block.row(t), c0 + s.first[t]);
      }
    }
  }

  // The online-softmax step of every row: S becomes the weights P, alpha the rescale factor.
  static void tile_softmax(const Block& block, const Scratch& s) {
    const std::int64_t lanes = K::lanes();
    for (std::int64_t t = 0; t < block.rows; ++t) {
      s.alpha[t] = 1.0f;
      if (s.cols[t] > 0) {
        K::online_softmax(s.s + t * kKeys, s.cols[t], s.rowmax + lanes * t, s.m + t, s.l + t,
                          s.alpha + t);
      }
    }
  }

  // O = alpha O + P V, V panel by V panel, each reused by every group from L1: keys every row
  // of a group sees through the group's microkernel, each row's others (before the shared
  // ones: its sliding window starts earlier; after them: the causal diagonal) through a 1-row
  // pass, so that NaN or Inf in a V row a query row does not see never reaches it (not even
  // as 0 x Inf). Steps k_ahead once per group.
  static void tile_pv(const Block& block, std::int64_t keys, const Scratch& s,
                      RowPrefetch& k_ahead) {
    const std::int64_t panel = K::panel();
    for (std::int64_t cp = 0; cp < s.dim_p; cp += panel) {
      const float* vp = s.vp + (cp / panel) * kKeys * panel;
      for (std::int64_t t0 = 0; t0 < block.rows; t0 += kRows) {
        const int nr = group_rows(block, t0);
        std::int64_t begin = 0, end = keys, most = 0;  // keys [begin, end): the shared ones
        bool rescale = false;  // none once the group's maxima have settled (every alpha 1)
        for (int r = 0; r < nr; ++r) {
          begin = std::max(begin, s.first[t0 + r]);
          end = std::min(end, s.cols[t0 + r]);
          most = std::max(most, s.cols[t0 + r]);
          rescale |= s.alpha[t0 + r] != 1.0f;
        }
        if (most == 0) continue;  // no row of the group sees the tile: alpha is 1
        end = std::max(begin, end);
        k_ahead.step();
        const float* p_rows = s.s + t0 * kKeys;
        const float* alpha = rescale ? s.alpha + t0 : nullptr;
        float* o_rows = s.acc + t0 * s.dim_p + cp;
        const float* p_shared = p_rows + begin;
        const float* v_shared = vp + begin * panel;
        if constexpr (K::kWholeGroups) {
          K::template pv_tile<kRows>(p_shared, end - begin, v_shared, alpha, o_rows, s.dim_p);
        } else {
          mha::support::with_count<kRows>(nr, [&](auto rows) {
            K::template pv_tile<decltype(rows)::value>(p_shared, end - begin, v_shared, alpha,
                                                       o_rows, s.dim_p);
          });
        }
        for (int r = 0; r < nr; ++r) {  // each row's keys before and past the shared ones
          const std::int64_t first = s.first[t0 + r], cols = s.cols[t0 + r];
          const std::int64_t before = std::min(begin, cols) - first;
          const std::int64_t after = cols - std::max(end, first);
          const float* p_row = p_rows + r * kKeys;
          if (before > 0) {
            K::template pv_tile<1>(p_row + first, before, vp + first * panel, nullptr,
                                   o_rows + r * s.dim_p, s.dim_p);
          }
          if (after > 0) {
            const std::int64_t j = std::max(end, first);
            K::template pv_tile<1>(p_row + j, after, vp + j * panel, nullptr, o_rows + r * s.dim_p,
                                   s.dim_p);
          }
        }
      }
    }
  }

  // o = O / l, lse = (m + log2 l) ln 2 for every block row.
  static void finish_block(const mha::Problem& p, const Block& block, const Scratch& s, float* o,
                           float* lse) {
    for (std::int64_t t = 0; t < block.rows; ++t) {
      K::finish_row(s.acc + t * s.dim_p, s.m[t], s.l[t], mha::sink_of(p, block.head(t)),
                    mha::visible_keys(p, block.row(t)), p.head_dim, block.o_row(p, o, t),
                    block.lse_at(p, lse, t));
    }
  }

  // The first row of block's KV head in x (K or V), and for i8 its scale.
  static mha::KvView kv_head(const mha::Problem& p, const Block& block, const mha::KvView& x,
                             const mha::Strides& st, const mha::Strides& scale_st) {
    return mha::kv_row(x, p.kv_type, st, scale_st, block.batch, 0, block.kv_head);
  }

  // kTyped: K and V of a reduced type, each tile widened into s.wide before it is packed
  // (no software prefetch: the widening reads each tile in one sequential pass).
  template <bool kTyped>
  static void prefill(const mha::Problem& p, const float* q, mha::KvView k, mha::KvView v, float* o,
                      float* lse, mha::Workspace ws) {
    const std::int64_t dim = p.head_dim, panel = K::panel();
    const float c = logit_scale(p);
    const Shaping shape = shaping(p);
    Carve workspace(ws.data);
    const Scratch s = carve(p, workspace);
    mha::support::for_each_block(p, rows_per_head(p), [&](const Block& block) {
      start_block(p, block, q, s);
      const mha::KvView k_head = kv_head(p, block, k, p.k, p.k_scale);
      const mha::KvView v_head = kv_head(p, block, v, p.v, p.v_scale);
      const std::int64_t block_keys = block.keys(p);
      for (std::int64_t t = 0; t < block.rows; ++t) {  // each row's keys, once per block
        s.row_first[t] = mha::first_key(p, block.row(t));
        s.row_end[t] = mha::visible_keys(p, block.row(t));
      }
      for (std::int64_t c0 = block.first_key(p); c0 < block_keys; c0 += kKeys) {
        const std::int64_t keys = std::min(kKeys, block_keys - c0);
        for (std::int64_t t = 0; t < block.rows; ++t) {  // Block::tile_first_seen, tile_keys_seen
          const std::int64_t first = std::clamp(s.row_first[t] - c0, std::int64_t{0}, keys);
          const std::int64_t end = std::clamp(s.row_end[t] - c0, std::int64_t{0}, keys);
          const bool none = first == end;  // of the tile: both 0
          s.first[t] = none ? 0 : first;
          s.cols[t] = none ? 0 : end;
        }
        RowPrefetch v_ahead, k_ahead;
        if constexpr (!kTyped) {
          // V of this tile arrives during S, K of the next one during P V.
          const float* k_tile = static_cast<const float*>(k_head.data) + c0 * p.k.seq;
          const float* v_tile = static_cast<const float*>(v_head.data) + c0 * p.v.seq;
          const std::int64_t next_keys = std::min(kKeys, block_keys - c0 - kKeys);
          v_ahead = RowPrefetch(v_tile, p.v.seq, keys, dim,
                                groups(block) * mha::support::ceil_div(keys, panel));
          if (next_keys > 0) {
            k_ahead = RowPrefetch(k_tile + kKeys * p.k.seq, p.k.seq, next_keys, dim,
                                  groups(block) * (s.dim_p / panel));
          }
        }
        const float* rows = nullptr;
        std::int64_t seq = 0;
        tile_rows(p, k_head, p.k, p.k_scale, c0, keys, s.wide, &rows, &seq);
        K::pack_k(rows, seq, keys, dim, s.kp);
        tile_logits(p, block, c0, keys, c, shape, s, v_ahead);
        tile_softmax(block, s);
        tile_rows(p, v_head, p.v, p.v_scale, c0, keys, s.wide, &rows, &seq);
        K::pack_v(rows, seq, keys, dim, s.vp);
        tile_pv(block, keys, s, k_ahead);
      }
      finish_block(p, block, s, o, lse);
    });
  }

  // ---- Decode -------------------------------------------------------------------------

  // Query rows per KV head, g x q_len: a decode block's rows.
  static std::int64_t decode_rows_per_kv_head(const mha::Problem& p) {
    return p.q_heads / p.kv_heads * p.q_len;
  }

  static bool decodes(const mha::Problem& p) { return decode_rows_per_kv_head(p) < kDecodeRows; }

  struct DecodeScratch {
    std::int64_t tile_keys;  // keys per tile, a multiple of K::decode_step()
    std::int64_t dim_w;      // head_dim rounded up to W: an accumulator's length
    float* acc;              // [rows][dim_w]: O
    std::int64_t ldw;        // tile_keys + W: a row of weights and a vector past its end
    float* weights;          // [K::kDecodeGroup][ldw]: a row's (a group's) logits, then weights
    float* k_wide;           // [tile_keys][head_dim]: the tile's K widened (kv_type not f32)
    float* v_wide;           // [tile_keys][head_dim]: and its V
  };

  static DecodeScratch carve_decode(const mha::Problem& p, Carve& carve) {
    const std::int64_t rows = decode_rows_per_kv_head(p);  // < kDecodeRows
    DecodeScratch s;
    s.tile_keys = mha::support::decode_tile_keys(p, K::decode_step());
    s.dim_w = mha::support::round_up(p.head_dim, K::lanes());
    s.acc = carve.take<float>(rows * s.dim_w);
    s.ldw = s.tile_keys + K::lanes();
    s.weights = carve.take<float>(K::kDecodeGroup * s.ldw);
    s.k_wide = s.v_wide = nullptr;
    if (p.kv_type != mha::KvType::f32) {
      s.k_wide = carve.take<float>(s.tile_keys * p.head_dim);
      s.v_wide = carve.take<float>(s.tile_keys * p.head_dim);
    }
    return s;
  }

  // Rows [0, n) of K and V into L2 (PREFETCHT1, PRFM PLDL2KEEP), every line holding an
  // element of them: one address per 64 bytes, and the last element's, for a row that does
  // not start on a line. Prefetches never fault and change no result. Whole rows at a time,
  // no per-line state (with RowPrefetch's, the bookkeeping cost avx2 4.4 ns per row and key).
  // Inlined: called out of line from the S loop, avx2's decode from memory (g = 4) ran 28-38
  // ns per row and key instead of 23-31 (the call clobbers every vector register).
  // T: float, or unsigned char for rows of another type counted in bytes.
  template <class T>
  static MHA_ALWAYS_INLINE void prefetch_rows(const T* k, std::int64_t k_seq, const T* v,
                                              std::int64_t v_seq, std::int64_t n,
                                              std::int64_t dim) {
    constexpr std::int64_t kLine = 64 / sizeof(T);
    for (std::int64_t i = 0; i < n; ++i) {
      const T* k_row = k + i * k_seq;
      const T* v_row = v + i * v_seq;
      for (std::int64_t d = 0; d < dim; d += kLine) {
        __builtin_prefetch(k_row + d, 0, 2);
        __builtin_prefetch(v_row + d, 0, 2);
      }
      __builtin_prefetch(k_row + dim - 1, 0, 2);
      __builtin_prefetch(v_row + dim - 1, 0, 2);
    }
  }

  // Prefetch: the next tile's K and V rows, spread over the S steps of every row (a few whole
  // rows per kDotKeys keys, through one counter: the S loop has no register to spare).
  template <bool kShaped>
  static void decode_rows(const mha::Problem& p, const float* q, const float* k, const float* v,
                          float* o, float* lse, mha::Workspace ws) {
    const std::int64_t dim = p.head_dim;
    const std::int64_t rows = decode_rows_per_kv_head(p);  // < kDecodeRows
    Carve workspace(ws.data);
    const DecodeScratch s = carve_decode(p, workspace);
    const std::int64_t tile_keys = s.tile_keys;
    const float c = logit_scale(p);
    const Shaping shape = shaping(p);
    // Prefetch steps per tile: one per kDotKeys keys of every row's S.
    const std::int64_t steps = rows * mha::support::ceil_div(tile_keys, K::kDotKeys);

    // One block per (batch, KV head): all its g x q_len rows (block row t: query head
    // head0 + t / q_len, query row t % q_len).
    mha::support::for_each_block(p, p.q_len, [&](const Block& block) {
      const float* k_head = block.k_head(p, k);
      const float* v_head = block.v_head(p, v);
      float ms[kDecodeRows], ls[kDecodeRows];
      std::fill(ms, ms + rows, neg_inf());
      std::fill(ls, ls + rows, 0.0f);
      std::fill(s.acc, s.acc + rows * s.dim_w, 0.0f);
      // Keys [block_first, block_keys): a sliding window's tiles start at its first key.
      const std::int64_t block_keys = block.keys(p), block_first = block.first_key(p);
      // The first tile, before it is needed.
      prefetch_rows(k_head + block_first * p.k.seq, p.k.seq, v_head + block_first * p.v.seq,
                    p.v.seq, std::min(tile_keys, block_keys - block_first), dim);

      for (std::int64_t c0 = block_first; c0 < block_keys; c0 += tile_keys) {
        const std::int64_t keys = std::min(tile_keys, block_keys - c0);
        const std::int64_t next =
            std::clamp(block_keys - c0 - tile_keys, std::int64_t{0}, tile_keys);
        const float* k_tile = k_head + c0 * p.k.seq;
        const float* v_tile = v_head + c0 * p.v.seq;
        // The next tile's rows, rows_per_step at each step.
        const std::int64_t rows_per_step = mha::support::ceil_div(next, steps);
        std::int64_t done = 0;  // of the next tile's rows
        const auto prefetch_step = [&done, rows_per_step, next, tile_keys, dim, k_tile, v_tile,
                                    k_seq = p.k.seq, v_seq = p.v.seq] {
          if (const std::int64_t n = std::min(rows_per_step, next - done); n > 0) {
            prefetch_rows(k_tile + (tile_keys + done) * k_seq, k_seq,
                          v_tile + (tile_keys + done) * v_seq, v_seq, n, dim);
            done += n;
          }
        };
        for (std::int64_t t = 0; t < rows; ++t) {
          // The row's keys of the tile: [first, first + cols).
          const std::int64_t first = block.tile_first_seen(p, t, c0, keys);
          const std::int64_t cols = block.tile_keys_seen(p, t, c0, keys) - first;
          if (cols == 0) continue;
          const float tile_max =
              shape_row<kShaped>(shape, s.weights, cols,
                                 K::decode_logits(block.q_row(p, q, t), k_tile + first * p.k.seq,
                                                  p.k.seq, cols, dim, c, s.weights, prefetch_step),
                                 block.head(t), block.row(t), c0 + first);
          float alpha = 1.0f;
          if (tile_max > ms[t]) {
            alpha = std::exp2(ms[t] - tile_max);  // exactly 0 when the old max is -inf
            ms[t] = tile_max;
          }
          const float sum = K::decode_weights(s.weights, cols, mha::support::logit_shift(ms[t]));
          ls[t] = ls[t] * alpha + sum;
          K::decode_pv(s.weights, cols, v_tile + first * p.v.seq, p.v.seq, dim, s.acc + t * s.dim_w,
                       alpha);
        }
      }

      for (std::int64_t t = 0; t < rows; ++t) {
        K::finish_row(s.acc + t * s.dim_w, ms[t], ls[t], mha::sink_of(p, block.head(t)),
                      mha::visible_keys(p, block.row(t)), dim, block.o_row(p, o, t),
                      block.lse_at(p, lse, t));
      }
    });
  }

  // decode_rows for K and V of type T (f16, bf16, i8): the tile's rows as stored, the next
  // tile prefetched in bytes. With K::kKvDecode the policy's own pieces read them in place
  // (decode_logits_kv, decode_pv_kv); otherwise each tile's K and V rows are widened into
  // s.k_wide and s.v_wide first (in L1: decode_tile_keys sizes a tile for its K and V in
  // fp32), which the fp32 pieces then read for all the KV head's rows.
  template <mha::KvType T, bool kShaped>
  static void decode_rows_kv(const mha::Problem& p, const float* q, const mha::KvView& k,
                             const mha::KvView& v, float* o, float* lse, mha::Workspace ws) {
    const std::int64_t dim = p.head_dim;
    const std::int64_t rows = decode_rows_per_kv_head(p);  // < kDecodeRows
    Carve workspace(ws.data);
    const DecodeScratch s = carve_decode(p, workspace);
    const std::int64_t tile_keys = s.tile_keys;
    const float c = logit_scale(p);
    const Shaping shape = shaping(p);
    const std::int64_t steps = rows * mha::support::ceil_div(tile_keys, K::kDotKeys);
    constexpr auto kBytes = static_cast<std::int64_t>(mha::kv_type_bytes(T));
    const std::int64_t k_bytes = p.k.seq * kBytes, v_bytes = p.v.seq * kBytes, row = dim * kBytes;

    mha::support::for_each_block(p, p.q_len, [&](const Block& block) {
      const mha::KvView k_head = kv_head(p, block, k, p.k, p.k_scale);
      const mha::KvView v_head = kv_head(p, block, v, p.v, p.v_scale);
      const auto* k0 = static_cast<const unsigned char*>(k_head.data);
      const auto* v0 = static_cast<const unsigned char*>(v_head.data);
      float ms[kDecodeRows], ls[kDecodeRows];
      std::fill(ms, ms + rows, neg_inf());
      std::fill(ls, ls + rows, 0.0f);
      std::fill(s.acc, s.acc + rows * s.dim_w, 0.0f);
      const std::int64_t block_keys = block.keys(p), block_first = block.first_key(p);
      prefetch_rows(k0 + block_first * k_bytes, k_bytes, v0 + block_first * v_bytes, v_bytes,
                    std::min(tile_keys, block_keys - block_first), row);

      for (std::int64_t c0 = block_first; c0 < block_keys; c0 += tile_keys) {
        const std::int64_t keys = std::min(tile_keys, block_keys - c0);
        const std::int64_t next =
            std::clamp(block_keys - c0 - tile_keys, std::int64_t{0}, tile_keys);
        const unsigned char* k_tile = k0 + c0 * k_bytes;
        const unsigned char* v_tile = v0 + c0 * v_bytes;
        const float* k_scale = k_head.scale + (T == mha::KvType::i8 ? c0 * p.k_scale.seq : 0);
        const float* v_scale = v_head.scale + (T == mha::KvType::i8 ? c0 * p.v_scale.seq : 0);
        if constexpr (!K::kKvDecode) {
          widen_rows(T, k_tile, p.k.seq, k_scale, p.k_scale.seq, keys, dim, s.k_wide);
          widen_rows(T, v_tile, p.v.seq, v_scale, p.v_scale.seq, keys, dim, s.v_wide);
        }
        const std::int64_t rows_per_step = mha::support::ceil_div(next, steps);
        std::int64_t done = 0;  // of the next tile's rows
        const auto prefetch_step = [&done, rows_per_step, next, k_bytes, v_bytes, row,
                                    k_next = k_tile + tile_keys * k_bytes,
                                    v_next = v_tile + tile_keys * v_bytes] {
          if (const std::int64_t n = std::min(rows_per_step, next - done); n > 0) {
            prefetch_rows(k_next + done * k_bytes, k_bytes, v_next + done * v_bytes, v_bytes, n,
                          row);
            done += n;
          }
        };
        // Block row t on its own.
        // The keys of the tile block row t sees: [first, first + cols).
        const auto seen = [&](std::int64_t t, std::int64_t* first) {
          *first = block.tile_first_seen(p, t, c0, keys);
          return block.tile_keys_seen(p, t, c0, keys) - *first;
        };
        const auto one_row = [&](std::int64_t t) {
          std::int64_t first = 0;
          const std::int64_t cols = seen(t, &first);
          if (cols == 0) return;
          float tile_max;
          if constexpr (K::kKvDecode) {
            tile_max = K::template decode_logits_kv<T>(
                block.q_row(p, q, t), k_tile + first * k_bytes, p.k.seq,
                T == mha::KvType::i8 ? k_scale + first * p.k_scale.seq : k_scale, p.k_scale.seq,
                cols, dim, c, s.weights, prefetch_step);
          } else {
            tile_max = K::decode_logits(block.q_row(p, q, t), s.k_wide + first * dim, dim, cols,
                                        dim, c, s.weights, prefetch_step);
          }
          tile_max = shape_row<kShaped>(shape, s.weights, cols, tile_max, block.head(t),
                                        block.row(t), c0 + first);
          float alpha = 1.0f;
          if (tile_max > ms[t]) {
            alpha = std::exp2(ms[t] - tile_max);  // exactly 0 when the old max is -inf
            ms[t] = tile_max;
          }
          const float sum = K::decode_weights(s.weights, cols, mha::support::logit_shift(ms[t]));
          ls[t] = ls[t] * alpha + sum;
          if constexpr (K::kKvDecode) {
            K::template decode_pv_kv<T>(
                s.weights, cols, v_tile + first * v_bytes, p.v.seq,
                T == mha::KvType::i8 ? v_scale + first * p.v_scale.seq : v_scale, p.v_scale.seq,
                dim, s.acc + t * s.dim_w, alpha);
          } else {
            K::decode_pv(s.weights, cols, s.v_wide + first * dim, dim, dim, s.acc + t * s.dim_w,
                         alpha);
          }
        };
        if constexpr (K::kKvDecode && K::kDecodeGroup > 1) {
          // The R rows t0 + r q_len: query heads of the KV head at one query row, which see
          // the same keys.
          const auto group = [&](auto size, std::int64_t t0) {
            constexpr int R = decltype(size)::value;
            std::int64_t first = 0;
            const std::int64_t cols = seen(t0, &first);
            if (cols == 0) return;
            const float* qr[R];
            for (int r = 0; r < R; ++r) qr[r] = block.q_row(p, q, t0 + r * p.q_len);
            float tile_max[R], alpha[R];
            K::template decode_logits_group_kv<R, T>(
                qr, k_tile + first * k_bytes, p.k.seq,
                T == mha::KvType::i8 ? k_scale + first * p.k_scale.seq : k_scale, p.k_scale.seq,
                cols, dim, c, s.weights, s.ldw, tile_max, prefetch_step);
            for (int r = 0; r < R; ++r) {
              const std::int64_t t = t0 + r * p.q_len;
              tile_max[r] = shape_row<kShaped>(shape, s.weights + r * s.ldw, cols, tile_max[r],
                                               block.head(t), block.row(t), c0 + first);
              alpha[r] = 1.0f;
              if (tile_max[r] > ms[t]) {
                alpha[r] = std::exp2(ms[t] - tile_max[r]);  // 0 when the old max is -inf
                ms[t] = tile_max[r];
              }
              const float sum =
                  K::decode_weights(s.weights + r * s.ldw, cols, mha::support::logit_shift(ms[t]));
              ls[t] = ls[t] * alpha[r] + sum;
            }
            K::template decode_pv_group_kv<R, T>(
                s.weights, s.ldw, cols, v_tile + first * v_bytes, p.v.seq,
                T == mha::KvType::i8 ? v_scale + first * p.v_scale.seq : v_scale, p.v_scale.seq,
                dim, s.acc + t0 * s.dim_w, p.q_len * s.dim_w, alpha);
          };
          const std::int64_t heads = p.q_heads / p.kv_heads;
          for (std::int64_t i = 0; i < p.q_len; ++i) {  // query row i
            for (std::int64_t h0 = 0; h0 < heads;) {
              const std::int64_t t0 = h0 * p.q_len + i;
              if (heads - h0 >= 4 && K::kDecodeGroup >= 4) {
                group(std::integral_constant<int, 4>{}, t0);
                h0 += 4;
              } else if (heads - h0 >= 2) {
                group(std::integral_constant<int, 2>{}, t0);
                h0 += 2;
              } else {
                one_row(t0);
                h0 += 1;
              }
            }
          }
        } else {
          for (std::int64_t t = 0; t < rows; ++t) one_row(t);
        }
      }

      for (std::int64_t t = 0; t < rows; ++t) {
        K::finish_row(s.acc + t * s.dim_w, ms[t], ls[t], mha::sink_of(p, block.head(t)),
                      mha::visible_keys(p, block.row(t)), dim, block.o_row(p, o, t),
                      block.lse_at(p, lse, t));
      }
    });
  }

  // ---- Entry points -------------------------------------------------------------------

  static std::size_t workspace(const mha::Problem& p) {
    if (decodes(p)) return mha::support::workspace_bytes([&](Carve& c) { carve_decode(p, c); });
    // At least what the largest decode needs, so that the size never shrinks as q_len grows.
    mha::Problem largest_decode = p;
    largest_decode.q_heads = p.kv_heads;
    largest_decode.q_len = kDecodeRows - 1;
    return std::max(
        mha::support::workspace_bytes([&](Carve& c) { carve_decode(largest_decode, c); }),
        mha::support::workspace_bytes([&](Carve& c) { carve(p, c); }));
  }

  // A decode of any KV type, its logits shaped or not (kShaped: shape_row).
  template <bool kShaped>
  static void decode(const mha::Problem& p, const float* q, const mha::KvView& k,
                     const mha::KvView& v, float* o, float* lse, mha::Workspace ws) {
    if (p.kv_type == mha::KvType::f16) {
      decode_rows_kv<mha::KvType::f16, kShaped>(p, q, k, v, o, lse, ws);
    } else if (p.kv_type == mha::KvType::bf16) {
      decode_rows_kv<mha::KvType::bf16, kShaped>(p, q, k, v, o, lse, ws);
    } else if (p.kv_type == mha::KvType::i8) {
      decode_rows_kv<mha::KvType::i8, kShaped>(p, q, k, v, o, lse, ws);
    } else {
      decode_rows<kShaped>(p, q, static_cast<const float*>(k.data),
                           static_cast<const float*>(v.data), o, lse, ws);
    }
  }

  // Computes what mha/attention.h specifies; the caller holds the mha::FpEnvGuard.
  static void run(const mha::Problem& p, const float* q, const mha::KvView& k, const mha::KvView& v,
                  float* o, float* lse, mha::Workspace ws) {
    const bool typed = p.kv_type != mha::KvType::f32;
    if (decodes(p)) {
      if (shaping(p).on()) {
        decode<true>(p, q, k, v, o, lse, ws);
      } else {
        decode<false>(p, q, k, v, o, lse, ws);
      }
    } else if (typed) {
      prefill<true>(p, q, k, v, o, lse, ws);
    } else {
      prefill<false>(p, q, k, v, o, lse, ws);
    }
  }
};

}  // namespace tiled
