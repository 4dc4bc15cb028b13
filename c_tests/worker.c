/* Drives the kvo_worker_* C API from C11 with the host backend: "GPU" KV tensors are plain host
 * memory (aligned_alloc, on_device = 0). Checks byte-exact store and load jobs (block ids in
 * random order, block_size_factor 3, a partial first chunk, a tensor whose block stride exceeds
 * its page, a job large enough to be split across threads), the host tier layout read through
 * kvo_worker_get_host_buffer, reported bytes, FIFO completion order per direction, a whole step
 * from the scheduler carried through kvo_step_encode / kvo_step_decode and completed back into
 * it, kvo_worker_swap_blocks, caller-provided host buffers, and bad inputs (exact status, a
 * message naming the argument, nothing changed). Prints one line per failed check and
 * `N passed, M failed`; exits non-zero on any failure. Compiled and run by tests/c_api.rs. */
#include "kvoffload.h"

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FACTOR 3     /* GPU blocks per host slot */
#define SLOTS 16     /* host slots */
#define NBLOCKS 32   /* blocks per tensor */
#define PAGE0 64     /* tensor 0: contiguous blocks */
#define STRIDE0 64
#define PAGE1 40     /* tensor 1: 56 bytes of padding after each page */
#define STRIDE1 96
#define PAGES (PAGE0 + PAGE1)
#define WAIT_MS 30000
#define MAX_DONE 64
#define KEY_LEN 8
#define GBS 4 /* tokens per GPU block (scheduler) */
#define MAX_IDS 64
#define STEP_BYTES 1024

#include "check.h"

/* U32S(1, 2, 3) expands to `array, length`. */
#define U32S(...)                                                                               \
    ((const uint32_t[]){__VA_ARGS__}), (sizeof((const uint32_t[]){__VA_ARGS__}) / sizeof(uint32_t))

/* ---- memory ----------------------------------------------------------------------------- */

/* A fixed-seed xorshift generator: the "random" block orders are the same on every run. */
static uint64_t rng_state = 0x9E3779B97F4A7C15u;

static uint32_t rnd(uint32_t n) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state % n);
}

/* `n` distinct ids from `0..range` in random order, none of them in `avoid` (`n_avoid`). */
static void random_ids(uint32_t *out, size_t n, uint32_t range, const uint32_t *avoid,
                       size_t n_avoid) {
    size_t k = 0;
    while (k < n) {
        uint32_t v = rnd(range);
        int dup = 0;
        for (size_t i = 0; i < k; i++) {
            dup |= out[i] == v;
        }
        for (size_t i = 0; i < n_avoid; i++) {
            dup |= avoid[i] == v;
        }
        if (!dup) {
            out[k++] = v;
        }
    }
}

/* A "GPU" tensor in host memory: `num_blocks` pages of `page` bytes, `stride` bytes apart, every
 * byte (padding included) filled with a pattern of `seed`; `orig` keeps the initial bytes. */
typedef struct {
    uint8_t *mem;
    uint8_t *orig;
    size_t size;
    kvo_kv_tensor t;
} tensor_t;

static uint8_t pattern(uint32_t seed, size_t i) {
    uint32_t x = (uint32_t)i * 2654435761u + seed * 40503u + 0x5bd1e995u;
    x ^= x >> 15;
    return (uint8_t)(x ^ (x >> 8));
}

static tensor_t tensor_new(uint32_t num_blocks, uint64_t stride, uint64_t page, uint32_t seed) {
    tensor_t t;
    memset(&t, 0, sizeof t);
    t.size = ((size_t)(num_blocks * stride) + 63) / 64 * 64;
    t.mem = aligned_alloc(64, t.size);
    t.orig = malloc(t.size);
    if (t.mem == NULL || t.orig == NULL) {
        printf("out of memory\n");
        exit(2);
    }
    for (size_t i = 0; i < t.size; i++) {
        t.mem[i] = pattern(seed, i);
    }
    memcpy(t.orig, t.mem, t.size);
    t.t.base = (uint64_t)(uintptr_t)t.mem;
    t.t.block_stride = stride;
    t.t.page_size = page;
    t.t.num_blocks = num_blocks;
    t.t.on_device = 0;
    return t;
}

static void tensor_free(tensor_t *t) {
    free(t->mem);
    free(t->orig);
    t->mem = t->orig = NULL;
}

/* Block `b` of the tensor now / as it was. */
static uint8_t *block(const tensor_t *t, uint32_t b) {
    return t->mem + (size_t)b * t->t.block_stride;
}
static const uint8_t *orig_block(const tensor_t *t, uint32_t b) {
    return t->orig + (size_t)b * t->t.block_stride;
}

/* The tensor's bytes equal `want` (size t->size); prints the first difference. */
static int tensor_is(const tensor_t *t, const uint8_t *want) {
    for (size_t i = 0; i < t->size; i++) {
        if (t->mem[i] != want[i]) {
            printf("  tensor differs at byte %zu (block %zu, offset %zu): %u, want %u\n", i,
                   i / (size_t)t->t.block_stride, i % (size_t)t->t.block_stride, t->mem[i],
                   want[i]);
            return 0;
        }
    }
    return 1;
}

/* The tensor is still what it was at creation (padding included). */
#define CHECK_UNTOUCHED(t) check(tensor_is(&(t), (t).orig), __LINE__, #t " unchanged")

static int bytes_are(const uint8_t *got, const uint8_t *want, size_t n, const char *what) {
    for (size_t i = 0; i < n; i++) {
        if (got[i] != want[i]) {
            printf("  %s differs at byte %zu: %u, want %u\n", what, i, got[i], want[i]);
            return 0;
        }
    }
    return 1;
}

/* ---- worker helpers --------------------------------------------------------------------- */

static kvo_worker_config wcfg(uint32_t factor, uint32_t slots) {
    kvo_worker_config c;
    memset(&c, 0xAB, sizeof c);
    CHECK_OK(kvo_worker_config_default(&c));
    c.block_size_factor = factor;
    c.num_host_slots = slots;
    return c;
}

static kvo_worker *new_worker_(const kvo_worker_config *c, const kvo_kv_tensor *ts, size_t n,
                               const kvo_host_buffer *hb, int line) {
    kvo_worker *w = NULL;
    check_status(kvo_worker_new(c, ts, n, hb, &w), KVO_STATUS_OK, NULL, line, "kvo_worker_new");
    check(w != NULL, line, "kvo_worker_new wrote the handle");
    if (w == NULL) {
        printf("cannot go on without a worker\n");
        exit(1);
    }
    return w;
}
#define NEW_WORKER(c, ts, n, hb) new_worker_((c), (ts), (n), (hb), __LINE__)

typedef struct {
    kvo_completion c[MAX_DONE];
    size_t n;
} done_t;

/* Waits for `ids` then polls once: every listed job must be in that one poll. */
static done_t wait_poll_(kvo_worker *w, const uint64_t *ids, size_t n, int line) {
    done_t d;
    memset(&d, 0, sizeof d);
    check_status(kvo_worker_wait(w, ids, n, WAIT_MS), KVO_STATUS_OK, NULL, line,
                 "kvo_worker_wait");
    check_status(kvo_worker_poll(w, d.c, MAX_DONE, &d.n), KVO_STATUS_OK, NULL, line,
                 "kvo_worker_poll");
    for (size_t i = 0; i < n; i++) {
        int found = 0;
        for (size_t k = 0; k < d.n; k++) {
            found |= d.c[k].job_id == ids[i];
        }
        if (!found) {
            char what[96];
            snprintf(what, sizeof what, "job %llu polled after its wait",
                     (unsigned long long)ids[i]);
            check(0, line, what);
        }
    }
    return d;
}
#define WAIT_POLL(w, ...) wait_poll_((w), U64S(__VA_ARGS__), __LINE__)

/* The completion of `id` in `d` (NULL if absent). */
static const kvo_completion *find(const done_t *d, uint64_t id) {
    for (size_t k = 0; k < d->n; k++) {
        if (d->c[k].job_id == id) {
            return &d->c[k];
        }
    }
    return NULL;
}

/* Job `id` completed in `d` with `success` and `bytes` (the reserved field zero). */
static void check_done_(const done_t *d, uint64_t id, uint32_t success, uint64_t bytes,
                        int line) {
    const kvo_completion *c = find(d, id);
    char what[128];
    snprintf(what, sizeof what, "job %llu completed {success %u, bytes %llu}",
             (unsigned long long)id, success, (unsigned long long)bytes);
    int ok = c != NULL && c->success == success && c->bytes == bytes && c->reserved == 0 &&
             c->seconds >= 0.0;
    check(ok, line, what);
    if (!ok && c != NULL) {
        printf("  got {success %u, bytes %llu, seconds %g, reserved %u}\n", c->success,
               (unsigned long long)c->bytes, c->seconds, c->reserved);
    }
}
#define CHECK_DONE(d, id, success, bytes) check_done_(&(d), (id), (success), (bytes), __LINE__)

/* Nothing left to poll. */
static void check_idle_(kvo_worker *w, int line) {
    kvo_completion c[4];
    size_t n = 99;
    check_status(kvo_worker_poll(w, c, 4, &n), KVO_STATUS_OK, NULL, line, "kvo_worker_poll");
    check(n == 0, line, "no completion left to poll");
    if (n != 0 && n <= 4) {
        for (size_t i = 0; i < n; i++) {
            printf("  left: job %llu\n", (unsigned long long)c[i].job_id);
        }
    }
}
#define CHECK_IDLE(w) check_idle_((w), __LINE__)

/* The host tier buffer of tensor `t`, which must hold `len` bytes. */
static uint8_t *host_buf_(const kvo_worker *w, uint32_t t, size_t len, int line) {
    void *p = NULL;
    size_t n = 0;
    check_status(kvo_worker_get_host_buffer(w, t, &p, &n), KVO_STATUS_OK, NULL, line,
                 "kvo_worker_get_host_buffer");
    check(p != NULL && n == len, line, "host buffer length is slots * page * factor");
    if (p == NULL || n != len) {
        printf("  got %p, %zu bytes; want %zu\n", p, n, len);
        exit(1);
    }
    return p;
}
#define HOST_BUF(w, t, len) host_buf_((w), (t), (len), __LINE__)

/* Sub-block `j` of slot `s` in a host buffer of pages of `page` bytes. */
static size_t sub_off(uint32_t s, uint32_t j, uint64_t page, uint32_t factor) {
    return (size_t)s * (size_t)page * factor + (size_t)j * (size_t)page;
}

/* The host tier image a store of `blocks` (n) into `slots` starting at sub-block `skip` makes
 * in `img` (page `page`, factor `factor`) from tensor `t`'s original bytes. */
static void store_image(uint8_t *img, const tensor_t *t, const uint32_t *blocks, size_t n,
                        const uint32_t *slots, uint32_t skip, uint32_t factor) {
    for (size_t i = 0; i < n; i++) {
        size_t k = skip + i;
        size_t off = sub_off(slots[k / factor], (uint32_t)(k % factor), t->t.page_size, factor);
        memcpy(img + off, orig_block(t, blocks[i]), (size_t)t->t.page_size);
    }
}

/* The job error message of `id`; `want` must be in it. */
static void check_job_error_(const kvo_worker *w, uint64_t id, const char *want, int line) {
    char buf[256];
    size_t len = 0;
    memset(buf, 0, sizeof buf);
    check_status(kvo_worker_job_error(w, id, buf, sizeof buf, &len), KVO_STATUS_OK, NULL, line,
                 "kvo_worker_job_error");
    int ok = len > 0 && len == strlen(buf) && strstr(buf, want) != NULL;
    char what[128];
    snprintf(what, sizeof what, "job %llu error names \"%s\"", (unsigned long long)id, want);
    check(ok, line, what);
    if (!ok) {
        printf("  got \"%s\" (length %zu)\n", buf, len);
    }
}
#define CHECK_JOB_ERROR(w, id, want) check_job_error_((w), (id), (want), __LINE__)

/* ---- tests ------------------------------------------------------------------------------ */

static void test_config_default(void) {
    kvo_worker_config c;
    memset(&c, 0xAB, sizeof c);
    CHECK_OK(kvo_worker_config_default(&c));
    CHECK(c.struct_size == sizeof(kvo_worker_config));
    CHECK(c.block_size_factor == 1 && c.num_host_slots == 0 && c.threads == 4);
    CHECK(c.backend == KVO_BACKEND_HOST && c.device == 0 && c.reserved == 0);
    CHECK_STATUS(kvo_worker_config_default(NULL), KVO_STATUS_NULL_ARGUMENT, "out");
}

/* 1. A store job (random GPU blocks, partial first chunk) lands byte for byte in the host
 * tier; a load job brings it back into other blocks; nothing else moves. */
static void test_store_load(void) {
    tensor_t t0 = tensor_new(NBLOCKS, STRIDE0, PAGE0, 1);
    tensor_t t1 = tensor_new(NBLOCKS, STRIDE1, PAGE1, 2);
    const kvo_kv_tensor ts[2] = {t0.t, t1.t};
    kvo_worker_config c = wcfg(FACTOR, SLOTS);
    kvo_worker *w = NEW_WORKER(&c, ts, 2, NULL);
    const size_t len0 = (size_t)SLOTS * PAGE0 * FACTOR, len1 = (size_t)SLOTS * PAGE1 * FACTOR;
    uint8_t *h0 = HOST_BUF(w, 0, len0);
    uint8_t *h1 = HOST_BUF(w, 1, len1);
    uint8_t *img0 = calloc(1, len0), *img1 = calloc(1, len1);
    uint8_t *want0 = malloc(t0.size), *want1 = malloc(t1.size);
    CHECK(bytes_are(h0, img0, len0, "fresh host buffer 0 (zeroed)"));
    CHECK(bytes_are(h1, img1, len1, "fresh host buffer 1 (zeroed)"));

    /* Store 7 blocks from logical block 4 (4 % 3 == 1: the first chunk starts at sub-block 1),
     * so (7 + 1) / 3 rounded up = 3 slots. */
    uint32_t src[7], slots[3], dst[7];
    random_ids(src, 7, NBLOCKS, NULL, 0);
    random_ids(slots, 3, SLOTS, NULL, 0);
    CHECK_OK(kvo_worker_submit_job(w, 1, KVO_JOB_KIND_STORE, src, 7, slots, 3, 4, 0));
    done_t d = WAIT_POLL(w, 1);
    CHECK(d.n == 1);
    CHECK_DONE(d, 1, 1, 7 * PAGES);
    store_image(img0, &t0, src, 7, slots, 1, FACTOR);
    store_image(img1, &t1, src, 7, slots, 1, FACTOR);
    CHECK(bytes_are(h0, img0, len0, "host buffer 0 after the store"));
    CHECK(bytes_are(h1, img1, len1, "host buffer 1 after the store"));
    /* The skipped sub-block 0 of the first slot stays as it was (zero). */
    CHECK(h0[sub_off(slots[0], 0, PAGE0, FACTOR)] == 0);
    CHECK(h1[sub_off(slots[0], 0, PAGE1, FACTOR)] == 0);
    CHECK_UNTOUCHED(t0);
    CHECK_UNTOUCHED(t1);

    /* Load them back into 7 other blocks, same chunk alignment. */
    random_ids(dst, 7, NBLOCKS, src, 7);
    CHECK_OK(kvo_worker_submit_job(w, 2, KVO_JOB_KIND_LOAD, slots, 3, dst, 7, 4, 0));
    d = WAIT_POLL(w, 2);
    CHECK(d.n == 1);
    CHECK_DONE(d, 2, 1, 7 * PAGES);
    memcpy(want0, t0.orig, t0.size);
    memcpy(want1, t1.orig, t1.size);
    for (size_t i = 0; i < 7; i++) {
        memcpy(want0 + (size_t)dst[i] * STRIDE0, orig_block(&t0, src[i]), PAGE0);
        memcpy(want1 + (size_t)dst[i] * STRIDE1, orig_block(&t1, src[i]), PAGE1);
    }
    /* The loaded pages match, everything else (other blocks, stride padding) is unchanged. */
    CHECK(tensor_is(&t0, want0));
    CHECK(tensor_is(&t1, want1));
    CHECK(bytes_are(h0, img0, len0, "host buffer 0 after the load"));
    CHECK_IDLE(w);

    /* A load that starts mid-slot (block_index 5: skip 2) of a single block. */
    CHECK_OK(kvo_worker_submit_job(w, 3, KVO_JOB_KIND_LOAD, U32S(slots[2]), U32S(31), 5, 0));
    d = WAIT_POLL(w, 3);
    CHECK_DONE(d, 3, 1, PAGES);
    /* Logical sub-block 2 of slot slots[2] is k = 8 of the store: beyond its 7 blocks + 1, so
     * it holds zeros (never written). */
    {
        uint8_t zeros[PAGE0];
        memset(zeros, 0, sizeof zeros);
        CHECK(bytes_are(block(&t0, 31), zeros, PAGE0, "tensor 0 block 31"));
        CHECK(bytes_are(block(&t1, 31), zeros, PAGE1, "tensor 1 block 31"));
        /* tensor 1's padding after block 31's page is untouched */
        CHECK(bytes_are(block(&t1, 31) + PAGE1, orig_block(&t1, 31) + PAGE1, STRIDE1 - PAGE1,
                        "tensor 1 block 31 padding"));
    }
    /* Logical sub-block 1 of slot slots[2] (k = 7, the store's last block src[6]), factor 3:
     * block_index 4 loads it into block 31 again. */
    CHECK_OK(kvo_worker_submit_job(w, 4, KVO_JOB_KIND_LOAD, U32S(slots[2]), U32S(31), 7, 0));
    d = WAIT_POLL(w, 4);
    CHECK_DONE(d, 4, 1, PAGES);
    CHECK(bytes_are(block(&t0, 31), orig_block(&t0, src[6]), PAGE0, "tensor 0 block 31"));
    CHECK(bytes_are(block(&t1, 31), orig_block(&t1, src[6]), PAGE1, "tensor 1 block 31"));

    /* Empty jobs complete with 0 bytes. */
    CHECK_OK(kvo_worker_submit_job(w, 5, KVO_JOB_KIND_STORE, NULL, 0, NULL, 0, 0, 0));
    d = WAIT_POLL(w, 5);
    CHECK_DONE(d, 5, 1, 0);
    CHECK_IDLE(w);

    kvo_worker_free(w);
    free(img0);
    free(img1);
    free(want0);
    free(want1);
    tensor_free(&t0);
    tensor_free(&t1);
}

/* 2. Several jobs per direction complete in submission order; poll hands out at most `cap` and
 * keeps the rest. */
static void test_fifo(void) {
    tensor_t t0 = tensor_new(NBLOCKS, STRIDE0, PAGE0, 3);
    tensor_t t1 = tensor_new(NBLOCKS, STRIDE1, PAGE1, 4);
    const kvo_kv_tensor ts[2] = {t0.t, t1.t};
    kvo_worker_config c = wcfg(1, SLOTS);
    c.threads = 1;
    kvo_worker *w = NEW_WORKER(&c, ts, 2, NULL);

    /* Stores 100..107 (the first one larger), loads 200..207 interleaved with them; the loads
     * read slots 9..15 and write blocks 17..23 and 31, which no store touches. */
    uint32_t all[8];
    for (uint32_t i = 0; i < 8; i++) {
        all[i] = i;
    }
    CHECK_OK(kvo_worker_submit_job(w, 100, KVO_JOB_KIND_STORE, all, 8, all, 8, 0, 0));
    for (uint32_t i = 1; i < 8; i++) {
        CHECK_OK(kvo_worker_submit_job(w, 100 + i, KVO_JOB_KIND_STORE, U32S(i), U32S(i), 0, 0));
        CHECK_OK(kvo_worker_submit_job(w, 200 + i, KVO_JOB_KIND_LOAD, U32S(8 + i), U32S(16 + i),
                                       0, 0));
    }
    CHECK_OK(kvo_worker_submit_job(w, 200, KVO_JOB_KIND_LOAD, U32S(15), U32S(31), 0, 0));

    /* Poll one at a time until all 16 arrived. */
    uint64_t stores[8], loads[8];
    size_t ns = 0, nl = 0, polls = 0;
    CHECK_OK(kvo_worker_wait(w, U64S(100, 101, 102, 103, 104, 105, 106, 107, 200, 201, 202, 203,
                                     204, 205, 206, 207),
                             WAIT_MS));
    while (ns + nl < 16 && polls < 100) {
        kvo_completion one[1];
        size_t n = 99;
        CHECK_OK(kvo_worker_poll(w, one, 1, &n));
        CHECK(n == 1);
        polls++;
        if (n != 1) {
            break;
        }
        CHECK(one[0].success == 1);
        if (one[0].job_id >= 200 && nl < 8) {
            loads[nl++] = one[0].job_id;
        } else if (ns < 8) {
            stores[ns++] = one[0].job_id;
        }
    }
    CHECK(ns == 8 && nl == 8);
    int in_order = 1;
    for (size_t i = 0; i < ns; i++) {
        in_order &= stores[i] == 100 + i;
    }
    CHECK(in_order);
    /* Loads: 201..207 were submitted before 200. */
    CHECK(nl == 8 && loads[0] == 201 && loads[6] == 207 && loads[7] == 200);
    for (size_t i = 0; i + 1 < 7 && nl == 8; i++) {
        CHECK(loads[i] + 1 == loads[i + 1]);
    }
    CHECK_IDLE(w);
    /* Polled ids are no longer known. */
    CHECK_STATUS(kvo_worker_wait(w, U64S(100), WAIT_MS), KVO_STATUS_NOT_FOUND, "100");

    /* A job finished but not handed out yet is still waitable, and stays pollable after a wait;
     * poll with cap 0 (NULL out) hands out nothing. */
    CHECK_OK(kvo_worker_submit_job(w, 300, KVO_JOB_KIND_STORE, U32S(3), U32S(3), 0, 0));
    CHECK_OK(kvo_worker_wait(w, U64S(300), WAIT_MS));
    CHECK_OK(kvo_worker_wait(w, U64S(300), WAIT_MS));
    size_t n0 = 99;
    CHECK_OK(kvo_worker_poll(w, NULL, 0, &n0));
    CHECK(n0 == 0);
    done_t d = WAIT_POLL(w, 300);
    CHECK(d.n == 1);
    CHECK_DONE(d, 300, 1, PAGES);
    /* Waiting for nothing is fine. */
    CHECK_OK(kvo_worker_wait(w, NULL, 0, 0));

    kvo_worker_free(w);
    tensor_free(&t0);
    tensor_free(&t1);
}

/* 3. A job of several MiB (split across threads) is byte-exact. */
static void test_large_job(void) {
    const uint32_t nb = 40;
    const uint64_t page = 128 * 1024 + 8, stride = page + 56;
    tensor_t t = tensor_new(nb, stride, page, 5);
    kvo_worker_config c = wcfg(1, nb);
    c.threads = 4;
    kvo_worker *w = NEW_WORKER(&c, &t.t, 1, NULL);
    uint32_t src[40], dst[40];
    random_ids(src, nb, nb, NULL, 0);
    random_ids(dst, nb, nb, NULL, 0);
    CHECK_OK(kvo_worker_submit_job(w, 1, KVO_JOB_KIND_STORE, src, nb, dst, nb, 0, 0));
    done_t d = WAIT_POLL(w, 1);
    CHECK_DONE(d, 1, 1, (uint64_t)nb * page);
    uint8_t *h = HOST_BUF(w, 0, (size_t)nb * page);
    int ok = 1;
    for (uint32_t i = 0; i < nb && ok; i++) {
        ok = bytes_are(h + (size_t)dst[i] * page, orig_block(&t, src[i]), page, "large store");
    }
    CHECK(ok);
    /* Load everything back shifted by one block (slot i -> block (i + 1) % nb). */
    uint32_t slots[40], blocks[40];
    for (uint32_t i = 0; i < nb; i++) {
        slots[i] = i;
        blocks[i] = (i + 1) % nb;
    }
    CHECK_OK(kvo_worker_submit_job(w, 2, KVO_JOB_KIND_LOAD, slots, nb, blocks, nb, 0, 0));
    d = WAIT_POLL(w, 2);
    CHECK_DONE(d, 2, 1, (uint64_t)nb * page);
    uint8_t *want = malloc(t.size);
    memcpy(want, t.orig, t.size);
    for (uint32_t i = 0; i < nb; i++) {
        /* slot dst[i] holds block src[i]; it goes to block (dst[i] + 1) % nb */
        memcpy(want + (size_t)((dst[i] + 1) % nb) * stride, orig_block(&t, src[i]), page);
    }
    CHECK(tensor_is(&t, want));
    free(want);
    kvo_worker_free(w);
    tensor_free(&t);
}

/* ---- a whole step from the scheduler ------------------------------------------------------ */

static void put_u64(uint8_t *dst, uint64_t v) {
    for (int i = KEY_LEN - 1; i >= 0; i--) {
        dst[i] = (uint8_t)(v & 0xff);
        v >>= 8;
    }
}

/* Adds request `id` of `tokens` prompt tokens hashed from `seed` (hash of block i: seed*1e6+i). */
static void add_request(kvo_scheduler *s, uint64_t id, uint64_t seed, uint64_t tokens) {
    uint8_t h[MAX_IDS * KEY_LEN];
    size_t n = (size_t)(tokens / GBS);
    for (size_t i = 0; i < n; i++) {
        put_u64(h + i * KEY_LEN, seed * 1000000u + i);
    }
    CHECK_OK(kvo_scheduler_add_request(s, id, tokens, KVO_NO_LIMIT));
    CHECK_OK(kvo_scheduler_append_block_hashes(s, id, h, n, tokens));
}

typedef struct {
    kvo_job_info info;
    uint32_t src[MAX_IDS], dst[MAX_IDS];
} job_t;

static job_t get_job(const kvo_step *st, size_t i) {
    job_t j;
    memset(&j, 0, sizeof j);
    CHECK_OK(kvo_step_get_job(st, i, &j.info));
    if (j.info.n_src <= MAX_IDS && j.info.n_dst <= MAX_IDS) {
        CHECK_OK(kvo_step_get_job_blocks(st, i, j.src, j.info.n_src, j.dst, j.info.n_dst));
    }
    return j;
}

/* What a worker process does with a plan it received: decode, submit, wait, poll, and hand the
 * completions back (as reports) to the scheduler. Returns the completions. */
static done_t run_step_on_worker(kvo_scheduler *s, const kvo_step *plan, kvo_worker *w) {
    uint8_t bytes[STEP_BYTES];
    size_t len = 0;
    CHECK_OK(kvo_step_encode(plan, bytes, sizeof bytes, &len));
    kvo_step *recv = NULL;
    CHECK_OK(kvo_step_new(&recv));
    CHECK_OK(kvo_step_decode(recv, bytes, len));
    kvo_step_info info;
    memset(&info, 0, sizeof info);
    CHECK_OK(kvo_step_get_info(recv, &info));
    uint64_t ids[MAX_IDS];
    for (size_t i = 0; i < info.num_jobs && i < MAX_IDS; i++) {
        ids[i] = get_job(recv, i).info.id;
    }
    CHECK_OK(kvo_worker_submit_step(w, recv, 0));
    kvo_step_free(recv); /* the worker keeps nothing of the plan */
    done_t d = wait_poll_(w, ids, info.num_jobs, __LINE__);
    CHECK(d.n == info.num_jobs);
    kvo_job_report reps[MAX_DONE];
    for (size_t i = 0; i < d.n; i++) {
        reps[i].job_id = d.c[i].job_id;
        reps[i].count = 1;
        reps[i].success = d.c[i].success;
    }
    CHECK_OK(kvo_scheduler_complete_jobs(s, reps, d.n));
    CHECK_OK(kvo_scheduler_check_invariants(s));
    return d;
}

/* 4. Request 1 stores 3 chunks through a step executed by the worker; request 2 shares the
 * prefix, hits after a 1-block GPU hit, and its load (a partial first chunk) brings the exact
 * bytes back into its own GPU blocks. */
static void test_scheduler_step(void) {
    tensor_t t0 = tensor_new(NBLOCKS, STRIDE0, PAGE0, 6);
    tensor_t t1 = tensor_new(NBLOCKS, STRIDE1, PAGE1, 7);
    const kvo_kv_tensor ts[2] = {t0.t, t1.t};
    kvo_worker_config c = wcfg(FACTOR, SLOTS);
    kvo_worker *w = NEW_WORKER(&c, ts, 2, NULL);

    kvo_scheduler_config sc;
    memset(&sc, 0, sizeof sc);
    CHECK_OK(kvo_scheduler_config_default(&sc));
    sc.key_len = KEY_LEN;
    sc.gpu_block_size = GBS;
    sc.block_size_factor = FACTOR;
    sc.num_slots = SLOTS;
    sc.offload_prompt_only = 0;
    kvo_scheduler *s = NULL;
    CHECK_OK(kvo_scheduler_new(&sc, &s));
    kvo_step *st = NULL;
    CHECK_OK(kvo_step_new(&st));
    if (s == NULL || st == NULL) {
        exit(1);
    }

    /* Request 1: 36 tokens = 9 GPU blocks (random ids) = 3 chunks. */
    uint32_t b1[9], b2[10];
    random_ids(b1, 9, NBLOCKS, NULL, 0);
    random_ids(b2, 10, NBLOCKS, b1, 9);
    add_request(s, 1, 3, 36);
    kvo_match_result m = {99, 99, 99};
    CHECK_OK(kvo_scheduler_match(s, 1, 0, &m));
    CHECK(m.kind == KVO_MATCH_MISS);
    uint32_t has_job = 9;
    uint64_t job = 0;
    CHECK_OK(kvo_scheduler_on_alloc(s, 1, b1, 9, 0, &has_job, &job));
    CHECK(has_job == 0);
    kvo_scheduled_request r;
    memset(&r, 0, sizeof r);
    r.request_id = 1;
    r.num_scheduled_tokens = 36;
    r.num_tokens = 36;
    r.new_block_ids = b1;
    r.n_new_block_ids = 9;
    CHECK_OK(kvo_scheduler_build_step(s, &r, 1, NULL, 0, st));
    job_t j = get_job(st, 0);
    CHECK(j.info.kind == KVO_JOB_KIND_STORE && j.info.group_size == 9 && j.info.n_dst == 3);
    const uint64_t store_id = j.info.id;
    uint32_t store_slots[3] = {j.dst[0], j.dst[1], j.dst[2]};

    done_t d = run_step_on_worker(s, st, w);
    CHECK_DONE(d, store_id, 1, 9 * PAGES);
    {
        const size_t len0 = (size_t)SLOTS * PAGE0 * FACTOR, len1 = (size_t)SLOTS * PAGE1 * FACTOR;
        uint8_t *img0 = calloc(1, len0), *img1 = calloc(1, len1);
        store_image(img0, &t0, b1, 9, store_slots, 0, FACTOR);
        store_image(img1, &t1, b1, 9, store_slots, 0, FACTOR);
        CHECK(bytes_are(HOST_BUF(w, 0, len0), img0, len0, "host buffer 0 after the step"));
        CHECK(bytes_are(HOST_BUF(w, 1, len1), img1, len1, "host buffer 1 after the step"));
        free(img0);
        free(img1);
    }
    CHECK_UNTOUCHED(t0);
    CHECK_UNTOUCHED(t1);
    CHECK_OK(kvo_scheduler_finish_request(s, 1));

    /* The chunks are loadable: request 2 (40 tokens, same prefix) with one GPU block hit. */
    add_request(s, 2, 3, 40);
    CHECK_OK(kvo_scheduler_match(s, 2, GBS, &m));
    CHECK(m.kind == KVO_MATCH_HIT && m.tokens == 32);
    CHECK_OK(kvo_scheduler_on_alloc(s, 2, b2, 10, 32, &has_job, &job));
    CHECK(has_job == 1);
    CHECK_OK(kvo_scheduler_build_step(s, NULL, 0, NULL, 0, st));
    j = get_job(st, 0);
    CHECK(j.info.kind == KVO_JOB_KIND_LOAD && j.info.id == job && j.info.block_index == 1 &&
          j.info.group_size == 8 && j.info.n_src == 3 && j.info.n_dst == 8);
    CHECK(j.src[0] == store_slots[0] && j.src[1] == store_slots[1] && j.src[2] == store_slots[2]);

    d = run_step_on_worker(s, st, w);
    CHECK_DONE(d, job, 1, 8 * PAGES);
    {
        uint8_t *want0 = malloc(t0.size), *want1 = malloc(t1.size);
        memcpy(want0, t0.orig, t0.size);
        memcpy(want1, t1.orig, t1.size);
        for (size_t i = 1; i < 9; i++) { /* GPU block i of request 2 = block i of request 1 */
            memcpy(want0 + (size_t)b2[i] * STRIDE0, orig_block(&t0, b1[i]), PAGE0);
            memcpy(want1 + (size_t)b2[i] * STRIDE1, orig_block(&t1, b1[i]), PAGE1);
        }
        CHECK(tensor_is(&t0, want0));
        CHECK(tensor_is(&t1, want1));
        free(want0);
        free(want1);
    }
    kvo_scheduler_stats stats;
    memset(&stats, 0, sizeof stats);
    stats.struct_size = sizeof stats;
    CHECK_OK(kvo_scheduler_get_stats(s, &stats));
    CHECK(stats.loads_in_flight == 0 && stats.stores_in_flight == 0 && stats.failed_jobs == 0);
    CHECK(stats.manager.pinned == 0 && stats.manager.ready == 3);

    /* A plan whose block_size_factor differs from the worker's is refused, nothing submitted. */
    kvo_worker_config c1 = wcfg(1, SLOTS);
    kvo_worker *w1 = NEW_WORKER(&c1, ts, 2, NULL);
    CHECK_STATUS(kvo_worker_submit_step(w1, st, 0), KVO_STATUS_INVALID_ARGUMENT,
                 "block_size_factor");
    CHECK_IDLE(w1);
    /* A plan with a job id already in flight on the worker: INVALID_STATE, nothing submitted. */
    CHECK_OK(kvo_worker_submit_job(w1, job, KVO_JOB_KIND_STORE, U32S(0), U32S(0), 0, 0));
    kvo_worker *w3 = NEW_WORKER(&c, ts, 2, NULL);
    uint8_t *snap0 = malloc(t0.size), *snap1 = malloc(t1.size);
    for (size_t i = 0; i < 10; i++) { /* what the plan's load would overwrite */
        memset(block(&t0, b2[i]), 0x5A, PAGE0);
        memset(block(&t1, b2[i]), 0x5A, PAGE1);
    }
    memcpy(snap0, t0.mem, t0.size);
    memcpy(snap1, t1.mem, t1.size);
    CHECK_OK(kvo_worker_submit_job(w3, job, KVO_JOB_KIND_STORE, U32S(0), U32S(0), 0, 0));
    CHECK_STATUS(kvo_worker_submit_step(w3, st, 0), KVO_STATUS_INVALID_STATE, "job_id");
    d = WAIT_POLL(w3, job);
    CHECK(d.n == 1);
    CHECK_DONE(d, job, 1, PAGES);
    CHECK_IDLE(w3);
    CHECK(tensor_is(&t0, snap0));
    CHECK(tensor_is(&t1, snap1));
    free(snap0);
    free(snap1);
    /* An empty plan is fine whatever its factor. */
    kvo_step *empty = NULL;
    CHECK_OK(kvo_step_new(&empty));
    CHECK_OK(kvo_worker_submit_step(w1, empty, 0));
    CHECK_STATUS(kvo_worker_submit_step(NULL, empty, 0), KVO_STATUS_NULL_ARGUMENT, "worker");
    CHECK_STATUS(kvo_worker_submit_step(w1, NULL, 0), KVO_STATUS_NULL_ARGUMENT, "step");
    kvo_step_free(empty);
    kvo_worker_free(w3);
    kvo_worker_free(w1);

    kvo_step_free(st);
    kvo_scheduler_free(s);
    kvo_worker_free(w);
    tensor_free(&t0);
    tensor_free(&t1);
}

/* ---- bad input, as tables (check.h) ------------------------------------------------------ */

#define MAX_REGIONS 6
#define LEN0 ((size_t)SLOTS * PAGE0 * FACTOR) /* host tier buffer of a tensor of PAGE0 pages */
#define LEN1 ((size_t)SLOTS * PAGE1 * FACTOR)

/* The outputs a case may be given; outputs_reset fills them with 0xA5 before each case. */
typedef struct {
    char buf[256];
    size_t len, n, host_len;
    void *host_ptr;
    kvo_completion done[2];
} outputs;

struct fixture {
    kvo_worker *w; /* NULL for the kvo_worker_new cases */
    kvo_worker_stats before;
    /* Memory no case may change (tensors, host tier buffers), and its bytes before the case. */
    struct {
        const uint8_t *mem;
        size_t len;
        uint8_t *copy;
    } region[MAX_REGIONS];
    size_t n_regions;
    outputs o;
    tensor_t *t0, *t1;
    /* kvo_worker_new cases: the good arguments, edited by the case, and *out. */
    kvo_worker_config good, cfg;
    kvo_kv_tensor ok[2], ts[2];
    kvo_host_buffer host_ok[2], hb[2];
    kvo_worker *out;
};

static void outputs_reset(outputs *o) {
    memset(o, 0xA5, sizeof *o);
}

/* The case wrote no output; prints the first byte it wrote. */
static int outputs_kept(const fixture *f) {
    outputs ref;
    outputs_reset(&ref);
    return bytes_kept(&f->o, &ref, sizeof ref);
}
#define KEPT outputs_kept(f)

/* IDS(1, 2): an array of block ids or slots. */
#define IDS(...) ((const uint32_t[]){__VA_ARGS__})

/* `mem` (len bytes) must not change in any case. */
static void watch(fixture *f, const void *mem, size_t len) {
    if (f->n_regions == MAX_REGIONS) {
        printf("too many regions\n");
        exit(2);
    }
    f->region[f->n_regions].mem = mem;
    f->region[f->n_regions].len = len;
    f->region[f->n_regions].copy = malloc(len);
    f->n_regions++;
}

static void fixture_free(fixture *f) {
    for (size_t i = 0; i < f->n_regions; i++) {
        free(f->region[i].copy);
    }
    f->n_regions = 0;
}

static kvo_worker_stats worker_stats(const kvo_worker *w) {
    kvo_worker_stats s;
    memset(&s, 0, sizeof s);
    s.struct_size = sizeof s;
    CHECK_OK(kvo_worker_get_stats(w, &s));
    return s;
}

/* Before each case: the worker's stats and the watched bytes, fresh outputs; after it: the same
 * stats (no job taken, handed out or counted) and bytes (nothing copied). */
static void worker_before(fixture *f) {
    if (f->w != NULL) {
        f->before = worker_stats(f->w);
    }
    for (size_t i = 0; i < f->n_regions; i++) {
        memcpy(f->region[i].copy, f->region[i].mem, f->region[i].len);
    }
    outputs_reset(&f->o);
}
static void worker_after(fixture *f, int line, const char *what) {
    if (f->w != NULL) {
        kvo_worker_stats after = worker_stats(f->w);
        int same = memcmp(&f->before, &after, sizeof after) == 0;
        check(same, line, "the case changed the worker's stats");
        if (!same) {
            printf("  %s: jobs in flight %llu -> %llu\n", what,
                   (unsigned long long)f->before.jobs_in_flight,
                   (unsigned long long)after.jobs_in_flight);
        }
    }
    for (size_t i = 0; i < f->n_regions; i++) {
        check(bytes_are(f->region[i].mem, f->region[i].copy, f->region[i].len, "watched bytes"),
              line, "the case left the tensors and host buffers alone");
    }
}
static const fixture_hooks worker_hooks = {worker_before, worker_after};

/* Bad swaps (tensors 0 and 2 have pages of 64 bytes, tensor 1 of 40; tensor 2 has 8 blocks):
 * exact status, a message naming the argument, nothing copied or queued. */
#define BAD_SWAPS(X)                                                                            \
    X(swap_pages, kvo_worker_swap_blocks(f->w, 0, 1, IDS(0), IDS(0), 1, 0, 0),                  \
      INVALID_ARGUMENT, "page", KEPT)                                                           \
    X(swap_job_pages, kvo_worker_swap_blocks(f->w, 1, 0, IDS(0), IDS(0), 1, 1, 60),             \
      INVALID_ARGUMENT, "page", KEPT)                                                           \
    X(swap_dst_tensor, kvo_worker_swap_blocks(f->w, 0, 3, IDS(0), IDS(0), 1, 0, 0),             \
      INVALID_ARGUMENT, "dst_tensor", KEPT)                                                     \
    X(swap_src_tensor, kvo_worker_swap_blocks(f->w, 7, 0, IDS(0), IDS(0), 1, 1, 61),            \
      INVALID_ARGUMENT, "src_tensor", KEPT)                                                     \
    X(swap_src_block, kvo_worker_swap_blocks(f->w, 0, 0, IDS(NBLOCKS), IDS(0), 1, 0, 0),        \
      INVALID_ARGUMENT, "src_blocks", KEPT)                                                     \
    X(swap_dst_block, kvo_worker_swap_blocks(f->w, 0, 2, IDS(0), IDS(8), 1, 1, 62),             \
      INVALID_ARGUMENT, "dst_blocks", KEPT)                                                     \
    X(swap_no_src, kvo_worker_swap_blocks(f->w, 0, 2, NULL, IDS(0), 1, 0, 0), NULL_ARGUMENT,    \
      "src_blocks", KEPT)                                                                       \
    X(swap_no_dst, kvo_worker_swap_blocks(f->w, 0, 2, IDS(0), NULL, 1, 0, 0), NULL_ARGUMENT,    \
      "dst_blocks", KEPT)                                                                       \
    X(swap_no_worker, kvo_worker_swap_blocks(NULL, 0, 2, IDS(0), IDS(0), 1, 0, 0),              \
      NULL_ARGUMENT, "worker", KEPT)                                                            \
    X(swap_same_block, /* read and written by one swap (copies of a job have no order) */       \
      kvo_worker_swap_blocks(f->w, 2, 2, IDS(0), IDS(0), 1, 0, 0), INVALID_ARGUMENT,            \
      "also a source", KEPT)
CASE_TABLE(bad_swaps, BAD_SWAPS);

/* ---- swaps and caller buffers ------------------------------------------------------------ */


/* 5. kvo_worker_swap_blocks, synchronous and as a job, and its bad inputs. */
static void test_swap(void) {
    tensor_t t0 = tensor_new(NBLOCKS, STRIDE0, PAGE0, 8);
    tensor_t t1 = tensor_new(NBLOCKS, STRIDE1, PAGE1, 9);
    tensor_t t2 = tensor_new(8, 128, PAGE0, 10); /* t0's page size, another stride */
    const kvo_kv_tensor ts[3] = {t0.t, t1.t, t2.t};
    kvo_worker_config c = wcfg(FACTOR, SLOTS);
    kvo_worker *w = NEW_WORKER(&c, ts, 3, NULL);
    uint8_t *want0 = malloc(t0.size), *want2 = malloc(t2.size);
    memcpy(want0, t0.orig, t0.size);
    memcpy(want2, t2.orig, t2.size);

    /* Synchronous: done when the call returns, nothing to poll. */
    const uint32_t s1[2] = {1, 5}, d1[2] = {7, 0};
    CHECK_OK(kvo_worker_swap_blocks(w, 0, 2, s1, d1, 2, 0, 0));
    memcpy(want2 + 7 * 128, orig_block(&t0, 1), PAGE0);
    memcpy(want2 + 0 * 128, orig_block(&t0, 5), PAGE0);
    CHECK(tensor_is(&t2, want2));
    CHECK_UNTOUCHED(t0);
    CHECK_IDLE(w);
    /* Zero blocks: nothing happens. */
    CHECK_OK(kvo_worker_swap_blocks(w, 0, 2, NULL, NULL, 0, 0, 0));
    CHECK_IDLE(w);

    /* As a job, within one tensor (consecutive blocks) and back from t2 into t0. */
    const uint32_t s2[2] = {2, 3}, d2[2] = {20, 21};
    const uint32_t s3[3] = {6, 7, 2}, d3[3] = {30, 9, 31};
    CHECK_OK(kvo_worker_swap_blocks(w, 0, 0, s2, d2, 2, 1, 50));
    CHECK_OK(kvo_worker_swap_blocks(w, 2, 0, s3, d3, 3, 1, 51));
    /* A job id in flight (not polled yet) cannot be reused, by a swap or a job. */
    CHECK_STATUS(kvo_worker_swap_blocks(w, 0, 0, s2, d2, 2, 1, 50), KVO_STATUS_INVALID_STATE,
                 "job_id");
    CHECK_STATUS(kvo_worker_submit_job(w, 51, KVO_JOB_KIND_STORE, U32S(0), U32S(0), 0, 0),
                 KVO_STATUS_INVALID_STATE, "job_id");
    done_t d = WAIT_POLL(w, 50, 51);
    CHECK(d.n == 2);
    CHECK_DONE(d, 50, 1, 2 * PAGE0);
    CHECK_DONE(d, 51, 1, 3 * PAGE0);
    memcpy(want0 + 20 * STRIDE0, orig_block(&t0, 2), PAGE0);
    memcpy(want0 + 21 * STRIDE0, orig_block(&t0, 3), PAGE0);
    memcpy(want0 + 30 * STRIDE0, want2 + 6 * 128, PAGE0);
    memcpy(want0 + 9 * STRIDE0, want2 + 7 * 128, PAGE0); /* t2 block 7 = t0 block 1 by now */
    memcpy(want0 + 31 * STRIDE0, want2 + 2 * 128, PAGE0);
    CHECK(tensor_is(&t0, want0));
    CHECK(tensor_is(&t2, want2));

    /* Bad swaps: the table BAD_SWAPS. */
    fixture f;
    memset(&f, 0, sizeof f);
    f.w = w;
    watch(&f, t0.mem, t0.size);
    watch(&f, t1.mem, t1.size);
    watch(&f, t2.mem, t2.size);
    watch(&f, HOST_BUF(w, 0, LEN0), LEN0);
    watch(&f, HOST_BUF(w, 1, LEN1), LEN1);
    watch(&f, HOST_BUF(w, 2, LEN0), LEN0);
    RUN_CASES(&f, &worker_hooks, bad_swaps);
    fixture_free(&f);
    CHECK(tensor_is(&t0, want0));
    CHECK(tensor_is(&t2, want2));
    CHECK_UNTOUCHED(t1);
    CHECK_IDLE(w);
    /* The ids of refused swap jobs were not taken. */
    CHECK_OK(kvo_worker_swap_blocks(w, 0, 2, IDS(0), IDS(0), 1, 1, 60));
    d = WAIT_POLL(w, 60);
    CHECK_DONE(d, 60, 1, PAGE0);

    free(want0);
    free(want2);
    kvo_worker_free(w);
    tensor_free(&t0);
    tensor_free(&t1);
    tensor_free(&t2);
}

/* 6. Caller-provided host buffers: used in place, reported back, left to the caller. */
static void test_caller_buffers(void) {
    tensor_t t0 = tensor_new(NBLOCKS, STRIDE0, PAGE0, 11);
    tensor_t t1 = tensor_new(NBLOCKS, STRIDE1, PAGE1, 12);
    const kvo_kv_tensor ts[2] = {t0.t, t1.t};
    const size_t len0 = (size_t)SLOTS * PAGE0 * FACTOR, len1 = (size_t)SLOTS * PAGE1 * FACTOR;
    uint8_t *m0 = aligned_alloc(64, len0); /* len0 is a multiple of 64 */
    uint8_t *m1 = malloc(len1 + 24); /* longer than needed: fine */
    uint8_t *img0 = malloc(len0), *img1 = malloc(len1 + 24);
    memset(m0, 0xEE, len0);
    memset(m1, 0xDD, len1 + 24);
    memcpy(img0, m0, len0);
    memcpy(img1, m1, len1 + 24);
    kvo_host_buffer hb[2] = {{m0, len0}, {m1, len1 + 24}};
    kvo_worker_config c = wcfg(FACTOR, SLOTS);
    kvo_worker *w = NEW_WORKER(&c, ts, 2, hb);
    CHECK(HOST_BUF(w, 0, len0) == m0);
    CHECK(HOST_BUF(w, 1, len1 + 24) == m1);
    CHECK(bytes_are(m0, img0, len0, "caller buffer 0 before any job"));

    /* A store of 4 blocks from logical block 2 (skip 2): slots 15 (the last one) and 0. */
    const uint32_t src[4] = {9, 2, 30, 17}, slots[2] = {15, 0};
    CHECK_OK(kvo_worker_submit_job(w, 1, KVO_JOB_KIND_STORE, src, 4, slots, 2, 2, 0));
    done_t d = WAIT_POLL(w, 1);
    CHECK_DONE(d, 1, 1, 4 * PAGES);
    store_image(img0, &t0, src, 4, slots, 2, FACTOR);
    store_image(img1, &t1, src, 4, slots, 2, FACTOR);
    CHECK(bytes_are(m0, img0, len0, "caller buffer 0 after the store"));
    CHECK(bytes_are(m1, img1, len1 + 24, "caller buffer 1 after the store (tail untouched)"));

    /* Load back into blocks 0..3. */
    const uint32_t dst[4] = {0, 1, 3, 4};
    CHECK_OK(kvo_worker_submit_job(w, 2, KVO_JOB_KIND_LOAD, slots, 2, dst, 4, 2, 0));
    d = WAIT_POLL(w, 2);
    CHECK_DONE(d, 2, 1, 4 * PAGES);
    for (size_t i = 0; i < 4; i++) {
        CHECK(bytes_are(block(&t0, dst[i]), orig_block(&t0, src[i]), PAGE0, "loaded page"));
        CHECK(bytes_are(block(&t1, dst[i]), orig_block(&t1, src[i]), PAGE1, "loaded page"));
    }
    CHECK(bytes_are(block(&t0, 2), orig_block(&t0, 2), PAGE0, "block 2 untouched"));
    kvo_worker_free(w);
    /* The buffers are still the caller's (valgrind flags a free by the library). */
    CHECK(bytes_are(m0, img0, len0, "caller buffer 0 after kvo_worker_free"));
    free(m0);
    free(m1);
    free(img0);
    free(img1);
    tensor_free(&t0);
    tensor_free(&t1);
}

/* kvo_worker_new's arguments: the good ones edited by `edit` (the case's one bad field). */
#define CFG(edit) ((edit), &f->cfg)
#define TS(edit) ((edit), f->ts)
#define HB(edit) ((edit), f->hb)
#define SENTINEL ((kvo_worker *)(uintptr_t)0x1230)
#define NO_HANDLE (f->out == SENTINEL)

static void new_before(fixture *f) {
    f->cfg = f->good;
    memcpy(f->ts, f->ok, sizeof f->ts);
    memcpy(f->hb, f->host_ok, sizeof f->hb);
    f->out = SENTINEL;
    worker_before(f);
}
static void new_after(fixture *f, int line, const char *what) {
    if (f->out != SENTINEL && f->out != NULL) {
        kvo_worker_free(f->out);
    }
    worker_after(f, line, what);
}
static const fixture_hooks new_hooks = {new_before, new_after};

/* 7. kvo_worker_new refuses bad configs and registrations: NULL pointers, config fields,
 * tensors (overlapping, repeated, empty, misaligned, on a device), caller host buffers (too
 * small, NULL, sized for another factor); no handle written, no memory touched. */
#define BAD_NEW(X)                                                                              \
    X(no_cfg, kvo_worker_new(NULL, f->ts, 2, NULL, &f->out), NULL_ARGUMENT, "cfg", NO_HANDLE)   \
    X(no_tensors, kvo_worker_new(&f->cfg, NULL, 2, NULL, &f->out), NULL_ARGUMENT, "tensors",    \
      NO_HANDLE)                                                                                \
    X(no_out, kvo_worker_new(&f->cfg, f->ts, 2, NULL, NULL), NULL_ARGUMENT, "out", NO_HANDLE)   \
    X(size_short, kvo_worker_new(CFG(f->cfg.struct_size = sizeof f->cfg - 1), f->ts, 2, NULL,   \
                                 &f->out),                                                      \
      INVALID_ARGUMENT, "struct_size", NO_HANDLE)                                               \
    X(size_0, kvo_worker_new(CFG(f->cfg.struct_size = 0), f->ts, 2, NULL, &f->out),             \
      INVALID_ARGUMENT, "struct_size", NO_HANDLE)                                               \
    X(factor_0, kvo_worker_new(CFG(f->cfg.block_size_factor = 0), f->ts, 2, NULL, &f->out),     \
      INVALID_ARGUMENT, "block_size_factor", NO_HANDLE)                                         \
    X(slots_0, kvo_worker_new(CFG(f->cfg.num_host_slots = 0), f->ts, 2, NULL, &f->out),         \
      INVALID_ARGUMENT, "num_host_slots", NO_HANDLE)                                            \
    X(backend, kvo_worker_new(CFG(f->cfg.backend = 7), f->ts, 2, NULL, &f->out),                \
      INVALID_ARGUMENT, "backend", NO_HANDLE)                                                   \
    X(no_tensor, kvo_worker_new(&f->cfg, f->ts, 0, NULL, &f->out), INVALID_ARGUMENT, "tensors", \
      NO_HANDLE)                                                                                \
    X(no_tensor_null, kvo_worker_new(&f->cfg, NULL, 0, NULL, &f->out), INVALID_ARGUMENT,        \
      "tensors", NO_HANDLE)                                                                     \
    X(overlap, /* tensor 1 starts inside tensor 0's last page */                                \
      kvo_worker_new(&f->cfg,                                                                   \
                     TS((f->ts[1].base = f->ts[0].base + (NBLOCKS - 1) * STRIDE0 + 8,           \
                         f->ts[1].num_blocks = 1)),                                             \
                     2, NULL, &f->out),                                                         \
      INVALID_ARGUMENT, "overlaps", NO_HANDLE)                                                  \
    X(same_twice, kvo_worker_new(&f->cfg, TS(f->ts[1] = f->ts[0]), 2, NULL, &f->out),           \
      INVALID_ARGUMENT, "tensors[1]", NO_HANDLE)                                                \
    X(page_0, kvo_worker_new(&f->cfg, TS(f->ts[0].page_size = 0), 2, NULL, &f->out),            \
      INVALID_ARGUMENT, "tensors[0]", NO_HANDLE)                                                \
    X(blocks_0, kvo_worker_new(&f->cfg, TS(f->ts[1].num_blocks = 0), 2, NULL, &f->out),         \
      INVALID_ARGUMENT, "tensors[1]", NO_HANDLE)                                                \
    X(stride_unaligned, /* >= page 40, not a multiple of 8 */                                   \
      kvo_worker_new(&f->cfg, TS(f->ts[1].block_stride = 60), 2, NULL, &f->out),                \
      INVALID_ARGUMENT, "block_stride", NO_HANDLE)                                              \
    X(stride_short, /* < page 40 */                                                             \
      kvo_worker_new(&f->cfg, TS(f->ts[1].block_stride = 32), 2, NULL, &f->out),                \
      INVALID_ARGUMENT, "block_stride", NO_HANDLE)                                              \
    X(base_misaligned, kvo_worker_new(&f->cfg, TS(f->ts[0].base += 4), 2, NULL, &f->out),       \
      INVALID_ARGUMENT, "base", NO_HANDLE)                                                      \
    X(base_0, kvo_worker_new(&f->cfg, TS(f->ts[0].base = 0), 2, NULL, &f->out),                 \
      INVALID_ARGUMENT, "tensors[0].base", NO_HANDLE)                                           \
    X(extent_overflow,                                                                          \
      kvo_worker_new(&f->cfg, TS(f->ts[0].base = UINT64_MAX - 7), 2, NULL, &f->out),            \
      INVALID_ARGUMENT, "tensors[0]", NO_HANDLE)                                                \
    X(on_device, kvo_worker_new(&f->cfg, TS(f->ts[1].on_device = 1), 2, NULL, &f->out),         \
      INVALID_ARGUMENT, "tensors[1]", NO_HANDLE)                                                \
    X(host_short, kvo_worker_new(&f->cfg, f->ts, 2, HB(f->hb[1].len = LEN1 - 1), &f->out),      \
      INVALID_ARGUMENT, "host_buffers[1]", NO_HANDLE)                                           \
    X(host_null, kvo_worker_new(&f->cfg, f->ts, 2, HB(f->hb[0].ptr = NULL), &f->out),           \
      INVALID_ARGUMENT, "host_buffers[0]", NO_HANDLE)                                           \
    X(host_factor_1, /* a host buffer for a factor-3 tier sized for factor 1 */                 \
      kvo_worker_new(&f->cfg, f->ts, 2, HB(f->hb[0].len = (size_t)SLOTS * PAGE0), &f->out),     \
      INVALID_ARGUMENT, "host_buffers[0]", NO_HANDLE)
CASE_TABLE(bad_new, BAD_NEW);

static void test_bad_new(void) {
    tensor_t t0 = tensor_new(NBLOCKS, STRIDE0, PAGE0, 13);
    tensor_t t1 = tensor_new(NBLOCKS, STRIDE1, PAGE1, 14);
    uint8_t *m0 = malloc(LEN0), *m1 = malloc(LEN1);
    memset(m0, 0x11, LEN0);
    memset(m1, 0x22, LEN1);
    fixture f;
    memset(&f, 0, sizeof f);
    f.good = wcfg(FACTOR, SLOTS);
    f.ok[0] = t0.t;
    f.ok[1] = t1.t;
    f.host_ok[0] = (kvo_host_buffer){m0, LEN0};
    f.host_ok[1] = (kvo_host_buffer){m1, LEN1};
    watch(&f, t0.mem, t0.size);
    watch(&f, t1.mem, t1.size);
    watch(&f, m0, LEN0);
    watch(&f, m1, LEN1);

    RUN_CASES(&f, &new_hooks, bad_new);

    CHECK(tensor_is(&t0, t0.orig) && tensor_is(&t1, t1.orig));
    int untouched = 1;
    for (size_t i = 0; i < LEN0; i++) {
        untouched &= m0[i] == 0x11;
    }
    for (size_t i = 0; i < LEN1; i++) {
        untouched &= m1[i] == 0x22;
    }
    CHECK(untouched);
    fixture_free(&f);
    free(m0);
    free(m1);

    /* The good registration works after all these. */
    kvo_worker *w = NEW_WORKER(&f.good, f.ok, 2, NULL);
    kvo_worker_free(w);
    kvo_worker_free(NULL);
    tensor_free(&t0);
    tensor_free(&t1);
}

/* 8. Bad calls on a live worker (tensors 0 and 1, 16 host slots, factor 3). First on an idle
 * one: NULL arguments and unknown kinds are refused at submit, and take no job id. */
#define IDLE(X)                                                                                 \
    X(submit_no_worker,                                                                         \
      kvo_worker_submit_job(NULL, 1, KVO_JOB_KIND_STORE, IDS(1, 2), 2, IDS(1, 2), 1, 0, 0),     \
      NULL_ARGUMENT, "worker", KEPT)                                                            \
    X(submit_no_src,                                                                            \
      kvo_worker_submit_job(f->w, 1, KVO_JOB_KIND_STORE, NULL, 2, IDS(1, 2), 1, 0, 0),          \
      NULL_ARGUMENT, "src", KEPT)                                                               \
    X(submit_no_dst,                                                                            \
      kvo_worker_submit_job(f->w, 1, KVO_JOB_KIND_STORE, IDS(1, 2), 2, NULL, 1, 0, 0),          \
      NULL_ARGUMENT, "dst", KEPT)                                                               \
    X(submit_kind, kvo_worker_submit_job(f->w, 1, 2, IDS(1, 2), 2, IDS(1, 2), 1, 0, 0),         \
      INVALID_ARGUMENT, "kind", KEPT)                                                           \
    X(wait_refused_id, kvo_worker_wait(f->w, U64S(1), WAIT_MS), NOT_FOUND, "job_ids[0]", KEPT)
CASE_TABLE(idle, IDLE);

/* Jobs 10..14 were accepted and failed (block ids outside the registration), not polled yet:
 * their errors are kept only once handed out, and their ids are in flight until then. */
#define FAILED_NOT_POLLED(X)                                                                    \
    X(error_not_polled, kvo_worker_job_error(f->w, 10, f->o.buf, sizeof f->o.buf, &f->o.len),   \
      NOT_FOUND, "10", KEPT)                                                                    \
    X(submit_failed_id, kvo_worker_submit_job(f->w, 10, KVO_JOB_KIND_STORE, U32S(3), U32S(4),   \
                                              0, 0),                                            \
      INVALID_STATE, "job_id", KEPT)
CASE_TABLE(failed_not_polled, FAILED_NOT_POLLED);

/* Polled: kvo_worker_job_error's bad arguments and unknown jobs. */
#define ERRORS(X)                                                                               \
    X(error_no_buf, kvo_worker_job_error(f->w, 10, NULL, 8, &f->o.len), NULL_ARGUMENT, "buf",   \
      KEPT)                                                                                     \
    X(error_no_len, kvo_worker_job_error(f->w, 10, f->o.buf, sizeof f->o.buf, NULL),            \
      NULL_ARGUMENT, "out_len", KEPT)                                                           \
    X(error_no_worker, kvo_worker_job_error(NULL, 10, f->o.buf, sizeof f->o.buf, &f->o.len),    \
      NULL_ARGUMENT, "worker", KEPT)                                                            \
    X(error_unknown, kvo_worker_job_error(f->w, 777, f->o.buf, sizeof f->o.buf, &f->o.len),     \
      NOT_FOUND, "777", KEPT)
CASE_TABLE(errors, ERRORS);

/* Job 20 (a store) finished, not polled: its id cannot be taken again (the refused duplicate, a
 * load into block 5, does not run). */
#define JOB_NOT_POLLED(X)                                                                       \
    X(submit_id_in_flight,                                                                      \
      kvo_worker_submit_job(f->w, 20, KVO_JOB_KIND_LOAD, U32S(4), U32S(5), 0, 0),               \
      INVALID_STATE, "job_id", KEPT)
CASE_TABLE(job_not_polled, JOB_NOT_POLLED);

/* Job 20 succeeded and was polled: no error message, nothing to wait for; bad waits. */
#define JOB_POLLED(X)                                                                           \
    X(error_succeeded, kvo_worker_job_error(f->w, 20, f->o.buf, sizeof f->o.buf, &f->o.len),    \
      NOT_FOUND, "20", KEPT)                                                                    \
    X(wait_unknown, kvo_worker_wait(f->w, U64S(777), WAIT_MS), NOT_FOUND, "777", KEPT)          \
    X(wait_polled, kvo_worker_wait(f->w, U64S(20), WAIT_MS), NOT_FOUND, "20", KEPT)             \
    X(wait_no_ids, kvo_worker_wait(f->w, NULL, 1, WAIT_MS), NULL_ARGUMENT, "job_ids", KEPT)     \
    X(wait_no_worker, kvo_worker_wait(NULL, U64S(20), WAIT_MS), NULL_ARGUMENT, "worker", KEPT)
CASE_TABLE(job_polled, JOB_POLLED);

/* Job 30 finished, not polled: a refused poll hands nothing out and loses nothing; host
 * buffers of an unknown tensor or into NULL. */
#define FINISHED_NOT_POLLED(X)                                                                  \
    X(poll_no_n, kvo_worker_poll(f->w, f->o.done, 2, NULL), NULL_ARGUMENT, "out_n", KEPT)       \
    X(poll_no_out, kvo_worker_poll(f->w, NULL, 2, &f->o.n), NULL_ARGUMENT, "out", KEPT)         \
    X(poll_no_worker, kvo_worker_poll(NULL, f->o.done, 2, &f->o.n), NULL_ARGUMENT, "worker",    \
      KEPT)                                                                                     \
    X(host_tensor, kvo_worker_get_host_buffer(f->w, 2, &f->o.host_ptr, &f->o.host_len),         \
      INVALID_ARGUMENT, "tensor", KEPT)                                                         \
    X(host_no_ptr, kvo_worker_get_host_buffer(f->w, 0, NULL, &f->o.host_len), NULL_ARGUMENT,    \
      "out_ptr", KEPT)                                                                          \
    X(host_no_len, kvo_worker_get_host_buffer(f->w, 0, &f->o.host_ptr, NULL), NULL_ARGUMENT,    \
      "out_len", KEPT)                                                                          \
    X(host_no_worker, kvo_worker_get_host_buffer(NULL, 0, &f->o.host_ptr, &f->o.host_len),      \
      NULL_ARGUMENT, "worker", KEPT)
CASE_TABLE(finished_not_polled, FINISHED_NOT_POLLED);

/* Shut down (jobs 40 and 41 finished, not polled): submissions and swaps are refused. */
#define SHUT_DOWN(X)                                                                            \
    X(submit_shut_down,                                                                         \
      kvo_worker_submit_job(f->w, 42, KVO_JOB_KIND_STORE, U32S(6), U32S(9), 0, 0),              \
      INVALID_STATE, "shut down", KEPT)                                                         \
    X(swap_shut_down, kvo_worker_swap_blocks(f->w, 0, 0, IDS(3), IDS(13), 1, 0, 0),             \
      INVALID_STATE, "shut down", KEPT)                                                         \
    X(swap_job_shut_down, kvo_worker_swap_blocks(f->w, 0, 0, IDS(3), IDS(13), 1, 1, 43),        \
      INVALID_STATE, "shut down", KEPT)                                                         \
    X(wait_refused, kvo_worker_wait(f->w, U64S(42), WAIT_MS), NOT_FOUND, "42", KEPT)            \
    X(shutdown_no_worker, kvo_worker_shutdown(NULL), NULL_ARGUMENT, "worker", KEPT)
CASE_TABLE(shut_down, SHUT_DOWN);

/* Refused and failed submissions. */
static void bad_calls_on_submit(fixture *f) {
    kvo_worker *w = f->w;
    RUN_CASES(f, &worker_hooks, idle);
    CHECK_IDLE(w);

    /* Accepted at submit, failed at poll: block ids outside the registration. */
    CHECK_OK(kvo_worker_submit_job(w, 10, KVO_JOB_KIND_STORE, U32S(3, 99), U32S(4), 0, 0));
    CHECK_OK(kvo_worker_submit_job(w, 11, KVO_JOB_KIND_LOAD, U32S(4), U32S(5, 1234567), 0, 0));
    CHECK_OK(kvo_worker_submit_job(w, 12, KVO_JOB_KIND_STORE, U32S(3), U32S(SLOTS), 0, 0));
    CHECK_OK(kvo_worker_submit_job(w, 13, KVO_JOB_KIND_STORE, U32S(3, 4), U32S(1, 2), 0, 0));
    CHECK_OK(kvo_worker_submit_job(w, 14, KVO_JOB_KIND_LOAD, U32S(SLOTS + 5), U32S(0), 0, 0));
    CHECK_OK(kvo_worker_wait(w, U64S(10, 11, 12, 13, 14), WAIT_MS));
    RUN_CASES(f, &worker_hooks, failed_not_polled);
    done_t d = WAIT_POLL(w, 10, 11, 12, 13, 14);
    CHECK(d.n == 5);
    CHECK_DONE(d, 10, 0, 0);
    CHECK_DONE(d, 11, 0, 0);
    CHECK_DONE(d, 12, 0, 0);
    CHECK_DONE(d, 13, 0, 0);
    CHECK_DONE(d, 14, 0, 0);
    CHECK_JOB_ERROR(w, 10, "99");
    CHECK_JOB_ERROR(w, 11, "1234567");
    CHECK_JOB_ERROR(w, 12, "16");
    CHECK_JOB_ERROR(w, 13, "slot");
    CHECK_JOB_ERROR(w, 14, "21");
    CHECK_IDLE(w);
}

/* kvo_worker_job_error (truncation, sizing, bad arguments), job ids in use, kvo_worker_wait. */
static void bad_calls_on_ids(fixture *f) {
    kvo_worker *w = f->w;
    char buf[256], small[6];
    size_t full = 0, full2 = 0;
    memset(small, 'x', sizeof small);
    CHECK_OK(kvo_worker_job_error(w, 10, buf, sizeof buf, &full));
    CHECK_OK(kvo_worker_job_error(w, 10, small, sizeof small, &full2));
    CHECK(full2 == full && full == strlen(buf) && full > 5);
    CHECK(small[5] == '\0' && memcmp(small, buf, 5) == 0);
    full2 = 0;
    CHECK_OK(kvo_worker_job_error(w, 10, NULL, 0, &full2)); /* sizing call */
    CHECK(full2 == full);
    RUN_CASES(f, &worker_hooks, errors);

    /* A successful job has no error message; its id is taken until polled. */
    CHECK_OK(kvo_worker_submit_job(w, 20, KVO_JOB_KIND_STORE, U32S(3), U32S(4), 0, 0));
    CHECK_OK(kvo_worker_wait(w, U64S(20), WAIT_MS));
    RUN_CASES(f, &worker_hooks, job_not_polled);
    done_t d = WAIT_POLL(w, 20);
    CHECK(d.n == 1);
    CHECK_DONE(d, 20, 1, PAGES);
    RUN_CASES(f, &worker_hooks, job_polled);
    CHECK_UNTOUCHED(*f->t0); /* the refused duplicate (a load into block 5) did not run */
    /* Once polled, the id may be used again. */
    CHECK_OK(kvo_worker_submit_job(w, 20, KVO_JOB_KIND_STORE, U32S(3), U32S(4), 0, 0));
    d = WAIT_POLL(w, 20);
    CHECK_DONE(d, 20, 1, PAGES);

    /* kvo_worker_poll and kvo_worker_get_host_buffer, with job 30 waiting to be polled. */
    CHECK_OK(kvo_worker_submit_job(w, 30, KVO_JOB_KIND_STORE, U32S(3), U32S(5), 0, 0));
    CHECK_OK(kvo_worker_wait(w, U64S(30), WAIT_MS));
    RUN_CASES(f, &worker_hooks, finished_not_polled);
    d = WAIT_POLL(w, 30);
    CHECK(d.n == 1);
    CHECK_DONE(d, 30, 1, PAGES);
}

/* kvo_worker_shutdown: finishes what is in flight, keeps it pollable, refuses the rest. */
static void bad_calls_at_shutdown(fixture *f) {
    kvo_worker *w = f->w;
    CHECK_OK(kvo_worker_submit_job(w, 40, KVO_JOB_KIND_STORE, U32S(6, 7, 8), U32S(9), 0, 0));
    CHECK_OK(kvo_worker_wait(w, U64S(40), WAIT_MS)); /* the lanes are independent */
    CHECK_OK(kvo_worker_submit_job(w, 41, KVO_JOB_KIND_LOAD, U32S(9), U32S(10, 11, 12), 0, 0));
    CHECK_OK(kvo_worker_shutdown(w));
    RUN_CASES(f, &worker_hooks, shut_down);
    CHECK(bytes_are(block(f->t0, 13), orig_block(f->t0, 13), PAGE0, "block 13 after the swaps"));
    CHECK_OK(kvo_worker_shutdown(w)); /* again: harmless */
    done_t d = WAIT_POLL(w, 40, 41);
    CHECK(d.n == 2);
    CHECK_DONE(d, 40, 1, 3 * PAGES);
    CHECK_DONE(d, 41, 1, 3 * PAGES);
    /* Both ran to the end (the load read what the store wrote). */
    CHECK(bytes_are(block(f->t0, 10), orig_block(f->t0, 6), PAGE0, "block 10"));
    CHECK(bytes_are(block(f->t1, 12), orig_block(f->t1, 8), PAGE1, "block 12"));
}

static void test_bad_calls(void) {
    tensor_t t0 = tensor_new(NBLOCKS, STRIDE0, PAGE0, 15);
    tensor_t t1 = tensor_new(NBLOCKS, STRIDE1, PAGE1, 16);
    const kvo_kv_tensor ts[2] = {t0.t, t1.t};
    kvo_worker_config c = wcfg(FACTOR, SLOTS);
    fixture f;
    memset(&f, 0, sizeof f);
    f.w = NEW_WORKER(&c, ts, 2, NULL);
    f.t0 = &t0;
    f.t1 = &t1;
    uint8_t *h0 = HOST_BUF(f.w, 0, LEN0), *h1 = HOST_BUF(f.w, 1, LEN1);
    uint8_t *zero = calloc(1, LEN0);
    watch(&f, t0.mem, t0.size);
    watch(&f, t1.mem, t1.size);
    watch(&f, h0, LEN0);
    watch(&f, h1, LEN1);

    bad_calls_on_submit(&f);
    /* Nothing was copied by the failed jobs. */
    CHECK(bytes_are(h0, zero, LEN0, "host buffer 0"));
    CHECK(bytes_are(h1, zero, LEN1, "host buffer 1"));
    CHECK_UNTOUCHED(t0);
    CHECK_UNTOUCHED(t1);
    bad_calls_on_ids(&f);
    bad_calls_at_shutdown(&f);

    fixture_free(&f);
    free(zero);
    kvo_worker_free(f.w);
    tensor_free(&t0);
    tensor_free(&t1);
}

/* 9. A submitted step after shutdown is refused. */
static void test_step_after_shutdown(void) {
    tensor_t t0 = tensor_new(NBLOCKS, STRIDE0, PAGE0, 17);
    kvo_worker_config c = wcfg(FACTOR, SLOTS);
    kvo_worker *w = NEW_WORKER(&c, &t0.t, 1, NULL);
    kvo_scheduler_config sc;
    memset(&sc, 0, sizeof sc);
    CHECK_OK(kvo_scheduler_config_default(&sc));
    sc.key_len = KEY_LEN;
    sc.gpu_block_size = GBS;
    sc.block_size_factor = FACTOR;
    sc.num_slots = SLOTS;
    sc.offload_prompt_only = 0;
    kvo_scheduler *s = NULL;
    kvo_step *st = NULL;
    CHECK_OK(kvo_scheduler_new(&sc, &s));
    CHECK_OK(kvo_step_new(&st));
    if (s == NULL || st == NULL) {
        exit(1);
    }
    add_request(s, 1, 5, 12);
    kvo_match_result m;
    CHECK_OK(kvo_scheduler_match(s, 1, 0, &m));
    uint32_t has_job = 0;
    uint64_t job = 0;
    const uint32_t b[3] = {4, 2, 9};
    CHECK_OK(kvo_scheduler_on_alloc(s, 1, b, 3, 0, &has_job, &job));
    kvo_scheduled_request r;
    memset(&r, 0, sizeof r);
    r.request_id = 1;
    r.num_scheduled_tokens = 12;
    r.num_tokens = 12;
    r.new_block_ids = b;
    r.n_new_block_ids = 3;
    CHECK_OK(kvo_scheduler_build_step(s, &r, 1, NULL, 0, st));
    kvo_step_info info;
    CHECK_OK(kvo_step_get_info(st, &info));
    CHECK(info.num_jobs == 1);
    CHECK_OK(kvo_worker_shutdown(w));
    CHECK_STATUS(kvo_worker_submit_step(w, st, 0), KVO_STATUS_INVALID_STATE, "shut down");
    CHECK_IDLE(w);
    void *p = NULL;
    size_t len = 0;
    CHECK_OK(kvo_worker_get_host_buffer(w, 0, &p, &len)); /* still readable */
    kvo_step_free(st);
    kvo_scheduler_free(s);
    kvo_worker_free(w);
    tensor_free(&t0);
}

/* 10. CUDA: absent here; asking for it fails cleanly. */
static void test_cuda(void) {
    int32_t avail = kvo_cuda_available();
    CHECK(avail == 0 || avail == 1);
    CHECK(kvo_cuda_available() == avail); /* stable */
    tensor_t t0 = tensor_new(4, STRIDE0, PAGE0, 18);
    kvo_worker_config c = wcfg(1, 4);
    c.backend = KVO_BACKEND_CUDA;
    kvo_worker *const sentinel = (kvo_worker *)(uintptr_t)0x1230;
    kvo_worker *w = sentinel;
    kvo_status st = kvo_worker_new(&c, &t0.t, 1, NULL, &w);
    if (st == KVO_STATUS_OK) {
        printf("note: a CUDA device is usable here; the CUDA_UNAVAILABLE check is skipped\n");
        CHECK(avail == 1);
        kvo_worker_free(w);
    } else {
        check_status(st, KVO_STATUS_CUDA_UNAVAILABLE, NULL, __LINE__,
                     "kvo_worker_new(backend CUDA)");
        CHECK(w == sentinel);
        CHECK(avail == 0);
    }
    CHECK_UNTOUCHED(t0);
    tensor_free(&t0);
}

/* A plan's stores read what its forward pass writes: kvo_worker_submit_step holds them until the
 * next plan, kvo_worker_submit_stores or a wait naming them, so the host tier gets the KV the
 * forward pass wrote after submit_step returned. */
static void test_stores_follow_the_forward_pass(void) {
    tensor_t t0 = tensor_new(NBLOCKS, STRIDE0, PAGE0, 23);
    kvo_worker_config c = wcfg(1, SLOTS);
    kvo_worker *w = NEW_WORKER(&c, &t0.t, 1, NULL);
    kvo_scheduler_config sc;
    CHECK_OK(kvo_scheduler_config_default(&sc));
    sc.key_len = KEY_LEN;
    sc.gpu_block_size = GBS;
    sc.num_slots = SLOTS;
    kvo_scheduler *s = NULL;
    kvo_step *st = NULL;
    CHECK_OK(kvo_scheduler_new(&sc, &s));
    CHECK_OK(kvo_step_new(&st));
    if (s == NULL || st == NULL) {
        exit(1);
    }
    add_request(s, 1, 6, 8);
    kvo_match_result m;
    CHECK_OK(kvo_scheduler_match(s, 1, 0, &m));
    uint32_t has_job = 0;
    uint64_t none = 0;
    const uint32_t b[2] = {5, 6};
    CHECK_OK(kvo_scheduler_on_alloc(s, 1, b, 2, 0, &has_job, &none));
    kvo_scheduled_request r = {.request_id = 1, .num_scheduled_tokens = 8, .num_tokens = 8,
                               .new_block_ids = b, .n_new_block_ids = 2};
    CHECK_OK(kvo_scheduler_build_step(s, &r, 1, NULL, 0, st));
    job_t j = get_job(st, 0);
    CHECK(j.info.kind == KVO_JOB_KIND_STORE && j.info.n_dst == 2);
    CHECK_OK(kvo_worker_submit_step(w, st, 0));
    /* The forward pass writes blocks 5 and 6 after submit_step returned. */
    memset(block(&t0, 5), 0x5A, PAGE0);
    memset(block(&t0, 6), 0x6B, PAGE0);
    kvo_completion out[4];
    size_t n = 9;
    CHECK_OK(kvo_worker_poll(w, out, 4, &n));
    CHECK(n == 0); /* held, not run */
    CHECK_OK(kvo_worker_submit_stores(w));
    done_t d = WAIT_POLL(w, j.info.id);
    CHECK_DONE(d, j.info.id, 1, 2 * PAGE0);
    uint8_t *host = host_buf_(w, 0, (size_t)SLOTS * PAGE0, __LINE__);
    uint8_t want5[PAGE0], want6[PAGE0];
    memset(want5, 0x5A, PAGE0);
    memset(want6, 0x6B, PAGE0);
    CHECK(bytes_are(host + sub_off(j.dst[0], 0, PAGE0, 1), want5, PAGE0, "slot of block 5"));
    CHECK(bytes_are(host + sub_off(j.dst[1], 0, PAGE0, 1), want6, PAGE0, "slot of block 6"));
    CHECK_STATUS(kvo_worker_submit_stores(NULL), KVO_STATUS_NULL_ARGUMENT, "worker");
    CHECK_OK(kvo_worker_shutdown(w));
    CHECK_STATUS(kvo_worker_submit_stores(w), KVO_STATUS_INVALID_STATE, "shut down");
    kvo_step_free(st);
    kvo_scheduler_free(s);
    kvo_worker_free(w);
    tensor_free(&t0);
}

/* Every failed job's message is there after the poll that hands it out, however many failed;
 * the next poll that hands out jobs replaces them. */
static void test_many_failed_jobs(void) {
    enum { N = 3000 };
    tensor_t t0 = tensor_new(NBLOCKS, STRIDE0, PAGE0, 31);
    kvo_worker_config c = wcfg(1, SLOTS);
    kvo_worker *w = NEW_WORKER(&c, &t0.t, 1, NULL);
    int submitted = 1;
    for (uint64_t id = 0; id < N; id++) {
        /* KV block 999 is outside the registration. */
        submitted &= kvo_worker_submit_job(w, id, KVO_JOB_KIND_STORE, U32S(999), U32S(0), 0, 0) ==
                     KVO_STATUS_OK;
    }
    CHECK(submitted);
    kvo_completion *done = calloc(N, sizeof *done);
    size_t n = 0, got = 0;
    while (got < N) {
        CHECK_OK(kvo_worker_poll(w, done + got, N - got, &n));
        got += n;
        if (n == 0) break;
    }
    CHECK(got == N);
    /* All in one poll: the failures are reported at the first poll after submission. */
    CHECK(n == N);
    int all = 1;
    char buf[256];
    for (size_t i = 0; i < N; i++) {
        size_t len = 0;
        all &= done[i].success == 0;
        all &= kvo_worker_job_error(w, done[i].job_id, buf, sizeof buf, &len) == KVO_STATUS_OK;
        all &= strstr(buf, "999") != NULL && len == strlen(buf);
    }
    CHECK(all);
    CHECK_OK(kvo_worker_submit_job(w, N, KVO_JOB_KIND_STORE, U32S(1), U32S(0), 0, 0));
    done_t d = WAIT_POLL(w, N);
    CHECK_DONE(d, N, 1, PAGE0);
    size_t len = 0;
    CHECK_STATUS(kvo_worker_job_error(w, 0, buf, sizeof buf, &len), KVO_STATUS_NOT_FOUND,
                 "latest poll");
    free(done);
    kvo_worker_free(w);
    tensor_free(&t0);
}

/* Per-layer views into one allocation whose pages interleave without sharing a byte are
 * accepted; views that share bytes are refused. */
static void test_interleaved_views(void) {
    tensor_t all = tensor_new(16, 8192, 8192, 32);
    kvo_kv_tensor layers[2] = {all.t, all.t};
    layers[0].page_size = layers[1].page_size = 4096;
    layers[1].base += 4096;
    layers[0].num_blocks = layers[1].num_blocks = 16;
    kvo_worker_config c = wcfg(1, 4);
    kvo_worker *w = NEW_WORKER(&c, layers, 2, NULL);
    /* A job copies its block of every layer: 2 pages. */
    CHECK_OK(kvo_worker_submit_job(w, 1, KVO_JOB_KIND_STORE, U32S(3), U32S(0), 0, 0));
    CHECK_OK(kvo_worker_submit_job(w, 2, KVO_JOB_KIND_STORE, U32S(5), U32S(1), 0, 0));
    done_t d = WAIT_POLL(w, 1, 2);
    CHECK_DONE(d, 1, 1, 2 * 4096);
    CHECK_DONE(d, 2, 1, 2 * 4096);
    uint8_t *h0 = HOST_BUF(w, 0, 4 * 4096), *h1 = HOST_BUF(w, 1, 4 * 4096);
    CHECK(bytes_are(h0, orig_block(&all, 3), 4096, "layer 0, block 3"));
    CHECK(bytes_are(h1, orig_block(&all, 3) + 4096, 4096, "layer 1, block 3"));
    CHECK(bytes_are(h0 + 4096, orig_block(&all, 5), 4096, "layer 0, block 5"));
    CHECK(bytes_are(h1 + 4096, orig_block(&all, 5) + 4096, 4096, "layer 1, block 5"));
    kvo_worker_free(w);

    kvo_worker *sentinel = (kvo_worker *)&c, *out = sentinel;
    layers[1].base -= 8; /* layer 1's pages now start in layer 0's last 8 bytes */
    CHECK_STATUS(kvo_worker_new(&c, layers, 2, NULL, &out), KVO_STATUS_INVALID_ARGUMENT,
                 "tensors[1] overlaps tensors[0]");
    layers[1].base += 8;
    layers[1].page_size = 4104; /* layer 1's pages reach into layer 0's next page */
    CHECK_STATUS(kvo_worker_new(&c, layers, 2, NULL, &out), KVO_STATUS_INVALID_ARGUMENT,
                 "tensors[1] overlaps tensors[0]");
    CHECK(out == sentinel);
    tensor_free(&all);
}

/* 11. Stats per direction and the Prometheus text: values, labels, and the argument checks. */
static void test_stats_and_metrics(void) {
    tensor_t t0 = tensor_new(NBLOCKS, STRIDE0, PAGE0, 11);
    tensor_t t1 = tensor_new(NBLOCKS, STRIDE1, PAGE1, 12);
    const kvo_kv_tensor ts[2] = {t0.t, t1.t};
    kvo_worker_config c = wcfg(1, SLOTS);
    kvo_worker *w = NEW_WORKER(&c, ts, 2, NULL);

    kvo_worker_stats st;
    memset(&st, 0xAB, sizeof st);
    st.struct_size = sizeof st;
    CHECK_OK(kvo_worker_get_stats(w, &st));
    CHECK(st.struct_size == sizeof st && st.load.jobs == 0 && st.store.bytes == 0 &&
          st.jobs_in_flight == 0 && st.load.size_buckets[KVO_SIZE_BUCKETS - 1] == 0);

    CHECK_OK(kvo_worker_submit_job(w, 1, KVO_JOB_KIND_STORE, U32S(0, 1), U32S(0, 1), 0, 0));
    CHECK_OK(kvo_worker_submit_job(w, 2, KVO_JOB_KIND_STORE, U32S(NBLOCKS), U32S(2), 0, 0));
    CHECK_OK(kvo_worker_submit_job(w, 3, KVO_JOB_KIND_LOAD, U32S(0), U32S(5), 0, 0));
    CHECK_OK(kvo_worker_get_stats(w, &st));
    CHECK(st.jobs_in_flight == 3);
    done_t d = WAIT_POLL(w, 1, 2, 3);
    CHECK(d.n == 3);
    CHECK_OK(kvo_worker_get_stats(w, &st));
    CHECK(st.jobs_in_flight == 0);
    CHECK(st.store.jobs == 2 && st.store.failed_jobs == 1 && st.store.bytes == 2 * PAGES);
    CHECK(st.load.jobs == 1 && st.load.failed_jobs == 0 && st.load.bytes == PAGES);
    CHECK(st.store.seconds >= 0.0 && st.load.seconds >= 0.0);
    CHECK(st.store.size_buckets[0] == 1 && st.load.size_buckets[0] == 1);

    /* An older, shorter struct gets only its own bytes. */
    struct {
        size_t struct_size;
        kvo_transfer_stats load;
        uint64_t canary;
    } old;
    old.struct_size = offsetof(kvo_worker_stats, store);
    old.canary = 77;
    CHECK_OK(kvo_worker_get_stats(w, (kvo_worker_stats *)(void *)&old));
    CHECK(old.struct_size == offsetof(kvo_worker_stats, store) && old.load.jobs == 1 &&
          old.canary == 77);

    CHECK_STATUS(kvo_worker_get_stats(NULL, &st), KVO_STATUS_NULL_ARGUMENT, "worker");
    CHECK_STATUS(kvo_worker_get_stats(w, NULL), KVO_STATUS_NULL_ARGUMENT, "out");
    st.struct_size = 2;
    CHECK_STATUS(kvo_worker_get_stats(w, &st), KVO_STATUS_INVALID_ARGUMENT, "struct_size");

    /* The text: asked for its length first, then rendered. */
    const kvo_label labels[2] = {{"engine", "e\"0"}, {"rank", "3"}};
    size_t len = 0;
    CHECK_STATUS(kvo_worker_metrics_text(w, "vllm:kv_offload", labels, 2, NULL, 0, &len),
                 KVO_STATUS_BUFFER_TOO_SMALL, "cap");
    CHECK(len > 0);
    char *text = malloc(len + 1);
    size_t got = 0;
    CHECK_STATUS(kvo_worker_metrics_text(w, "vllm:kv_offload", labels, 2, text, len, &got),
                 KVO_STATUS_BUFFER_TOO_SMALL, "cap");
    CHECK(got == len);
    memset(text, 'x', len + 1);
    CHECK_OK(kvo_worker_metrics_text(w, "vllm:kv_offload", labels, 2, text, len + 1, &got));
    CHECK(got == len && text[len] == '\0' && strlen(text) == len);
    CHECK(strstr(text, "\nvllm:kv_offload_store_bytes_total{engine=\"e\\\"0\",rank=\"3\"} " "208\n") !=
          NULL);
    CHECK(strstr(text, "\nvllm:kv_offload_store_failed_jobs_total{engine=\"e\\\"0\",rank=\"3\"} 1\n") !=
          NULL);
    CHECK(strstr(text, "\nvllm:kv_offload_load_size_bucket{engine=\"e\\\"0\",rank=\"3\",le=\"1000000\"} 1\n") !=
          NULL);
    CHECK(strstr(text, "# TYPE vllm:kv_offload_load_size histogram\n") != NULL);
    free(text);

    /* Bad arguments: named, and nothing written. */
    char small[8] = "keep";
    size_t keep = 99;
    CHECK_STATUS(kvo_worker_metrics_text(NULL, "p", NULL, 0, small, 8, &keep),
                 KVO_STATUS_NULL_ARGUMENT, "worker");
    CHECK_STATUS(kvo_worker_metrics_text(w, NULL, NULL, 0, small, 8, &keep),
                 KVO_STATUS_NULL_ARGUMENT, "prefix");
    CHECK_STATUS(kvo_worker_metrics_text(w, "p", NULL, 0, small, 8, NULL),
                 KVO_STATUS_NULL_ARGUMENT, "out_len");
    CHECK_STATUS(kvo_worker_metrics_text(w, "p", NULL, 1, small, 8, &keep),
                 KVO_STATUS_NULL_ARGUMENT, "labels");
    CHECK_STATUS(kvo_worker_metrics_text(w, "p", NULL, 0, NULL, 1 << 20, &keep),
                 KVO_STATUS_NULL_ARGUMENT, "buf");
    const kvo_label no_value[1] = {{"engine", NULL}};
    CHECK_STATUS(kvo_worker_metrics_text(w, "p", no_value, 1, small, 8, &keep),
                 KVO_STATUS_NULL_ARGUMENT, "labels[0].value");
    CHECK_STATUS(kvo_worker_metrics_text(w, "9p", NULL, 0, small, 8, &keep),
                 KVO_STATUS_INVALID_ARGUMENT, "prefix");
    const kvo_label bad_name[2] = {{"engine", "0"}, {"a-b", "1"}};
    CHECK_STATUS(kvo_worker_metrics_text(w, "p", bad_name, 2, small, 8, &keep),
                 KVO_STATUS_INVALID_ARGUMENT, "labels");
    const kvo_label twice[2] = {{"rank", "0"}, {"rank", "1"}};
    CHECK_STATUS(kvo_worker_metrics_text(w, "p", twice, 2, small, 8, &keep),
                 KVO_STATUS_INVALID_ARGUMENT, "labels[1].name");
    const kvo_label le[1] = {{"le", "0"}};
    CHECK_STATUS(kvo_worker_metrics_text(w, "p", le, 1, small, 8, &keep),
                 KVO_STATUS_INVALID_ARGUMENT, "labels[0].name");
    const kvo_label not_utf8[1] = {{"engine", "\xff"}};
    CHECK_STATUS(kvo_worker_metrics_text(w, "p", not_utf8, 1, small, 8, &keep),
                 KVO_STATUS_INVALID_ARGUMENT, "labels[0].value");
    CHECK(keep == 99 && strcmp(small, "keep") == 0);
    /* An empty prefix: bare names. */
    char big[16384];
    CHECK_OK(kvo_worker_metrics_text(w, "", NULL, 0, big, sizeof big, &got));
    CHECK(strncmp(big, "# HELP load_bytes_total ", 24) == 0);

    kvo_worker_free(w);
    tensor_free(&t0);
    tensor_free(&t1);
}

int main(void) {
    test_config_default();
    test_many_failed_jobs();
    test_interleaved_views();
    test_stores_follow_the_forward_pass();
    test_store_load();
    test_fifo();
    test_large_job();
    test_scheduler_step();
    test_swap();
    test_caller_buffers();
    test_bad_new();
    test_bad_calls();
    test_step_after_shutdown();
    test_cuda();
    test_stats_and_metrics();
    printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
