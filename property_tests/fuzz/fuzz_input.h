// What the fuzz targets share: reading the input bytes, failing so that libFuzzer records the
// input, and calls that must either succeed or be rejected with std::invalid_argument.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>

namespace mha::fuzz {

/// Reads the input front to back. Past its end every read gives zeros, so every byte string
/// decodes to something, and a short input is a small problem.
class Bytes {
 public:
  Bytes(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  std::uint8_t u8() { return pos_ < size_ ? data_[pos_++] : 0; }
  std::uint32_t u32() {
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= std::uint32_t{u8()} << (8 * i);
    return v;
  }
  std::uint64_t u64() {
    std::uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= std::uint64_t{u8()} << (8 * i);
    return v;
  }
  /// The bytes not read yet.
  std::string rest() {
    std::string s(reinterpret_cast<const char*>(data_ + pos_), size_ - pos_);
    pos_ = size_;
    return s;
  }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

/// Reports a broken expectation and aborts: libFuzzer saves the input as a crash, and the
/// corpus replay fails.
[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "fuzz: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

inline void expect(bool ok, const std::string& what) {
  if (!ok) fail(what);
}

/// `f()` must throw std::invalid_argument whose message is `message` (any non-empty message
/// when `message` is empty). Any other exception, or none, fails.
template <typename F>
void expect_rejected(F&& f, const std::string& message, const std::string& what) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    const std::string got = e.what();
    if (got.empty()) fail(what + ": rejected with an empty message");
    if (!message.empty() && got != message) {
      fail(what + ": rejected with \"" + got + "\", expected \"" + message + "\"");
    }
    return;
  } catch (const std::exception& e) {
    fail(what + ": threw " + e.what() + " instead of std::invalid_argument");
  } catch (...) {
    fail(what + ": threw a non-std exception");
  }
  fail(what + ": accepted, expected the rejection \"" + message + "\"");
}

/// `f()` must not throw.
template <typename F>
void expect_accepted(F&& f, const std::string& what) {
  try {
    f();
  } catch (const std::exception& e) {
    fail(what + ": threw \"" + e.what() + "\" for a valid call");
  } catch (...) {
    fail(what + ": threw a non-std exception for a valid call");
  }
}

}  // namespace mha::fuzz
