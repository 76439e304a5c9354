// The aio op's handle: the queue of slices its workers take, request settlement, and the psync engine.
// See ds_aio.cpp for the overall design and ds_aio_request.h for O_DIRECT.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "ds_aio_request.h"

namespace ds_aio {

enum Engine : int32_t { kEngineAuto = 0, kEnginePsync = 1, kEngineIoUring = 2 };
enum DirectMode : int32_t { kDirectOff = 0, kDirectOn = 1, kDirectWhereAllowed = 2 };

// A contiguous run of whole blocks of one request, worked on by one worker.
struct Slice {
  Request* req;
  int64_t pos;   // next byte (relative to the request) to issue
  int64_t end;   // one past the slice's last byte
  int64_t unit;  // block size for this request
  int64_t begin = 0;  // the slice's first byte (pos advances)
  int32_t outstanding = 0;  // blocks in flight (io_uring)
  bool issued_all = false;
};

// An aligned scratch buffer, allocated on first use. A failed allocation returns null; callers then
// move the bytes buffered instead, which is slower but still correct.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { std::free(ptr_); }
  char* get(int64_t bytes) {
    if (bytes > size_) {
      std::free(ptr_);
      size_ = (bytes + kAlign - 1) / kAlign * kAlign;
      ptr_ = static_cast<char*>(std::aligned_alloc(kAlign, static_cast<size_t>(size_)));
      if (ptr_ == nullptr) size_ = 0;
    }
    return ptr_;
  }

 private:
  char* ptr_ = nullptr;
  int64_t size_ = 0;
};

class UringWorker;

// Reads or writes one block synchronously: aligned memory goes direct, unaligned memory through
// `bounce`, a tail shorter than kAlign buffered (see ds_aio_request.h).
inline void sync_block(Request& r, int64_t pos, int64_t len, AlignedBuffer& bounce) {
  char* mem = r.buffer + pos;
  const int64_t offset = r.file_offset + pos;
  const int64_t body = r.direct() ? len - len % kAlign : len;
  if (body > 0) {
    char* scratch = (r.direct() && !is_aligned(mem) && offset % kAlign == 0) ? bounce.get(body) : nullptr;
    if (scratch == nullptr) {
      if (io_full(r, mem, body, offset) < body) return;
    } else if (r.write) {
      std::memcpy(scratch, mem, static_cast<size_t>(body));
      if (io_full(r, scratch, body, offset) < body) return;
    } else {
      const int64_t moved = io_full(r, scratch, body, offset);
      std::memcpy(mem, scratch, static_cast<size_t>(moved));
      if (moved < body) return;
    }
  }
  if (len > body) io_full(r, mem + body, len - body, offset + body);
}

class Handle {
 public:
  Handle(int64_t block_size, int32_t queue_depth, bool single_submit, bool overlap_events, int32_t num_threads)
      : block_size_(block_size), queue_depth_(queue_depth), single_submit_(single_submit),
        overlap_events_(overlap_events), num_threads_(num_threads) {}

  ~Handle();

  // Starts the workers with `engine`; returns the engine used, or -errno when none could start.
  int32_t start(int32_t engine, int32_t* setup_error);

  void submit(Request* r, int32_t direct_mode, const char* path);

  int64_t wait() {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return completed_ == submitted_; });
    const int64_t count = completed_since_wait_;
    completed_since_wait_ = 0;
    return count;
  }

  // The next slice; with `block`, waits for one (null only once the handle stops).
  Slice* pop(bool block) {
    std::unique_lock<std::mutex> lock(mu_);
    if (block) work_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return nullptr;
    Slice* slice = queue_.front();
    queue_.pop_front();
    slice->req->mark_started();
    return slice;
  }

  void finish_slice(Slice* slice) {
    Request* r = slice->req;
    if (r->want_checksum && !r->failed())  // the bytes are in the buffer now (read) or on their way out (write)
      r->checksum.fetch_add(checksum_part(r->buffer, slice->begin, slice->end, r->nbytes), std::memory_order_relaxed);
    delete slice;
    if (r->slices_left.fetch_sub(1, std::memory_order_acq_rel) == 1) settle(r);
  }

  // The psync engine on one slice: every remaining block, one after another.
  void run_slice_sync(Slice* slice, AlignedBuffer& bounce) {
    Request& r = *slice->req;
    while (slice->pos < slice->end && !r.failed()) {
      const int64_t len = std::min(slice->unit, slice->end - slice->pos);
      sync_block(r, slice->pos, len, bounce);
      slice->pos += len;
    }
    finish_slice(slice);
  }

  int32_t queue_depth() const { return queue_depth_; }
  bool single_submit() const { return single_submit_; }
  bool overlap_events() const { return overlap_events_; }

 private:
  bool open_files(Request* r, int32_t direct_mode, const char* path);
  void settle(Request* r);

  const int64_t block_size_;
  const int32_t queue_depth_;
  const bool single_submit_;
  const bool overlap_events_;
  const int32_t num_threads_;

  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Slice*> queue_;
  bool stop_ = false;
  int64_t submitted_ = 0, completed_ = 0, completed_since_wait_ = 0;
  std::vector<std::thread> threads_;
  std::vector<std::unique_ptr<UringWorker>> uring_workers_;
};

}  // namespace ds_aio
