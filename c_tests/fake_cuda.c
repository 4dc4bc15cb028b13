/*
 * A fake CUDA driver library for tests/cuda_fake.rs: the driver entry points that
 * src/transfer/cuda.rs uses, implemented on host memory, built as libcuda.so.
 *
 * - Every pointer is host memory: copies are a memmove done at once, in the calling thread.
 * - Events model stream order: an event recorded on one of our streams gets the stream's next
 *   sequence number; it reports CUDA_SUCCESS once its stream has completed that number. A query
 *   of a not-yet-complete event counts, and the `queries_to_complete`-th query (default 3)
 *   completes the stream up to that event (and so every event recorded before it). With the
 *   knob `never_complete` set, queries never complete anything (cuStreamSynchronize still does).
 *   Events recorded on a stream this library did not create (the host's compute stream) are
 *   complete at once.
 * - A copy of size 0, from or to NULL or from or to the "bad" address 0xBAD000 fails with
 *   CUDA_ERROR_INVALID_VALUE (the batch call sets failIdx to the first bad copy, copies nothing).
 * - Work calls need the primary context current on the calling thread (per-thread, like CUDA),
 *   else CUDA_ERROR_INVALID_CONTEXT.
 * - Counters for the tests: uint64_t fake_stat(const char *name), void fake_reset_stats(void),
 *   void fake_set(const char *knob, long long value).
 * - cuMemHostRegister_v2 touches no memory. Knobs: `register_max_bytes` (n > 0: a call for more
 *   than n bytes fails with CUDA_ERROR_INVALID_VALUE, like a driver's single-call ceiling) and
 *   `register_fail_in` (n > 0: the n-th call from now fails with CUDA_ERROR_OUT_OF_MEMORY).
 *
 * Build variants (macros):
 *   FAKE_DRIVER_VERSION=n     what cuDriverGetVersion reports (default 12080)
 *   FAKE_NO_BATCH             no cuMemcpyBatchAsync symbol at all
 *   FAKE_BATCH_V2_ONLY        only cuMemcpyBatchAsync_v2 (CUDA 13 signature, no failIdx)
 *   FAKE_MISSING_REQUIRED     no cuStreamWaitEvent (a driver lacking a required entry point)
 * Environment: FAKE_CUDA_DEVICES=0 makes cuInit fail with CUDA_ERROR_NO_DEVICE.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef FAKE_DRIVER_VERSION
#define FAKE_DRIVER_VERSION 12080
#endif

#define EXPORT __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct fake_ctx *CUcontext;
typedef struct fake_stream *CUstream;
typedef struct fake_event *CUevent;

typedef struct {
    unsigned int type;
    int id;
} CUmemLocation;

typedef struct {
    unsigned int srcAccessOrder;
    CUmemLocation srcLocHint;
    CUmemLocation dstLocHint;
    unsigned int flags;
} CUmemcpyAttributes;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
};

#define BAD_ADDR 0xBAD000ULL
#define CU_EVENT_DISABLE_TIMING 2u
#define CU_STREAM_NON_BLOCKING 1u
#define MAX_REGISTERED 64

struct fake_ctx {
    int unused;
};

struct fake_stream {
    unsigned int flags;
    uint64_t last_seq; /* sequence number of the last event recorded on it */
    uint64_t done_seq; /* events up to this number are complete */
    struct fake_stream *next;
};

struct fake_event {
    unsigned int flags;
    int recorded;
    int external; /* recorded on a stream we did not create: complete */
    struct fake_stream *stream;
    uint64_t seq;
    int queries;
    double time_ms;
    struct fake_event *next;
};

/* Counters, readable by name through fake_stat. */
#define FAKE_STATS(X)                                                                            \
    X(init_calls)                                                                                \
    X(primary_ctx_refs)                                                                          \
    X(ctx_set_current_calls)                                                                     \
    X(streams_created)                                                                           \
    X(streams_live)                                                                              \
    X(nonblocking_streams_created)                                                               \
    X(stream_syncs)                                                                              \
    X(stream_waits)                                                                              \
    X(stream_waits_on_other_stream)                                                              \
    X(events_created)                                                                            \
    X(events_live)                                                                               \
    X(event_records)                                                                             \
    X(event_records_external)                                                                    \
    X(event_queries)                                                                             \
    X(memcpy_async_calls)                                                                        \
    X(batch_calls)                                                                               \
    X(batch_copies)                                                                              \
    X(batch_v2_calls)                                                                            \
    X(last_batch_src_order)                                                                      \
    X(last_batch_src_loc_type)                                                                   \
    X(last_batch_dst_loc_type)                                                                   \
    X(bytes_copied)                                                                              \
    X(failed_copies)                                                                             \
    X(host_register_calls)                                                                       \
    X(host_unregister_calls)                                                                     \
    X(host_registered_live)                                                                      \
    X(host_registered_bytes)                                                                     \
    X(largest_register_bytes)                                                                    \
    X(last_register_flags)                                                                       \
    X(context_errors)

struct fake_stats {
#define X(name) uint64_t name;
    FAKE_STATS(X)
#undef X
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct fake_stats stats;
static struct fake_ctx the_ctx;
static __thread CUcontext tls_current;
static int initialized;
static struct fake_stream *streams;
static struct fake_event *events;
static void *registered[MAX_REGISTERED];
static size_t registered_len[MAX_REGISTERED];
static long long register_max_bytes; /* knob */
static long long register_fail_in;   /* knob */
static double clock_ms;
static int queries_to_complete = 3;
static int never_complete;
static int batch_fails; /* knob: the batch call answers CUDA_ERROR_NOT_SUPPORTED */

#define LOCK() pthread_mutex_lock(&mu)
#define UNLOCK() pthread_mutex_unlock(&mu)

static int ctx_ok(void) {
    if (tls_current == &the_ctx && stats.primary_ctx_refs > 0) return 1;
    stats.context_errors++;
    return 0;
}

static struct fake_stream *our_stream(CUstream s) {
    for (struct fake_stream *p = streams; p; p = p->next)
        if (p == s) return p;
    return NULL;
}

static struct fake_event *our_event(CUevent e) {
    for (struct fake_event *p = events; p; p = p->next)
        if (p == e) return p;
    return NULL;
}

static int event_complete(const struct fake_event *e) {
    return !e->recorded || e->external || e->seq <= e->stream->done_seq;
}

static int copy_ok(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    return n != 0 && dst != 0 && src != 0 && dst != BAD_ADDR && src != BAD_ADDR;
}

static void do_copy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    stats.bytes_copied += n;
    clock_ms += 0.001 + (double)n * 1e-7;
}

/* ---- test hooks ---------------------------------------------------------------------------- */

EXPORT uint64_t fake_stat(const char *name) {
    uint64_t v = UINT64_MAX;
    LOCK();
#define X(n)                                                                                     \
    if (strcmp(name, #n) == 0) v = stats.n;
    FAKE_STATS(X)
#undef X
    if (strcmp(name, "current_ctx_is_primary") == 0) v = tls_current == &the_ctx;
    UNLOCK();
    return v;
}

EXPORT void fake_reset_stats(void) {
    LOCK();
    uint64_t refs = stats.primary_ctx_refs, slive = stats.streams_live, elive = stats.events_live,
             hlive = stats.host_registered_live, hbytes = stats.host_registered_bytes;
    memset(&stats, 0, sizeof stats);
    stats.primary_ctx_refs = refs;
    stats.streams_live = slive;
    stats.events_live = elive;
    stats.host_registered_live = hlive;
    stats.host_registered_bytes = hbytes;
    UNLOCK();
}

EXPORT void fake_set(const char *knob, long long value) {
    LOCK();
    if (strcmp(knob, "queries_to_complete") == 0) queries_to_complete = (int)value;
    if (strcmp(knob, "never_complete") == 0) never_complete = (int)value;
    if (strcmp(knob, "batch_fails") == 0) batch_fails = (int)value;
    if (strcmp(knob, "register_max_bytes") == 0) register_max_bytes = value;
    if (strcmp(knob, "register_fail_in") == 0) register_fail_in = value;
    UNLOCK();
}

/* ---- initialisation, devices, contexts ----------------------------------------------------- */

EXPORT CUresult cuInit(unsigned int flags) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    const char *devices = getenv("FAKE_CUDA_DEVICES");
    if (devices && strcmp(devices, "0") == 0) return CUDA_ERROR_NO_DEVICE;
    LOCK();
    initialized = 1;
    stats.init_calls++;
    UNLOCK();
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDriverGetVersion(int *version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = FAKE_DRIVER_VERSION;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetCount(int *count) {
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    *count = 1;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
    *device = 0;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev) {
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (dev != 0) return CUDA_ERROR_INVALID_DEVICE;
    LOCK();
    stats.primary_ctx_refs++;
    UNLOCK();
    *ctx = &the_ctx;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    if (dev != 0) return CUDA_ERROR_INVALID_DEVICE;
    CUresult rc = CUDA_SUCCESS;
    LOCK();
    if (stats.primary_ctx_refs == 0)
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else
        stats.primary_ctx_refs--;
    UNLOCK();
    return rc;
}

EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
    if (ctx && ctx != &the_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    tls_current = ctx;
    LOCK();
    stats.ctx_set_current_calls++;
    UNLOCK();
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetCurrent(CUcontext *ctx) {
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    *ctx = tls_current;
    return CUDA_SUCCESS;
}

/* ---- streams and events -------------------------------------------------------------------- */

EXPORT CUresult cuStreamCreate(CUstream *out, unsigned int flags) {
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    LOCK();
    if (!ctx_ok()) {
        UNLOCK();
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    struct fake_stream *s = calloc(1, sizeof *s);
    s->flags = flags;
    s->next = streams;
    streams = s;
    stats.streams_created++;
    stats.streams_live++;
    if (flags & CU_STREAM_NON_BLOCKING) stats.nonblocking_streams_created++;
    UNLOCK();
    *out = s;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamDestroy_v2(CUstream stream) {
    CUresult rc = CUDA_ERROR_INVALID_HANDLE;
    LOCK();
    for (struct fake_stream **p = &streams; *p; p = &(*p)->next) {
        if (*p == stream) {
            *p = stream->next;
            /* Events still pointing at it become "external" (complete). */
            for (struct fake_event *e = events; e; e = e->next)
                if (e->stream == stream) e->external = 1;
            free(stream);
            stats.streams_live--;
            rc = CUDA_SUCCESS;
            break;
        }
    }
    UNLOCK();
    return rc;
}

EXPORT CUresult cuStreamSynchronize(CUstream stream) {
    CUresult rc = CUDA_SUCCESS;
    LOCK();
    struct fake_stream *s = our_stream(stream);
    if (!ctx_ok())
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else if (s)
        s->done_seq = s->last_seq;
    stats.stream_syncs++;
    UNLOCK();
    return rc;
}

#ifndef FAKE_MISSING_REQUIRED
EXPORT CUresult cuStreamWaitEvent(CUstream stream, CUevent event, unsigned int flags) {
    CUresult rc = CUDA_SUCCESS;
    LOCK();
    struct fake_stream *s = our_stream(stream);
    struct fake_event *e = our_event(event);
    if (!ctx_ok())
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else if (!s || !e)
        rc = CUDA_ERROR_INVALID_HANDLE;
    else if (flags != 0)
        rc = CUDA_ERROR_INVALID_VALUE;
    else {
        stats.stream_waits++;
        if (e->recorded && (e->external || e->stream != s)) stats.stream_waits_on_other_stream++;
    }
    UNLOCK();
    return rc;
}
#endif

EXPORT CUresult cuEventCreate(CUevent *out, unsigned int flags) {
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    LOCK();
    if (!ctx_ok()) {
        UNLOCK();
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    struct fake_event *e = calloc(1, sizeof *e);
    e->flags = flags;
    e->next = events;
    events = e;
    stats.events_created++;
    stats.events_live++;
    UNLOCK();
    *out = e;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventDestroy_v2(CUevent event) {
    CUresult rc = CUDA_ERROR_INVALID_HANDLE;
    LOCK();
    for (struct fake_event **p = &events; *p; p = &(*p)->next) {
        if (*p == event) {
            *p = event->next;
            free(event);
            stats.events_live--;
            rc = CUDA_SUCCESS;
            break;
        }
    }
    UNLOCK();
    return rc;
}

EXPORT CUresult cuEventRecord(CUevent event, CUstream stream) {
    CUresult rc = CUDA_SUCCESS;
    LOCK();
    struct fake_event *e = our_event(event);
    struct fake_stream *s = our_stream(stream);
    if (!ctx_ok())
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else if (!e)
        rc = CUDA_ERROR_INVALID_HANDLE;
    else {
        e->recorded = 1;
        e->queries = 0;
        e->stream = s;
        e->external = s == NULL;
        e->seq = s ? ++s->last_seq : 0;
        clock_ms += 0.001;
        e->time_ms = clock_ms;
        stats.event_records++;
        if (!s) stats.event_records_external++;
    }
    UNLOCK();
    return rc;
}

EXPORT CUresult cuEventQuery(CUevent event) {
    CUresult rc;
    LOCK();
    struct fake_event *e = our_event(event);
    stats.event_queries++;
    if (!ctx_ok())
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else if (!e)
        rc = CUDA_ERROR_INVALID_HANDLE;
    else if (event_complete(e))
        rc = CUDA_SUCCESS;
    else if (never_complete)
        rc = CUDA_ERROR_NOT_READY;
    else if (++e->queries >= queries_to_complete) {
        if (e->stream->done_seq < e->seq) e->stream->done_seq = e->seq;
        rc = CUDA_SUCCESS;
    } else
        rc = CUDA_ERROR_NOT_READY;
    UNLOCK();
    return rc;
}

EXPORT CUresult cuEventElapsedTime(float *ms, CUevent start, CUevent end) {
    CUresult rc = CUDA_SUCCESS;
    LOCK();
    struct fake_event *a = our_event(start), *b = our_event(end);
    if (!ms || !a || !b || !a->recorded || !b->recorded)
        rc = CUDA_ERROR_INVALID_HANDLE;
    else if ((a->flags | b->flags) & CU_EVENT_DISABLE_TIMING)
        rc = CUDA_ERROR_INVALID_HANDLE;
    else if (!event_complete(a) || !event_complete(b))
        rc = CUDA_ERROR_NOT_READY;
    else
        *ms = (float)(b->time_ms - a->time_ms);
    UNLOCK();
    return rc;
}

/* ---- copies -------------------------------------------------------------------------------- */

EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream) {
    (void)stream;
    CUresult rc = CUDA_SUCCESS;
    LOCK();
    stats.memcpy_async_calls++;
    if (!ctx_ok())
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else if (!copy_ok(dst, src, n)) {
        stats.failed_copies++;
        rc = CUDA_ERROR_INVALID_VALUE;
    } else
        do_copy(dst, src, n);
    UNLOCK();
    return rc;
}

#if !defined(FAKE_NO_BATCH)
static CUresult batch(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                      CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs,
                      size_t *failIdx, CUstream stream) {
    if (failIdx) *failIdx = SIZE_MAX;
    if (!ctx_ok()) return CUDA_ERROR_INVALID_CONTEXT;
    /* The legacy default stream is rejected, as by the real call. */
    if (!stream || !dsts || !srcs || !sizes || count == 0 || !attrs || !attrsIdxs ||
        numAttrs == 0 || numAttrs > count || attrsIdxs[0] != 0)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t k = 0; k < numAttrs; k++) {
        if (attrs[k].srcAccessOrder < 1 || attrs[k].srcAccessOrder > 3) return CUDA_ERROR_INVALID_VALUE;
        if (attrs[k].srcLocHint.type > 4 || attrs[k].dstLocHint.type > 4) return CUDA_ERROR_INVALID_VALUE;
        if (attrs[k].flags > 1) return CUDA_ERROR_INVALID_VALUE;
        if (k > 0 && attrsIdxs[k] <= attrsIdxs[k - 1]) return CUDA_ERROR_INVALID_VALUE;
    }
    stats.last_batch_src_order = attrs[0].srcAccessOrder;
    stats.last_batch_src_loc_type = attrs[0].srcLocHint.type;
    stats.last_batch_dst_loc_type = attrs[0].dstLocHint.type;
    for (size_t i = 0; i < count; i++) {
        if (!copy_ok(dsts[i], srcs[i], sizes[i])) {
            stats.failed_copies++;
            if (failIdx) *failIdx = i;
            return CUDA_ERROR_INVALID_VALUE;
        }
    }
    for (size_t i = 0; i < count; i++) do_copy(dsts[i], srcs[i], sizes[i]);
    stats.batch_copies += count;
    return CUDA_SUCCESS;
}

#if !defined(FAKE_BATCH_V2_ONLY)
EXPORT CUresult cuMemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                                   CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs,
                                   size_t *failIdx, CUstream stream) {
    LOCK();
    stats.batch_calls++;
    CUresult rc = batch_fails ? CUDA_ERROR_NOT_SUPPORTED
                              : batch(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, failIdx,
                                      stream);
    UNLOCK();
    return rc;
}
#else
EXPORT CUresult cuMemcpyBatchAsync_v2(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
                                      size_t count, CUmemcpyAttributes *attrs, size_t *attrsIdxs,
                                      size_t numAttrs, CUstream stream) {
    LOCK();
    stats.batch_calls++;
    stats.batch_v2_calls++;
    CUresult rc = batch_fails ? CUDA_ERROR_NOT_SUPPORTED
                              : batch(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, NULL,
                                      stream);
    UNLOCK();
    return rc;
}
#endif
#endif

/* ---- host memory --------------------------------------------------------------------------- */

EXPORT CUresult cuMemHostRegister_v2(void *p, size_t len, unsigned int flags) {
    CUresult rc = CUDA_SUCCESS;
    LOCK();
    stats.host_register_calls++;
    if (!ctx_ok()) {
        UNLOCK();
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    if (!p || len == 0 || flags > 0xf ||
        (register_max_bytes > 0 && len > (unsigned long long)register_max_bytes)) {
        UNLOCK();
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (register_fail_in > 0 && --register_fail_in == 0) {
        UNLOCK();
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    int free_slot = -1;
    for (int i = 0; i < MAX_REGISTERED; i++) {
        if (registered[i] == p) rc = CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
        if (!registered[i] && free_slot < 0) free_slot = i;
    }
    if (rc == CUDA_SUCCESS) {
        if (free_slot < 0) {
            rc = CUDA_ERROR_INVALID_VALUE;
        } else {
            registered[free_slot] = p;
            registered_len[free_slot] = len;
            stats.host_registered_live++;
            stats.host_registered_bytes += len;
            if (len > stats.largest_register_bytes) stats.largest_register_bytes = len;
            stats.last_register_flags = flags;
        }
    }
    UNLOCK();
    return rc;
}

EXPORT CUresult cuMemHostUnregister(void *p) {
    CUresult rc = CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
    LOCK();
    stats.host_unregister_calls++;
    if (!ctx_ok()) {
        UNLOCK();
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    for (int i = 0; i < MAX_REGISTERED; i++) {
        if (p && registered[i] == p) {
            registered[i] = NULL;
            stats.host_registered_live--;
            stats.host_registered_bytes -= registered_len[i];
            rc = CUDA_SUCCESS;
        }
    }
    UNLOCK();
    return rc;
}

/* ---- errors -------------------------------------------------------------------------------- */

EXPORT CUresult cuGetErrorName(CUresult error, const char **name) {
    if (!name) return CUDA_ERROR_INVALID_VALUE;
    switch (error) {
#define NAME(code)                                                                               \
    case code:                                                                                   \
        *name = #code;                                                                           \
        return CUDA_SUCCESS;
        NAME(CUDA_SUCCESS)
        NAME(CUDA_ERROR_INVALID_VALUE)
        NAME(CUDA_ERROR_OUT_OF_MEMORY)
        NAME(CUDA_ERROR_NOT_INITIALIZED)
        NAME(CUDA_ERROR_NO_DEVICE)
        NAME(CUDA_ERROR_INVALID_DEVICE)
        NAME(CUDA_ERROR_INVALID_CONTEXT)
        NAME(CUDA_ERROR_INVALID_HANDLE)
        NAME(CUDA_ERROR_NOT_READY)
        NAME(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)
        NAME(CUDA_ERROR_NOT_SUPPORTED)
        NAME(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED)
#undef NAME
    default:
        *name = NULL;
        return CUDA_ERROR_INVALID_VALUE;
    }
}
