// The link's socket transport (engine/disagg/link/socket_transport.py): one connected TCP socket, a
// sending thread and a receiving thread, each taking the buffers posted for its direction in order.
// Posting only queues (no system call: callable with the GIL held); waiting blocks on a condition
// (called without the GIL). Every message carries a 16-byte header (magic, size), so a receive
// whose size does not match what arrives fails instead of landing the wrong bytes. Any failure
// fails the channel: every work not done by then fails, and the socket is shut down, so the peer's
// works fail too. `abort` returns only once neither thread touches a posted buffer any more.

#include <pthread.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <limits>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <deque>
#include <mutex>
#include <string>
#include <thread>

namespace {

constexpr uint32_t kMagic = 0x314c564bu;  // "KVL1"
// NOTE: received in slices of this many bytes: each slice is copied out of the socket while it is still
// in cache (a 4 MiB message whole: 3.2 GB/s between two processes on loopback; in slices: 4.0 GB/s)
constexpr int64_t kRecvSlice = 256 << 10;

struct Message {
    uint32_t magic;
    uint32_t reserved;
    int64_t nbytes;
};

struct Item {
    char* data;
    int64_t nbytes;
    int64_t seq;
};

constexpr int64_t kNobody = std::numeric_limits<int64_t>::max();

// NOTE: every wake-up is a context switch: a thread is woken only when what it waits for may be there
// (a posting wakes an idle thread; a message done wakes the waiters once the lowest work they wait
// for is done; a failure wakes everyone)
struct Channel {
    int fd = -1;
    std::mutex mu;
    std::condition_variable work_cv[2];  // each thread: something posted, or the end
    std::condition_variable done_cv;     // the waiters: what they wait for is done, or failed
    std::deque<Item> queue[2];           // 0: sends, 1: receives
    int64_t posted[2] = {0, 0};
    int64_t done[2] = {0, 0};
    int64_t wake_at[2] = {kNobody, kNobody};  // the lowest work a waiter waits for
    bool idle[2] = {false, false};            // a thread waits for a posting
    bool busy[2] = {false, false};            // a thread is in a system call on a posted buffer
    bool failed = false;
    bool stop = false;
    bool closed = false;
    std::string error;
    std::thread threads[2];
};

std::string system_error(const char* what) {
    return std::string(what) + ": " + std::strerror(errno);
}

// Writes all of `iov` (advancing it); "" or why it failed.
std::string send_all(int fd, struct iovec* iov, int count) {
    while (count > 0) {
        struct msghdr msg;
        std::memset(&msg, 0, sizeof msg);
        msg.msg_iov = iov;
        msg.msg_iovlen = count;
        ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR) continue;
            return system_error("send");
        }
        while (count > 0 && n >= static_cast<ssize_t>(iov->iov_len)) {
            n -= static_cast<ssize_t>(iov->iov_len);
            ++iov;
            --count;
        }
        if (count > 0) {
            iov->iov_base = static_cast<char*>(iov->iov_base) + n;
            iov->iov_len -= static_cast<size_t>(n);
        }
    }
    return "";
}

std::string recv_all(int fd, char* data, int64_t nbytes) {
    while (nbytes > 0) {
        ssize_t n = recv(fd, data, static_cast<size_t>(std::min<int64_t>(nbytes, kRecvSlice)), MSG_WAITALL);
        if (n == 0) return "Connection closed by peer";
        if (n < 0) {
            if (errno == EINTR) continue;
            return system_error("recv");
        }
        data += n;
        nbytes -= n;
    }
    return "";
}

std::string move(int fd, int direction, const Item& item) {
    Message header{kMagic, 0, item.nbytes};
    if (direction == 0) {
        struct iovec iov[2] = {{&header, sizeof header}, {item.data, static_cast<size_t>(item.nbytes)}};
        return send_all(fd, iov, item.nbytes > 0 ? 2 : 1);
    }
    std::string error = recv_all(fd, reinterpret_cast<char*>(&header), sizeof header);
    if (!error.empty()) return error;
    if (header.magic != kMagic || header.nbytes != item.nbytes)
        return "protocol: a message of " + std::to_string(header.nbytes) + " bytes where " +
               std::to_string(item.nbytes) + " were expected";
    return recv_all(fd, item.data, item.nbytes);
}

void fail_locked(Channel* ch, const std::string& error) {
    if (!ch->failed) {
        ch->failed = true;
        ch->error = error;
        shutdown(ch->fd, SHUT_RDWR);
    }
    for (auto& cv : ch->work_cv) cv.notify_all();
    ch->done_cv.notify_all();
}

void run(Channel* ch, int direction) {
    // NOTE: named as kvlife names its Python threads, so per-thread CPU (/proc, py-spy) tells them apart
    pthread_setname_np(pthread_self(), direction == 0 ? "kvlife-sock-tx" : "kvlife-sock-rx");
    std::unique_lock<std::mutex> lock(ch->mu);
    for (;;) {
        ch->idle[direction] = true;
        ch->work_cv[direction].wait(lock, [&] { return ch->stop || ch->failed || !ch->queue[direction].empty(); });
        ch->idle[direction] = false;
        if (ch->stop) return;
        if (ch->failed) {  // what is still queued fails with the channel
            ch->work_cv[direction].wait(lock, [&] { return ch->stop; });
            return;
        }
        Item item = ch->queue[direction].front();
        ch->busy[direction] = true;
        lock.unlock();
        std::string error = move(ch->fd, direction, item);
        lock.lock();
        ch->busy[direction] = false;
        if (!error.empty()) {
            fail_locked(ch, error);
            continue;
        }
        ch->queue[direction].pop_front();
        ch->done[direction] = item.seq;
        if (item.seq >= ch->wake_at[direction] || ch->failed) {  // NOTE: failed: an abort waits for `busy`
            ch->wake_at[direction] = kNobody;
            ch->done_cv.notify_all();
        }
    }
}

}  // namespace

extern "C" {

// Takes ownership of the connected socket `fd`; NULL if the threads cannot start.
void* kvlife_channel_open(int fd) {
    Channel* ch = new Channel();
    ch->fd = fd;
    try {
        ch->threads[0] = std::thread(run, ch, 0);
        ch->threads[1] = std::thread(run, ch, 1);
    } catch (...) {
        {
            std::lock_guard<std::mutex> lock(ch->mu);
            ch->stop = true;
        }
        for (auto& cv : ch->work_cv) cv.notify_all();
        for (auto& t : ch->threads)
            if (t.joinable()) t.join();
        close(fd);
        delete ch;
        return nullptr;
    }
    return ch;
}

// Queue `count` buffers (`data[i]`, `nbytes[i]` bytes each) to send (direction 0) or to receive into
// (1), in order; the first one's sequence number (from 1; the others follow it), or -1 if the channel
// has failed or is closed (nothing queued).
int64_t kvlife_channel_post(void* handle, int direction, void* const* data, const int64_t* nbytes, int64_t count) {
    Channel* ch = static_cast<Channel*>(handle);
    if (direction < 0 || direction > 1 || count < 1) return -1;
    for (int64_t i = 0; i < count; ++i)
        if (nbytes[i] < 0) return -1;
    std::lock_guard<std::mutex> lock(ch->mu);
    if (ch->failed || ch->closed) return -1;
    int64_t first = ch->posted[direction] + 1;
    for (int64_t i = 0; i < count; ++i)
        ch->queue[direction].push_back(Item{static_cast<char*>(data[i]), nbytes[i], ++ch->posted[direction]});
    if (ch->idle[direction]) ch->work_cv[direction].notify_one();
    return first;
}

// 0: work `seq` of `direction` is done; 1: not yet after `timeout` seconds (0: just look);
// 2: it never will be (the channel failed or was aborted).
int kvlife_channel_wait(void* handle, int direction, int64_t seq, double timeout) {
    Channel* ch = static_cast<Channel*>(handle);
    std::unique_lock<std::mutex> lock(ch->mu);
    auto deadline = std::chrono::steady_clock::now() +
                    std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                        std::chrono::duration<double>(timeout > 0 ? timeout : 0));
    while (timeout > 0 && ch->done[direction] < seq && !ch->failed) {
        ch->wake_at[direction] = std::min(ch->wake_at[direction], seq);  // NOTE: again after another's wake-up
        if (ch->done_cv.wait_until(lock, deadline) == std::cv_status::timeout) break;
    }
    if (ch->done[direction] >= seq) return 0;
    return ch->failed ? 2 : 1;
}

// Why the channel failed ("" if it has not); copies at most `size` - 1 bytes.
void kvlife_channel_error(void* handle, char* out, int64_t size) {
    Channel* ch = static_cast<Channel*>(handle);
    std::lock_guard<std::mutex> lock(ch->mu);
    if (size <= 0) return;
    std::strncpy(out, ch->error.c_str(), static_cast<size_t>(size - 1));
    out[size - 1] = '\0';
}

// Fail the channel (`reason`) and shut the socket down; returns once neither thread is in a system
// call on a posted buffer, so nothing posted is read or written afterwards.
void kvlife_channel_abort(void* handle, const char* reason) {
    Channel* ch = static_cast<Channel*>(handle);
    std::unique_lock<std::mutex> lock(ch->mu);
    fail_locked(ch, reason);
    shutdown(ch->fd, SHUT_RDWR);
    ch->done_cv.wait(lock, [&] { return !ch->busy[0] && !ch->busy[1]; });
}

// Abort, stop both threads and close the socket (idempotent); the handle stays valid until destroyed.
void kvlife_channel_close(void* handle) {
    Channel* ch = static_cast<Channel*>(handle);
    {
        std::unique_lock<std::mutex> lock(ch->mu);
        if (ch->closed) return;
        ch->closed = true;
        fail_locked(ch, "the channel was closed");
        ch->stop = true;
        for (auto& cv : ch->work_cv) cv.notify_all();
    }
    for (auto& t : ch->threads)
        if (t.joinable()) t.join();
    close(ch->fd);
}

void kvlife_channel_destroy(void* handle) {
    Channel* ch = static_cast<Channel*>(handle);
    kvlife_channel_close(ch);
    delete ch;
}

}  // extern "C"
