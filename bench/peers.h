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
//            prepare <name> <problem> threads=<n> q=<paths> k=<paths> v=<paths> o=<path>
//                                       ->  ok <seconds of one call> | error <why>
//            run <n>                    ->  ok <seconds of n calls> | error <why>
//            release                    ->  ok
//   <problem>: batch= q_len= kv_len= q_heads= kv_heads= head_dim= causal= scale= and each
//   tensor's element strides, q_strides=<batch>,<seq>,<head> (and k_, v_, o_strides).
//   <paths>: comma-separated files, one per copy of the tensor (decode rotates over copies).
//
// The tensors are never copied: every Workspace tensor lives in a memfd mapping (see
// SharedAllocator) that the server maps through /proc/<pid>/fd. `prepare` builds the peer's
// session for the problem and calls it once on copy 0, writing o, which mha_bench checks
// against the reference like any kernel's output; `run` times n calls in the server (with
// time.perf_counter, copies rotating), so the pipe's latency is not in the figure.
#pragma once

#include <mha/attention.h>

#include <cstddef>
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
  std::string name;     ///< peer-torch-sdpa, peer-ort-attention, peer-ort-gqa, peer-openvino-sdpa
  std::string version;  ///< e.g. torch-2.15.0
};

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

  /// Whether `peer` computes this problem; otherwise `why` says why not.
  bool supports(const std::string& peer, const Problem& p, std::string* why);
  /// Builds the peer's session for the problem, calls it once on copy 0 (writing o) and
  /// returns the seconds that call took, or a negative number with `why` set.
  double prepare(const std::string& peer, const Problem& p, int threads,
                 const std::vector<const float*>& q, const std::vector<const float*>& k,
                 const std::vector<const float*>& v, float* o, std::string* why);
  /// Seconds for n calls timed in the server, or a negative number with `why` set.
  double run(long long n, std::string* why);
  void release();

 private:
  std::string request(const std::string& line);  // one line out, one line back ("" if dead)

  int pid_ = -1;
  std::FILE* to_ = nullptr;    // the server's standard input
  std::FILE* from_ = nullptr;  // its standard output
  std::vector<PeerInfo> peers_;
  std::vector<std::string> skipped_;
  std::string error_;
};

}  // namespace mha::bench
