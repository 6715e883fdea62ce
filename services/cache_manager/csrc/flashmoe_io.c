/*
 * flashmoe_io: the io_uring read helper of the cache manager.
 *
 * The arena's slots are registered as fixed buffers and the stripe files (opened O_DIRECT) as
 * fixed files; reads are io_uring_prep_read_fixed. Where the buffers cannot be registered (the
 * kernel charges them to RLIMIT_MEMLOCK, which a container may not be allowed to raise) the ring
 * runs without them: reads are io_uring_prep_read into the same slots, and
 * fm_ring_fixed_buffers() says 0 and why (the registration's -errno). The API is asynchronous so that the cache
 * manager's one poll loop never blocks on the disk:
 *
 *   fm_submit(ops)  registers a batch of reads (the caller keeps `ops` alive until the batch is
 *                   reaped), queues them and submits as many as fit under `depth`; returns at
 *                   once with the batch id.
 *   fm_reap()       consumes the completions that are there (never waits), writes each read's
 *                   result and completion time, refills the ring from the queue so that `depth`
 *                   reads stay in flight across batches, and hands out the ids of the batches
 *                   that completed entirely.
 *   fm_ring_eventfd() is readable when completions are there (io_uring_register_eventfd).
 *
 * Each SQE's user_data is a tag (batch slot, batch generation, op index). A completion is only
 * written when its tag names an active batch of the same generation and an op of that batch that
 * is in flight; any other completion is counted as stale and dropped.
 *
 * Any error (a failed io_uring_submit, a caller's fm_ring_fail) drains every read in the kernel
 * (async-cancel, then wait with a bound, fm_set_drain_timeout_ns) before the error is returned,
 * and completes every batch with -ECANCELED on its unfinished ops, so nothing is written into a
 * slot after the helper reported the failure. The ring is failed from then on: fm_submit
 * returns the error, fm_reap only hands out the failed batches. When the drain itself times out
 * the error is -ETIMEDOUT; the kernel may still finish those reads, and their completions are
 * stale.
 *
 * Test-only fault injection (fm_set_fault), off unless set:
 *   FM_FAULT_DELAY        completions are held and reported only `param` ms after they arrive
 *   FM_FAULT_SHORT_READ   every `param`-th read is submitted 4096 bytes shorter
 *   FM_FAULT_SUBMIT_ERROR the next fm_submit fails with -EIO after (at most) `param` SQEs of it
 *                         went to the kernel, as if io_uring_submit had failed
 *   FM_FAULT_STALE        forge `param` completions with bad tags now (each must count as stale)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define FM_ABI_VERSION 3
#define FM_MAX_BUFFERS 16384 /* IORING_MAX_REG_BUFFERS */
#define FM_MAX_BATCHES 4096
#define FM_SHORTEN 4096 /* what FM_FAULT_SHORT_READ takes off a read */
#define FM_DEFAULT_DRAIN_NS 10000000000ull

/* user_data of a read: op index in bits 0..31, batch slot in 32..44, generation in 45..63. The
 * slot field can name slots past the table, so the bounds check is a real check. */
#define TAG_OP_BITS 32
#define TAG_SLOT_BITS 13
#define TAG_GEN_BITS (64 - TAG_OP_BITS - TAG_SLOT_BITS)
#define TAG_SLOT_MASK ((1ull << TAG_SLOT_BITS) - 1)
#define TAG_GEN_MASK ((1ull << TAG_GEN_BITS) - 1)
#define TAG_CANCEL UINT64_MAX /* the drain's async-cancel request; slot field out of range */

enum { FM_FAULT_DELAY = 1, FM_FAULT_SHORT_READ = 2, FM_FAULT_SUBMIT_ERROR = 3, FM_FAULT_STALE = 4 };

/* One block read. Must match READ_OP_DTYPE in common/store.py (48 bytes, no padding). */
typedef struct {
    int32_t file_index;
    int32_t buf_index;
    uint64_t file_offset;
    uint64_t buf_offset;
    uint32_t length;
    int32_t result; /* bytes read, or -errno; -EINPROGRESS while queued or in flight */
    uint64_t t_submit_ns;
    uint64_t t_complete_ns;
} fm_read_op;

_Static_assert(sizeof(fm_read_op) == 48, "fm_read_op layout must match READ_OP_DTYPE");

enum batch_state { BATCH_FREE = 0, BATCH_ACTIVE, BATCH_DONE };

typedef struct {
    fm_read_op *ops;
    uint64_t id;        /* unique per ring; its low TAG_GEN_BITS are the generation */
    unsigned n;
    unsigned cursor;    /* ops[0..cursor) were submitted or are invalid; the rest are queued */
    unsigned oldest;    /* no op below this index is in flight (advanced lazily) */
    unsigned remaining; /* valid ops not yet completed */
    int state;
    int prev, next;     /* active batches in submit order */
} fm_batch;

typedef struct {
    uint64_t tag;
    int32_t res;
    uint64_t t_arrive_ns;
} fm_held;

typedef struct {
    struct io_uring ring;
    unsigned depth;
    struct iovec *bufs;
    unsigned nbufs;
    int fixed_bufs;      /* 1: bufs are registered (read_fixed); 0: plain reads into them */
    int bufs_error;      /* 0, or the -errno io_uring_register_buffers gave */
    int *fds;
    unsigned nfiles;
    int efd;

    fm_batch batches[FM_MAX_BATCHES];
    int free_slots[FM_MAX_BATCHES];
    unsigned n_free;
    int active_head, active_tail; /* doubly linked via prev/next */
    int pending;                  /* first active batch with queued ops; -1 when none */
    int done[FM_MAX_BATCHES];     /* completed batches not yet handed out (FIFO) */
    unsigned done_head, n_done;
    uint64_t next_id;

    unsigned in_kernel;  /* reads submitted to the kernel and not yet completed there */
    unsigned cancels;    /* drain's cancel requests not yet completed */
    unsigned queued;     /* valid reads accepted by fm_submit, not yet submitted */
    fm_held *held;       /* FM_FAULT_DELAY: completions that arrived, not yet reported */
    unsigned n_held;

    uint64_t drain_timeout_ns;
    int failed;   /* 0, or the -errno that failed the ring */
    int unusable; /* the drain timed out: reads may still be in the kernel */
    uint64_t stale;
    uint64_t faults_injected;
    uint64_t reads_submitted;

    unsigned fault_delay_ms, fault_short_every, fault_submit_after;
} fm_ring;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t make_tag(unsigned slot, uint64_t id, unsigned op) {
    return ((id & TAG_GEN_MASK) << (TAG_OP_BITS + TAG_SLOT_BITS)) |
           ((uint64_t)slot << TAG_OP_BITS) | op;
}

int fm_abi_version(void) { return FM_ABI_VERSION; }

int fm_op_size(void) { return (int)sizeof(fm_read_op); }

int fm_max_batches(void) { return FM_MAX_BATCHES; }

/* 0 when this process may set up an io_uring instance, else -errno (seccomp, sysctl). */
int fm_probe(void) {
    struct io_uring ring;
    int ret = io_uring_queue_init(1, &ring, 0);
    if (ret < 0) return ret;
    io_uring_queue_exit(&ring);
    return 0;
}

static void ring_free(fm_ring *r) {
    io_uring_queue_exit(&r->ring);
    if (r->efd >= 0) close(r->efd);
    for (unsigned i = 0; i < r->nfiles; i++) close(r->fds[i]);
    free(r->fds);
    free(r->bufs);
    free(r->held);
    free(r);
}

/* Create a ring of `depth` entries, register nslots buffers of slot_bytes at base and an
 * eventfd that becomes readable when completions are there. */
int fm_ring_open(unsigned depth, void *base, uint64_t slot_bytes, unsigned nslots, fm_ring **out) {
    if (depth == 0 || depth > 4096 || nslots == 0 || nslots > FM_MAX_BUFFERS || slot_bytes == 0 ||
        slot_bytes > (1ull << 30) || ((uintptr_t)base % 4096) != 0)
        return -EINVAL;
    fm_ring *r = calloc(1, sizeof(*r));
    if (!r) return -ENOMEM;
    int ret = io_uring_queue_init(depth, &r->ring, 0);
    if (ret < 0) {
        free(r);
        return ret;
    }
    r->efd = -1;
    r->depth = depth;
    r->nbufs = nslots;
    r->drain_timeout_ns = FM_DEFAULT_DRAIN_NS;
    r->active_head = r->active_tail = r->pending = -1;
    r->n_free = FM_MAX_BATCHES;
    for (unsigned i = 0; i < FM_MAX_BATCHES; i++) r->free_slots[i] = (int)(FM_MAX_BATCHES - 1 - i);
    r->bufs = calloc(nslots, sizeof(struct iovec));
    r->held = calloc(depth, sizeof(fm_held));
    if (!r->bufs || !r->held) {
        ring_free(r);
        return -ENOMEM;
    }
    for (unsigned i = 0; i < nslots; i++) {
        r->bufs[i].iov_base = (char *)base + (uint64_t)i * slot_bytes;
        r->bufs[i].iov_len = slot_bytes;
    }
    ret = io_uring_register_buffers(&r->ring, r->bufs, nslots);
    if (ret == -ENOMEM || ret == -EPERM) {
        /* Over RLIMIT_MEMLOCK (or not allowed to pin): read into the slots unregistered. */
        r->fixed_bufs = 0;
        r->bufs_error = ret;
    } else if (ret < 0) {
        goto fail;
    } else {
        r->fixed_bufs = 1;
    }
    r->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (r->efd < 0) {
        ret = -errno;
        goto fail;
    }
    ret = io_uring_register_eventfd(&r->ring, r->efd);
    if (ret < 0) goto fail;
    *out = r;
    return 0;
fail:
    ring_free(r);
    return ret;
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

int fm_ring_eventfd(const fm_ring *r) { return r->efd; }

/* 1 when the slots are registered fixed buffers; 0 when reads go to them unregistered, and then
 * *err is the registration's -errno. */
int fm_ring_fixed_buffers(const fm_ring *r, int *err) {
    if (err) *err = r->bufs_error;
    return r->fixed_bufs;
}

/* Reads in flight: in the kernel, or arrived and held back by FM_FAULT_DELAY. Never above
 * depth. Reads accepted but waiting for a free queue entry are fm_queued(). */
unsigned fm_inflight(const fm_ring *r) { return r->in_kernel + r->n_held; }

unsigned fm_queued(const fm_ring *r) { return r->queued; }

uint64_t fm_stale_count(const fm_ring *r) { return r->stale; }

uint64_t fm_faults_injected(const fm_ring *r) { return r->faults_injected; }

/* 0, or the -errno that failed the ring (-ETIMEDOUT when its drain timed out). */
int fm_ring_error(const fm_ring *r) { return r->unusable ? -ETIMEDOUT : r->failed; }

void fm_set_drain_timeout_ns(fm_ring *r, uint64_t ns) { r->drain_timeout_ns = ns; }

static int op_is_valid(const fm_ring *r, const fm_read_op *op) {
    return op->file_index >= 0 && (unsigned)op->file_index < r->nfiles && op->buf_index >= 0 &&
           (unsigned)op->buf_index < r->nbufs && op->length > 0 &&
           op->buf_offset <= r->bufs[op->buf_index].iov_len &&
           op->length <= r->bufs[op->buf_index].iov_len - op->buf_offset;
}

/* --- batch bookkeeping ------------------------------------------------------------------- */

static void active_unlink(fm_ring *r, int slot) {
    fm_batch *b = &r->batches[slot];
    if (b->prev >= 0) r->batches[b->prev].next = b->next;
    else r->active_head = b->next;
    if (b->next >= 0) r->batches[b->next].prev = b->prev;
    else r->active_tail = b->prev;
    b->prev = b->next = -1;
}

static void batch_done(fm_ring *r, int slot) {
    fm_batch *b = &r->batches[slot];
    if (b->state == BATCH_ACTIVE) active_unlink(r, slot);
    b->state = BATCH_DONE;
    r->done[(r->done_head + r->n_done) % FM_MAX_BATCHES] = slot;
    r->n_done++;
}

/* Skip ops that fm_submit found invalid; the first batch without queued ops moves the
 * pending pointer on. */
static void advance_cursor(fm_ring *r, int slot) {
    fm_batch *b = &r->batches[slot];
    while (b->cursor < b->n && b->ops[b->cursor].result != -EINPROGRESS) b->cursor++;
    if (b->cursor == b->n && r->pending == slot) r->pending = b->next;
}

/* Write one completion if its tag names an op in flight; otherwise count it stale. */
static void complete(fm_ring *r, uint64_t tag, int32_t res) {
    uint64_t slot = (tag >> TAG_OP_BITS) & TAG_SLOT_MASK;
    uint64_t gen = tag >> (TAG_OP_BITS + TAG_SLOT_BITS);
    unsigned op = (unsigned)(tag & 0xffffffffu);
    fm_batch *b = slot < FM_MAX_BATCHES ? &r->batches[slot] : NULL;
    if (!b || b->state != BATCH_ACTIVE || (b->id & TAG_GEN_MASK) != gen || op >= b->cursor ||
        b->ops[op].result != -EINPROGRESS) {
        r->stale++;
        return;
    }
    b->ops[op].result = res;
    b->ops[op].t_complete_ns = now_ns();
    if (--b->remaining == 0) batch_done(r, (int)slot);
}

static void release_held(fm_ring *r, int all) {
    uint64_t now = now_ns(), hold = (uint64_t)r->fault_delay_ms * 1000000ull;
    unsigned kept = 0;
    for (unsigned i = 0; i < r->n_held; i++) {
        if (all || now - r->held[i].t_arrive_ns >= hold) complete(r, r->held[i].tag, r->held[i].res);
        else r->held[kept++] = r->held[i];
    }
    r->n_held = kept;
}

/* Take every CQE that is there (without waiting). */
static void consume_cqes(fm_ring *r) {
    struct io_uring_cqe *cqe;
    unsigned head, seen = 0;
    io_uring_for_each_cqe(&r->ring, head, cqe) {
        uint64_t tag = io_uring_cqe_get_data64(cqe);
        seen++;
        if (tag == TAG_CANCEL) {
            r->cancels--;
            continue;
        }
        r->in_kernel--;
        if (r->fault_delay_ms && r->n_held < r->depth && !r->failed) {
            r->held[r->n_held++] = (fm_held){tag, cqe->res, now_ns()};
            r->faults_injected++;
        } else {
            complete(r, tag, cqe->res);
        }
    }
    io_uring_cq_advance(&r->ring, seen);
}

/* Wait (bounded by the drain timeout) until the kernel holds none of our reads. */
static int drain(fm_ring *r) {
    /* No cancel when a failed submit left SQEs behind: submitting it would start them. */
    if (r->in_kernel > 0 && io_uring_sq_ready(&r->ring) == 0) {
        struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
        if (sqe) {
            /* Reads still queued in io_uring (not yet at the device) end sooner. */
            io_uring_prep_cancel64(sqe, 0, IORING_ASYNC_CANCEL_ANY);
            io_uring_sqe_set_data64(sqe, TAG_CANCEL);
            if (io_uring_submit(&r->ring) == 1) r->cancels++;
        }
    }
    uint64_t deadline = now_ns() + r->drain_timeout_ns;
    consume_cqes(r);
    while (r->in_kernel > 0) {
        uint64_t now = now_ns();
        if (now >= deadline) return -ETIMEDOUT;
        struct __kernel_timespec ts = {.tv_sec = (long long)((deadline - now) / 1000000000ull),
                                       .tv_nsec = (long long)((deadline - now) % 1000000000ull)};
        struct io_uring_cqe *cqe;
        int ret = io_uring_wait_cqe_timeout(&r->ring, &cqe, &ts);
        if (ret == -ETIME) return -ETIMEDOUT;
        if (ret < 0 && ret != -EINTR) return ret;
        consume_cqes(r);
    }
    return 0;
}

/* Drain, then complete every batch with -ECANCELED on its unfinished ops and fail the ring.
 * Returns err, or -ETIMEDOUT when the drain timed out. */
static int fail_ring(fm_ring *r, int err) {
    if (!r->failed) r->failed = err;
    int drained = drain(r);
    release_held(r, 1);
    while (r->active_head >= 0) {
        int slot = r->active_head;
        fm_batch *b = &r->batches[slot];
        for (unsigned i = 0; i < b->n; i++)
            if (b->ops[i].result == -EINPROGRESS) b->ops[i].result = -ECANCELED;
        b->remaining = 0;
        batch_done(r, slot);
    }
    r->pending = -1;
    r->queued = 0;
    r->unusable = drained < 0;
    return r->unusable ? -ETIMEDOUT : err;
}

/* Submit queued reads while fewer than depth are in flight. Never waits on the disk. */
static int fill(fm_ring *r, unsigned limit) {
    unsigned prepared = 0;
    while (r->pending >= 0 && r->in_kernel + r->n_held + prepared < r->depth && prepared < limit) {
        int slot = r->pending;
        fm_batch *b = &r->batches[slot];
        struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
        if (!sqe) break;
        unsigned idx = b->cursor;
        fm_read_op *op = &b->ops[idx];
        unsigned length = op->length;
        r->reads_submitted++;
        if (r->fault_short_every && r->reads_submitted % r->fault_short_every == 0 &&
            length > FM_SHORTEN) {
            length -= FM_SHORTEN;
            r->faults_injected++;
        }
        void *dst = (char *)r->bufs[op->buf_index].iov_base + op->buf_offset;
        if (r->fixed_bufs)
            io_uring_prep_read_fixed(sqe, op->file_index, dst, length, op->file_offset,
                                     op->buf_index);
        else
            io_uring_prep_read(sqe, op->file_index, dst, length, op->file_offset);
        sqe->flags |= IOSQE_FIXED_FILE;
        io_uring_sqe_set_data64(sqe, make_tag((unsigned)slot, b->id, idx));
        op->t_submit_ns = now_ns();
        b->cursor++;
        prepared++;
        r->queued--;
        advance_cursor(r, slot);
    }
    if (prepared == 0) return 0;
    int ret;
    do {
        ret = io_uring_submit(&r->ring);
    } while (ret == -EINTR);
    if (ret > 0) r->in_kernel += (unsigned)ret;
    if (ret < 0) return ret;
    if ((unsigned)ret < prepared) return -EIO; /* SQEs left behind in the queue */
    return 0;
}

/*
 * Register a batch of n reads and submit what fits under depth. `ops` is the caller's and must
 * stay alive until fm_reap hands out the batch id. Invalid ops get -EINVAL and are not
 * submitted. Returns 0, -EAGAIN when FM_MAX_BATCHES batches are outstanding (nothing was
 * registered), or the ring's error (then the batch, if registered, was failed with the others).
 */
int fm_submit(fm_ring *r, fm_read_op *ops, unsigned n, uint64_t *batch_id_out) {
    if (r->failed) return fm_ring_error(r);
    if (r->n_free == 0) return -EAGAIN;
    int slot = r->free_slots[--r->n_free];
    fm_batch *b = &r->batches[slot];
    memset(b, 0, sizeof(*b));
    b->ops = ops;
    b->n = n;
    b->id = ++r->next_id;
    b->prev = b->next = -1;
    for (unsigned i = 0; i < n; i++) {
        ops[i].t_submit_ns = ops[i].t_complete_ns = 0;
        if (op_is_valid(r, &ops[i])) {
            ops[i].result = -EINPROGRESS;
            b->remaining++;
        } else {
            ops[i].result = -EINVAL;
        }
    }
    *batch_id_out = b->id;
    if (b->remaining == 0) {
        batch_done(r, slot);
        return 0;
    }
    b->state = BATCH_ACTIVE;
    b->prev = r->active_tail;
    if (r->active_tail >= 0) r->batches[r->active_tail].next = slot;
    else r->active_head = slot;
    r->active_tail = slot;
    r->queued += b->remaining;
    if (r->pending < 0) r->pending = slot;
    advance_cursor(r, slot);
    if (r->fault_submit_after) {
        /* What fits of the first `param` SQEs goes to the kernel, then the submit "fails". */
        int ret = fill(r, r->fault_submit_after);
        r->faults_injected++;
        return fail_ring(r, ret < 0 ? ret : -EIO);
    }
    int ret = fill(r, UINT32_MAX);
    return ret < 0 ? fail_ring(r, ret) : 0;
}

/*
 * Never waits: takes the completions that are there, refills the ring, and writes the ids of
 * up to max_done batches that completed entirely. Returns how many, or the ring's error when it
 * failed in this call (its batches are then handed out by the next calls).
 */
int fm_reap(fm_ring *r, uint64_t *done_batch_ids, unsigned max_done) {
    uint64_t counter;
    /* Clear the eventfd before looking at the CQ, so a completion that arrives after the look
     * signals it again. */
    if (read(r->efd, &counter, sizeof(counter)) < 0 && errno != EAGAIN) return -errno;
    consume_cqes(r);
    release_held(r, 0);
    if (!r->failed) {
        int ret = fill(r, UINT32_MAX);
        if (ret < 0) return fail_ring(r, ret);
    }
    unsigned k = 0;
    while (k < max_done && r->n_done > 0) {
        int slot = r->done[r->done_head];
        r->done_head = (r->done_head + 1) % FM_MAX_BATCHES;
        r->n_done--;
        done_batch_ids[k++] = r->batches[slot].id;
        r->batches[slot].state = BATCH_FREE;
        r->free_slots[r->n_free++] = slot;
    }
    return (int)k;
}

/* Submit time (CLOCK_MONOTONIC ns) of the oldest read in flight, 0 when none is. Completions
 * waiting in the CQ are taken first (the eventfd stays set, so fm_reap still hands their
 * batches out): a read that completed is never counted as late. Reads are submitted in batch
 * order, so the first active batch with a read in flight holds the oldest. */
uint64_t fm_oldest_submit_ns(fm_ring *r) {
    consume_cqes(r);
    for (int slot = r->active_head; slot >= 0; slot = r->batches[slot].next) {
        fm_batch *b = &r->batches[slot];
        while (b->oldest < b->cursor && b->ops[b->oldest].result != -EINPROGRESS) b->oldest++;
        if (b->oldest < b->cursor) return b->ops[b->oldest].t_submit_ns;
    }
    return 0;
}

/* Give up on every read (a read timeout): drain, cancel, fail the ring. Returns 0 when the
 * drain completed, -ETIMEDOUT when reads may still be in the kernel. On a failed ring it drains
 * again (late completions count as stale). */
int fm_ring_fail(fm_ring *r, int err) {
    if (err >= 0) err = -ECANCELED;
    return fail_ring(r, err) == -ETIMEDOUT ? -ETIMEDOUT : 0;
}

/* Forge completions whose tags fail each check in turn: slot past the table, free slot,
 * wrong generation, op index past the batch. */
static void forge_stale(fm_ring *r, unsigned count) {
    int live = r->active_head;
    for (unsigned i = 0; i < count; i++) {
        uint64_t tag;
        switch (i % 4) {
        case 0:
            tag = make_tag(FM_MAX_BATCHES + 1, 0, 0);
            break;
        case 1:
            tag = make_tag(r->n_free ? (unsigned)r->free_slots[0] : 0, 0, 0);
            break;
        case 2:
            tag = live >= 0 ? make_tag((unsigned)live, r->batches[live].id + 1, 0)
                            : make_tag(FM_MAX_BATCHES + 2, 0, 0);
            break;
        default:
            tag = live >= 0 ? make_tag((unsigned)live, r->batches[live].id, r->batches[live].n)
                            : make_tag(FM_MAX_BATCHES + 3, 0, 0);
        }
        r->faults_injected++;
        complete(r, tag, -EFAULT);
    }
}

/* Test-only fault injection; param 0 turns a kind off. */
int fm_set_fault(fm_ring *r, int kind, unsigned param) {
    switch (kind) {
    case FM_FAULT_DELAY:
        r->fault_delay_ms = param;
        return 0;
    case FM_FAULT_SHORT_READ:
        r->fault_short_every = param;
        return 0;
    case FM_FAULT_SUBMIT_ERROR:
        r->fault_submit_after = param;
        return 0;
    case FM_FAULT_STALE:
        forge_stale(r, param);
        return 0;
    default:
        return -EINVAL;
    }
}

/* Drain what is in flight (bounded; late completions only count as stale), then release the
 * ring, its buffers and files. The caller's ops stay untouched after this returns. */
int fm_ring_close(fm_ring *r) {
    if (!r) return 0;
    int ret = 0;
    if (r->in_kernel > 0 || r->n_held > 0 || r->active_head >= 0)
        ret = fail_ring(r, -ECANCELED) == -ETIMEDOUT ? -ETIMEDOUT : 0;
    ring_free(r);
    return ret;
}
