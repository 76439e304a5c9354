// The aio op: asynchronous reads and writes between host memory and files, for ZeRO-Infinity swapping.
//
// A handle owns `num_threads` workers. A request (one buffer <-> one byte range of one file) is
// opened on the caller's thread, cut into up to `num_threads` slices of whole blocks
// (`block_size`, rounded down to a multiple of 4 KiB for O_DIRECT), and the slices go to a shared
// queue. Each worker runs one of two engines:
//
// - io_uring (raw syscalls, see ds_aio_uring.h): the worker keeps up to `queue_depth` block reads or
//   writes in flight on its own ring, across slices and requests. `single_submit` enters the kernel
//   once per block instead of once per batch; `overlap_events` refills the queue as each block
//   completes instead of waiting for the whole batch (DeepSpeed's two libaio knobs, same meaning).
// - psync: blocking pread/pwrite, one block at a time per worker (the fallback where io_uring is
//   missing or forbidden; `queue_depth`, `single_submit` and `overlap_events` have no effect).
//
// A request settles when its last slice finishes; its outcome goes to the caller's Result, and
// ds_aio_wait() returns once every submitted request has settled. See ds_aio_request.h for O_DIRECT.
#include <sched.h>
#include <sys/stat.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "ds_aio_request.h"
#include "ds_aio_uring.h"
#include "ds_cpu_optim.h"  // DS_EXPORT, DS_DEFINE_OP_INFO

namespace ds_aio {
namespace {

enum Engine : int32_t { kEngineAuto = 0, kEnginePsync = 1, kEngineIoUring = 2 };
enum DirectMode : int32_t { kDirectOff = 0, kDirectOn = 1, kDirectWhereAllowed = 2 };

// A contiguous run of whole blocks of one request, worked on by one worker.
struct Slice {
  Request* req;
  int64_t pos;   // next byte (relative to the request) to issue
  int64_t end;   // one past the slice's last byte
  int64_t unit;  // block size for this request
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
void sync_block(Request& r, int64_t pos, int64_t len, AlignedBuffer& bounce) {
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
    return slice;
  }

  void finish_slice(Slice* slice) {
    Request* r = slice->req;
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

Handle::~Handle() {
  wait();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& thread : threads_) thread.join();
}

int32_t Handle::start(int32_t engine, int32_t* setup_error) {
  *setup_error = 0;
  if (engine != kEnginePsync) {
    for (int32_t i = 0; i < num_threads_; ++i) {
      auto worker = std::make_unique<UringWorker>(*this);
      const int err = worker->open();
      if (err != 0) {
        *setup_error = err;
        uring_workers_.clear();
        if (engine == kEngineIoUring) return -err;
        break;
      }
      uring_workers_.push_back(std::move(worker));
    }
  }
  const int32_t used = uring_workers_.empty() ? kEnginePsync : kEngineIoUring;
  try {
    for (int32_t i = 0; i < num_threads_; ++i) {
      if (used == kEngineIoUring) {
        threads_.emplace_back([worker = uring_workers_[i].get()] { worker->run(); });
      } else {
        threads_.emplace_back([this] {
          AlignedBuffer bounce;
          while (Slice* slice = pop(/*block=*/true)) run_slice_sync(slice, bounce);
        });
      }
    }
  } catch (const std::system_error& err) {
    const int code = err.code().value();
    return -(code != 0 ? code : EAGAIN);  // the caller deletes the handle, which joins what started
  }
  return used;
}

bool Handle::open_files(Request* r, int32_t direct_mode, const char* path) {
  const int flags = (r->write ? (O_WRONLY | O_CREAT) : O_RDONLY) | O_CLOEXEC;
  r->fd_plain = ::open(path, flags, 0644);
  if (r->fd_plain < 0) {
    r->fail(errno, kStageOpen);
    return false;
  }
  if (direct_mode == kDirectOff) return true;
  r->fd_direct = ::open(path, (flags & ~O_CREAT) | O_DIRECT);  // the file exists now
  if (r->fd_direct >= 0) return true;
  if (errno != EINVAL) {
    r->fail(errno, kStageOpen);
    return false;
  }
  if (direct_mode == kDirectOn) {
    r->fail(EINVAL, kStageDirectRefused);
    return false;
  }
  r->direct_refused = 1;
  return true;
}

void Handle::submit(Request* r, int32_t direct_mode, const char* path) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++submitted_;
  }
  if (!open_files(r, direct_mode, path)) {
    settle(r);
    return;
  }
  const int64_t unit = r->direct() ? std::max(kAlign, block_size_ - block_size_ % kAlign) : block_size_;
  const int64_t num_blocks = (r->nbytes + unit - 1) / unit;
  const int64_t num_slices = std::min<int64_t>(num_threads_, num_blocks);
  if (num_slices == 0) {
    settle(r);
    return;
  }
  r->slices_left.store(static_cast<int32_t>(num_slices));
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int64_t k = 0; k < num_slices; ++k) {
      const int64_t first = k * num_blocks / num_slices, last = (k + 1) * num_blocks / num_slices;
      queue_.push_back(new Slice{r, first * unit, std::min(last * unit, r->nbytes), unit});
    }
  }
  work_cv_.notify_all();
}

void Handle::settle(Request* r) {
  if (r->fd_direct >= 0) ::close(r->fd_direct);
  // A written file's close can report a deferred write error (NFS and the like).
  if (r->fd_plain >= 0 && ::close(r->fd_plain) != 0 && r->write) r->fail(errno, kStageClose);
  Result* out = r->out;
  out->bytes_done = r->bytes_done.load();
  out->direct_bytes = r->direct_bytes.load();
  out->error = r->error.load();
  out->stage = r->stage.load();
  out->direct_refused = r->direct_refused;
  delete r;
  std::lock_guard<std::mutex> lock(mu_);
  ++completed_;
  ++completed_since_wait_;
  if (completed_ == submitted_) done_cv_.notify_all();
}

}  // namespace
}  // namespace ds_aio

DS_DEFINE_OP_INFO()

// A handle with `num_threads` workers using `engine` (0 auto: io_uring where it works, else psync;
// 1 psync; 2 io_uring, or fail). Returns null on failure with the errno in *setup_error; else
// *engine_used is 1 or 2 and *setup_error holds why io_uring was not used under auto (0 if it was).
DS_EXPORT void* ds_aio_create(int64_t block_size, int32_t queue_depth, int32_t single_submit, int32_t overlap_events,
                              int32_t num_threads, int32_t engine, int32_t* engine_used, int32_t* setup_error) {
  if (block_size <= 0 || queue_depth <= 0 || num_threads <= 0) {
    *setup_error = EINVAL;
    return nullptr;
  }
  auto* handle = new ds_aio::Handle(block_size, queue_depth, single_submit != 0, overlap_events != 0, num_threads);
  const int32_t used = handle->start(engine, setup_error);
  if (used < 0) {
    delete handle;
    *setup_error = -used;
    return nullptr;
  }
  *engine_used = used;
  return handle;
}

// Waits for every request, stops the workers and frees the handle.
DS_EXPORT void ds_aio_destroy(void* handle) { delete static_cast<ds_aio::Handle*>(handle); }

// Queues a read (is_write 0) or write of `nbytes` at `buffer` from/to `path` at `file_offset`;
// direct_mode 0 buffered, 1 O_DIRECT or fail, 2 O_DIRECT where the file system allows it. `out` is
// filled when the request settles and must stay valid until ds_aio_wait returns.
DS_EXPORT void ds_aio_submit(void* handle, int32_t is_write, void* buffer, int64_t nbytes, const char* path,
                             int64_t file_offset, int32_t direct_mode, ds_aio::Result* out) {
  std::memset(out, 0, sizeof(*out));
  auto* r = new ds_aio::Request;
  r->write = is_write != 0;
  r->buffer = static_cast<char*>(buffer);
  r->nbytes = nbytes;
  r->file_offset = file_offset;
  r->out = out;
  static_cast<ds_aio::Handle*>(handle)->submit(r, direct_mode, path);
}

// Blocks until every submitted request has settled; returns how many settled since the last wait.
DS_EXPORT int64_t ds_aio_wait(void* handle) { return static_cast<ds_aio::Handle*>(handle)->wait(); }

// 0 when this process may set up an io_uring ring, else the errno (ENOSYS, EPERM, ...).
DS_EXPORT int32_t ds_aio_probe_io_uring() {
  ds_aio::Ring ring;
  return ring.open(2);
}
