// A minimal io_uring ring driven by raw syscalls, for the aio op.
//
// [Note: why raw syscalls] liburing is a thin convenience layer over three syscalls and three mmap'ed
// regions; hosts without liburing-dev (and without network to install it) still have the kernel
// interface and its header <linux/io_uring.h> (linux-libc-dev). This ring uses only what the op needs:
// IORING_OP_READ / IORING_OP_WRITE (kernel 5.6+), submission with an optional wait for completions,
// and reaping. One ring belongs to one worker thread; nothing here is thread-safe.
#pragma once

#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>

#ifndef __NR_io_uring_setup
#define __NR_io_uring_setup 425  // the same number on every architecture (unified syscall table)
#endif
#ifndef __NR_io_uring_enter
#define __NR_io_uring_enter 426
#endif

namespace ds_aio {

class Ring {
 public:
  Ring() = default;
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;
  ~Ring() { close(); }

  // Sets the ring up with room for `entries` submissions. Returns 0, or the errno of the failure
  // (ENOSYS: kernel without io_uring; EPERM: io_uring_disabled or a seccomp filter; ENOMEM: memlock).
  int open(unsigned entries) {
    io_uring_params params;
    std::memset(&params, 0, sizeof(params));
    const long fd = syscall(__NR_io_uring_setup, entries, &params);
    if (fd < 0) return errno;
    fd_ = static_cast<int>(fd);
    sq_bytes_ = params.sq_off.array + params.sq_entries * sizeof(unsigned);
    cq_bytes_ = params.cq_off.cqes + params.cq_entries * sizeof(io_uring_cqe);
    const bool single_mmap = (params.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single_mmap) sq_bytes_ = cq_bytes_ = std::max(sq_bytes_, cq_bytes_);
    sq_ring_ = map(sq_bytes_, IORING_OFF_SQ_RING);
    cq_ring_ = single_mmap ? sq_ring_ : map(cq_bytes_, IORING_OFF_CQ_RING);
    sqes_bytes_ = params.sq_entries * sizeof(io_uring_sqe);
    sqes_ = static_cast<io_uring_sqe*>(map(sqes_bytes_, IORING_OFF_SQES));
    if (sq_ring_ == nullptr || cq_ring_ == nullptr || sqes_ == nullptr) {
      const int err = errno;
      close();
      return err;
    }
    char* sq = static_cast<char*>(sq_ring_);
    sq_head_ = reinterpret_cast<unsigned*>(sq + params.sq_off.head);
    sq_tail_ = reinterpret_cast<unsigned*>(sq + params.sq_off.tail);
    sq_mask_ = *reinterpret_cast<unsigned*>(sq + params.sq_off.ring_mask);
    sq_array_ = reinterpret_cast<unsigned*>(sq + params.sq_off.array);
    sq_entries_ = params.sq_entries;
    char* cq = static_cast<char*>(cq_ring_);
    cq_head_ = reinterpret_cast<unsigned*>(cq + params.cq_off.head);
    cq_tail_ = reinterpret_cast<unsigned*>(cq + params.cq_off.tail);
    cq_mask_ = *reinterpret_cast<unsigned*>(cq + params.cq_off.ring_mask);
    cqes_ = reinterpret_cast<io_uring_cqe*>(cq + params.cq_off.cqes);
    local_tail_ = *sq_tail_;
    unsubmitted_ = 0;
    return 0;
  }

  void close() {
    if (sqes_ != nullptr) munmap(sqes_, sqes_bytes_);
    if (cq_ring_ != nullptr && cq_ring_ != sq_ring_) munmap(cq_ring_, cq_bytes_);
    if (sq_ring_ != nullptr) munmap(sq_ring_, sq_bytes_);
    if (fd_ >= 0) ::close(fd_);
    sqes_ = nullptr;
    sq_ring_ = cq_ring_ = nullptr;
    fd_ = -1;
  }

  // Queues a read or write of `len` bytes at file offset `offset`; false when the queue is full.
  bool queue_rw(bool write, int fd, void* buffer, unsigned len, uint64_t offset, uint64_t user_data) {
    const unsigned head = __atomic_load_n(sq_head_, __ATOMIC_ACQUIRE);
    if (local_tail_ - head >= sq_entries_) return false;
    const unsigned index = local_tail_ & sq_mask_;
    io_uring_sqe* sqe = &sqes_[index];
    std::memset(sqe, 0, sizeof(*sqe));
    sqe->opcode = write ? IORING_OP_WRITE : IORING_OP_READ;
    sqe->fd = fd;
    sqe->addr = reinterpret_cast<uint64_t>(buffer);
    sqe->len = len;
    sqe->off = offset;
    sqe->user_data = user_data;
    sq_array_[index] = index;
    ++local_tail_;
    ++unsubmitted_;
    return true;
  }

  // Hands every queued submission to the kernel and, when `wait` is set, blocks until at least one
  // completion is ready. Returns 0; EAGAIN or EBUSY when the kernel could not take everything now
  // (reap completions, then call again); or the errno of another failure. EINTR is retried here.
  int enter(bool wait) {
    __atomic_store_n(sq_tail_, local_tail_, __ATOMIC_RELEASE);
    for (;;) {
      const unsigned min_complete = wait ? 1u : 0u;
      const long consumed = syscall(__NR_io_uring_enter, fd_, unsubmitted_, min_complete,
                                    wait ? IORING_ENTER_GETEVENTS : 0u, nullptr, 0);
      if (consumed < 0) {
        if (errno == EINTR) continue;
        return errno;
      }
      unsubmitted_ -= static_cast<unsigned>(consumed);
      if (unsubmitted_ == 0 || consumed == 0) return unsubmitted_ == 0 ? 0 : EAGAIN;
      wait = false;  // the kernel stopped early; push the rest without waiting again
    }
  }

  // Calls `on_completion(user_data, res)` for every completion ready now; returns how many.
  template <class F>
  unsigned reap(F&& on_completion) {
    unsigned head = *cq_head_;
    const unsigned tail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
    unsigned count = 0;
    while (head != tail) {
      const io_uring_cqe& cqe = cqes_[head & cq_mask_];
      const uint64_t user_data = cqe.user_data;
      const int32_t res = cqe.res;
      ++head;
      ++count;
      __atomic_store_n(cq_head_, head, __ATOMIC_RELEASE);  // the slot is ours to reuse from here on
      on_completion(user_data, res);
    }
    return count;
  }

  // Takes back submissions the kernel has not consumed (after enter() failed); calls
  // `on_taken(user_data)` for each so the caller can run them another way.
  template <class F>
  void take_unsubmitted(F&& on_taken) {
    for (unsigned t = local_tail_ - unsubmitted_; t != local_tail_; ++t) on_taken(sqes_[t & sq_mask_].user_data);
    local_tail_ -= unsubmitted_;
    unsubmitted_ = 0;
    __atomic_store_n(sq_tail_, local_tail_, __ATOMIC_RELEASE);
  }

  unsigned unsubmitted() const { return unsubmitted_; }

 private:
  void* map(size_t bytes, off_t what) {
    void* ptr = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, what);
    return ptr == MAP_FAILED ? nullptr : ptr;
  }

  int fd_ = -1;
  void* sq_ring_ = nullptr;
  void* cq_ring_ = nullptr;
  io_uring_sqe* sqes_ = nullptr;
  size_t sq_bytes_ = 0, cq_bytes_ = 0, sqes_bytes_ = 0;
  unsigned *sq_head_ = nullptr, *sq_tail_ = nullptr, *sq_array_ = nullptr;
  unsigned *cq_head_ = nullptr, *cq_tail_ = nullptr;
  unsigned sq_mask_ = 0, cq_mask_ = 0, sq_entries_ = 0;
  unsigned local_tail_ = 0, unsubmitted_ = 0;
  io_uring_cqe* cqes_ = nullptr;
};

}  // namespace ds_aio
