// The io_uring engine of the aio op: one worker thread keeping up to queue_depth blocks in flight on
// its own ring, across slices and requests; see ds_aio.cpp for the design.
#pragma once

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "ds_aio_handle.h"
#include "ds_aio_request.h"
#include "ds_aio_uring.h"

namespace ds_aio {

// One io_uring worker: keeps up to queue_depth blocks in flight on its own ring.
class UringWorker {
 public:
  explicit UringWorker(Handle& handle)
      : handle_(handle), depth_(static_cast<unsigned>(handle.queue_depth())), ops_(depth_), bounces_(depth_) {
    for (unsigned i = depth_; i > 0; --i) free_.push_back(i - 1);
  }

  int open() { return ring_.open(depth_); }

  void run() {
    for (;;) {
      if (broken_) {
        if (!run_sync_after_break()) return;
        continue;
      }
      const bool may_issue = handle_.overlap_events() || inflight_ == 0;
      while (may_issue && inflight_ < depth_) {
        if (cur_ == nullptr) {
          cur_ = handle_.pop(/*block=*/inflight_ == 0);
          if (cur_ == nullptr) {
            if (inflight_ == 0) return;  // stopped, nothing left
            break;
          }
        }
        if (!issue_next()) {
          close_cursor();
        } else if (handle_.single_submit()) {
          submit(/*wait=*/false);
          if (broken_) break;
        }
      }
      if (broken_ || inflight_ == 0) continue;
      submit(/*wait=*/true);
      ring_.reap([&](uint64_t index, int32_t res) { complete(static_cast<unsigned>(index), res); });
    }
  }

 private:
  struct Op {
    Request* req;
    Slice* slice;
    char* mem;     // the caller's memory for this block
    char* io;      // what the kernel reads/writes: `mem`, or a bounce buffer
    int64_t len;
    int64_t offset;
    bool direct;
    bool bounce;
  };

  // Queues the next block of the current slice (running a short tail synchronously on the way);
  // false when the slice has nothing more to issue.
  bool issue_next() {
    Slice& s = *cur_;
    Request& r = *s.req;
    while (s.pos < s.end && !r.failed()) {
      const int64_t len = std::min(s.unit, s.end - s.pos);
      char* mem = r.buffer + s.pos;
      const int64_t offset = r.file_offset + s.pos;
      s.pos += len;
      const int64_t body = r.direct() ? len - len % kAlign : len;
      if (len > body) io_full(r, mem + body, len - body, offset + body);
      if (body == 0) continue;
      const unsigned index = free_.back();
      free_.pop_back();
      Op& op = ops_[index];
      op = Op{&r, cur_, mem, mem, body, offset, r.direct() && offset % kAlign == 0, false};
      if (op.direct && !is_aligned(mem)) {
        char* scratch = bounces_[index].get(body);
        if (scratch != nullptr) {
          op.io = scratch;
          op.bounce = true;
          if (r.write) std::memcpy(scratch, mem, static_cast<size_t>(body));
        } else {
          op.direct = false;  // no bounce memory: this block goes buffered
        }
      }
      ring_.queue_rw(r.write, op.direct ? r.fd_direct : r.fd_plain, op.io, static_cast<unsigned>(body),
                     static_cast<uint64_t>(offset), index);
      ++s.outstanding;
      ++inflight_;
      return true;
    }
    return false;
  }

  void close_cursor() {
    Slice* slice = cur_;
    cur_ = nullptr;
    slice->issued_all = true;
    if (slice->outstanding == 0) handle_.finish_slice(slice);
  }

  void submit(bool wait) {
    for (;;) {
      const int err = ring_.enter(wait);
      if (err == 0) return;
      if (err != EAGAIN && err != EBUSY) {
        break_ring();
        return;
      }
      // The kernel is short of resources: make room by reaping, then try again.
      if (ring_.reap([&](uint64_t index, int32_t res) { complete(static_cast<unsigned>(index), res); }) == 0) {
        sched_yield();
      }
      wait = false;
      if (ring_.unsubmitted() == 0) return;
    }
  }

  void complete(unsigned index, int32_t res) {
    Op& op = ops_[index];
    Request& r = *op.req;
    if (res < 0) {
      r.fail(-res, kStageIo);
    } else {
      const int64_t moved = res;
      r.account(moved, op.direct);
      if (op.bounce && !r.write) std::memcpy(op.mem, op.io, static_cast<size_t>(moved));
      // A short transfer: finish it synchronously; the end of the file or the error shows there.
      if (moved < op.len && !r.failed()) io_full(r, op.mem + moved, op.len - moved, op.offset + moved);
    }
    release(index);
  }

  void release(unsigned index) {
    Slice* slice = ops_[index].slice;
    free_.push_back(index);
    --inflight_;
    if (--slice->outstanding == 0 && slice->issued_all) handle_.finish_slice(slice);
  }

  // io_uring_enter failed in a way retrying cannot fix: run what the kernel did not take
  // synchronously, wait for what it did take by polling the completion ring, then carry on with psync.
  void break_ring() {
    broken_ = true;
    ring_.take_unsubmitted([&](uint64_t user_data) {
      const unsigned index = static_cast<unsigned>(user_data);
      Op& op = ops_[index];
      const int64_t moved = io_full(*op.req, op.io, op.len, op.offset);
      if (op.bounce && !op.req->write) std::memcpy(op.mem, op.io, static_cast<size_t>(moved));
      release(index);
    });
    while (inflight_ > 0) {
      if (ring_.reap([&](uint64_t index, int32_t res) { complete(static_cast<unsigned>(index), res); }) == 0) {
        usleep(50);
      }
    }
  }

  bool run_sync_after_break() {
    Slice* slice = cur_ != nullptr ? cur_ : handle_.pop(/*block=*/true);
    cur_ = nullptr;
    if (slice == nullptr) return false;
    handle_.run_slice_sync(slice, sync_bounce_);
    return true;
  }

  Handle& handle_;
  const unsigned depth_;
  Ring ring_;
  std::vector<Op> ops_;
  std::vector<AlignedBuffer> bounces_;
  std::vector<unsigned> free_;
  AlignedBuffer sync_bounce_;
  Slice* cur_ = nullptr;
  unsigned inflight_ = 0;
  bool broken_ = false;
};

}  // namespace ds_aio
