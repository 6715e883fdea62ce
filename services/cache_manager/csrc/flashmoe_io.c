/*
 * flashmoe_io: the io_uring read helper of the cache manager.
 *
 * The arena's slots are registered as fixed buffers and the stripe files (opened O_DIRECT) as
 * fixed files; fm_ring_read() runs a batch of block reads with io_uring_prep_read_fixed,
 * keeping `depth` reads in flight until every read of the batch completed, and records each
 * read's result and submit/complete times. Python calls it through ctypes (which releases the
 * GIL for the duration of the call).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define FM_ABI_VERSION 1
#define FM_MAX_BUFFERS 16384 /* IORING_MAX_REG_BUFFERS */

/* One block read. Must match READ_OP_DTYPE in common/store.py (48 bytes, no padding). */
typedef struct {
    int32_t file_index;
    int32_t buf_index;
    uint64_t file_offset;
    uint64_t buf_offset;
    uint32_t length;
    int32_t result; /* bytes read, or -errno */
    uint64_t t_submit_ns;
    uint64_t t_complete_ns;
} fm_read_op;

_Static_assert(sizeof(fm_read_op) == 48, "fm_read_op layout must match READ_OP_DTYPE");

typedef struct {
    struct io_uring ring;
    unsigned depth;
    struct iovec *bufs;
    unsigned nbufs;
    int *fds;
    unsigned nfiles;
} fm_ring;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int fm_abi_version(void) { return FM_ABI_VERSION; }

int fm_op_size(void) { return (int)sizeof(fm_read_op); }

/* Create a ring of `depth` entries and register nslots buffers of slot_bytes at base. */
int fm_ring_open(unsigned depth, void *base, uint64_t slot_bytes, unsigned nslots, fm_ring **out) {
    if (depth == 0 || nslots == 0 || nslots > FM_MAX_BUFFERS || slot_bytes == 0 ||
        slot_bytes > (1ull << 30) || ((uintptr_t)base % 4096) != 0)
        return -EINVAL;
    fm_ring *r = calloc(1, sizeof(*r));
    if (!r) return -ENOMEM;
    int ret = io_uring_queue_init(depth, &r->ring, 0);
    if (ret < 0) {
        free(r);
        return ret;
    }
    r->depth = depth;
    r->nbufs = nslots;
    r->bufs = calloc(nslots, sizeof(struct iovec));
    if (!r->bufs) {
        io_uring_queue_exit(&r->ring);
        free(r);
        return -ENOMEM;
    }
    for (unsigned i = 0; i < nslots; i++) {
        r->bufs[i].iov_base = (char *)base + (uint64_t)i * slot_bytes;
        r->bufs[i].iov_len = slot_bytes;
    }
    ret = io_uring_register_buffers(&r->ring, r->bufs, nslots);
    if (ret < 0) {
        io_uring_queue_exit(&r->ring);
        free(r->bufs);
        free(r);
        return ret;
    }
    *out = r;
    return 0;
}

/* Open the stripe files with O_DIRECT and register them as fixed files. */
int fm_ring_register_files(fm_ring *r, const char **paths, unsigned n) {
    if (r->fds) return -EBUSY;
    int *fds = calloc(n, sizeof(int));
    if (!fds) return -ENOMEM;
    for (unsigned i = 0; i < n; i++) {
        fds[i] = open(paths[i], O_RDONLY | O_DIRECT | O_CLOEXEC);
        if (fds[i] < 0) {
            int err = -errno;
            while (i-- > 0) close(fds[i]);
            free(fds);
            return err;
        }
    }
    int ret = io_uring_register_files(&r->ring, fds, n);
    if (ret < 0) {
        for (unsigned i = 0; i < n; i++) close(fds[i]);
        free(fds);
        return ret;
    }
    r->fds = fds;
    r->nfiles = n;
    return 0;
}

static int op_is_valid(const fm_ring *r, const fm_read_op *op) {
    return op->file_index >= 0 && (unsigned)op->file_index < r->nfiles && op->buf_index >= 0 &&
           (unsigned)op->buf_index < r->nbufs &&
           op->buf_offset + op->length <= r->bufs[op->buf_index].iov_len && op->length > 0;
}

/*
 * Run n reads, at most `depth` in flight. Per-read outcome goes to ops[i].result; the return
 * value is 0, or -errno when the ring itself failed (reads not yet completed then keep
 * result -ECANCELED).
 */
int fm_ring_read(fm_ring *r, fm_read_op *ops, unsigned n) {
    unsigned next = 0, inflight = 0, done = 0;
    for (unsigned i = 0; i < n; i++) ops[i].result = -ECANCELED;
    while (done < n) {
        while (inflight < r->depth && next < n) {
            fm_read_op *op = &ops[next];
            if (!op_is_valid(r, op)) {
                op->result = -EINVAL;
                next++;
                done++;
                continue;
            }
            struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
            if (!sqe) break;
            void *dst = (char *)r->bufs[op->buf_index].iov_base + op->buf_offset;
            io_uring_prep_read_fixed(sqe, op->file_index, dst, op->length, op->file_offset,
                                     op->buf_index);
            sqe->flags |= IOSQE_FIXED_FILE;
            io_uring_sqe_set_data64(sqe, next);
            op->t_submit_ns = now_ns();
            next++;
            inflight++;
        }
        if (inflight == 0) continue;
        int ret = io_uring_submit_and_wait(&r->ring, 1);
        if (ret < 0 && ret != -EINTR) return ret;
        struct io_uring_cqe *cqe;
        unsigned head, seen = 0;
        io_uring_for_each_cqe(&r->ring, head, cqe) {
            fm_read_op *op = &ops[io_uring_cqe_get_data64(cqe)];
            op->result = cqe->res;
            op->t_complete_ns = now_ns();
            seen++;
        }
        io_uring_cq_advance(&r->ring, seen);
        inflight -= seen;
        done += seen;
    }
    return 0;
}

void fm_ring_close(fm_ring *r) {
    if (!r) return;
    io_uring_queue_exit(&r->ring);
    for (unsigned i = 0; i < r->nfiles; i++) close(r->fds[i]);
    free(r->fds);
    free(r->bufs);
    free(r);
}
