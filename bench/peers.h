// The framework peers (PyTorch, ONNX Runtime, OpenVINO) timed inside mha_bench, next to the
// kernels on the same shapes and the very same input tensors.
//
// `--peers=CMD` starts CMD (bench/peers/, `python -m mha_peers`) as a child process and talks
// to it over its standard input and output, one line per message:
//
//   server:  peer <name> <version>      one per framework it could import, then
//            skip <name> <why>          one per framework it could not, then
//            ready
//   client:  supports <name> <problem>  ->  yes | no <why>
//            prepare <name> <problem> threads=<n> q=<paths> k=<paths> v=<paths>
//                    [k_scale=<paths> v_scale=<paths>] o=<path>
//                                       ->  ok <seconds of one call> | error <why>
//            supports_gemm <name> <gemm>  ->  yes | no <why>
//            prepare_gemm <name> <gemm> threads=<n> a=<path> b=<path> c=<path> [cold=<bytes>]
//                                       ->  ok <seconds of one call> | error <why>
//            supports_layer <name> <layer>  ->  yes | no <why>
//            prepare_layer <name> <layer> threads=<n> x=<path> wq=<path> wk=<path>
//                    wv=<path> wo=<path> [bq= bk= bv= bo=<path>] [k_cache= v_cache=<path>]
//                    y=<path> [cold=<bytes>] ->  ok <seconds of one call> | error <why>
//            run <n>                    ->  ok <seconds of n calls> | error <why>
//            release                    ->  ok
//   <problem>: batch= q_len= kv_len= q_heads= kv_heads= head_dim= causal= scale= and each
//   tensor's element strides, q_strides=<batch>,<seq>,<head> (and k_, v_, o_strides); for K
//   and V stored in a reduced type (mha/kv_types.h), kv_type=f16|bf16|i8 (absent: f32), the
//   strides counting elements of that type, and for i8 k_scale_strides= and v_scale_strides=
//   of the per-row fp32 scales, whose paths prepare then adds as k_scale= and v_scale=.
//   A ragged batch (Problem::kv_lens) adds kv_lens=<l0>,<l1>,...: sequence b sees its first
//   l_b keys (bottom-right causal on its own length), kv_len the tensors' capacity.
//   Attention sinks (Problem::sinks) add sinks=<s0>,<s1>,...: one logit per query head that
//   joins its softmax's denominator only. A sliding window (Problem::window) adds window=<w>:
//   a row sees the w most recent of the keys it sees without it. Logit soft-capping
//   (Problem::softcap) adds softcap=<c>: every logit s (scale q.k) becomes c tanh(s / c) before
//   the softmax; sinks are not capped. ALiBi (Problem::alibi) adds alibi=<m0>,<m1>,...: one
//   slope per query head (17 significant digits, as the sinks), and alibi_offset=<n> when
//   Problem::alibi_offset is not 0: head h adds -m_h |i + kv_len - q_len + n - j| to the logit
//   of row i and key j (kv_len: the sequence's own length in a ragged batch), after the
//   soft-cap; sinks are not biased.
//   <paths>: comma-separated files, one per copy of the tensor (decode rotates over copies).
//   <gemm>: m= n= k=, for C[m][n] = A[m][k] B[k][n]; <path>: one file, one copy.
//   <layer>: batch= d= heads= kv_heads= head_dim= n= past= causal=0|1 bias=0|1, the whole
//   attention layer (mha/layer.h) on n new tokens of each of `batch` sequences with `past`
//   tokens already in the cache (LayerShape, LayerTensors below). The biases are sent with
//   bias=1 only; the caches are required when past > 0, optional when past = 0.
//   cold=<bytes>: run reads a buffer of that many bytes before each call, untimed, and times
//   the calls alone, so that each finds its weights (and cache) in no cache, as mha_bench's
//   own calls of such a problem do.
//
// Every peer computes one kind of problem: peer-torch-sdpa, peer-ort-attention, peer-ort-gqa
// and peer-openvino-sdpa attention, peer-torch-matmul GEMMs, peer-torch-layer layers. A
// supports request of another kind is answered `no <name> computes <kind> problems, not
// <kind>`, and a prepare of another kind is an error. run and release serve every kind.
//
// The tensors are never copied: every Workspace tensor lives in a memfd mapping (see
// SharedAllocator) that the server maps through /proc/<pid>/fd. `prepare` builds the peer's
// session for the problem and calls it once on copy 0, writing o, which mha_bench checks
// against the reference like any kernel's output; `run` times n calls in the server (with
// time.perf_counter, copies rotating), so the pipe's latency is not in the figure. Likewise
// prepare_gemm and prepare_layer call once, writing c or y; the peer may convert what a user
// would hold in another layout there, outside timing (the layer's nn.Linear weights, and
// its cache as a torch tensor, copied: the shared k_cache and v_cache are never written).
// A layer call writes the new tokens' K and V to cache positions [past, past + n) of its
// own cache every time, so the n calls of a run are n identical steps.
#pragma once

#include <mha/attention.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace mha::bench {

/// Allocates whole pages in a memfd mapping, so that another process can map the same
/// memory through shared_path(). Page-aligned, hence also on a 64-byte boundary.
void* shared_allocate(std::size_t bytes);
void shared_free(void* p);
/// "/proc/<pid>/fd/<fd>" for memory from shared_allocate, else an empty string.
std::string shared_path(const void* p);

template <typename T>
struct SharedAllocator {
  using value_type = T;
  SharedAllocator() = default;
  template <typename U>
  explicit SharedAllocator(const SharedAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(shared_allocate(n * sizeof(T))); }
  void deallocate(T* p, std::size_t) { shared_free(p); }
  friend bool operator==(const SharedAllocator&, const SharedAllocator&) { return true; }
  friend bool operator!=(const SharedAllocator&, const SharedAllocator&) { return false; }
};

/// One framework the server could load.
struct PeerInfo {
  /// Attention: peer-torch-sdpa, peer-ort-attention, peer-ort-gqa, peer-openvino-sdpa;
  /// GEMM: peer-torch-matmul; layer: peer-torch-layer.
  std::string name;
  std::string version;  ///< e.g. torch-2.15.0
  std::string how;      ///< how it is run: layout, form, mask, fused path (the report's table)
};

/// One GEMM, C[m][n] = A[m][k] B[k][n], every matrix fp32, dense, row-major.
struct GemmShape {
  std::int64_t m = 0, n = 0, k = 0;
};

/// One call of the attention layer (mha/layer.h) on n new tokens of each of `batch`
/// sequences, with `past` tokens already in the cache, capacity past + n. The attention
/// scale is 1 / sqrt(head_dim); causal is bottom-right (query i sees cache positions
/// j <= past + i).
struct LayerShape {
  std::int64_t batch = 0;
  std::int64_t d = 0;         ///< model width
  std::int64_t heads = 0;     ///< H
  std::int64_t kv_heads = 0;  ///< Hkv, dividing H
  std::int64_t head_dim = 0;  ///< D
  std::int64_t n = 0;         ///< new tokens per sequence
  std::int64_t past = 0;      ///< tokens already cached per sequence
  bool causal = true;
  bool bias = false;  ///< whether bq, bk, bv and bo are given
};

/// The layer's tensors, fp32, dense, row-major, each from shared_allocate: x [batch][n][d];
/// the weights as the math writes them, [in][out]: wq [d][H D], wk and wv [d][Hkv D], wo
/// [H D][d]; the biases (null unless LayerShape::bias) bq [H D], bk and bv [Hkv D], bo [d];
/// the KV cache, head-major k_cache and v_cache [batch][Hkv][past + n][D], whose first
/// `past` positions hold the past tokens' K and V (read only; may be null when past = 0);
/// the output y [batch][n][d].
struct LayerTensors {
  const float* x = nullptr;
  const float* wq = nullptr;
  const float* wk = nullptr;
  const float* wv = nullptr;
  const float* wo = nullptr;
  const float* bq = nullptr;
  const float* bk = nullptr;
  const float* bv = nullptr;
  const float* bo = nullptr;
  const float* k_cache = nullptr;
  const float* v_cache = nullptr;
  float* y = nullptr;
};

/// The exp error the peers are checked with. PyTorch's CPU flash attention computes exp with
/// exp_u20 (about 20 correct bits of 24: within 8 ulp); ONNX Runtime's and OpenVINO's exps
/// are not documented, and are held to the same bound. A wrong mask, scale or head mapping
/// errs by orders of magnitude more.
constexpr double kPeerExpUlp = 8.0;

/// How far a peer's output may be from the reference: the tolerance of a kernel whose exp
/// errs by `exp_ulp`, plus `extra_v` times the row's largest |v| (reference/tolerance.h).
struct PeerBound {
  double exp_ulp = kPeerExpUlp;
  double extra_v = 0.0;
  /// Steps of an 8-bit grid over a tensor's range that each element of K and V may move by
  /// when the peer stores them again in its own 8-bit form (0: it does not). See peer_bound.
  double requantized_steps = 0.0;
};

/// The bound for a peer computing with K and V of type t. fp32: kPeerExpUlp. f16 and bf16
/// (unit roundoff u = 2^-11, 2^-8): the frameworks' reduced-precision attention takes q, K
/// and V in the type (mha_bench gives q rounded to it, so the reference sees the same q),
/// forms the logits and the softmax in fp32, and may round each weight to the type before
/// the product with V (PyTorch's CPU flash attention does, and accumulates in fp32), then
/// rounds the output. Weights p_j (1 + e_j), |e_j| <= u: normalized again (rounded in the
/// denominator too) they move by at most 2u / (1 - u) in total (tolerance.h, step 2), so the
/// output by that times V; with the denominator summing the unrounded weights, the output is
/// off by sum_j p_j e_j v_j, at most u V. The larger, 2u / (1 - u) V, plus the output's own
/// rounding, u |o| <= u V: extra_v = 2u / (1 - u) + u. What this bound cannot see on such a
/// peer: an output change below its rounding (bf16: 2^-8 relative), e.g. 1 % of 131072 keys
/// dropped; a missing dominant key or a zero output it rejects (bench/peers/tests).
///
/// i8: no peer reads this project's i8 rows (a scale per row, symmetric). OpenVINO keeps its
/// cache in u8 with a scale and a zero point per group of its own choosing (tokens or
/// channels, KEY_CACHE_GROUP_SIZE, KEY_CACHE_QUANT_MODE), so it is given the stored values in
/// fp32 and quantizes them again. Whatever its groups, an element then moves by at most
/// delta = 1.125 steps of (max - min) / 255 over the whole tensor: half a step rounding, half
/// a step more where a zero point rounded to the grid clamps an end of the range, and 255 x
/// 2^-11 < 0.125 of a step if the scale is held in f16; plus 2^-24 max |x| for the values'
/// own rounding to fp32. A logit moves by at most e = scale |q|_1 delta_K, so each weight by
/// a factor within e^(+-2e) after normalizing, and the output by (e^(2e) - 1) max |v| from
/// the weights plus delta_V from the values (mha_bench's compare_with_reference). The fp32
/// part of the bound is computed on this project's stored values; the peer's differ by
/// delta, which changes that part by delta times a rounding, far below both terms. What this
/// bound cannot see: on mha_bench's inputs (reference/sensitive.h: logits 16 q_a k_a, v in
/// [0.5, 1.5]) an element's move of 1.125 / 255 moves a logit by up to 0.07 and the bound by
/// about 0.2, while dropping a row's dominant key moves the output by about 0.03: such a peer
/// passes. A zero answer, or one off by a quarter, it rejects (bench/peers/tests).
PeerBound peer_bound(KvType t);

/// The peer server: a child process, started once, serving every peer benchmark.
class PeerServer {
 public:
  /// Starts `command` through /bin/sh and reads its greeting. On failure error() says why
  /// and peers() is empty.
  explicit PeerServer(const std::string& command);
  ~PeerServer();
  PeerServer(const PeerServer&) = delete;
  PeerServer& operator=(const PeerServer&) = delete;

  const std::vector<PeerInfo>& peers() const { return peers_; }
  /// "<name>: <why>" for each framework the server could not load.
  const std::vector<std::string>& skipped() const { return skipped_; }
  const std::string& error() const { return error_; }

  /// Whether `peer` computes this attention problem; otherwise `why` says why not (also
  /// for the GEMM and layer peers).
  bool supports(const std::string& peer, const Problem& p, std::string* why);
  /// Builds the peer's session for the problem, calls it once on copy 0 (writing o) and
  /// returns the seconds that call took, or a negative number with `why` set.
  double prepare(const std::string& peer, const Problem& p, int threads,
                 const std::vector<const float*>& q, const std::vector<KvView>& k,
                 const std::vector<KvView>& v, float* o, std::string* why);
  /// Whether `peer` computes this GEMM; otherwise `why` says why not (also for the
  /// attention and layer peers).
  bool supports_gemm(const std::string& peer, const GemmShape& s, std::string* why);
  /// Prepares the GEMM on a, b and c (memory from shared_allocate), calls it once (writing
  /// c) and returns the seconds that call took, or a negative number with `why` set.
  /// `cold`: bytes run reads before each call, untimed (0: none).
  double prepare_gemm(const std::string& peer, const GemmShape& s, int threads, const float* a,
                      const float* b, float* c, std::string* why, std::int64_t cold = 0);
  /// Whether `peer` computes this layer; otherwise `why` says why not (also for the
  /// attention and GEMM peers).
  bool supports_layer(const std::string& peer, const LayerShape& s, std::string* why);
  /// Prepares the layer on t (memory from shared_allocate), calls it once (writing t.y) and
  /// returns the seconds that call took, or a negative number with `why` set.
  double prepare_layer(const std::string& peer, const LayerShape& s, int threads,
                       const LayerTensors& t, std::string* why, std::int64_t cold = 0);
  /// Seconds for n calls of the last prepared problem, of any kind, timed in the server, or
  /// a negative number with `why` set.
  double run(long long n, std::string* why);
  void release();

 private:
  std::string request(const std::string& line);         // one line out, one line back ("" if dead)
  bool yes(const std::string& line, std::string* why);  // a supports request's answer

  int pid_ = -1;
  std::FILE* to_ = nullptr;    // the server's standard input
  std::FILE* from_ = nullptr;  // its standard output
  std::vector<PeerInfo> peers_;
  std::vector<std::string> skipped_;
  std::string error_;
};

}  // namespace mha::bench
