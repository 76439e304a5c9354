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
#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <system_error>

#include "ds_aio_handle.h"
#include "ds_aio_request.h"
#include "ds_aio_uring.h"
#include "ds_aio_uring_worker.h"
#include "ds_cpu_optim.h"  // DS_EXPORT, DS_DEFINE_OP_INFO

namespace ds_aio {

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
      auto* slice = new Slice{r, first * unit, std::min(last * unit, r->nbytes), unit};
      slice->begin = slice->pos;
      queue_.push_back(slice);
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
  out->end_ns = monotonic_ns();
  out->checksum = r->checksum.load();
  out->start_ns = r->start_ns.load() != 0 ? r->start_ns.load() : out->end_ns;
  delete r;
  std::lock_guard<std::mutex> lock(mu_);
  ++completed_;
  ++completed_since_wait_;
  if (completed_ == submitted_) done_cv_.notify_all();
}

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
// filled when the request settles and must stay valid until ds_aio_wait returns. `flags`: kWantChecksum
// has the workers sum the bytes as each slice completes (Result::checksum).
DS_EXPORT void ds_aio_submit(void* handle, int32_t is_write, void* buffer, int64_t nbytes, const char* path,
                             int64_t file_offset, int32_t direct_mode, ds_aio::Result* out, int32_t flags) {
  std::memset(out, 0, sizeof(*out));
  auto* r = new ds_aio::Request;
  r->write = is_write != 0;
  r->buffer = static_cast<char*>(buffer);
  r->nbytes = nbytes;
  r->file_offset = file_offset;
  r->out = out;
  r->want_checksum = (flags & ds_aio::kWantChecksum) != 0;
  static_cast<ds_aio::Handle*>(handle)->submit(r, direct_mode, path);
}

// Blocks until every submitted request has settled; returns how many settled since the last wait.
DS_EXPORT int64_t ds_aio_wait(void* handle) { return static_cast<ds_aio::Handle*>(handle)->wait(); }

// 0 when this process may set up an io_uring ring, else the errno (ENOSYS, EPERM, ...).
DS_EXPORT int32_t ds_aio_probe_io_uring() {
  ds_aio::Ring ring;
  return ring.open(2);
}
