// mha_bench: every registry kernel and the composed baselines across prefill, decode, head
// and KV-sharing sweeps, with this machine's own limits measured in the same run.
//
// Names: <family>/<kernel>/B:<b>/H:<h>/Hkv:<hkv>/Lq:<lq>/Lk:<lk>/D:<d>/causal:<0|1>
// [/kv:<f16|bf16|i8>][/sinks:1][/window:<w>][/softcap:<c>][/alibi:1]/threads:<n>. /sinks:1:
// with attention sinks (Problem::sinks, sink_logits below); /window:<w>: a sliding window of w
// keys (Problem::window); /softcap:<c>: logits soft-capped at c (Problem::softcap); /alibi:1:
// ALiBi with the paper's slopes (Problem::alibi, alibi_slopes below).
// Family ragged: a decode step of B sequences whose caches hold different numbers of keys
// (Problem::kv_lens, ragged_lengths below), Lk their capacity. Counters: GFLOPS, peak_frac; decode
// also GBps, kv_bytes, bw_frac; a reduced KV type also kv_err_max, kv_err_rms (docs/benchmarks.md).
#include <benchmark/benchmark.h>
#include <mha/attention.h>
#include <mha/kv_types.h>
#include <mha/parallel.h>
#include <mha/registry.h>
#include <mha/support.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <new>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "composed.h"
#include "layer_bench.h"
#include "peers.h"
#include "probe.h"
#include "reference.h"
#include "sensitive.h"
#include "tolerance.h"

#if MHA_HAVE_OPENBLAS
#include <cblas.h>
#endif
#if MHA_HAVE_ONEDNN
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>
#endif

#if MHA_HAVE_COMMIT_HEADER
#include "commit.h"  // generated at build time: MHA_COMMIT
#endif
#ifndef MHA_COMMIT
#define MHA_COMMIT "unknown"
#endif
#ifndef MHA_COMPILER
#define MHA_COMPILER "unknown"
#endif
#ifndef MHA_FLAGS
#define MHA_FLAGS "unknown"
#endif

namespace mha::bench {
namespace {

// ---------------------------------------------------------------------------------------
// What is measured

// --size=quick, --size=default (what runs without the flag), --size=full; --size=cliffs: the
// cliff sweep alone.
enum class Size { quick, default_size, full, cliffs };

// The name on the command line and in the JSON context (mha_size).
const char* size_name(Size size) {
  switch (size) {
    case Size::quick:
      return "quick";
    case Size::default_size:
      return "default";
    case Size::full:
      return "full";
    case Size::cliffs:
      return "cliffs";
  }
  return "unknown";
}

struct Shape {
  std::string family;  // prefill, decode, ragged, heads, cliffs
  std::int64_t batch, heads, kv_heads, q_len, kv_len, dim;
  bool causal;
  int threads;
  std::string caches = "";  // cliffs: the cache configuration's name (cliff_configs)
  KvType kv = KvType::f32;  // K and V as stored: "/kv:<type>" in the name unless f32
  bool sinks = false;       // attention sinks (Problem::sinks): "/sinks:1" in the name
  std::int64_t window = 0;  // a sliding window (Problem::window): "/window:<w>" unless 0
  // A variant's plain twin that no other comparison needs: the registry kernels alone (no
  // composed baselines, no peers), for the variant's time over the same kernel's without it.
  bool kernels_only = false;
  float softcap = 0.0f;  // logit soft-capping (Problem::softcap): "/softcap:<c>" unless 0
  bool alibi = false;    // ALiBi (Problem::alibi, alibi_slopes): "/alibi:1" in the name

  std::string name(const std::string& impl) const {
    std::ostringstream os;
    os << family << "/" << impl << (caches.empty() ? "" : "/caches:") << caches << "/B:" << batch
       << "/H:" << heads << "/Hkv:" << kv_heads << "/Lq:" << q_len << "/Lk:" << kv_len
       << "/D:" << dim << "/causal:" << causal
       << (kv == KvType::f32 ? "" : std::string("/kv:") + kv_type_name(kv))
       << (sinks ? "/sinks:1" : "")
       << (window > 0 ? "/window:" + std::to_string(window) : std::string());
    if (softcap > 0.0f) os << "/softcap:" << softcap;  // as %g: 20, 50, 0.5
    if (alibi) os << "/alibi:1";
    os << "/threads:" << threads;
    return os.str();
  }
  // One query row per query head: a KV cache, head-major.
  bool decode() const {
    return family == "decode" || family == "ragged" || (family == "cliffs" && q_len == 1);
  }
};

// The sink logits of a shape with sinks (Problem::sinks), one per query head, by the shape's
// name: set by workspace() once its inputs are made (sink_logits_for), so that each weighs
// about as much as all of its head's keys (a peer that dropped them would fail the check).
std::vector<float>& sink_logits(const std::string& shape) {
  static std::map<std::string, std::vector<float>> made;
  return made[shape];
}

// ALiBi's slopes for `heads` query heads as the paper sets them (BLOOM, MPT), 2^(-8 (h + 1) /
// heads): 0.84 down to 1/256 at 32 heads, so that head 0's bias over the main prefill's 2048
// keys reaches -1700 and head 31's -8 (an output that ignored them fails the check). Kept for
// the life of the process, so that problems may point at them.
const std::vector<float>& alibi_slopes(std::int64_t heads) {
  static std::map<std::int64_t, std::vector<float>> made;
  std::vector<float>& slopes = made[heads];
  if (slopes.empty()) {
    for (std::int64_t h = 0; h < heads; ++h) {
      slopes.push_back(static_cast<float>(
          std::exp2(-8.0 * static_cast<double>(h + 1) / static_cast<double>(heads))));
    }
  }
  return slopes;
}

// The keys of each sequence of a ragged shape: B lengths evenly spread from Lk / 32 to Lk
// (1024 to 32768 for Lk = 32768, B = 8), as a continuous-batching decode step meets them.
// Kept for the life of the process, so that problems may point at them.
const std::vector<std::int64_t>& ragged_lengths(std::int64_t batch, std::int64_t kv_len) {
  static std::map<std::pair<std::int64_t, std::int64_t>, std::vector<std::int64_t>> made;
  std::vector<std::int64_t>& lens = made[{batch, kv_len}];
  if (lens.empty()) {
    const std::int64_t shortest = std::max<std::int64_t>(1, kv_len / 32);
    for (std::int64_t b = 0; b < batch; ++b) {
      lens.push_back(batch > 1 ? shortest + (kv_len - shortest) * b / (batch - 1) : kv_len);
    }
  }
  return lens;
}

std::vector<Shape> shapes(Size size, int cores) {
  constexpr float kSoftcap = 20.0f;  // the benchmarks' soft-cap (Problem::softcap)
  std::vector<Shape> out;
  // Every shape on one thread and, through the driver, on every core.
  const auto add = [&](const char* family, std::int64_t h, std::int64_t hkv, std::int64_t lq,
                       std::int64_t lk, std::int64_t d, bool causal, KvType kv = KvType::f32) {
    out.push_back({family, 1, h, hkv, lq, lk, d, causal, 1, "", kv});
    if (cores > 1) out.push_back({family, 1, h, hkv, lq, lk, d, causal, cores, "", kv});
  };
  constexpr KvType kReduced[] = {KvType::f16, KvType::bf16, KvType::i8};
  if (size == Size::cliffs) return out;  // the cliff sweep alone
  if (size == Size::quick) {             // every family once, small
    for (bool causal : {false, true}) add("prefill", 4, 2, 128, 128, 64, causal);
    add("prefill", 4, 1, 128, 128, 64, false);
    add("decode", 4, 2, 1, 512, 64, true);
    add("decode", 4, 1, 1, 512, 64, true);
    add("heads", 2, 2, 128, 128, 64, false);
    out.push_back({"ragged", 4, 4, 2, 1, 512, 64, true, 1});
    out.push_back({"prefill", 1, 4, 2, 128, 128, 64, true, 1, "", KvType::f32, true});
    out.push_back({"prefill", 1, 4, 2, 256, 256, 64, true, 1, "", KvType::f32, false, 64});
    out.push_back({"decode", 1, 4, 2, 1, 512, 64, true, 1, "", KvType::f32, false, 128});
    Shape capped{"prefill", 1, 4, 2, 128, 128, 64, true, 1};
    capped.softcap = kSoftcap;
    out.push_back(capped);
    Shape biased{"prefill", 1, 4, 2, 128, 128, 64, true, 1};
    biased.alibi = true;
    out.push_back(biased);
    for (KvType kv : kReduced) {
      add("decode", 4, 2, 1, 512, 64, true, kv);
      add("prefill", 4, 2, 128, 128, 64, true, kv);
    }
    return out;
  }
  const bool full = size == Size::full;
  // Prefill: Lq = Lk, GQA 32/8, D = 128, causal and not.
  const std::vector<std::int64_t> lengths =
      full ? std::vector<std::int64_t>{128, 256, 512, 1024, 2048, 4096, 8192}
           : std::vector<std::int64_t>{512, 2048};
  for (std::int64_t l : lengths) {
    for (bool causal : {false, true}) add("prefill", 32, 8, l, l, 128, causal);
  }
  // Attention sinks (gpt-oss) on the main causal prefill shape, beside the same without.
  for (int threads : {1, cores}) {
    if (threads > 1 && cores == 1) break;
    out.push_back({"prefill", 1, 32, 8, 2048, 2048, 128, true, threads, "", KvType::f32, true});
  }
  // Logit soft-capping (Gemma 2) on the main causal prefill shape, beside the same without: a
  // cap of 20 on the inputs' logits (reference/sensitive.h: big keys 16, dominant ones 20)
  // takes the dominant key from e^4 big keys' weight to e^1.9, so an output that ignored it
  // would fail the check.
  for (int threads : {1, cores}) {
    if (threads > 1 && cores == 1) break;
    Shape capped{"prefill", 1, 32, 8, 2048, 2048, 128, true, threads};
    capped.softcap = kSoftcap;
    out.push_back(capped);
  }
  // ALiBi (BLOOM, MPT) on the main causal prefill shape, beside the same without.
  for (int threads : {1, cores}) {
    if (threads > 1 && cores == 1) break;
    Shape biased{"prefill", 1, 32, 8, 2048, 2048, 128, true, threads};
    biased.alibi = true;
    out.push_back(biased);
  }
  // Sliding windows (Mistral, Gemma's local layers, gpt-oss): a long causal prefill with a
  // window of 1024 and a decode step over a 32768-key cache with a window of 4096, each beside
  // the same without (the decode's is among the caches below).
  for (int threads : {1, cores}) {
    if (threads > 1 && cores == 1) break;
    for (std::int64_t window : {std::int64_t{0}, std::int64_t{1024}}) {
      out.push_back({"prefill", 1, 32, 8, 8192, 8192, 128, true, threads, "", KvType::f32, false,
                     window, window == 0});
    }
    out.push_back({"decode", 1, 32, 8, 1, 32768, 128, true, threads, "", KvType::f32, false, 4096});
  }
  if (full) add("prefill", 32, 8, 2048, 2048, 64, false);
  // Decode: one query against a KV cache.
  const std::vector<std::int64_t> caches =
      full ? std::vector<std::int64_t>{512, 2048, 8192, 32768, 131072}
           : std::vector<std::int64_t>{4096, 32768};
  for (std::int64_t lk : caches) add("decode", 32, 8, 1, lk, 128, true);
  // MHA decode: every query head reads its own KV head.
  add("decode", 8, 8, 1, 32768, 128, true);
  // Continuous batching: one decode step of 8 sequences of 1024 to 32768 keys.
  out.push_back({"ragged", 8, 32, 8, 1, 32768, 128, true, 1});
  if (cores > 1) out.push_back({"ragged", 8, 32, 8, 1, 32768, 128, true, cores});
  // Split-KV decoding: one KV head, a cache in L2 and one in memory.
  add("decode", 8, 1, 1, 1024, 128, true);
  add("decode", 8, 1, 1, 131072, 128, true);
  // KV sharing: MHA (Hkv = H), GQA (H/2, H/4, H/8), MQA (1).
  const std::int64_t kv_len = full ? 2048 : 1024;
  for (std::int64_t hkv : {32, 16, 8, 4, 1}) {
    if (!full && (hkv == 16 || hkv == 4)) continue;
    add("prefill", 32, hkv, kv_len, kv_len, 128, false);
    add("decode", 32, hkv, 1, 32768, 128, true);
  }
  // Head sweeps at fixed model width d = H * D: the total work stays the same.
  for (std::int64_t width :
       full ? std::vector<std::int64_t>{1024, 4096} : std::vector<std::int64_t>{1024}) {
    for (std::int64_t h : {1, 2, 4, 8, 16, 32, 64}) {
      if (!full && h != 4 && h != 16 && h != 64) continue;
      add("heads", h, h, kv_len, kv_len, width / h, false);
    }
  }
  // K and V stored in f16, bf16 and i8 (mha/kv_types.h): decode from the L3 and from memory,
  // GQA and MHA, and split-KV with one KV head (the full size: every decode shape above), and
  // the main prefill shape (the full size: both lengths, causal and not).
  std::vector<Shape> reduced;
  for (const Shape& s : out) {
    const bool decode =
        s.family == "decode" && (full || (s.heads == 32 && s.kv_heads == 8) || s.heads == 8);
    const bool prefill = s.family == "prefill" && s.heads == 32 && s.kv_heads == 8 &&
                         s.dim == 128 && (full || (s.q_len == 2048 && !s.causal));
    if ((!decode && !prefill) || s.window > 0) continue;
    for (KvType kv : kReduced) {
      reduced.push_back(s);
      reduced.back().kv = kv;
    }
  }
  out.insert(out.end(), reduced.begin(), reduced.end());
  return out;
}

// ---------------------------------------------------------------------------------------
// The cliff sweep: every tiled kernel, 1 thread, over cache configurations (the tiling of
// other machines, set in this process by mha::support::set_caches, as MHA_CACHES would),
// head widths, groups, prefill and decode, so that a tiling that collapses on some cache
// size or head width shows in one table. Each point is the best of its rounds, which are
// spread over the whole sweep: the host's other tenants only ever slow a call down, and a
// burst of them would otherwise pass for a cliff.

struct CacheConfig {
  std::string name;             // in benchmark names: "native", "32K-256K", ...
  mha::support::Caches caches;  // l1d 0: the system's (native)
};

// The configurations of the sweep: this CPU's own caches, then L1d and L2 of the families the
// kernels land on (no L3 given: its share unknown, the kernels' most cautious tiling).
std::vector<CacheConfig> cliff_configs(Size size) {
  constexpr std::int64_t K = 1024, M = 1024 * 1024;
  std::vector<CacheConfig> out = {
      {"native", {0, 0, 0}},
      {"32K-256K", {32 * K, 256 * K, 0}},  // Haswell to Skylake client, many laptops
      {"32K-512K", {32 * K, 512 * K, 0}},  // AMD Zen 2-3, Cortex-A76
      {"48K-1M", {48 * K, 1 * M, 0}},      // Intel Ice Lake server, AMD Zen 4
      {"48K-2M", {48 * K, 2 * M, 0}},      // Intel Sapphire and Emerald Rapids
      {"64K-1M", {64 * K, 1 * M, 0}},      // Arm Neoverse N1, V1
  };
  if (size == Size::quick) out = {out[0], out[1]};
  return out;
}

// The sweep's problems: B = 1, one KV head and g = H query heads.
// Prefill: L = 512 (L = 256 for g >= 8, which has g times the rows), not causal. Decode: one
// query row per head over Lk = 2^19 / D keys, 4 MiB of K and V at every D (in the L3 where
// there is one).
std::vector<Shape> cliff_shapes(Size size) {
  const std::vector<std::int64_t> dims =
      size == Size::quick ? std::vector<std::int64_t>{16, 128}
                          : std::vector<std::int64_t>{16, 32, 64, 80, 96, 112, 128, 160, 192, 256};
  const std::vector<std::int64_t> groups = size == Size::quick
                                               ? std::vector<std::int64_t>{1, 4}
                                               : std::vector<std::int64_t>{1, 4, 8, 32};
  std::vector<Shape> out;
  for (bool decode : {false, true}) {
    for (std::int64_t g : groups) {
      for (std::int64_t d : dims) {
        const std::int64_t l = g >= 8 ? 256 : 512;
        const std::int64_t lk = decode ? (std::int64_t{1} << 19) / d : l;
        out.push_back({"cliffs", 1, g, 1, decode ? 1 : l, lk, d, decode, 1});
      }
    }
  }
  return out;
}

struct Impl {
  std::string name;
  double exp_ulp;
  // Runs one problem on `threads` threads: registry kernels through the parallel driver,
  // baselines with their library's thread count set to it.
  std::function<void(const Problem&, const float*, KvView, KvView, float*, float*, int threads)>
      run;
  // registry.inc's `tiled`; the baselines' sgemm blocks for the caches too.
  bool tiled = true;
  // The ISA whose FMA peak peak_frac is over: the kernel's; empty for the baselines (the
  // widest, as for scalar kernels).
  std::string isa;
  // A portable kernel (registry name <library>-<target>: xsimd-avx2, highway-sse4, ...):
  // at the default size timed on the headline shapes only (headline()).
  bool portable = false;
  // The KvTypes it reads (registry.h: kv_bit); the baselines fp32 only.
  unsigned kv_types = kKvF32;
  // Whether it takes the attention variants (Problem::kv_lens, sinks): the baselines do not.
  bool variants = true;
};

// The shapes the portable kernels are compared with the hand-written ones on at the default
// size (the others would double its time): the GQA prefill at L = 2048 and the MHA decode
// from memory.
bool headline(const Shape& s) {
  if (s.family == "prefill") {
    return s.heads == 32 && s.kv_heads == 8 && s.q_len == 2048 && s.dim == 128 && !s.causal;
  }
  return s.family == "decode" && s.heads == 8 && s.kv_heads == 8 && s.kv_len == 32768;
}

std::vector<Impl> implementations() {
  std::vector<Impl> out;
  for (const KernelInfo& kernel : all_kernels()) {
    if (!available(kernel)) continue;
    // The driver's workspace, grown on a benchmark's first call (the check against the
    // reference, before the timed loop), so that timed calls allocate nothing.
    auto workspace = std::make_shared<std::vector<unsigned char>>();
    out.push_back({kernel.name, kernel.exp_ulp,
                   [info = &kernel, workspace](const Problem& p, const float* q, KvView k, KvView v,
                                               float* o, float* lse, int threads) {
                     const std::size_t bytes = parallel_workspace(info->workspace, p, threads);
                     if (workspace->size() < bytes) workspace->resize(bytes);
                     parallel_attention(info->fn, info->workspace, p, q, k, v, o, lse, threads,
                                        Workspace{workspace->data(), bytes});
                   },
                   kernel.tiled, isa_name(kernel.isa),
                   std::string(kernel.name).find('-') != std::string::npos, kernel.kv_types});
  }
  // A composed baseline: its library's threads set to the benchmark's, then the composition.
  const auto composed = [&out](const char* name, Sgemm gemm, void (*set_threads)(int)) {
    auto baseline = std::make_shared<Composed>(gemm);
    out.push_back({name, kComposedExpUlp,
                   [baseline, set_threads](const Problem& p, const float* q, KvView k, KvView v,
                                           float* o, float* lse, int threads) {
                     set_threads(threads);
                     baseline->run(p, q, static_cast<const float*>(k.data),
                                   static_cast<const float*>(v.data), o, lse, threads);
                   },
                   true, "", false, kKvF32, /*variants=*/false});
  };
#if MHA_HAVE_OPENBLAS
  composed("composed-openblas", &openblas_sgemm, &openblas_threads);
#endif
#if MHA_HAVE_ONEDNN
  composed("composed-onednn", &onednn_sgemm, &onednn_threads);
#endif
  (void)composed;  // unused when neither library was found
  return out;
}

// ---------------------------------------------------------------------------------------
// Inputs: allocated and first-touched outside the timed loop, kept across the repeated
// calls Google Benchmark makes for one benchmark, and rotated over enough copies to read
// cold data when the KV cache is beyond the last-level cache. Their values are
// reference/sensitive.h's, on which the check below sees a dropped KV tile or 1% of the keys
// at every length (no kernel's or peer's speed depends on the values).

// Tensors live in shared memory (peers.h: memfd mappings), so that the framework peers read
// the very inputs the kernels read, in place. They start on a page boundary, hence on a
// 64-byte one (a cache line, a zmm), as the allocators of frameworks give them (PyTorch's and
// oneDNN's align to 64 bytes). std::vector's own storage of a large tensor is 16 bytes past a
// page boundary, so every 64-byte vector load of a row would straddle two cache lines; decode,
// which reads K and V in place, ran up to a third slower so.
using Tensor = std::vector<float, SharedAllocator<float>>;

struct Workspace {
  std::string key;
  Problem p;
  int copies = 1;
  // K and V as p.kv_type stores them (a reduced type's bytes in float-sized storage), and
  // for i8 their scales; k32 and v32: copy 0 in fp32 before it was rounded to that type.
  std::vector<Tensor> q, k, v, k_scale, v_scale;
  Tensor k32, v32;
  Tensor o, lse;
  KvView k_view(std::size_t c) const {
    return {k[c].data(), k_scale.empty() ? nullptr : k_scale[c].data()};
  }
  KvView v_view(std::size_t c) const {
    return {v[c].data(), v_scale.empty() ? nullptr : v_scale[c].data()};
  }
  // compare_with_reference's sampled rows, made once per problem (the cliff sweep checks
  // each problem under every cache configuration and kernel).
  std::map<std::int64_t, ref::Result> want;
  std::map<std::pair<std::int64_t, double>, ref::Tolerance> tol;
  // A reduced type's quantization error on these inputs (quantization_error), once computed.
  bool quantized = false;
  double quant_max = 0.0, quant_rms = 0.0;
};

// The bytes of K and V a call reads: their elements in the stored type, and i8's scales (each
// sequence's own keys, Problem::kv_lens, from its first row's first key, Problem::window, to
// its last row's last).
std::int64_t kv_bytes(const Problem& p) {
  std::int64_t rows = 0;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const Problem s = sequence(p, b);
    if (s.q_len > 0) rows += p.kv_heads * (visible_keys(s, s.q_len - 1) - first_key(s, 0));
  }
  const std::int64_t scales = p.kv_type == KvType::i8 ? 4 : 0;
  return 2 * rows * (p.head_dim * static_cast<std::int64_t>(kv_type_bytes(p.kv_type)) + scales);
}

// Floats of storage that hold n elements of type t.
std::size_t floats_for(std::int64_t n, KvType t) {
  return static_cast<std::size_t>((n * static_cast<std::int64_t>(kv_type_bytes(t)) + 3) / 4);
}

// `stored` (floats_for its extent) and, for i8, `scales`: x (fp32, strides st) in p.kv_type,
// row by row as a cache's append stores them (kv::narrow_rows).
void store_as(const Problem& p, const Strides& st, const Strides& scale_st, const Tensor& x,
              Tensor& stored, Tensor& scales) {
  stored.assign(floats_for(static_cast<std::int64_t>(x.size()), p.kv_type), 0.0f);
  const bool i8 = p.kv_type == KvType::i8;
  if (i8) {
    scales.assign(static_cast<std::size_t>(extent(scale_st, p.batch, p.kv_len, p.kv_heads, 1)),
                  0.0f);
  }
  auto* out = reinterpret_cast<unsigned char*>(stored.data());
  const auto bytes = static_cast<std::int64_t>(kv_type_bytes(p.kv_type));
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t j = 0; j < p.kv_len; ++j) {
      for (std::int64_t h = 0; h < p.kv_heads; ++h) {
        const std::int64_t at = b * st.batch + j * st.seq + h * st.head;
        float* scale =
            i8 ? scales.data() + b * scale_st.batch + j * scale_st.seq + h * scale_st.head
               : nullptr;
        kv::narrow_rows(p.kv_type, x.data() + at, 1, p.head_dim, out + at * bytes, scale);
      }
    }
  }
}

// With K and V in f16 or bf16, q rounded to that type too, as the projection of a model that
// keeps such a cache produces it, and as the frameworks' reduced-precision attention takes it
// (q, K and V of one type): every implementation, and the reference, read the same q.
void round_q(KvType t, Tensor& q) {
  for (float& x : q) {
    if (t == KvType::f16) x = kv::f16_to_f32(kv::f32_to_f16(x));
    if (t == KvType::bf16) x = kv::bf16_to_f32(kv::f32_to_bf16(x));
  }
}

Problem workspace_problem(const Shape& s) {
  Problem p = make_problem(s.batch, s.q_len, s.kv_len, s.heads, s.kv_heads, s.dim, s.causal);
  p.kv_type = s.kv;
  if (s.decode()) {
    p.k = p.v = dense_strides(Layout::head_major, s.kv_len, s.kv_heads, s.dim);
    p.k_scale = p.v_scale = dense_strides(Layout::head_major, s.kv_len, s.kv_heads, 1);
  }
  if (s.family == "ragged") p.kv_lens = ragged_lengths(s.batch, s.kv_len).data();
  p.window = s.window;
  p.softcap = s.softcap;
  if (s.alibi) p.alibi = alibi_slopes(s.heads).data();
  if (s.sinks) {
    Shape key = s;
    key.caches.clear();
    std::vector<float>& sinks = sink_logits(key.name(""));
    sinks.resize(static_cast<std::size_t>(s.heads), 0.0f);
    p.sinks = sinks.data();
  }
  return p;
}

Workspace& workspace(const Shape& s, const Probe& probe) {
  static Workspace w;
  Shape problem = s;
  problem.caches.clear();  // the tensors are the same under every cache configuration
  const std::string key = problem.name("");
  if (w.key == key) return w;
  w = Workspace();
  w.key = key;
  w.p = workspace_problem(s);
  // A decode that reads from DRAM (probe.h: reads_from) rotates over copies of its KV
  // cache that together exceed 3x the last-level cache the system reports, so no call finds
  // its data in any cache level, whatever its true size (a VM may report 480 MiB of L3 that
  // reads at DRAM speed, yet keeps a 33 MB working set: read once per call it streamed at
  // 1.5x DRAM).
  const std::int64_t ws = kv_bytes(w.p);
  if (s.decode() && probe.level_of(ws) == Level::dram) {
    const std::int64_t llc = probe.caches.last_level();
    w.copies = static_cast<int>(std::max<std::int64_t>(2, (3 * llc + ws - 1) / ws));
  }
  const Problem& p = w.p;
  for (int c = 0; c < w.copies; ++c) {
    w.q.emplace_back(static_cast<std::size_t>(q_extent(p)));
    Tensor k(static_cast<std::size_t>(k_extent(p))), v(static_cast<std::size_t>(v_extent(p)));
    ref::SensitiveInputs(p, static_cast<std::uint64_t>(c) + 1)
        .fill(w.q.back().data(), k.data(), v.data());
    round_q(p.kv_type, w.q.back());
    if (p.kv_type == KvType::f32) {
      w.k.push_back(std::move(k));
      w.v.push_back(std::move(v));
      continue;
    }
    Tensor k_scale, v_scale;
    w.k.emplace_back();
    w.v.emplace_back();
    store_as(p, p.k, p.k_scale, k, w.k.back(), k_scale);
    store_as(p, p.v, p.v_scale, v, w.v.back(), v_scale);
    if (p.kv_type == KvType::i8) {
      w.k_scale.push_back(std::move(k_scale));
      w.v_scale.push_back(std::move(v_scale));
    }
    if (c == 0) {
      w.k32 = std::move(k);
      w.v32 = std::move(v);
    }
  }
  w.o.assign(static_cast<std::size_t>(o_extent(w.p)), 0.0f);
  w.lse.assign(static_cast<std::size_t>(lse_extent(w.p)), 0.0f);
  if (p.sinks != nullptr) {
    // Each head's sink: the lse of its middle row without sinks (batch 0), so that the sink
    // weighs about as much as the keys that row sees.
    Problem plain = p;
    plain.sinks = nullptr;
    const std::int64_t row = p.q_len / 2;
    const ref::Result r =
        ref::attention(plain, w.q[0].data(), w.k_view(0), w.v_view(0), row, row + 1);
    float* sinks = const_cast<float*>(p.sinks);
    for (std::int64_t h = 0; h < p.q_heads; ++h) sinks[h] = static_cast<float>(r.lse_at(0, h, row));
  }
  return w;
}

// The largest move of an element of copy 0's K or V (stored values) when stored again in
// 8 bits with groups of the peer's choosing: `steps` steps of (max - min) / 255 over the
// tensor, plus the values' rounding to fp32 (peers.h, peer_bound).
double requantized_move(const Problem& p, const KvView& x, const Strides& st,
                        const Strides& scale_st, double steps) {
  double lo = std::numeric_limits<double>::infinity(), hi = -lo, abs_max = 0.0;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t j = 0; j < p.kv_len; ++j) {
      for (std::int64_t h = 0; h < p.kv_heads; ++h) {
        const ref::KvRow row = ref::kv_row(p, x, st, scale_st, b, j, h);
        for (std::int64_t d = 0; d < p.head_dim; ++d) {
          const double e = row.at(d);
          lo = std::min(lo, e);
          hi = std::max(hi, e);
          abs_max = std::max(abs_max, std::fabs(e));
        }
      }
    }
  }
  return steps * (hi - lo) / 255.0 + 0x1p-24 * abs_max;
}

// Compares sampled rows of w.o and w.lse (first, middle, last query row of every head: every
// row of a decode) with the reference under the shared tolerance, for an implementation whose
// exp errs by at most `exp_ulp`, plus, for a peer's reduced-precision arithmetic or its own
// 8-bit copy of K and V (peers.h, peer_bound), `extra.extra_v` times the row's largest |v| and
// what `extra.requantized_steps` moves; lse only when `check_lse`. Empty when they agree.
std::string compare_with_reference(Workspace& w, double exp_ulp, bool check_lse,
                                   const PeerBound& extra = {0.0, 0.0, 0.0}) {
  const Problem& p = w.p;
  double k_move = 0.0, v_move = 0.0;
  if (extra.requantized_steps > 0.0) {
    k_move = requantized_move(p, w.k_view(0), p.k, p.k_scale, extra.requantized_steps);
    v_move = requantized_move(p, w.v_view(0), p.v, p.v_scale, extra.requantized_steps);
  }
  for (std::int64_t row : {std::int64_t{0}, p.q_len / 2, p.q_len - 1}) {
    if (w.want.count(row) == 0) {
      w.want.emplace(row, ref::attention(p, w.q[0].data(), w.k_view(0), w.v_view(0), row, row + 1));
    }
    if (w.tol.count({row, exp_ulp}) == 0) {
      w.tol.emplace(
          std::make_pair(row, exp_ulp),
          ref::tolerance(p, w.q[0].data(), w.k_view(0), w.v_view(0), exp_ulp, row, row + 1));
    }
    const ref::Result& want = w.want.at(row);
    const ref::Tolerance& tol = w.tol.at({row, exp_ulp});
    for (std::int64_t b = 0; b < p.batch; ++b) {
      for (std::int64_t h = 0; h < p.q_heads; ++h) {
        const std::size_t r = tol.row(b, h, row);
        double bound = tol.o[r] + extra.extra_v * tol.v_max[r];
        if (extra.requantized_steps > 0.0) {
          const float* qr = w.q[0].data() + b * p.q.batch + row * p.q.seq + h * p.q.head;
          double q1 = 0.0;
          for (std::int64_t d = 0; d < p.head_dim; ++d) q1 += std::fabs(double{qr[d]});
          const double logit_move = std::fabs(double{p.scale}) * q1 * k_move;
          bound += std::expm1(2.0 * logit_move) * tol.v_max[r] + v_move;
        }
        for (std::int64_t d = 0; d < p.head_dim; ++d) {
          const double got =
              w.o[static_cast<std::size_t>(b * p.o.batch + row * p.o.seq + h * p.o.head + d)];
          const double diff = std::fabs(got - want.o_at(b, h, row, d));
          if (!(diff <= bound)) {
            std::ostringstream os;
            os << "output differs from the reference: o[b=" << b << "][h=" << h << "][i=" << row
               << "][d=" << d << "] = " << got << ", expected " << want.o_at(b, h, row, d)
               << " (bound " << bound << ")";
            return os.str();
          }
        }
        if (!check_lse) continue;
        const double got = w.lse[static_cast<std::size_t>(b * p.lse.batch + h * p.lse.head + row)];
        const double want_lse = want.lse_at(b, h, row);
        if (!(std::fabs(got - want_lse) <= tol.lse[r]) &&
            !(std::isinf(want_lse) && got == want_lse)) {
          return "lse differs from the reference at row " + std::to_string(row);
        }
      }
    }
  }
  return std::string();
}

// What storing K and V in a reduced type costs on these inputs: the exact outputs (the
// reference's) of the sampled rows on the stored values against those on the fp32 values they
// were rounded from; sets w.quant_max, the largest |difference|, and w.quant_rms, the RMS
// difference over the RMS output. Made once per workspace, after compare_with_reference.
void quantization_error(Workspace& w) {
  if (w.quantized || w.p.kv_type == KvType::f32) return;
  Problem fp32 = w.p;
  fp32.kv_type = KvType::f32;
  double max = 0.0, err2 = 0.0, out2 = 0.0;
  for (const auto& [row, want] : w.want) {
    const ref::Result exact =
        ref::attention(fp32, w.q[0].data(), w.k32.data(), w.v32.data(), row, row + 1);
    for (std::int64_t b = 0; b < fp32.batch; ++b) {
      for (std::int64_t h = 0; h < fp32.q_heads; ++h) {
        for (std::int64_t d = 0; d < fp32.head_dim; ++d) {
          const double diff = want.o_at(b, h, row, d) - exact.o_at(b, h, row, d);
          max = std::max(max, std::fabs(diff));
          err2 += diff * diff;
          out2 += exact.o_at(b, h, row, d) * exact.o_at(b, h, row, d);
        }
      }
    }
  }
  w.quantized = true;
  w.quant_max = max;
  w.quant_rms = out2 > 0 ? std::sqrt(err2 / out2) : 0.0;
}

// FLOPs as DESIGN.md (section 8) defines them: 4 D per visible query-key pair, over all B H heads
// (each sequence's own pairs: Problem::q_lens, kv_lens; within a window: Problem::window).
double flops(const Problem& p) {
  double pairs = 0.0;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const Problem s = sequence(p, b);
    for (std::int64_t i = 0; i < s.q_len; ++i) pairs += static_cast<double>(keys_seen(s, i));
  }
  return 4.0 * static_cast<double>(p.head_dim) * pairs * static_cast<double>(p.q_heads);
}

// The counters of one benchmark from the seconds its iterations took.
void set_counters(benchmark::State& state, const Shape& s, const Problem& p, const Probe& probe,
                  const std::string& isa, double seconds) {
  const double per_second = static_cast<double>(state.iterations()) / seconds;
  const int all = s.threads > 1 ? 1 : 0;
  const double gflops = flops(p) / 1e9 * per_second;
  state.counters["GFLOPS"] = gflops;
  const int threads = all ? probe.cores : 1;
  // The probe's `figure`, or, when `value` exceeds it, the higher of it and the same figure
  // measured now, after the timed loop (kept as counter `now`): another process held a
  // core while the probe ran, memory bandwidth drifted (by 10% over minutes on a shared
  // VM), or the probe is wrong. The reporter turns a fraction still above kClockSlack into
  // an error.
  const auto limit_of = [&](double value, double figure, const char* now, auto measure) {
    if (value <= figure) return figure;
    figure = std::max(figure, measure());
    state.counters[now] = figure;
    return figure;
  };
  const FmaPeak& fma = probe.fma_peak(isa);
  const double peak = limit_of(gflops, fma.gflops[all], "peak_gflops_now",
                               [&] { return measure_fma_gflops(fma.isa, threads); });
  state.counters["peak_frac"] = gflops / peak;
  if (!s.decode()) return;
  const std::int64_t bytes = kv_bytes(p);
  const double gbps = static_cast<double>(bytes) / 1e9 * per_second;
  state.counters["kv_bytes"] = static_cast<double>(bytes);
  state.counters["GBps"] = gbps;
  double limit = 0.0;
  switch (probe.level_of(bytes)) {
    case Level::dram:
      // Measured by the probe (main measures DRAM whenever may_read_dram says a benchmark
      // may need it).
      limit = limit_of(gbps, probe.dram_gbps[all], "dram_gbps_now",
                       [&] { return measure_dram_gbps(probe.caches, threads); });
      state.SetLabel("bw:dram");
      break;
    case Level::l2:
      limit = limit_of(gbps, probe.l2_gbps[all], "l2_gbps_now",
                       [&] { return measure_l2_gbps(probe.caches, threads); });
      state.SetLabel("bw:l2");
      break;
    case Level::l3:
      limit = limit_of(gbps, probe.l3_gbps[all], "l3_gbps_now",
                       [&] { return measure_l3_gbps(probe.caches, threads); });
      state.SetLabel("bw:l3");
      break;
    case Level::between:
      break;
  }
  if (limit > 0) state.counters["bw_frac"] = gbps / limit;
}

// A reduced type's quantization error on the benchmark's inputs (quantization_error), the
// same for every implementation of the shape: kv_err_max and kv_err_rms.
void set_quantization_counters(benchmark::State& state, Workspace& w) {
  if (w.p.kv_type == KvType::f32) return;
  quantization_error(w);
  state.counters["kv_err_max"] = w.quant_max;
  state.counters["kv_err_rms"] = w.quant_rms;
}

// --plant=BUG, a self-test of the check above: every implementation's answer (kernels',
// baselines', peers') is made wrong before the check, as a bug would make it, and the run
// succeeds only if the check rejects it in every benchmark (a benchmark it passes is timed
// and reported as an escape). zeros: o all zeros; last-tile: a decode of more than 16384
// keys without its last 128 keys; first-percent: without the first 1% of the keys;
// middle-key: without key kv_len / 2.
enum class Plant { none, zeros, last_tile, first_percent, middle_key };
Plant g_plant = Plant::none;
int g_planted_caught = 0;  // benchmarks whose planted answer the check rejected

// The keys an implementation with the planted bug reads: [first, first + count).
struct PlantedKeys {
  std::int64_t first = 0, count = 0;
};
PlantedKeys planted_keys(const Problem& p) {
  if (g_plant == Plant::last_tile && p.q_len == 1 && p.kv_len > 16384) return {0, p.kv_len - 128};
  if (g_plant == Plant::first_percent && p.kv_len >= 100) {
    return {p.kv_len / 100, p.kv_len - p.kv_len / 100};
  }
  return {0, p.kv_len};
}

// w's problem and K and V (those of copy c) as the planted bug sees them: without a plant,
// the problem itself. middle-key: copies of copy 0's K and V (and scales) without key
// kv_len / 2, made once per workspace, for every copy.
Problem planted_problem(const Workspace& w, std::size_t c, KvView& k, KvView& v) {
  const Problem& p = w.p;
  if (g_plant == Plant::middle_key && p.kv_len > 1) {
    static std::string key;
    static Tensor k_cut, v_cut, k_scale_cut, v_scale_cut;
    static Problem cut;
    if (key != w.key) {
      key = w.key;
      cut = p;
      cut.kv_len = p.kv_len - 1;
      const Layout layout = p.k.head < p.k.seq ? Layout::token_major : Layout::head_major;
      cut.k = cut.v = dense_strides(layout, cut.kv_len, p.kv_heads, p.head_dim);
      cut.k_scale = cut.v_scale = dense_strides(layout, cut.kv_len, p.kv_heads, 1);
      const auto row_bytes = static_cast<std::size_t>(p.head_dim) * kv_type_bytes(p.kv_type);
      const bool i8 = p.kv_type == KvType::i8;
      const auto cut_rows = [&](KvView from, const Strides& st, const Strides& scale_st, Tensor& to,
                                Tensor& to_scale) {
        to.assign(floats_for(k_extent(cut), p.kv_type), 0.0f);
        to_scale.assign(i8 ? static_cast<std::size_t>(k_scale_extent(cut)) : 0, 0.0f);
        for (std::int64_t b = 0; b < p.batch; ++b) {
          for (std::int64_t h = 0; h < p.kv_heads; ++h) {
            for (std::int64_t j = 0, t = 0; j < p.kv_len; ++j) {
              if (j == p.kv_len / 2) continue;
              const KvView row = kv_row(from, p.kv_type, st, scale_st, b, j, h);
              const KvView out = kv_row(KvView(to.data(), to_scale.data()), p.kv_type, cut.k,
                                        cut.k_scale, b, t, h);
              std::memcpy(const_cast<void*>(out.data), row.data, row_bytes);
              if (i8) *const_cast<float*>(out.scale) = *row.scale;
              ++t;
            }
          }
        }
      };
      cut_rows(w.k_view(0), p.k, p.k_scale, k_cut, k_scale_cut);
      cut_rows(w.v_view(0), p.v, p.v_scale, v_cut, v_scale_cut);
      // A ragged sequence past the cut key has one key fewer.
      static std::vector<std::int64_t> cut_lens;
      cut_lens.clear();
      for (std::int64_t b = 0; p.kv_lens != nullptr && b < p.batch; ++b) {
        cut_lens.push_back(p.kv_lens[b] - (p.kv_lens[b] > p.kv_len / 2 ? 1 : 0));
      }
      cut.kv_lens = p.kv_lens != nullptr ? cut_lens.data() : nullptr;
    }
    k = KvView(k_cut.data(), k_scale_cut.data());
    v = KvView(v_cut.data(), v_scale_cut.data());
    return cut;
  }
  (void)c;
  const PlantedKeys keys = planted_keys(p);
  Problem out = p;
  out.kv_len = keys.count;
  if (p.kv_lens != nullptr) {  // each sequence without the keys the plant drops from the whole
    static std::vector<std::int64_t> lens;
    lens.clear();
    for (std::int64_t b = 0; b < p.batch; ++b) {
      const std::int64_t first = keys.first, last = keys.first + keys.count;
      lens.push_back(std::max<std::int64_t>(0, std::min(p.kv_lens[b], last) - first));
    }
    out.kv_lens = lens.data();
  }
  k = advance(k, p.kv_type, keys.first * p.k.seq, keys.first * p.k_scale.seq);
  v = advance(v, p.kv_type, keys.first * p.v.seq, keys.first * p.v_scale.seq);
  return out;
}

// The check's verdict with the plant: an error is the expected outcome (counted), a pass
// is the escape the run must report.
std::string planted_verdict(const std::string& error) {
  if (g_plant == Plant::none) return error;
  if (!error.empty()) {
    ++g_planted_caught;
    return "planted answer rejected: " + error;
  }
  return std::string();
}

void run_benchmark(benchmark::State& state, const Impl& impl, const Shape& s, const Probe& probe) {
  Workspace& w = workspace(s, probe);
  static std::set<std::string> verified;
  const std::string name = s.name(impl.name);
  if (verified.count(name) == 0) {
    KvView k = w.k_view(0), v = w.v_view(0);
    const Problem planted = planted_problem(w, 0, k, v);
    impl.run(planted, w.q[0].data(), k, v, w.o.data(), w.lse.data(), s.threads);
    if (g_plant == Plant::zeros) std::fill(w.o.begin(), w.o.end(), 0.0f);
    const std::string error =
        planted_verdict(compare_with_reference(w, impl.exp_ulp, /*check_lse=*/true));
    if (!error.empty()) {
      state.SkipWithError(error.c_str());
      return;
    }
    verified.insert(name);
  }
  const Problem& p = w.p;
  int c = 0;
  // Wall clock around the loop (the same interval UseRealTime reports), so that the rates
  // below are plain numbers in every output format.
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    impl.run(p, w.q[c].data(), w.k_view(c), w.v_view(c), w.o.data(), nullptr, s.threads);
    benchmark::ClobberMemory();
    c = c + 1 == w.copies ? 0 : c + 1;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  set_counters(state, s, p, probe, impl.isa, seconds);
  set_quantization_counters(state, w);
}

// A point of the cliff sweep: run_benchmark with the kernels tiling for `caches`, then
// roof_frac, the fraction of the limit that binds: the FMA peak, or, for a decode whose K and
// V bytes at the bandwidth of their memory level take longer, that bandwidth.
// Calls of a cliff point: as many as take about `seconds` if it ran at half its roof (the FMA
// peak or, for a decode, its K and V at the bandwidth of the level they come from), so that
// Google Benchmark times a fixed count at once instead of growing it run by run (which cost
// the sweep twice its timed time).
std::int64_t cliff_iterations(const Shape& s, const Impl& impl, const Probe& probe,
                              double seconds) {
  const Problem p = workspace_problem(s);
  double least = flops(p) / (probe.fma_peak(impl.isa).gflops[0] * 1e9);
  if (s.decode()) {
    const Level level = probe.level_of(kv_bytes(p));
    const double bw = level == Level::l2     ? probe.l2_gbps[0]
                      : level == Level::dram ? probe.dram_gbps[0]
                                             : probe.l3_gbps[0];
    if (bw > 0) least = std::max(least, static_cast<double>(kv_bytes(p)) / (bw * 1e9));
  }
  return std::clamp<std::int64_t>(static_cast<std::int64_t>(seconds / (2 * least)), 1, 1000);
}

void run_cliff_benchmark(benchmark::State& state, const Impl& impl, const Shape& s,
                         const mha::support::Caches& caches, const Probe& probe) {
  mha::support::set_caches(caches);
  // One call untimed: the point before read other tensors, and a decode's K and V (4 MiB)
  // would come from memory on the first of a few dozen calls.
  Workspace& w = workspace(s, probe);
  impl.run(w.p, w.q[0].data(), w.k_view(0), w.v_view(0), w.o.data(), nullptr, s.threads);
  run_benchmark(state, impl, s, probe);
  mha::support::set_caches({0, 0, 0});
  if (state.error_occurred()) return;
  double roof = state.counters["peak_frac"];
  if (const auto bw = state.counters.find("bw_frac"); bw != state.counters.end()) {
    roof = std::max(roof, bw->second.value);
  }
  state.counters["roof_frac"] = roof;
}

template <typename T>
std::vector<const float*> pointers(const std::vector<T>& tensors) {
  std::vector<const float*> out;
  for (const T& t : tensors) out.push_back(t.data());
  return out;
}

// A framework peer on the kernels' own inputs: prepared (its session built and called once,
// its output checked against the reference), then timed in batches of calls that take about
// 20 ms each, the seconds measured by the server around its calls (manual time).
void run_peer_benchmark(benchmark::State& state, PeerServer& server, const std::string& peer,
                        const Shape& s, const Probe& probe) {
  Workspace& w = workspace(s, probe);
  std::string why;
  std::fill(w.o.begin(), w.o.end(), std::numeric_limits<float>::quiet_NaN());
  std::vector<KvView> k, v;
  for (std::size_t c = 0; c < w.k.size(); ++c) {
    k.push_back(w.k_view(c));
    v.push_back(w.v_view(c));
  }
  Problem planted = w.p;
  for (std::size_t c = 0; c < k.size(); ++c) planted = planted_problem(w, c, k[c], v[c]);
  const double once =
      server.prepare(peer, planted, s.threads, pointers(w.q), k, v, w.o.data(), &why);
  if (once < 0) {
    state.SkipWithError((peer + ": " + why).c_str());
    return;
  }
  if (g_plant == Plant::zeros) std::fill(w.o.begin(), w.o.end(), 0.0f);
  const PeerBound bound = peer_bound(w.p.kv_type);
  const std::string error =
      planted_verdict(compare_with_reference(w, bound.exp_ulp, /*check_lse=*/false, bound));
  if (!error.empty()) {
    server.release();
    state.SkipWithError(error.c_str());
    return;
  }
  const long long batch = std::max(1LL, static_cast<long long>(0.02 / std::max(once, 1e-9)));
  double seconds = 0.0;
  while (state.KeepRunningBatch(batch)) {
    const double t = server.run(batch, &why);
    if (t < 0) {
      state.SkipWithError((peer + ": " + why).c_str());
      break;
    }
    state.SetIterationTime(t);
    seconds += t;
  }
  server.release();
  if (state.error_occurred()) return;
  set_counters(state, s, w.p, probe, "", seconds);
  set_quantization_counters(state, w);
}

// ---------------------------------------------------------------------------------------
// Reporting: a fraction far above 1 means the probe is wrong; such a figure is turned into
// an error instead of being reported, and the run fails.
//
// A little above 1 is the clock: a probe's runs are a few milliseconds, and turbo and the
// host's other tenants move one core's rate between such runs. On an AMD EPYC (Zen 1)
// guest the AVX2 FMA loop ranged over 36-48 GFLOP/s from run to run; one probe's best was
// 39.4 and the same again when measured after the timed loop, while oneDNN's sgemm had run
// at 41.0 (1.04x). A probe that is wrong (an instruction's FLOPs or a buffer's bytes
// miscounted) is off by 2x or more; the highest rate over the lowest above, 48 / 36 = 1.33,
// bounds the clock's share, so a fraction up to kClockSlack stands, as measured.
constexpr double kClockSlack = 1.33;

// A peer's time per call on a trivial problem (a decode step, 2 query heads on 1 KV head,
// 16 keys of 16 floats, 1 thread): what the framework adds to every call, which the report
// shows beside the shapes that take under a millisecond. The best of 5 batches of about
// 20 ms; 0 when the peer does not take the problem.
double peer_overhead(PeerServer& server, const std::string& peer, const Probe& probe) {
  const Shape tiny{"decode", 1, 2, 1, 1, 16, 16, true, 1};
  Workspace& w = workspace(tiny, probe);
  std::string why;
  if (!server.supports(peer, w.p, &why)) return 0.0;
  const double once =
      server.prepare(peer, w.p, 1, pointers(w.q), {w.k_view(0)}, {w.v_view(0)}, w.o.data(), &why);
  if (once < 0) return 0.0;
  const long long batch = std::max(1LL, static_cast<long long>(0.02 / std::max(once, 1e-7)));
  double best = 0.0;
  for (int r = 0; r < 5; ++r) {
    const double t = server.run(batch, &why);
    if (t < 0) break;
    best = r == 0 ? t / static_cast<double>(batch) : std::min(best, t / static_cast<double>(batch));
  }
  server.release();
  return best;
}

std::string slack_text() {
  char text[16];
  std::snprintf(text, sizeof text, "%.2f", kClockSlack);
  return text;
}

bool g_probe_wrong = false;
bool g_errors = false;
std::vector<std::string> g_plant_escapes;  // --plant: runs whose planted answer was not rejected

template <typename Base>
class Checked : public Base {
 public:
  using Base::Base;
  void ReportRuns(const std::vector<benchmark::BenchmarkReporter::Run>& runs) override {
    std::vector<benchmark::BenchmarkReporter::Run> checked = runs;
    for (auto& run : checked) {
      g_errors |= run.error_occurred;
      if (g_plant != Plant::none) {
        const bool caught =
            run.error_occurred && run.error_message.rfind("planted answer rejected", 0) == 0;
        if (!caught) g_plant_escapes.push_back(run.benchmark_name());
      }
      for (const char* key : {"peak_frac", "bw_frac"}) {
        const auto it = run.counters.find(key);
        if (it != run.counters.end() && it->second.value > kClockSlack && !run.error_occurred) {
          run.error_occurred = true;
          run.error_message = std::string(key) + " = " + std::to_string(it->second.value) + " > " +
                              slack_text() + ": the machine probe is wrong";
          g_probe_wrong = true;
        }
      }
    }
    Base::ReportRuns(checked);
  }
};

// One line on standard error as each shape starts: how far the run is, and since when.
void progress(const std::string& shape, int index, int count) {
  static std::string last;  // Google Benchmark calls a benchmark several times
  if (shape == last) return;
  last = shape;
  static const auto start = std::chrono::steady_clock::now();
  const auto seconds =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::steady_clock::now() - start)
          .count();
  std::fprintf(stderr, "mha_bench: [%lldm%02llds] shape %d of %d: %s\n",
               static_cast<long long>(seconds / 60), static_cast<long long>(seconds % 60), index,
               count, shape.c_str());
}

std::string fixed(double x, int digits = 1) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, x);
  return buf;
}

// ---------------------------------------------------------------------------------------
// The steps of main

#if MHA_HAVE_OPENBLAS
// OpenBLAS picks its kernels for the CPU it recognizes; one older than the CPU (Debian 12's
// 0.3.21 on an Intel Xeon of model 207) falls back to Prescott's SSE3 kernels, 5-8x slower
// than its SkylakeX ones here (14-25 against 77-130 GFLOP/s for 2048 x 4096 x 4096 on one
// core). The baselines get the library's best: mha_bench restarts itself once with
// OPENBLAS_CORETYPE set for the widest ISA the CPU has (what a user who knows the variable
// does), and the context records the core OpenBLAS used (openblas_core).
void use_best_openblas_core(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") == nullptr &&
      std::strcmp(openblas_get_corename(), "Prescott") == 0) {
    const char* core = mha::cpu_supports(mha::Isa::avx512) ? "SkylakeX"
                       : mha::cpu_supports(mha::Isa::avx2) ? "Haswell"
                                                           : nullptr;
    if (core != nullptr) {
      setenv("OPENBLAS_CORETYPE", core, 1);
      execv("/proc/self/exe", argv);  // returns only on failure: then go on as we are
    }
  }
}
#endif

// Our own flags, taken out before Google Benchmark parses the rest.
struct Options {
  Size size = Size::default_size;
  bool probe_only = false;
  std::string peers_command;  // --peers=CMD: the framework peers' server (peers.h)
  int rounds = 1;             // --rounds=N: every shape's kernels and peers N times, alternating
  std::vector<char*> args;    // the rest, for Google Benchmark (the program's name first)
  bool json_out = false;      // --benchmark_out=FILE: JSON into FILE
  bool json_display = false;  // --benchmark_format=json: JSON on standard output
};

// Sets g_plant from --plant=BUG; false, with a message, for an unknown bug.
bool parse_plant(const std::string& bug) {
  if (bug == "zeros") {
    g_plant = Plant::zeros;
  } else if (bug == "last-tile") {
    g_plant = Plant::last_tile;
  } else if (bug == "first-percent") {
    g_plant = Plant::first_percent;
  } else if (bug == "middle-key") {
    g_plant = Plant::middle_key;
  } else {
    std::fprintf(stderr,
                 "mha_bench: --plant must be zeros, last-tile, first-percent or middle-key, "
                 "not '%s'\n",
                 bug.c_str());
    return false;
  }
  return true;
}

// Reads the command line into `options`; false, with a message, for a flag it rejects.
bool parse_options(int argc, char** argv, Options* options) {
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--size=", 0) == 0) {
      const std::string value = arg.substr(7);
      bool known = false;
      for (Size candidate : {Size::quick, Size::default_size, Size::full, Size::cliffs}) {
        if (value == size_name(candidate)) {
          options->size = candidate;
          known = true;
        }
      }
      if (!known) {
        std::fprintf(stderr, "mha_bench: --size must be quick, default, full or cliffs, not '%s'\n",
                     value.c_str());
        return false;
      }
      continue;
    }
    if (arg == "--probe_only") {
      options->probe_only = true;
      continue;
    }
    if (arg.rfind("--peers=", 0) == 0) {
      options->peers_command = arg.substr(8);
      continue;
    }
    if (arg.rfind("--plant=", 0) == 0) {
      if (!parse_plant(arg.substr(8))) return false;
      continue;
    }
    if (arg.rfind("--rounds=", 0) == 0) {
      options->rounds = std::atoi(arg.c_str() + 9);
      if (options->rounds < 1 || options->rounds > 100) {
        std::fprintf(stderr, "mha_bench: --rounds must be 1 to 100, not '%s'\n", arg.c_str() + 9);
        return false;
      }
      continue;
    }
    if (arg.rfind("--benchmark_out=", 0) == 0) options->json_out = true;
    if (arg == "--benchmark_out_format=console" || arg == "--benchmark_out_format=csv") {
      std::fprintf(stderr, "mha_bench: only --benchmark_out_format=json is supported\n");
      return false;
    }
    if (arg == "--benchmark_format=json") options->json_display = true;
    options->args.push_back(argv[i]);
  }
  return true;
}

// Hands the rest of the command line to Google Benchmark; false if it has flags nobody knows.
bool initialize_google_benchmark(Options* options) {
  std::vector<char*>& args = options->args;
  // A default minimum time per benchmark (Google Benchmark's own flag, so that names carry
  // no per-benchmark suffix); a --benchmark_min_time given by the user comes later and wins.
  bool user_min_time = false;
  for (char* arg : args) user_min_time |= std::strncmp(arg, "--benchmark_min_time=", 21) == 0;
  static char quick_min_time[] = "--benchmark_min_time=0.01";
  static char default_min_time[] = "--benchmark_min_time=0.3";
  if (!user_min_time) {
    args.insert(args.begin() + 1, options->size == Size::quick ? quick_min_time : default_min_time);
  }
  int n_args = static_cast<int>(args.size());
  benchmark::Initialize(&n_args, args.data());
  return !benchmark::ReportUnrecognizedArguments(n_args, args.data());
}

// The kernels and baselines into `impls`; false, with a message, if the registry refuses.
bool make_implementations(std::vector<Impl>* impls) {
  try {
    *impls = implementations();
  } catch (const std::exception& e) {  // e.g. a bad MHA_MAX_ISA
    std::fprintf(stderr, "mha_bench: %s\n", e.what());
    return false;
  }
  return true;
}

// Measures this machine's limits, once: the probe lives as long as the benchmarks that read it.
const Probe& probe_machine(const std::vector<Shape>& all_shapes, const Caches& caches,
                           const Options& options) {
  // Whether the L3 is faster than memory is only known once the probe has run: DRAM is
  // measured if any decode may read from it (probe.h: may_read_dram), which covers every
  // decode the probe's memory level then puts in DRAM.
  bool need_dram = false;
  for (const Shape& s : all_shapes) {
    need_dram |= s.decode() && may_read_dram(kv_bytes(workspace_problem(s)), caches);
  }
  std::fprintf(stderr, "mha_bench: probing the machine...\n");
  static const Probe probe =
      run_probe(caches, need_dram || options.size == Size::full || options.probe_only);
  return probe;
}

// One key of the JSON output's context.
void ctx(const std::string& key, const std::string& value) {
  benchmark::AddCustomContext(key, value);
}

// The build, the CPU and the probe's figures in the context, and the peaks on standard error.
void write_context(Size size, const Caches& caches, const Probe& probe) {
  ctx("mha_size", size_name(size));
  ctx("mha_commit", MHA_COMMIT);
  ctx("mha_compiler", MHA_COMPILER);
  ctx("mha_flags", MHA_FLAGS);
  ctx("mha_cpu_model", cpu_model());
  ctx("mha_cpu_id", cpu_identity());
  ctx("mha_best_kernel", mha::best_kernel().name);
  ctx("mha_best_isa", mha::isa_name(mha::best_kernel().isa));
  ctx("mha_cores", std::to_string(probe.cores));
#if MHA_HAVE_OPENBLAS
  ctx("openblas_core", openblas_get_corename());
#endif
  // The widest FMA's peak under its own keys, then every measured ISA's (the widest too).
  const FmaPeak& widest = probe.fma.front();
  ctx("probe_fma_isa", widest.isa);
  ctx("probe_fma_gflops_1t", fixed(widest.gflops[0]));
  ctx("probe_fma_gflops_all", fixed(widest.gflops[1]));
  for (const FmaPeak& peak : probe.fma) {
    ctx("probe_fma_" + peak.isa + "_gflops_1t", fixed(peak.gflops[0]));
    ctx("probe_fma_" + peak.isa + "_gflops_all", fixed(peak.gflops[1]));
  }
  ctx("probe_l1_gbps_1t", fixed(probe.l1_gbps[0]));
  ctx("probe_l2_gbps_1t", fixed(probe.l2_gbps[0]));
  if (probe.l3_gbps[0] > 0) ctx("probe_l3_gbps_1t", fixed(probe.l3_gbps[0]));
  if (probe.dram_gbps[0] > 0) ctx("probe_dram_gbps_1t", fixed(probe.dram_gbps[0]));
  ctx("probe_l1_gbps_all", fixed(probe.l1_gbps[1]));
  ctx("probe_l2_gbps_all", fixed(probe.l2_gbps[1]));
  if (probe.l3_gbps[1] > 0) ctx("probe_l3_gbps_all", fixed(probe.l3_gbps[1]));
  if (probe.dram_gbps[1] > 0) ctx("probe_dram_gbps_all", fixed(probe.dram_gbps[1]));
  ctx("cache_l1d_bytes", std::to_string(caches.l1d));
  ctx("cache_l2_bytes", std::to_string(caches.l2));
  ctx("cache_l3_bytes", std::to_string(caches.l3));
  ctx("memory_level_bytes", std::to_string(probe.memory_level()));
  std::string peaks;  // "216.0 / 431.2 avx512, 108.1 / 216.0 avx2"
  for (const FmaPeak& peak : probe.fma) {
    peaks += (peaks.empty() ? "" : ", ") + fixed(peak.gflops[0]) + " / " + fixed(peak.gflops[1]) +
             " " + peak.isa;
  }
  std::fprintf(stderr,
               "mha_bench: FMA peak GFLOP/s (1 core / %d cores) %s; read GB/s L1 %.0f, L2 %.0f, "
               "L3 %.0f, DRAM %.1f (1 core; 0 = not measured)\n",
               probe.cores, peaks.c_str(), probe.l1_gbps[0], probe.l2_gbps[0], probe.l3_gbps[0],
               probe.dram_gbps[0]);
}

// --probe_only: the probe's figures on standard output.
void print_probe(const Probe& probe, const Caches& caches) {
  for (const FmaPeak& peak : probe.fma) {
    std::printf("probe: FMA peak %.1f / %.1f GFLOP/s (1 core / %d cores, %s)\n", peak.gflops[0],
                peak.gflops[1], probe.cores, peak.isa.c_str());
  }
  const char* level[] = {"L1", "L2", "L3", "DRAM"};
  const double* gbps[] = {probe.l1_gbps, probe.l2_gbps, probe.l3_gbps, probe.dram_gbps};
  for (int i = 0; i < 4; ++i) {
    std::printf("probe: %-4s read %.1f / %.1f GB/s\n", level[i], gbps[i][0], gbps[i][1]);
  }
  std::printf("probe: caches L1d %lld, L2 %lld, L3 %lld bytes; faster than memory up to %lld\n",
              static_cast<long long>(caches.l1d), static_cast<long long>(caches.l2),
              static_cast<long long>(caches.l3), static_cast<long long>(probe.memory_level()));
}

// The peers: started once, before any benchmark, so their versions go in the context. Null
// without --peers.
std::unique_ptr<PeerServer> start_peers(const std::string& command, const Probe& probe) {
  std::unique_ptr<PeerServer> server;
  if (command.empty()) return server;
  server = std::make_unique<PeerServer>(command);
  if (!server->error().empty()) {
    std::fprintf(stderr, "mha_bench: peers skipped: %s\n", server->error().c_str());
  }
  for (const std::string& why : server->skipped()) {
    std::fprintf(stderr, "mha_bench: peer skipped: %s\n", why.c_str());
    ctx("peer_skipped_" + why.substr(0, why.find(':')), why.substr(why.find(':') + 2));
  }
  for (const PeerInfo& peer : server->peers()) {
    ctx(peer.name + "_version", peer.version);
    if (!peer.how.empty()) ctx(peer.name + "_how", peer.how);
    const double seconds = peer_overhead(*server, peer.name, probe);
    if (seconds > 0) ctx(peer.name + "_overhead_us", fixed(seconds * 1e6, 1));
  }
  return server;
}

// Registers the attention shapes' kernels, baselines and peers (`server` null: no peers).
// Shape by shape, so that kernels and peers of one shape are measured next to each other;
// with --rounds=N each shape's implementations run N times in turn (the same name N times
// in the output), so every ratio can come from neighbouring measurements.
void register_shapes(const std::vector<Shape>& all_shapes, const std::vector<Impl>& impls,
                     PeerServer* server, const Options& options, const Probe& probe) {
  std::vector<Shape> unique_shapes;
  std::set<std::string> shapes_seen;
  for (const Shape& s : all_shapes) {
    if (shapes_seen.insert(s.name("")).second) unique_shapes.push_back(s);
  }
  const int shape_count = static_cast<int>(unique_shapes.size());
  for (int index = 1; index <= shape_count; ++index) {
    const Shape& s = unique_shapes[static_cast<std::size_t>(index - 1)];
    // "decode/B:1/H:32/..." without the implementation's slot
    const std::string shape = s.family + s.name("").substr(s.family.size() + 1);
    std::vector<std::string> peers;
    if (server != nullptr && !s.kernels_only) {
      const mha::Problem p = workspace_problem(s);
      for (const PeerInfo& peer : server->peers()) {
        std::string why;
        if (server->supports(peer.name, p, &why)) peers.push_back(peer.name);
      }
    }
    for (int r = 0; r < options.rounds; ++r) {
      for (const Impl& impl : impls) {
        // An untiled kernel streams its head's K and V once per query row: beyond 2048 rows
        // a run would take minutes.
        if (!impl.tiled && s.q_len > 2048) continue;
        // Nor the scalar tiled one (blocked), whose causal prefill of 8192 rows takes half a
        // minute a call on one core.
        if (impl.isa == "scalar" && s.q_len > 2048) continue;
        if ((impl.kv_types & kv_bit(s.kv)) == 0) continue;  // a KV type it does not read
        // (The untiled kernels' prefill is the same loop over every type: fp32 shows it.)
        if (!impl.tiled && s.kv != KvType::f32 && !s.decode()) continue;
        if (impl.portable && options.size == Size::default_size && !headline(s)) continue;
        const bool variant = s.family == "ragged" || s.sinks || s.window > 0 || s.softcap > 0.0f ||
                             s.alibi || s.kernels_only;
        if (variant && !impl.variants) continue;
        benchmark::RegisterBenchmark(
            s.name(impl.name).c_str(),
            [impl, s, shape, index, shape_count, &probe](benchmark::State& st) {
              progress(shape, index, shape_count);
              run_benchmark(st, impl, s, probe);
            })
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
      }
      for (const std::string& peer : peers) {
        benchmark::RegisterBenchmark(s.name(peer).c_str(),
                                     [server, peer, s, &probe](benchmark::State& st) {
                                       run_peer_benchmark(st, *server, peer, s, probe);
                                     })
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
      }
    }
  }
}

// Registers the cliff sweep, after the attention shapes: its rounds each cover the whole
// grid, a problem at a time (under every configuration and kernel, so that its tensors and
// its reference are made once a round).
void register_cliff_sweep(const std::vector<Impl>& impls, Size size, const Probe& probe) {
  const std::vector<CacheConfig> configs = cliff_configs(size);
  const std::vector<Shape> cliff_problems = cliff_shapes(size);
  const int cliff_rounds = size == Size::quick ? 1 : 3;
  const int cliff_steps = cliff_rounds * static_cast<int>(cliff_problems.size());
  int cliff_step = 0;
  for (int r = 1; r <= cliff_rounds; ++r) {
    for (const Shape& problem : cliff_problems) {
      ++cliff_step;
      const std::string what = "cliffs, round " + std::to_string(r) + " of " +
                               std::to_string(cliff_rounds) + ": " +
                               problem.name("*").substr(std::strlen("cliffs/*/"));
      for (const CacheConfig& config : configs) {
        Shape s = problem;
        s.caches = config.name;
        for (const Impl& impl : impls) {
          if (!impl.tiled || impl.isa.empty()) continue;  // registry kernels that tile
          benchmark::RegisterBenchmark(
              s.name(impl.name).c_str(),
              [impl, s, what, config, cliff_step, cliff_steps, &probe](benchmark::State& st) {
                progress(what, cliff_step, cliff_steps);
                run_cliff_benchmark(st, impl, s, config.caches, probe);
              })
              ->UseRealTime()
              ->Iterations(cliff_iterations(s, impl, probe, size == Size::quick ? 0.001 : 0.005))
              ->Unit(benchmark::kMillisecond);
        }
      }
    }
  }
  const mha::support::Caches own = mha::support::caches();
  ctx("cliffs_native_caches", std::to_string(own.l1d >> 10) + "K," + std::to_string(own.l2 >> 10) +
                                  "K," + std::to_string(own.l3 >> 10) + "K");
}

// Registers the gemm/ and layer/ benchmarks (layer_bench.h), except in the cliff sweep alone.
void register_layers(const Options& options, const Probe& probe, PeerServer* server) {
  LayerBenchOptions layer_options;
  layer_options.quick = options.size == Size::quick;
  layer_options.full = options.size == Size::full;
  layer_options.cores = probe.cores;
  layer_options.rounds = options.rounds;
  layer_options.probe = &probe;
  layer_options.server = server;
  if (options.size != Size::cliffs) {
    register_gemm_benchmarks(layer_options);
    register_layer_benchmarks(layer_options);
  }
}

// The exit status once the benchmarks ran: 1 when the probe is wrong, when a --plant run let a
// planted answer through (or caught none), or when a benchmark reported an error; else 0.
int exit_status() {
  if (g_probe_wrong) {
    std::fprintf(stderr, "mha_bench: a peak_frac or bw_frac exceeded %s: the probe is wrong\n",
                 slack_text().c_str());
    return 1;
  }
  if (g_plant != Plant::none) {
    for (const std::string& name : g_plant_escapes) {
      std::fprintf(stderr, "mha_bench: --plant: not rejected by the check: %s\n", name.c_str());
    }
    if (!g_plant_escapes.empty() || g_planted_caught == 0) return 1;
    std::fprintf(stderr, "mha_bench: --plant: the check rejected the planted answer %d times\n",
                 g_planted_caught);
    return 0;
  }
  if (g_errors) {
    std::fprintf(stderr, "mha_bench: some benchmarks reported errors\n");
    return 1;
  }
  return 0;
}

// Runs every registered benchmark through the checking reporters; returns the exit status.
int run(const Options& options) {
  Checked<benchmark::ConsoleReporter> console;
  Checked<benchmark::JSONReporter> json_console;
  Checked<benchmark::JSONReporter> json_file;
  benchmark::BenchmarkReporter* display =
      options.json_display ? static_cast<benchmark::BenchmarkReporter*>(&json_console) : &console;
  benchmark::RunSpecifiedBenchmarks(display, options.json_out ? &json_file : nullptr);
  benchmark::Shutdown();
  return exit_status();
}

}  // namespace
}  // namespace mha::bench

int main(int argc, char** argv) {
  using namespace mha::bench;
#if MHA_HAVE_OPENBLAS
  use_best_openblas_core(argv);
#endif
  Options options;
  if (!parse_options(argc, argv, &options)) return 2;
  if (!initialize_google_benchmark(&options)) return 2;
  std::vector<Impl> impls;
  if (!make_implementations(&impls)) return 2;
  const std::vector<Shape> all_shapes =
      shapes(options.size, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  const Caches caches = detect_caches();
  const Probe& probe = probe_machine(all_shapes, caches, options);
  write_context(options.size, caches, probe);
  if (options.probe_only) {
    print_probe(probe, caches);
    return 0;
  }
  const std::unique_ptr<PeerServer> server = start_peers(options.peers_command, probe);
  register_shapes(all_shapes, impls, server.get(), options, probe);
  register_cliff_sweep(impls, options.size, probe);
  register_layers(options, probe, server.get());
  return run(options);
}
