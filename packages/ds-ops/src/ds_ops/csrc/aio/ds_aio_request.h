// One read or write request of the aio op: its files, its outcome, and the blocking I/O loop that
// every engine falls back on for tails, short transfers and unaligned pieces.
//
// [Note: O_DIRECT] O_DIRECT needs the memory address, the file offset and the length to be multiples
// of the device's logical block size; we use kAlign = 4096, which covers 512-byte and 4 KiB devices.
// A direct request opens its file twice: `fd_direct` (O_DIRECT) for the aligned body and `fd_plain`
// (buffered) for what cannot go direct: a tail shorter than kAlign, a request at an unaligned file
// offset, and the rest of a short transfer. Body chunks whose memory is not aligned are copied
// through aligned bounce buffers, so callers may pass any tensor. The kernel keeps the page cache
// coherent with direct I/O on the same file, and the two kinds never touch the same bytes.
#pragma once

#include <fcntl.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>

namespace ds_aio {

constexpr int64_t kAlign = 4096;

// Where a request failed; mirrored by ds_ops.aio._requests.Stage.
enum Stage : int32_t {
  kStageNone = 0,
  kStageOpen = 1,            // open() failed (missing directory, not a directory, read-only fs, ...)
  kStageIo = 2,              // a read or write failed (EIO, ENOSPC, EFBIG, ...)
  kStageShortRead = 3,       // the file ended before the request's last byte
  kStageDirectRefused = 4,   // O_DIRECT was required and the file system refuses it
  kStageClose = 5,           // close() of a written file failed (deferred write errors)
};

// What the caller gets back, filled once when the request has settled. Mirrored by ctypes.
struct Result {
  int64_t bytes_done;    // bytes read or written
  int64_t direct_bytes;  // of which with O_DIRECT
  int32_t error;         // errno of the first failure (0: success)
  int32_t stage;         // a Stage
  int32_t direct_refused;  // O_DIRECT was asked for "where allowed" and the file system refused it
  int32_t reserved;
  int64_t start_ns;  // CLOCK_MONOTONIC when a worker first took up the request (0: never started)
  int64_t end_ns;    // CLOCK_MONOTONIC when it settled
  uint64_t checksum;  // with kWantChecksum: wrapping sum of the buffer's 8-byte words (+ trailing bytes)
};

// ds_aio_submit flags.
constexpr int32_t kWantChecksum = 1;

// The checksum's share of bytes [begin, end) of a `total`-byte buffer: each byte counts at its place in
// its little-endian 8-byte word (from the buffer's first byte), bytes past the last whole word count
// as themselves; all sums wrap at 2^64. Slices of one buffer add up to the whole buffer's value.
inline uint64_t checksum_part(const char* buf, int64_t begin, int64_t end, int64_t total) {
  const int64_t words_end = total / 8 * 8;
  uint64_t sum = 0;
  int64_t i = begin;
  for (; i < end && i < words_end && i % 8 != 0; ++i)
    sum += static_cast<uint64_t>(static_cast<unsigned char>(buf[i])) << (8 * (i % 8));
  for (; i + 8 <= end && i + 8 <= words_end; i += 8) {
    uint64_t word;
    std::memcpy(&word, buf + i, 8);
    sum += word;
  }
  for (; i < end; ++i) {
    const uint64_t byte = static_cast<unsigned char>(buf[i]);
    sum += i < words_end ? byte << (8 * (i % 8)) : byte;
  }
  return sum;
}

// CLOCK_MONOTONIC in nanoseconds: the clock Python's time.monotonic_ns() reads on Linux.
inline int64_t monotonic_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

inline bool is_aligned(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % kAlign == 0; }

struct Request {
  bool write = false;
  char* buffer = nullptr;
  int64_t nbytes = 0;
  int64_t file_offset = 0;
  int fd_plain = -1;
  int fd_direct = -1;  // -1: buffered request
  Result* out = nullptr;
  std::atomic<int64_t> bytes_done{0};
  std::atomic<int64_t> direct_bytes{0};
  std::atomic<int32_t> error{0};
  std::atomic<int32_t> stage{kStageNone};
  std::atomic<int32_t> slices_left{0};
  std::atomic<int64_t> start_ns{0};
  std::atomic<uint64_t> checksum{0};
  bool want_checksum = false;
  int32_t direct_refused = 0;

  // The first worker to take up a slice of this request stamps its start.
  void mark_started() {
    int64_t never = 0;
    if (start_ns.load(std::memory_order_relaxed) == 0) start_ns.compare_exchange_strong(never, monotonic_ns());
  }

  bool direct() const { return fd_direct >= 0; }
  bool failed() const { return error.load(std::memory_order_relaxed) != 0; }

  // Records the first failure; later ones (often consequences of the first) are dropped.
  void fail(int32_t err, int32_t where) {
    int32_t none = 0;
    if (error.compare_exchange_strong(none, err)) stage.store(where);
  }

  void account(int64_t bytes, bool with_direct) {
    bytes_done.fetch_add(bytes, std::memory_order_relaxed);
    if (with_direct) direct_bytes.fetch_add(bytes, std::memory_order_relaxed);
  }

  // Whether `len` bytes at `mem` and file offset `offset` can go through the O_DIRECT descriptor.
  bool can_go_direct(const char* mem, int64_t len, int64_t offset) const {
    return direct() && is_aligned(mem) && offset % kAlign == 0 && len % kAlign == 0;
  }
};

// Moves `len` bytes between `mem` and the file at `offset` with pread/pwrite until done, the file
// ends, or an error. Each call goes direct when the piece allows it, else buffered. Records the
// bytes and any failure on `r`; returns the bytes moved (less than `len` on failure).
inline int64_t io_full(Request& r, char* mem, int64_t len, int64_t offset) {
  int64_t done = 0;
  while (done < len) {
    char* ptr = mem + done;
    const int64_t want = len - done;
    const int64_t at = offset + done;
    const bool direct = r.can_go_direct(ptr, want, at);
    const int fd = direct ? r.fd_direct : r.fd_plain;
    const ssize_t moved = r.write ? pwrite(fd, ptr, static_cast<size_t>(want), at)
                                  : pread(fd, ptr, static_cast<size_t>(want), at);
    if (moved < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      r.account(done, false);
      r.fail(err, kStageIo);
      return done;
    }
    if (moved == 0) {  // end of file on a read; a write that moves nothing cannot make progress
      r.account(done, false);
      if (r.write) r.fail(EIO, kStageIo);
      else r.fail(ENODATA, kStageShortRead);
      return done;
    }
    if (direct) r.direct_bytes.fetch_add(moved, std::memory_order_relaxed);
    done += moved;
  }
  r.account(done, false);
  return done;
}

}  // namespace ds_aio
