#include "peers.h"

#include <sys/mman.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <sstream>
#include <utility>

namespace mha::bench {

namespace {

struct Mapping {
  int fd;
  std::size_t bytes;
};

// Never destroyed: static tensors (the benchmarks' Workspace) are freed at exit, after
// every ordinary static is gone.
std::mutex& mappings_mutex() {
  static auto* m = new std::mutex;
  return *m;
}
std::map<const void*, Mapping>& mappings() {
  static auto* m = new std::map<const void*, Mapping>;
  return *m;
}

std::string problem_fields(const Problem& p) {
  std::ostringstream os;
  os.precision(17);
  const auto strides = [&os](const char* name, const Strides& s) {
    os << " " << name << "_strides=" << s.batch << "," << s.seq << "," << s.head;
  };
  os << "batch=" << p.batch << " q_len=" << p.q_len << " kv_len=" << p.kv_len
     << " q_heads=" << p.q_heads << " kv_heads=" << p.kv_heads << " head_dim=" << p.head_dim
     << " causal=" << (p.causal ? 1 : 0) << " scale=" << p.scale;
  strides("q", p.q);
  strides("k", p.k);
  strides("v", p.v);
  strides("o", p.o);
  if (p.sinks != nullptr) {  // attention sinks: one logit per query head
    os << " sinks=";
    for (std::int64_t h = 0; h < p.q_heads; ++h) os << (h > 0 ? "," : "") << p.sinks[h];
  }
  if (p.window > 0) os << " window=" << p.window;      // a sliding window of that many keys
  if (soft_capped(p)) os << " softcap=" << p.softcap;  // logits capped at c tanh(s / c)
  if (p.alibi != nullptr) {                            // ALiBi: one slope per query head
    os << " alibi=";
    for (std::int64_t h = 0; h < p.q_heads; ++h) os << (h > 0 ? "," : "") << p.alibi[h];
    if (p.alibi_offset != 0) os << " alibi_offset=" << p.alibi_offset;
  }
  if (p.kv_lens != nullptr) {  // a ragged batch: each sequence's keys
    os << " kv_lens=";
    for (std::int64_t b = 0; b < p.batch; ++b) os << (b > 0 ? "," : "") << p.kv_lens[b];
  }
  if (p.kv_type != KvType::f32) {
    os << " kv_type=" << kv_type_name(p.kv_type);
    if (p.kv_type == KvType::i8) {
      strides("k_scale", p.k_scale);
      strides("v_scale", p.v_scale);
    }
  }
  return os.str();
}

std::string paths(const std::vector<const void*>& tensors) {
  std::string out;
  for (const void* t : tensors) out += (out.empty() ? "" : ",") + shared_path(t);
  return out;
}

std::string paths(const std::vector<const float*>& tensors) {
  return paths(std::vector<const void*>(tensors.begin(), tensors.end()));
}

// The paths of the views' elements, or (scales) of their i8 scales.
std::string paths(const std::vector<KvView>& views, bool scales) {
  std::vector<const void*> out;
  for (const KvView& x : views) out.push_back(scales ? static_cast<const void*>(x.scale) : x.data);
  return paths(out);
}

std::string gemm_fields(const GemmShape& s) {
  std::ostringstream os;
  os << "m=" << s.m << " n=" << s.n << " k=" << s.k;
  return os.str();
}

std::string layer_fields(const LayerShape& s) {
  std::ostringstream os;
  os << "batch=" << s.batch << " d=" << s.d << " heads=" << s.heads << " kv_heads=" << s.kv_heads
     << " head_dim=" << s.head_dim << " n=" << s.n << " past=" << s.past
     << " causal=" << (s.causal ? 1 : 0) << " bias=" << (s.bias ? 1 : 0);
  return os.str();
}

// Appends " <name>=<path>" for memory from shared_allocate; otherwise says why in `why` and
// returns false (the server could not map it).
bool add_path(std::ostringstream& os, const char* name, const void* p, std::string* why) {
  const std::string path = shared_path(p);
  if (path.empty()) {
    *why = std::string(name) + " is not memory from shared_allocate";
    return false;
  }
  os << " " << name << "=" << path;
  return true;
}

// "ok 0.0123" -> 0.0123; anything else -> -1 with `why` the reply after its first word.
double seconds_from(const std::string& reply, std::string* why) {
  if (reply.rfind("ok ", 0) == 0) return std::strtod(reply.c_str() + 3, nullptr);
  const std::size_t space = reply.find(' ');
  *why = reply.empty() ? "the peer server exited"
                       : (space == std::string::npos ? reply : reply.substr(space + 1));
  return -1.0;
}

}  // namespace

PeerBound peer_bound(KvType t) {
  if (t == KvType::i8) return {kPeerExpUlp, 0.0, 1.125};
  if (t != KvType::f16 && t != KvType::bf16) return {};
  const double u = t == KvType::f16 ? 0x1p-11 : 0x1p-8;
  return {kPeerExpUlp, 2.0 * u / (1.0 - u) + u};
}

void* shared_allocate(std::size_t bytes) {
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  const std::size_t size = (bytes + page - 1) / page * page + (bytes == 0 ? page : 0);
  const int fd = memfd_create("mha-tensor", MFD_CLOEXEC);
  if (fd < 0) throw std::bad_alloc();
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    close(fd);
    throw std::bad_alloc();
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    close(fd);
    throw std::bad_alloc();
  }
  std::lock_guard<std::mutex> lock(mappings_mutex());
  mappings()[p] = {fd, size};
  return p;
}

void shared_free(void* p) {
  if (p == nullptr) return;
  std::lock_guard<std::mutex> lock(mappings_mutex());
  const auto it = mappings().find(p);
  if (it == mappings().end()) return;
  munmap(p, it->second.bytes);
  close(it->second.fd);
  mappings().erase(it);
}

std::string shared_path(const void* p) {
  std::lock_guard<std::mutex> lock(mappings_mutex());
  const auto it = mappings().find(p);
  if (it == mappings().end()) return std::string();
  return "/proc/" + std::to_string(getpid()) + "/fd/" + std::to_string(it->second.fd);
}

PeerServer::PeerServer(const std::string& command) {
  int in[2], out[2];  // in: we write, the child reads; out: the child writes, we read
  if (pipe(in) != 0 || pipe(out) != 0) {
    error_ = std::string("pipe: ") + std::strerror(errno);
    return;
  }
  std::fflush(nullptr);
  pid_ = fork();
  if (pid_ < 0) {
    error_ = std::string("fork: ") + std::strerror(errno);
    return;
  }
  if (pid_ == 0) {
    dup2(in[0], STDIN_FILENO);
    dup2(out[1], STDOUT_FILENO);
    close(in[0]);
    close(in[1]);
    close(out[0]);
    close(out[1]);
    execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  to_ = fdopen(in[1], "w");
  from_ = fdopen(out[0], "r");
  // A server that dies must not kill us with SIGPIPE on the next request.
  std::signal(SIGPIPE, SIG_IGN);
  for (;;) {
    const std::string line = request("");
    if (line.empty()) {
      error_ = "the peer server exited before it was ready (command: " + command + ")";
      peers_.clear();
      return;
    }
    std::istringstream is(line);
    std::string word, name;
    is >> word >> name;
    if (word == "ready") return;
    std::string rest;
    std::getline(is >> std::ws, rest);
    if (word == "peer") peers_.push_back({name, rest, ""});
    if (word == "how" && !peers_.empty() && peers_.back().name == name) peers_.back().how = rest;
    if (word == "skip") skipped_.push_back(name + ": " + rest);
  }
}

PeerServer::~PeerServer() {
  if (to_ != nullptr) std::fclose(to_);  // EOF on its input: the server exits
  if (from_ != nullptr) std::fclose(from_);
  if (pid_ > 0) waitpid(pid_, nullptr, 0);
}

std::string PeerServer::request(const std::string& line) {
  if (to_ == nullptr || from_ == nullptr) return std::string();
  if (!line.empty()) {
    if (std::fputs((line + "\n").c_str(), to_) < 0 || std::fflush(to_) != 0) return std::string();
  }
  std::string reply;
  for (int c; (c = std::fgetc(from_)) != EOF && c != '\n';) reply += static_cast<char>(c);
  return reply;
}

bool PeerServer::yes(const std::string& line, std::string* why) {
  const std::string reply = request(line);
  if (reply == "yes") return true;
  if (reply.rfind("no ", 0) == 0) {
    *why = reply.substr(3);
  } else {
    *why = reply.empty() ? "the peer server did not answer" : "the peer server said: " + reply;
  }
  return false;
}

bool PeerServer::supports(const std::string& peer, const Problem& p, std::string* why) {
  return yes("supports " + peer + " " + problem_fields(p), why);
}

double PeerServer::prepare(const std::string& peer, const Problem& p, int threads,
                           const std::vector<const float*>& q, const std::vector<KvView>& k,
                           const std::vector<KvView>& v, float* o, std::string* why) {
  std::ostringstream os;
  os << "prepare " << peer << " " << problem_fields(p) << " threads=" << threads
     << " q=" << paths(q) << " k=" << paths(k, false) << " v=" << paths(v, false);
  if (p.kv_type == KvType::i8) {
    os << " k_scale=" << paths(k, true) << " v_scale=" << paths(v, true);
  }
  os << " o=" << shared_path(o);
  return seconds_from(request(os.str()), why);
}

bool PeerServer::supports_gemm(const std::string& peer, const GemmShape& s, std::string* why) {
  return yes("supports_gemm " + peer + " " + gemm_fields(s), why);
}

double PeerServer::prepare_gemm(const std::string& peer, const GemmShape& s, int threads,
                                const float* a, const float* b, float* c, std::string* why,
                                std::int64_t cold) {
  std::ostringstream os;
  os << "prepare_gemm " << peer << " " << gemm_fields(s) << " threads=" << threads;
  if (cold > 0) os << " cold=" << cold;
  if (!add_path(os, "a", a, why) || !add_path(os, "b", b, why) || !add_path(os, "c", c, why)) {
    return -1.0;
  }
  return seconds_from(request(os.str()), why);
}

bool PeerServer::supports_layer(const std::string& peer, const LayerShape& s, std::string* why) {
  return yes("supports_layer " + peer + " " + layer_fields(s), why);
}

double PeerServer::prepare_layer(const std::string& peer, const LayerShape& s, int threads,
                                 const LayerTensors& t, std::string* why, std::int64_t cold) {
  std::ostringstream os;
  os << "prepare_layer " << peer << " " << layer_fields(s) << " threads=" << threads;
  if (cold > 0) os << " cold=" << cold;
  const std::pair<const char*, const void*> always[] = {{"x", t.x},   {"wq", t.wq}, {"wk", t.wk},
                                                        {"wv", t.wv}, {"wo", t.wo}, {"y", t.y}};
  const std::pair<const char*, const void*> biases[] = {
      {"bq", t.bq}, {"bk", t.bk}, {"bv", t.bv}, {"bo", t.bo}};
  const std::pair<const char*, const void*> caches[] = {{"k_cache", t.k_cache},
                                                        {"v_cache", t.v_cache}};
  for (const auto& [name, p] : always) {
    if (!add_path(os, name, p, why)) return -1.0;
  }
  for (const auto& [name, p] : biases) {
    if (s.bias && !add_path(os, name, p, why)) return -1.0;
  }
  for (const auto& [name, p] : caches) {  // optional without past tokens
    if ((s.past > 0 || p != nullptr) && !add_path(os, name, p, why)) return -1.0;
  }
  return seconds_from(request(os.str()), why);
}

double PeerServer::run(long long n, std::string* why) {
  return seconds_from(request("run " + std::to_string(n)), why);
}

void PeerServer::release() { request("release"); }

}  // namespace mha::bench
