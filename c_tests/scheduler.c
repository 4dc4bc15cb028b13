/* Drives full request life cycles through the kvo_scheduler_* and kvo_step_* C API from C11:
 * store and load jobs read back from step plans, the preemption / re-admission race of vLLM
 * issue #46014 (deferral while a request's flushed stores are unreported), step encoding,
 * failed jobs, completions across workers, and bad inputs (exact status, a message naming the
 * argument, nothing changed). Keys are 8 bytes (integers, big-endian), a GPU block holds 4
 * tokens and a chunk (host slot) 3 GPU blocks = 12 tokens, as in src/scheduler/tests.rs.
 * Prints one line per failed check and `N passed, M failed`; exits non-zero on any failure.
 * Compiled and run by tests/c_api.rs. */
#include "kvoffload.h"

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define KEY_LEN 8
#define GBS 4    /* tokens per GPU block */
#define FACTOR 3 /* GPU blocks per chunk (host slot): a chunk is 12 tokens */
#define NUM_SLOTS 300
#define MAX_IDS 64
#define STEP_BYTES 1024
#define NO_JOB UINT64_MAX
#define OVERFLOW_N (SIZE_MAX / 2) /* n * KEY_LEN overflows size_t */

#include "check.h"

/* U64S(1, 2, 3) expands to `array, length`. */

static int eq_u64(const uint64_t *got, size_t n, const uint64_t *want, size_t wn) {
    int ok = n == wn;
    for (size_t i = 0; ok && i < n; i++) {
        ok = got[i] == want[i];
    }
    if (!ok) {
        print_got("u64 array", got, n < MAX_IDS ? n : MAX_IDS);
    }
    return ok;
}

/* CHECK_U32(array, n, 1, 2): the first n entries are exactly {1, 2}. */
#define CHECK_U32(got, n, ...)                                                                  \
    check(eq_u32((got), (n), U64S(__VA_ARGS__)), __LINE__, #got " == {" #__VA_ARGS__ "}")
#define CHECK_U64(got, n, ...)                                                                  \
    check(eq_u64((got), (n), U64S(__VA_ARGS__)), __LINE__, #got " == {" #__VA_ARGS__ "}")

/* ---- hashes, keys, blocks --------------------------------------------------------------- */

/* Hash of GPU block `i` of prompt family `seed` (equal seeds share prefixes). */
static uint64_t block_hash(uint64_t seed, uint64_t i) {
    return seed * 1000000u + i;
}

/* The offload key of chunk `c`: the hash of its last GPU block. */
static uint64_t chunk_key(uint64_t seed, uint64_t c) {
    return block_hash(seed, (c + 1) * FACTOR - 1);
}

static void put_u64(uint8_t *dst, uint64_t v) {
    for (int i = KEY_LEN - 1; i >= 0; i--) {
        dst[i] = (uint8_t)(v & 0xff);
        v >>= 8;
    }
}

static uint64_t get_u64(const uint8_t *src) {
    uint64_t v = 0;
    for (int i = 0; i < KEY_LEN; i++) {
        v = (v << 8) | src[i];
    }
    return v;
}

typedef struct {
    uint8_t bytes[MAX_IDS * KEY_LEN];
    size_t n;
} hashes_t;

/* Hashes of GPU blocks `from..to` of `seed`, back to back. */
static hashes_t hashes(uint64_t seed, uint64_t from, uint64_t to) {
    hashes_t h;
    memset(&h, 0, sizeof h);
    for (uint64_t i = from; i < to && h.n < MAX_IDS; i++) {
        put_u64(h.bytes + h.n * KEY_LEN, block_hash(seed, i));
        h.n++;
    }
    return h;
}

typedef struct {
    uint32_t ids[MAX_IDS];
    size_t n;
} blocks_t;

/* GPU block ids `from..to`. */
static blocks_t blocks(uint32_t from, uint32_t to) {
    blocks_t b;
    memset(&b, 0, sizeof b);
    for (uint32_t i = from; i < to && b.n < MAX_IDS; i++) {
        b.ids[b.n++] = i;
    }
    return b;
}

/* One scheduled request; `b` (may be NULL) holds the GPU blocks allocated since the last step. */
static kvo_scheduled_request sched(uint64_t id, uint64_t computed, uint64_t scheduled,
                                   uint64_t tokens, const blocks_t *b) {
    kvo_scheduled_request r;
    memset(&r, 0, sizeof r);
    r.request_id = id;
    r.num_computed_tokens = computed;
    r.num_scheduled_tokens = scheduled;
    r.num_tokens = tokens;
    r.new_block_ids = b ? b->ids : NULL;
    r.n_new_block_ids = b ? b->n : 0;
    return r;
}

/* ---- scheduler helpers ------------------------------------------------------------------ */

static kvo_scheduler_config config(uint32_t num_workers) {
    kvo_scheduler_config cfg;
    memset(&cfg, 0, sizeof cfg);
    CHECK_OK(kvo_scheduler_config_default(&cfg));
    cfg.key_len = KEY_LEN;
    cfg.gpu_block_size = GBS;
    cfg.block_size_factor = FACTOR;
    cfg.num_slots = NUM_SLOTS;
    cfg.num_workers = num_workers;
    cfg.offload_prompt_only = 0;
    cfg.enable_events = 1;
    return cfg;
}

static kvo_scheduler *new_scheduler(uint32_t num_workers) {
    kvo_scheduler_config cfg = config(num_workers);
    kvo_scheduler *s = NULL;
    CHECK_OK(kvo_scheduler_new(&cfg, &s));
    CHECK(s != NULL);
    return s;
}

static kvo_step *new_step(void) {
    kvo_step *st = NULL;
    CHECK_OK(kvo_step_new(&st));
    CHECK(st != NULL);
    return st;
}

static kvo_scheduler_stats stats(const kvo_scheduler *s) {
    kvo_scheduler_stats st;
    memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    CHECK_OK(kvo_scheduler_get_stats(s, &st));
    return st;
}

static void check_invariants(const kvo_scheduler *s, int line) {
    check_status(kvo_scheduler_check_invariants(s), KVO_STATUS_OK, NULL, line,
                 "kvo_scheduler_check_invariants");
}

static void print_stats(const char *what, const kvo_scheduler_stats *s) {
    printf("  %s: requests %llu matches %llu deferred %llu/%llu/%llu hits %llu (%llu tokens) "
           "loads %llu stores %llu (%llu chunks) no_room %llu failed %llu in flight %llu/%llu | "
           "tier used %llu ready %llu pinned %llu storing %llu lookups %llu hits %llu\n",
           what, (unsigned long long)s->requests, (unsigned long long)s->matches,
           (unsigned long long)s->deferred_jobs_in_flight,
           (unsigned long long)s->deferred_store_in_flight,
           (unsigned long long)s->deferred_being_loaded, (unsigned long long)s->hits,
           (unsigned long long)s->hit_tokens, (unsigned long long)s->load_jobs,
           (unsigned long long)s->store_jobs, (unsigned long long)s->stored_chunks,
           (unsigned long long)s->store_no_room, (unsigned long long)s->failed_jobs,
           (unsigned long long)s->loads_in_flight, (unsigned long long)s->stores_in_flight,
           (unsigned long long)s->manager.used, (unsigned long long)s->manager.ready,
           (unsigned long long)s->manager.pinned, (unsigned long long)s->manager.stores_in_flight,
           (unsigned long long)s->manager.lookups, (unsigned long long)s->manager.hits);
}

/* After a failed call: the scheduler's stats are what they were and its invariants hold.
 * (Both structs were zeroed before being filled, and have no padding.) */
static void check_unchanged(const kvo_scheduler *s, const kvo_scheduler_stats *before, int line,
                            const char *what) {
    kvo_scheduler_stats after = stats(s);
    if (memcmp(before, &after, sizeof after) == 0) {
        passed++;
    } else {
        failed++;
        printf("FAIL line %d: %s changed the scheduler\n", line, what);
        print_stats("before", before);
        print_stats("after", &after);
    }
    check_invariants(s, line);
}

/* A call that must fail with `want`, name `arg` in its message and leave `s` unchanged. */
#define CHECK_BAD(s, call, want, arg)                                                           \
    do {                                                                                        \
        kvo_scheduler_stats before_ = stats(s);                                                 \
        check_status((call), (want), (arg), __LINE__, #call);                                   \
        check_unchanged((s), &before_, __LINE__, #call);                                        \
    } while (0)

static void add_(kvo_scheduler *s, uint64_t id, uint64_t seed, uint64_t tokens, int line) {
    hashes_t h = hashes(seed, 0, tokens / GBS);
    check_status(kvo_scheduler_add_request(s, id, tokens, KVO_NO_LIMIT), KVO_STATUS_OK, NULL,
                 line, "add_request");
    check_status(kvo_scheduler_append_block_hashes(s, id, h.bytes, h.n, tokens), KVO_STATUS_OK,
                 NULL, line, "append_block_hashes");
    check_invariants(s, line);
}
/* Adds request `id` with `tokens` prompt tokens hashed from `seed`. */
#define ADD(s, id, seed, tokens) add_((s), (id), (seed), (tokens), __LINE__)

/* Request `id` grows from `from` to `to` tokens (hashes of the newly full blocks appended). */
#define GROW(s, id, seed, from, to)                                                             \
    do {                                                                                        \
        hashes_t h_ = hashes((seed), (from) / GBS, (to) / GBS);                                 \
        CHECK_OK(kvo_scheduler_append_block_hashes((s), (id), h_.bytes, h_.n, (to)));           \
    } while (0)

static void match_(kvo_scheduler *s, uint64_t id, uint64_t gpu_hit, uint32_t kind,
                   uint32_t reason, uint64_t tokens, int line) {
    kvo_match_result r = {99, 99, 12345};
    char what[128];
    check_status(kvo_scheduler_match(s, id, gpu_hit, &r), KVO_STATUS_OK, NULL, line, "match");
    snprintf(what, sizeof what, "match(%llu, %llu) == {%u, %u, %llu}", (unsigned long long)id,
             (unsigned long long)gpu_hit, kind, reason, (unsigned long long)tokens);
    check(r.kind == kind && r.defer_reason == reason && r.tokens == tokens, line, what);
    if (r.kind != kind || r.defer_reason != reason || r.tokens != tokens) {
        printf("  got {%u, %u, %llu}\n", r.kind, r.defer_reason, (unsigned long long)r.tokens);
    }
    check_invariants(s, line);
}
#define MATCH_MISS(s, id, gpu_hit)                                                              \
    match_((s), (id), (gpu_hit), KVO_MATCH_MISS, KVO_DEFER_REASON_NONE, 0, __LINE__)
#define MATCH_HIT(s, id, gpu_hit, tokens)                                                       \
    match_((s), (id), (gpu_hit), KVO_MATCH_HIT, KVO_DEFER_REASON_NONE, (tokens), __LINE__)
#define MATCH_DEFER(s, id, gpu_hit, reason)                                                     \
    match_((s), (id), (gpu_hit), KVO_MATCH_DEFER, (reason), 0, __LINE__)

/* kvo_scheduler_on_alloc; returns the load job id, or NO_JOB when there is none. */
static uint64_t on_alloc_(kvo_scheduler *s, uint64_t id, blocks_t b, uint64_t external,
                          int line) {
    uint32_t has_job = 99;
    uint64_t job = NO_JOB;
    check_status(kvo_scheduler_on_alloc(s, id, b.ids, b.n, external, &has_job, &job),
                 KVO_STATUS_OK, NULL, line, "on_alloc");
    check(has_job == (external > 0), line, "on_alloc: has_job == (external > 0)");
    check(has_job || job == NO_JOB, line, "on_alloc without a job leaves out_job_id");
    check_invariants(s, line);
    return has_job == 1 ? job : NO_JOB;
}
#define ON_ALLOC(s, id, b, external) on_alloc_((s), (id), (b), (external), __LINE__)

static void build_(kvo_scheduler *s, kvo_step *st, const kvo_scheduled_request *reqs, size_t n,
                   const uint64_t *preempted, size_t np, int line) {
    check_status(kvo_scheduler_build_step(s, reqs, n, preempted, np, st), KVO_STATUS_OK, NULL,
                 line, "build_step");
    check_invariants(s, line);
}
/* BUILD(s, st, reqs, n, preempted, np); STEP1 schedules one request, STEP0 none. */
#define BUILD(s, st, reqs, n, pre, np) build_((s), (st), (reqs), (n), (pre), (np), __LINE__)
#define STEP1(s, st, req)                                                                       \
    do {                                                                                        \
        kvo_scheduled_request r_ = (req);                                                       \
        build_((s), (st), &r_, 1, NULL, 0, __LINE__);                                           \
    } while (0)
#define STEP0(s, st) build_((s), (st), NULL, 0, NULL, 0, __LINE__)

static void complete_(kvo_scheduler *s, uint32_t success, const uint64_t *ids, size_t n,
                      int line) {
    kvo_job_report reps[MAX_IDS];
    for (size_t i = 0; i < n && i < MAX_IDS; i++) {
        reps[i].job_id = ids[i];
        reps[i].count = 1;
        reps[i].success = success;
    }
    check_status(kvo_scheduler_complete_jobs(s, reps, n), KVO_STATUS_OK, NULL, line,
                 "complete_jobs");
    check_invariants(s, line);
}
/* One report (count 1) per job id. */
#define COMPLETE(s, success, ...) complete_((s), (success), U64S(__VA_ARGS__), __LINE__)

/* ---- step helpers ----------------------------------------------------------------------- */

static kvo_step_info info_(const kvo_step *st, int line) {
    kvo_step_info info;
    memset(&info, 0xAB, sizeof info);
    check_status(kvo_step_get_info(st, &info), KVO_STATUS_OK, NULL, line, "get_info");
    return info;
}
#define INFO(st) info_((st), __LINE__)

/* The step has `jobs` jobs and `flush` ids to flush, and 3 GPU blocks per host slot. */
#define CHECK_COUNTS(st, jobs, flush)                                                           \
    do {                                                                                        \
        kvo_step_info i_ = INFO(st);                                                            \
        CHECK(i_.num_jobs == (jobs) && i_.num_flush == (flush) &&                               \
              i_.block_size_factor == FACTOR && i_.reserved == 0);                              \
    } while (0)

typedef struct {
    kvo_job_info info;
    uint32_t src[MAX_IDS], dst[MAX_IDS];
} job_t;

static job_t job_(const kvo_step *st, size_t index, int line) {
    job_t j;
    memset(&j, 0, sizeof j);
    check_status(kvo_step_get_job(st, index, &j.info), KVO_STATUS_OK, NULL, line, "get_job");
    if (j.info.n_src > MAX_IDS || j.info.n_dst > MAX_IDS) {
        check(0, line, "job fits MAX_IDS");
        return j;
    }
    check_status(kvo_step_get_job_blocks(st, index, j.src, j.info.n_src, j.dst, j.info.n_dst),
                 KVO_STATUS_OK, NULL, line, "get_job_blocks");
    return j;
}
#define JOB(st, index) job_((st), (index), __LINE__)

static int job_is(const job_t *j, uint32_t kind, uint64_t id, uint64_t request,
                  uint32_t block_index, uint32_t group_size) {
    const kvo_job_info *i = &j->info;
    int ok = i->kind == kind && i->id == id && i->request_id == request &&
             i->block_index == block_index && i->group_size == group_size && i->reserved == 0;
    if (!ok) {
        printf("  got kind %u id %llu request %llu block_index %u group_size %u reserved %u\n",
               i->kind, (unsigned long long)i->id, (unsigned long long)i->request_id,
               i->block_index, i->group_size, i->reserved);
    }
    return ok;
}
/* CHECK_JOB(j, kind, id, request, block_index, group_size) */
#define CHECK_JOB(j, kind, id, req, bi, gs)                                                     \
    check(job_is(&(j), (kind), (id), (req), (bi), (gs)), __LINE__,                              \
          #j " is {" #kind ", id " #id ", request " #req ", block_index " #bi ", size " #gs "}")

static size_t flush_(const kvo_step *st, uint64_t *out, int line) {
    size_t n = 12345;
    check_status(kvo_step_get_flush(st, out, MAX_IDS, &n), KVO_STATUS_OK, NULL, line,
                 "get_flush");
    return n;
}
#define FLUSH(st, out) flush_((st), (out), __LINE__)

/* Encodes `st` into `buf` (STEP_BYTES) and returns the length. */
static size_t encode_(const kvo_step *st, uint8_t *buf, int line) {
    size_t n = 0;
    check_status(kvo_step_encode(st, buf, STEP_BYTES, &n), KVO_STATUS_OK, NULL, line, "encode");
    return n;
}
#define ENCODE(st, buf) encode_((st), (buf), __LINE__)

/* Two plans with the same summary, jobs, blocks and flush set. */
static int steps_equal(const kvo_step *a, const kvo_step *b, int line) {
    kvo_step_info ia = info_(a, line), ib = info_(b, line);
    int ok = memcmp(&ia, &ib, sizeof ia) == 0;
    for (size_t k = 0; ok && k < ia.num_jobs; k++) {
        job_t ja = job_(a, k, line), jb = job_(b, k, line);
        ok = memcmp(&ja, &jb, sizeof ja) == 0;
    }
    if (ok) {
        uint64_t fa[MAX_IDS], fb[MAX_IDS];
        size_t na = flush_(a, fa, line), nb = flush_(b, fb, line);
        ok = na == nb && na <= MAX_IDS && memcmp(fa, fb, na * sizeof fa[0]) == 0;
    }
    return ok;
}

/* A call on a step that must fail with `want`, name `arg` and leave the plan `st` unchanged
 * (same encoding before and after). */
#define CHECK_BAD_STEP(st, call, want, arg)                                                     \
    do {                                                                                        \
        uint8_t b1_[STEP_BYTES], b2_[STEP_BYTES];                                               \
        size_t n1_ = ENCODE((st), b1_);                                                         \
        check_status((call), (want), (arg), __LINE__, #call);                                   \
        size_t n2_ = ENCODE((st), b2_);                                                         \
        check(n1_ == n2_ && memcmp(b1_, b2_, n1_) == 0, __LINE__, #call " left the plan");      \
    } while (0)

/* ---- tests ------------------------------------------------------------------------------ */

static void test_config_default(void) {
    kvo_scheduler_config cfg;
    memset(&cfg, 0xAB, sizeof cfg);
    CHECK_OK(kvo_scheduler_config_default(&cfg));
    CHECK(cfg.struct_size == sizeof(kvo_scheduler_config));
    CHECK(cfg.key_len == 32 && cfg.gpu_block_size == 16 && cfg.block_size_factor == 1);
    CHECK(cfg.policy == KVO_POLICY_LRU && cfg.num_slots == 0 && cfg.num_workers == 1);
    CHECK(cfg.offload_prompt_only == 1 && cfg.store_threshold == 0 && cfg.enable_events == 0);
    CHECK(cfg.max_tracker_size == 64000);
    kvo_scheduler *s = NULL;
    CHECK_OK(kvo_scheduler_new(&cfg, &s));
    CHECK(s != NULL);
    kvo_scheduler_stats st = stats(s);
    CHECK(st.struct_size == sizeof st && st.requests == 0 && st.manager.capacity == 0);
    CHECK(st.manager.struct_size == sizeof(kvo_manager_stats));
    kvo_scheduler_free(s);
}

/* 1. One request stores its prompt, finishes; a second one sharing the prefix loads it. */
static void test_life_cycle(void) {
    kvo_scheduler *s = new_scheduler(1);
    kvo_step *st = new_step();
    kvo_scheduler_stats t;
    job_t j;
    uint64_t flush[MAX_IDS];

    /* Request 1: 24 tokens = 6 GPU blocks = 2 chunks, nothing offloaded yet. */
    ADD(s, 1, 1, 24);
    MATCH_MISS(s, 1, 0);
    CHECK(ON_ALLOC(s, 1, blocks(10, 16), 0) == NO_JOB);
    blocks_t b = blocks(10, 16);
    STEP1(s, st, sched(1, 0, 24, 24, &b));
    CHECK_COUNTS(st, 1, 0);
    j = JOB(st, 0);
    CHECK_JOB(j, KVO_JOB_KIND_STORE, 0, 1, 0, 6);
    CHECK(j.info.n_src == 6 && j.info.n_dst == 2);
    CHECK_U32(j.src, j.info.n_src, 10, 11, 12, 13, 14, 15); /* GPU blocks */
    CHECK_U32(j.dst, j.info.n_dst, 0, 1);                   /* host slots */
    CHECK(FLUSH(st, flush) == 0);
    t = stats(s);
    CHECK(t.requests == 1 && t.store_jobs == 1 && t.stored_chunks == 2);
    CHECK(t.stores_in_flight == 1 && t.loads_in_flight == 0);
    CHECK(t.manager.used == 2 && t.manager.stores_in_flight == 2 && t.manager.ready == 0);

    COMPLETE(s, 1, 0);
    t = stats(s);
    CHECK(t.stores_in_flight == 0 && t.manager.ready == 2 && t.manager.stores_in_flight == 0);

    /* One "stored" event with the two chunk keys (the hashes of GPU blocks 2 and 5). */
    kvo_event ev[4];
    uint8_t keys[8 * KEY_LEN];
    size_t ne = 99, nk = 99;
    CHECK_OK(kvo_scheduler_take_events(s, ev, 4, keys, 8, &ne, &nk));
    CHECK(ne == 1 && nk == 2);
    CHECK(ev[0].first_key == 0 && ev[0].n_keys == 2 && ev[0].removed == 0);
    CHECK(get_u64(keys) == chunk_key(1, 0) && get_u64(keys + KEY_LEN) == chunk_key(1, 1));
    CHECK(get_u64(keys) == 1000002 && get_u64(keys + KEY_LEN) == 1000005);
    CHECK_OK(kvo_scheduler_take_events(s, ev, 4, keys, 8, &ne, &nk));
    CHECK(ne == 0 && nk == 0);

    CHECK_OK(kvo_scheduler_finish_request(s, 1));
    CHECK(stats(s).requests == 0);

    /* Request 2: 30 tokens sharing the prefix; its 2 complete chunks (24 tokens) hit. */
    ADD(s, 2, 1, 30);
    MATCH_HIT(s, 2, 0, 24);
    uint64_t load = ON_ALLOC(s, 2, blocks(20, 28), 24);
    CHECK(load == 1);
    t = stats(s);
    CHECK(t.loads_in_flight == 1 && t.load_jobs == 1 && t.manager.pinned == 2);

    STEP0(s, st); /* the request waits for its load: not scheduled */
    CHECK_COUNTS(st, 1, 0);
    j = JOB(st, 0);
    CHECK_JOB(j, KVO_JOB_KIND_LOAD, 1, 2, 0, 6);
    CHECK_U32(j.src, j.info.n_src, 0, 1);                   /* host slots */
    CHECK_U32(j.dst, j.info.n_dst, 20, 21, 22, 23, 24, 25); /* GPU blocks */
    COMPLETE(s, 1, load);

    /* Scheduled for the rest: the loaded chunks are not stored again, the last one is partial. */
    b = blocks(20, 28);
    STEP1(s, st, sched(2, 24, 6, 30, &b));
    CHECK_COUNTS(st, 0, 0);

    t = stats(s);
    CHECK(t.requests == 1 && t.matches == 2 && t.hits == 1 && t.hit_tokens == 24);
    CHECK(t.load_jobs == 1 && t.store_jobs == 1 && t.stored_chunks == 2 && t.failed_jobs == 0);
    CHECK(t.deferred_jobs_in_flight == 0 && t.deferred_store_in_flight == 0 &&
          t.deferred_being_loaded == 0 && t.store_no_room == 0);
    CHECK(t.loads_in_flight == 0 && t.stores_in_flight == 0);
    CHECK(t.manager.pinned == 0 && t.manager.stores_in_flight == 0);
    CHECK(t.manager.used == 2 && t.manager.ready == 2 && t.manager.evictable == 2);
    CHECK(t.manager.capacity == NUM_SLOTS);
    CHECK_OK(kvo_scheduler_finish_request(s, 2));
    CHECK(stats(s).requests == 0);
    check_invariants(s, __LINE__);

    kvo_step_free(st);
    kvo_scheduler_free(s);
}

/* 2. vLLM #46014: R is preempted while its stores are in flight and re-matched before their
 * (flushed) completions are reported. The lookup would not reach R's in-flight keys (GPU hit
 * over them, the next chunk stored by Q), so only the deferral rule prevents a load. */
static void test_race(void) {
    kvo_scheduler *s = new_scheduler(1);
    kvo_step *st = new_step();
    uint64_t flush[MAX_IDS];
    job_t j;
    const uint64_t R = 1, Q = 2;

    /* R stores chunks 0..3; that store (job 0) stays in flight. */
    ADD(s, R, 7, 36);
    MATCH_MISS(s, R, 0);
    ON_ALLOC(s, R, blocks(0, 9), 0);
    blocks_t b = blocks(0, 9);
    STEP1(s, st, sched(R, 0, 36, 36, &b));
    CHECK_COUNTS(st, 1, 0);
    j = JOB(st, 0);
    CHECK_JOB(j, KVO_JOB_KIND_STORE, 0, R, 0, 9);
    CHECK_U32(j.dst, j.info.n_dst, 0, 1, 2);
    const uint64_t p = j.info.id;

    /* Q shares R's prefix and stores chunk 3 (chunks 0..3 are R's, in flight, so filtered). */
    ADD(s, Q, 7, 48);
    MATCH_MISS(s, Q, 36);
    ON_ALLOC(s, Q, blocks(20, 32), 0);
    b = blocks(20, 32);
    STEP1(s, st, sched(Q, 36, 12, 48, &b));
    CHECK_COUNTS(st, 1, 0);
    j = JOB(st, 0);
    CHECK_JOB(j, KVO_JOB_KIND_STORE, 1, Q, 9, 3);
    CHECK_U32(j.src, j.info.n_src, 29, 30, 31);
    CHECK_U32(j.dst, j.info.n_dst, 3);
    COMPLETE(s, 1, 1);

    /* R decodes to 48 tokens (chunk 3 is already stored), then is preempted. */
    GROW(s, R, 7, 36, 48);
    b = blocks(9, 12);
    STEP1(s, st, sched(R, 36, 12, 48, &b));
    CHECK_COUNTS(st, 0, 0);
    BUILD(s, st, NULL, 0, &R, 1);
    CHECK_COUNTS(st, 0, 1);
    size_t nf = FLUSH(st, flush);
    CHECK_U64(flush, nf, 0); /* R's stores, to wait for before the forward pass */
    CHECK(stats(s).stores_in_flight == 1);

    /* Batch-queue window: schedule again before the flushed completions are reported. */
    kvo_scheduler_stats before = stats(s);
    MATCH_DEFER(s, R, 36, KVO_DEFER_REASON_JOBS_IN_FLIGHT);
    kvo_scheduler_stats after = stats(s);
    CHECK(after.manager.lookups == before.manager.lookups); /* nothing looked up */
    CHECK(after.manager.hits == before.manager.hits);
    CHECK(after.deferred_jobs_in_flight == before.deferred_jobs_in_flight + 1);
    CHECK(after.matches == before.matches + 1 && after.hits == before.hits);
    CHECK(after.stores_in_flight == 1 && after.load_jobs == 0);
    STEP0(s, st);
    CHECK_COUNTS(st, 0, 0); /* no load job */
    uint32_t has_job = 7;
    uint64_t job = 77;
    b = blocks(40, 52);
    CHECK_BAD(s, kvo_scheduler_on_alloc(s, R, b.ids, b.n, 12, &has_job, &job),
              KVO_STATUS_INVALID_STATE, "request_id");
    CHECK(has_job == 7 && job == 77);

    /* Completions consumed: R matches and loads chunk 3 normally. */
    COMPLETE(s, 1, p);
    MATCH_HIT(s, R, 36, 12);
    uint64_t load = ON_ALLOC(s, R, blocks(40, 52), 12);
    CHECK(load == 2);
    STEP0(s, st);
    CHECK_COUNTS(st, 1, 0);
    j = JOB(st, 0);
    CHECK_JOB(j, KVO_JOB_KIND_LOAD, 2, R, 9, 3);
    CHECK_U32(j.src, j.info.n_src, 3);
    CHECK_U32(j.dst, j.info.n_dst, 49, 50, 51);
    COMPLETE(s, 1, load);
    after = stats(s);
    CHECK(after.manager.pinned == 0 && after.loads_in_flight == 0 &&
          after.stores_in_flight == 0);
    CHECK(after.hits == 1 && after.hit_tokens == 12 && after.deferred_jobs_in_flight == 1);
    CHECK(after.store_jobs == 2 && after.load_jobs == 1);

    kvo_step_free(st);
    kvo_scheduler_free(s);
}

/* 3. A plan with a load, a store and a flush travels as bytes; damaged bytes are refused. */
static void test_step_encoding(void) {
    kvo_scheduler *s = new_scheduler(1);
    kvo_step *plan = new_step(), *other = new_step(), *copy = new_step();
    uint8_t bytes[STEP_BYTES], again[STEP_BYTES], bad[STEP_BYTES];
    blocks_t b;

    /* Request 1 stores chunks 0, 1 (job 0, completed); request 3 stores one (job 1, in flight:
     * `other` keeps that plan). */
    ADD(s, 1, 1, 24);
    MATCH_MISS(s, 1, 0);
    b = blocks(0, 6);
    STEP1(s, other, sched(1, 0, 24, 24, &b));
    COMPLETE(s, 1, 0);
    ADD(s, 3, 3, 12);
    MATCH_MISS(s, 3, 0);
    b = blocks(30, 33);
    STEP1(s, other, sched(3, 0, 12, 12, &b));
    CHECK_COUNTS(other, 1, 0);
    /* Request 2 loads request 1's chunks (job 2); request 4 stores (job 3); 3 is preempted. */
    ADD(s, 2, 1, 26);
    MATCH_HIT(s, 2, 0, 24);
    CHECK(ON_ALLOC(s, 2, blocks(10, 17), 24) == 2);
    ADD(s, 4, 4, 12);
    MATCH_MISS(s, 4, 0);
    ON_ALLOC(s, 4, blocks(40, 43), 0);
    b = blocks(40, 43);
    kvo_scheduled_request r4 = sched(4, 0, 12, 12, &b);
    const uint64_t preempted = 3;
    BUILD(s, plan, &r4, 1, &preempted, 1);
    CHECK_COUNTS(plan, 2, 1);
    job_t j = JOB(plan, 0);
    CHECK_JOB(j, KVO_JOB_KIND_LOAD, 2, 2, 0, 6);
    CHECK_U32(j.src, j.info.n_src, 0, 1);
    CHECK_U32(j.dst, j.info.n_dst, 10, 11, 12, 13, 14, 15);
    j = JOB(plan, 1);
    CHECK_JOB(j, KVO_JOB_KIND_STORE, 3, 4, 0, 3);
    CHECK_U32(j.src, j.info.n_src, 40, 41, 42);
    CHECK_U32(j.dst, j.info.n_dst, 3);
    uint64_t flush[MAX_IDS];
    size_t nf = FLUSH(plan, flush);
    CHECK_U64(flush, nf, 1);

    /* Asking with cap 0 gives the length; one byte short is still too small. */
    size_t need = 0, len = 0;
    CHECK_STATUS(kvo_step_encode(plan, NULL, 0, &need), KVO_STATUS_BUFFER_TOO_SMALL, "cap");
    CHECK(need > 10 && need <= STEP_BYTES);
    memset(bytes, 0xEE, sizeof bytes);
    CHECK_STATUS(kvo_step_encode(plan, bytes, need - 1, &len), KVO_STATUS_BUFFER_TOO_SMALL,
                 "cap");
    CHECK(len == need && bytes[0] == 0xEE);
    len = ENCODE(plan, bytes);
    CHECK(len == need);
    CHECK(memcmp(bytes, "KVOS", 4) == 0 && bytes[4] == KVO_STEP_FORMAT_VERSION && bytes[5] == 0);

    /* Decoded into another handle: the same plan, and the same bytes again. */
    CHECK_OK(kvo_step_decode(copy, bytes, len));
    CHECK(steps_equal(plan, copy, __LINE__));
    CHECK(ENCODE(copy, again) == len && memcmp(bytes, again, len) == 0);
    j = JOB(copy, 1);
    CHECK_JOB(j, KVO_JOB_KIND_STORE, 3, 4, 0, 3);
    nf = FLUSH(copy, flush);
    CHECK_U64(flush, nf, 1);

    /* An empty plan round-trips too. */
    kvo_step *empty = new_step(), *empty2 = new_step();
    size_t elen = ENCODE(empty, again);
    CHECK_OK(kvo_step_decode(empty2, again, elen));
    CHECK(steps_equal(empty, empty2, __LINE__));
    kvo_step_info ei = INFO(empty2);
    CHECK(ei.num_jobs == 0 && ei.num_flush == 0);
    kvo_step_free(empty);
    kvo_step_free(empty2);

    /* Damaged bytes: refused, and the target (holding `other`'s plan) is unchanged. */
    CHECK_OK(kvo_step_decode(copy, bytes, len)); /* copy == plan again */
    uint8_t other_bytes[STEP_BYTES];
    size_t other_len = ENCODE(other, other_bytes);
    int all_refused = 1;
    for (size_t n = 0; n < len; n++) { /* every truncation */
        if (kvo_step_decode(other, bytes, n) != KVO_STATUS_CORRUPT_DATA) {
            printf("  truncation to %zu bytes not refused\n", n);
            all_refused = 0;
        }
    }
    CHECK(all_refused);
    all_refused = 1;
    for (size_t i = 0; i < len; i++) { /* every flipped byte */
        memcpy(bad, bytes, len);
        bad[i] ^= 0x10;
        if (kvo_step_decode(other, bad, len) != KVO_STATUS_CORRUPT_DATA) {
            printf("  flipped byte %zu not refused\n", i);
            all_refused = 0;
        }
    }
    CHECK(all_refused);
    CHECK_BAD_STEP(other, kvo_step_decode(other, bytes, len - 1), KVO_STATUS_CORRUPT_DATA,
                   "step bytes");
    memcpy(bad, bytes, len);
    bad[len / 2] ^= 0x01;
    CHECK_BAD_STEP(other, kvo_step_decode(other, bad, len), KVO_STATUS_CORRUPT_DATA,
                   "checksum");
    memcpy(bad, bytes, len);
    bad[4] = 2; /* another format version */
    CHECK_BAD_STEP(other, kvo_step_decode(other, bad, len), KVO_STATUS_CORRUPT_DATA,
                   "version 2");
    memcpy(bad, bytes, len);
    bad[0] = 'X'; /* not a plan */
    CHECK_BAD_STEP(other, kvo_step_decode(other, bad, len), KVO_STATUS_CORRUPT_DATA, "magic");
    memcpy(bad, bytes, len);
    bad[len] = 0; /* a trailing byte */
    CHECK_BAD_STEP(other, kvo_step_decode(other, bad, len + 1), KVO_STATUS_CORRUPT_DATA,
                   "step bytes");
    CHECK_BAD_STEP(other, kvo_step_decode(other, NULL, 0), KVO_STATUS_CORRUPT_DATA,
                   "step bytes");
    CHECK(ENCODE(other, again) == other_len && memcmp(again, other_bytes, other_len) == 0);
    CHECK_COUNTS(other, 1, 0);
    j = JOB(other, 0);
    CHECK_JOB(j, KVO_JOB_KIND_STORE, 1, 3, 0, 3);
    CHECK(steps_equal(plan, copy, __LINE__));

    kvo_step_free(copy);
    kvo_step_free(other);
    kvo_step_free(plan);
    kvo_scheduler_free(s);
}

/* 4. Failed stores roll back, failed loads report what to recompute, completions need every
 * worker. */
static void test_failures(void) {
    kvo_scheduler *s = new_scheduler(1);
    kvo_step *st = new_step();
    kvo_scheduler_stats t;
    blocks_t b;
    uint32_t has_job = 7, failed_load = 7;
    uint64_t job = 77, from = 77, to = 77;

    /* A failed store: its chunks are rolled back, not loadable. */
    ADD(s, 1, 5, 24);
    MATCH_MISS(s, 1, 0);
    b = blocks(0, 6);
    STEP1(s, st, sched(1, 0, 24, 24, &b));
    CHECK_COUNTS(st, 1, 0);
    COMPLETE(s, 0, 0);
    t = stats(s);
    CHECK(t.failed_jobs == 1 && t.stores_in_flight == 0);
    CHECK(t.manager.used == 0 && t.manager.ready == 0 && t.manager.stores_in_flight == 0);
    ADD(s, 2, 5, 24);
    MATCH_MISS(s, 2, 0);
    b = blocks(10, 16);
    /* After a MISS there is nothing to load: on_alloc with tokens is refused. */
    CHECK_BAD(s, kvo_scheduler_on_alloc(s, 2, b.ids, b.n, 24, &has_job, &job),
              KVO_STATUS_INVALID_STATE, "last match");
    CHECK(has_job == 7 && job == 77);

    /* Stored again by request 2, then a failed load for request 3. */
    ON_ALLOC(s, 2, blocks(10, 16), 0);
    STEP1(s, st, sched(2, 0, 24, 24, &b));
    CHECK_COUNTS(st, 1, 0);
    COMPLETE(s, 1, 1);
    ADD(s, 3, 5, 25);
    MATCH_HIT(s, 3, 0, 24);
    uint64_t load = ON_ALLOC(s, 3, blocks(20, 27), 24);
    CHECK(load == 2);
    CHECK_OK(kvo_scheduler_load_failure(s, 3, &failed_load, &from, &to));
    CHECK(failed_load == 0 && from == 77 && to == 77);
    STEP0(s, st);
    CHECK_COUNTS(st, 1, 0);
    COMPLETE(s, 0, load);
    CHECK_OK(kvo_scheduler_load_failure(s, 3, &failed_load, &from, &to));
    CHECK(failed_load == 1 && from == 0 && to == 24);
    t = stats(s);
    CHECK(t.failed_jobs == 2 && t.loads_in_flight == 0 && t.manager.pinned == 0);
    CHECK(t.manager.used == 0); /* the failed load's keys are dropped from the tier */
    MATCH_MISS(s, 3, 0);
    failed_load = 7;
    from = to = 77;
    CHECK_OK(kvo_scheduler_load_failure(s, 3, &failed_load, &from, &to));
    CHECK(failed_load == 0 && from == 77 && to == 77); /* reported until the next match */
    CHECK_OK(kvo_scheduler_load_failure(s, 2, &failed_load, &from, &to));
    CHECK(failed_load == 0);
    /* Events: the rolled-back store announced nothing; the dropped keys are announced removed. */
    kvo_event ev[4];
    uint8_t keys[8 * KEY_LEN];
    size_t ne = 99, nk = 99;
    CHECK_OK(kvo_scheduler_take_events(s, ev, 4, keys, 8, &ne, &nk));
    CHECK(ne == 2 && nk == 4);
    CHECK(ev[0].removed == 0 && ev[0].first_key == 0 && ev[0].n_keys == 2);
    CHECK(ev[1].removed == 1 && ev[1].first_key == 2 && ev[1].n_keys == 2);
    CHECK(get_u64(keys) == chunk_key(5, 0) && get_u64(keys + KEY_LEN) == chunk_key(5, 1));
    CHECK(get_u64(keys + 2 * KEY_LEN) == chunk_key(5, 0) &&
          get_u64(keys + 3 * KEY_LEN) == chunk_key(5, 1));
    kvo_step_free(st);
    kvo_scheduler_free(s);

    /* Two workers: a job completes with the second report. */
    s = new_scheduler(2);
    st = new_step();
    ADD(s, 1, 6, 12);
    MATCH_MISS(s, 1, 0);
    b = blocks(0, 3);
    STEP1(s, st, sched(1, 0, 12, 12, &b));
    CHECK_COUNTS(st, 1, 0);
    kvo_job_report three[3] = {{0, 1, 1}, {0, 1, 1}, {0, 1, 1}};
    CHECK_BAD(s, kvo_scheduler_complete_jobs(s, three, 3), KVO_STATUS_INVALID_ARGUMENT,
              "count");
    kvo_job_report one_of_three = {0, 3, 1};
    CHECK_BAD(s, kvo_scheduler_complete_jobs(s, &one_of_three, 1), KVO_STATUS_INVALID_ARGUMENT,
              "count");
    kvo_job_report zero = {0, 0, 1};
    CHECK_BAD(s, kvo_scheduler_complete_jobs(s, &zero, 1), KVO_STATUS_INVALID_ARGUMENT, "count");
    COMPLETE(s, 1, 0);
    t = stats(s);
    CHECK(t.stores_in_flight == 1 && t.manager.stores_in_flight == 1 && t.manager.ready == 0);
    ADD(s, 2, 6, 13);
    MATCH_DEFER(s, 2, 0, KVO_DEFER_REASON_STORE_IN_FLIGHT); /* its store is not complete */
    CHECK_BAD(s, kvo_scheduler_complete_jobs(s, three, 2), KVO_STATUS_INVALID_ARGUMENT, "count");
    COMPLETE(s, 1, 0);
    t = stats(s);
    CHECK(t.stores_in_flight == 0 && t.manager.ready == 1 && t.deferred_store_in_flight == 1);
    CHECK_BAD(s, kvo_scheduler_complete_jobs(s, three, 1), KVO_STATUS_NOT_FOUND, "job_id");
    MATCH_HIT(s, 2, 0, 12);
    load = ON_ALLOC(s, 2, blocks(10, 14), 12);
    CHECK(load == 1);
    STEP0(s, st);
    {
        job_t j = JOB(st, 0);
        CHECK_JOB(j, KVO_JOB_KIND_LOAD, 1, 2, 0, 3);
        CHECK_U32(j.dst, j.info.n_dst, 10, 11, 12);
    }
    kvo_job_report both = {load, 2, 1}; /* both workers in one report */
    CHECK_OK(kvo_scheduler_complete_jobs(s, &both, 1));
    t = stats(s);
    CHECK(t.loads_in_flight == 0 && t.manager.pinned == 0 && t.failed_jobs == 0);
    check_invariants(s, __LINE__);
    kvo_step_free(st);
    kvo_scheduler_free(s);
}

/* ---- bad inputs, as tables (check.h) ---------------------------------------------------- */

#define SENT64 0xA5A5A5A5A5A5A5A5ull /* an output no case wrote (outputs_reset) */

/* The outputs a case may be given; outputs_reset fills them with 0xA5 before each case. */
typedef struct {
    kvo_match_result match;
    uint32_t has_job, failed;
    uint64_t job, from, to;
    size_t n_events, n_keys, n;
    kvo_event events[4];
    uint8_t keys[4 * KEY_LEN];
    kvo_job_info job_info;
    kvo_step_info info;
    uint32_t src[MAX_IDS], dst[MAX_IDS];
    uint64_t flush[MAX_IDS];
    uint8_t bytes[STEP_BYTES];
    kvo_scheduler_stats stats, size0, size7; /* struct_size: sizeof, 0, sizeof(size_t) - 1 */
} outputs;

struct fixture {
    kvo_scheduler *s;
    kvo_step *st;
    kvo_scheduler_stats before; /* s's stats before the case */
    uint8_t plan[STEP_BYTES];   /* st's encoding before the case */
    size_t plan_len;
    outputs o;
    /* The inputs of the cases (see setup_inputs). */
    hashes_t h, four;
    blocks_t b5, b6, b7, b50;
    kvo_scheduled_request no_ids, short_ids, twice[2], overflowing, r99, r4;
    kvo_job_report rep, reps[2];
    uint64_t unknown;
    /* Bad configs: the good one, edited by the case, and *out, which must not be written. */
    kvo_scheduler_config cfg;
    kvo_scheduler *out;
};

static void outputs_reset(outputs *o) {
    memset(o, 0xA5, sizeof *o);
    o->stats.struct_size = sizeof o->stats;
    o->size0.struct_size = 0;
    o->size7.struct_size = sizeof(size_t) - 1;
}

/* The case wrote no output; prints the first byte it wrote. */
static int outputs_kept(const fixture *f) {
    outputs ref;
    outputs_reset(&ref);
    return bytes_kept(&f->o, &ref, sizeof ref);
}
#define KEPT outputs_kept(f)

/* Before each case: the scheduler's stats, the plan's bytes, fresh outputs; after it: the same
 * stats and plan, and the invariants hold. */
static void scheduler_before(fixture *f) {
    f->before = stats(f->s);
    f->plan_len = encode_(f->st, f->plan, __LINE__);
    outputs_reset(&f->o);
}
static void scheduler_after(fixture *f, int line, const char *what) {
    uint8_t plan[STEP_BYTES];
    check_unchanged(f->s, &f->before, line, what);
    size_t n = encode_(f->st, plan, line);
    check(n == f->plan_len && memcmp(plan, f->plan, n) == 0, line, "the case left the plan");
}
static const fixture_hooks scheduler_hooks = {scheduler_before, scheduler_after};

/* A good config edited by `edit` (the case's one bad field), as kvo_scheduler_new's argument. */
#define CFG(edit) ((edit), &f->cfg)
static int sentinel_marker;
#define SENTINEL ((kvo_scheduler *)(void *)&sentinel_marker)
#define NO_HANDLE (f->out == SENTINEL)

static void config_before(fixture *f) {
    f->cfg = config(1);
    f->out = SENTINEL;
}
static void config_after(fixture *f, int line, const char *what) {
    (void)f, (void)line, (void)what;
}
static const fixture_hooks config_hooks = {config_before, config_after};

/* 5a. Configurations: each bad one is refused, naming the field, and writes no handle. */
#define BAD_CONFIGS(X)                                                                          \
    X(default_no_out, kvo_scheduler_config_default(NULL), NULL_ARGUMENT, "out", NO_HANDLE)      \
    X(no_cfg, kvo_scheduler_new(NULL, &f->out), NULL_ARGUMENT, "cfg", NO_HANDLE)                \
    X(no_out, kvo_scheduler_new(&f->cfg, NULL), NULL_ARGUMENT, "out", NO_HANDLE)                \
    X(size_short, kvo_scheduler_new(CFG(f->cfg.struct_size = sizeof f->cfg - 1), &f->out),      \
      INVALID_ARGUMENT, "struct_size", NO_HANDLE)                                               \
    X(size_0, kvo_scheduler_new(CFG(f->cfg.struct_size = 0), &f->out), INVALID_ARGUMENT,        \
      "struct_size", NO_HANDLE)                                                                 \
    X(key_len_0, kvo_scheduler_new(CFG(f->cfg.key_len = 0), &f->out), INVALID_ARGUMENT,         \
      "key_len", NO_HANDLE)                                                                     \
    X(key_len_big, kvo_scheduler_new(CFG(f->cfg.key_len = KVO_MAX_KEY_LEN + 1), &f->out),       \
      INVALID_ARGUMENT, "key_len", NO_HANDLE)                                                   \
    X(block_size_0, kvo_scheduler_new(CFG(f->cfg.gpu_block_size = 0), &f->out),                 \
      INVALID_ARGUMENT, "gpu_block_size", NO_HANDLE)                                            \
    X(factor_0, kvo_scheduler_new(CFG(f->cfg.block_size_factor = 0), &f->out),                  \
      INVALID_ARGUMENT, "block_size_factor", NO_HANDLE)                                         \
    X(workers_0, kvo_scheduler_new(CFG(f->cfg.num_workers = 0), &f->out), INVALID_ARGUMENT,     \
      "num_workers", NO_HANDLE)                                                                 \
    X(policy, kvo_scheduler_new(CFG(f->cfg.policy = 9), &f->out), INVALID_ARGUMENT, "policy",   \
      NO_HANDLE)                                                                                \
    X(semantics, kvo_scheduler_new(CFG(f->cfg.semantics = 2), &f->out), INVALID_ARGUMENT,       \
      "semantics", NO_HANDLE)
CASE_TABLE(bad_configs, BAD_CONFIGS);

static void test_bad_config(void) {
    fixture f;
    memset(&f, 0, sizeof f);
    RUN_CASES(&f, &config_hooks, bad_configs);

    /* A larger struct_size (a newer caller) is fine; ARC works as well. */
    struct {
        kvo_scheduler_config cfg;
        uint64_t appended;
    } bigger;
    memset(&bigger, 0, sizeof bigger);
    bigger.cfg = config(1);
    bigger.cfg.struct_size = sizeof bigger;
    bigger.cfg.policy = KVO_POLICY_ARC;
    kvo_scheduler *out = NULL;
    CHECK_OK(kvo_scheduler_new(&bigger.cfg, &out));
    CHECK(out != NULL && out != SENTINEL);
    kvo_scheduler_free(out);
    kvo_scheduler_free(NULL);
    kvo_step_free(NULL);
}

/* The inputs of the cases: hashes, GPU blocks, scheduled requests, job reports. */
static void setup_inputs(fixture *f) {
    f->h = hashes(1, 0, 3);
    f->four = hashes(3, 0, 4); /* beyond request 3's 12 tokens: 3 full blocks */
    f->b5 = blocks(10, 15);
    f->b6 = blocks(10, 16);
    f->b7 = blocks(10, 17);
    f->b50 = blocks(50, 53);
    f->no_ids = sched(2, 0, 26, 26, NULL);
    f->no_ids.n_new_block_ids = 7; /* but no pointer */
    f->short_ids = sched(2, 0, 26, 26, &f->b6);
    f->twice[0] = f->twice[1] = sched(2, 0, 26, 26, &f->b7);
    f->overflowing = sched(2, 0, 26, 26, &f->b7);
    f->overflowing.num_computed_tokens = UINT64_MAX;
    f->r99 = sched(99, 0, 4, 4, &f->b7);
    f->r4 = sched(4, 12, 1, 13, NULL);
    f->rep = (kvo_job_report){0, 1, 1};
    f->unknown = 99;
}

/* 5b. Bad arguments on a live scheduler: exact status, the argument named, nothing changed.
 * The first tables run on: request 1 stored chunks 0, 1 (job 0) and finished; request 2 (26
 * tokens, hashed as 1) matched them, a hit of 24 tokens, and is not allocated yet; request 3 (12
 * tokens) has no hashes yet; request 99 is unknown. */
#define NULL_HANDLES(X)                                                                         \
    X(add_no_scheduler, kvo_scheduler_add_request(NULL, 5, 12, KVO_NO_LIMIT), NULL_ARGUMENT,    \
      "scheduler", KEPT)                                                                        \
    X(append_no_scheduler, kvo_scheduler_append_block_hashes(NULL, 2, f->h.bytes, 1, 26),       \
      NULL_ARGUMENT, "scheduler", KEPT)                                                         \
    X(match_no_scheduler, kvo_scheduler_match(NULL, 2, 0, &f->o.match), NULL_ARGUMENT,          \
      "scheduler", KEPT)                                                                        \
    X(alloc_no_scheduler,                                                                       \
      kvo_scheduler_on_alloc(NULL, 2, f->b7.ids, f->b7.n, 24, &f->o.has_job, &f->o.job),        \
      NULL_ARGUMENT, "scheduler", KEPT)                                                         \
    X(build_no_scheduler, kvo_scheduler_build_step(NULL, NULL, 0, NULL, 0, f->st),              \
      NULL_ARGUMENT, "scheduler", KEPT)                                                         \
    X(complete_no_scheduler, kvo_scheduler_complete_jobs(NULL, &f->rep, 1), NULL_ARGUMENT,      \
      "scheduler", KEPT)                                                                        \
    X(finish_no_scheduler, kvo_scheduler_finish_request(NULL, 2), NULL_ARGUMENT, "scheduler",   \
      KEPT)                                                                                     \
    X(failure_no_scheduler,                                                                     \
      kvo_scheduler_load_failure(NULL, 2, &f->o.failed, &f->o.from, &f->o.to), NULL_ARGUMENT,   \
      "scheduler", KEPT)                                                                        \
    X(reset_no_scheduler, kvo_scheduler_reset(NULL), NULL_ARGUMENT, "scheduler", KEPT)          \
    X(events_no_scheduler,                                                                      \
      kvo_scheduler_take_events(NULL, f->o.events, 4, f->o.keys, 4, &f->o.n_events,             \
                                &f->o.n_keys),                                                  \
      NULL_ARGUMENT, "scheduler", KEPT)                                                         \
    X(stats_no_scheduler, kvo_scheduler_get_stats(NULL, &f->o.stats), NULL_ARGUMENT,            \
      "scheduler", KEPT)                                                                        \
    X(invariants_no_scheduler, kvo_scheduler_check_invariants(NULL), NULL_ARGUMENT,             \
      "scheduler", KEPT)
CASE_TABLE(null_handles, NULL_HANDLES);

/* NULL pointers; empty arrays may be NULL. */
#define NULL_POINTERS(X)                                                                        \
    X(match_no_out, kvo_scheduler_match(f->s, 2, 0, NULL), NULL_ARGUMENT, "out", KEPT)          \
    X(append_no_hashes, kvo_scheduler_append_block_hashes(f->s, 2, NULL, 1, 26), NULL_ARGUMENT, \
      "hashes", KEPT)                                                                           \
    X(alloc_no_blocks, kvo_scheduler_on_alloc(f->s, 2, NULL, 7, 24, &f->o.has_job, &f->o.job),  \
      NULL_ARGUMENT, "block_ids", KEPT)                                                         \
    X(alloc_no_has_job,                                                                         \
      kvo_scheduler_on_alloc(f->s, 2, f->b7.ids, f->b7.n, 24, NULL, &f->o.job), NULL_ARGUMENT,  \
      "out_has_job", KEPT)                                                                      \
    X(alloc_no_job_id,                                                                          \
      kvo_scheduler_on_alloc(f->s, 2, f->b7.ids, f->b7.n, 24, &f->o.has_job, NULL),             \
      NULL_ARGUMENT, "out_job_id", KEPT)                                                        \
    X(build_no_step, kvo_scheduler_build_step(f->s, NULL, 0, NULL, 0, NULL), NULL_ARGUMENT,     \
      "step", KEPT)                                                                             \
    X(build_no_scheduled, kvo_scheduler_build_step(f->s, NULL, 1, NULL, 0, f->st),              \
      NULL_ARGUMENT, "scheduled", KEPT)                                                         \
    X(build_no_preempted, kvo_scheduler_build_step(f->s, NULL, 0, NULL, 1, f->st),              \
      NULL_ARGUMENT, "preempted", KEPT)                                                         \
    X(build_no_block_ids, kvo_scheduler_build_step(f->s, &f->no_ids, 1, NULL, 0, f->st),        \
      NULL_ARGUMENT, "scheduled[0].new_block_ids", KEPT)                                        \
    X(complete_no_reports, kvo_scheduler_complete_jobs(f->s, NULL, 1), NULL_ARGUMENT,           \
      "reports", KEPT)                                                                          \
    X(failure_no_failed, kvo_scheduler_load_failure(f->s, 2, NULL, &f->o.from, &f->o.to),       \
      NULL_ARGUMENT, "out_failed", KEPT)                                                        \
    X(failure_no_from, kvo_scheduler_load_failure(f->s, 2, &f->o.failed, NULL, &f->o.to),       \
      NULL_ARGUMENT, "out_from_token", KEPT)                                                    \
    X(failure_no_to, kvo_scheduler_load_failure(f->s, 2, &f->o.failed, &f->o.from, NULL),       \
      NULL_ARGUMENT, "out_to_token", KEPT)                                                      \
    X(stats_no_out, kvo_scheduler_get_stats(f->s, NULL), NULL_ARGUMENT, "out", KEPT)            \
    X(events_no_n_events,                                                                       \
      kvo_scheduler_take_events(f->s, f->o.events, 4, f->o.keys, 4, NULL, &f->o.n_keys),        \
      NULL_ARGUMENT, "out_n_events", KEPT)                                                      \
    X(complete_none, kvo_scheduler_complete_jobs(f->s, NULL, 0), OK, NULL, KEPT)                \
    X(append_none, kvo_scheduler_append_block_hashes(f->s, 2, NULL, 0, 26), OK, NULL, KEPT)
CASE_TABLE(null_pointers, NULL_POINTERS);

/* Unknown requests (99 never added, 1 finished and gone). */
#define UNKNOWN_REQUESTS(X)                                                                     \
    X(match_unknown, kvo_scheduler_match(f->s, 99, 0, &f->o.match), NOT_FOUND, "request_id",    \
      KEPT)                                                                                     \
    X(append_unknown, kvo_scheduler_append_block_hashes(f->s, 99, f->h.bytes, 1, 4), NOT_FOUND, \
      "request_id", KEPT)                                                                       \
    X(alloc_unknown,                                                                            \
      kvo_scheduler_on_alloc(f->s, 99, f->b7.ids, f->b7.n, 0, &f->o.has_job, &f->o.job),        \
      NOT_FOUND, "request_id", KEPT)                                                            \
    X(finish_unknown, kvo_scheduler_finish_request(f->s, 99), NOT_FOUND, "request_id", KEPT)    \
    X(finish_gone, kvo_scheduler_finish_request(f->s, 1), NOT_FOUND, "request_id", KEPT)        \
    X(failure_unknown,                                                                          \
      kvo_scheduler_load_failure(f->s, 99, &f->o.failed, &f->o.from, &f->o.to), NOT_FOUND,      \
      "request_id", KEPT)                                                                       \
    X(build_unknown, kvo_scheduler_build_step(f->s, &f->r99, 1, NULL, 0, f->st), NOT_FOUND,     \
      "request_id", KEPT)                                                                       \
    X(build_preempted_unknown, kvo_scheduler_build_step(f->s, NULL, 0, &f->unknown, 1, f->st),  \
      NOT_FOUND, "preempted[0]", KEPT)
CASE_TABLE(unknown_requests, UNKNOWN_REQUESTS);

/* A duplicate request; a match before its hashes; hashes beyond its full blocks; overflows;
 * block ids shorter than the tokens need (24 hit tokens need 6 GPU blocks, 26 tokens 7). */
#define BAD_ARGUMENTS(X)                                                                        \
    X(add_twice, kvo_scheduler_add_request(f->s, 2, 26, KVO_NO_LIMIT), INVALID_STATE,           \
      "request_id", KEPT)                                                                       \
    X(match_no_hashes, kvo_scheduler_match(f->s, 3, 0, &f->o.match), INVALID_STATE,             \
      "block hashes", KEPT)                                                                     \
    X(append_beyond, kvo_scheduler_append_block_hashes(f->s, 3, f->four.bytes, f->four.n, 12),  \
      INVALID_ARGUMENT, "hashes", KEPT)                                                         \
    X(append_overflow,                                                                          \
      kvo_scheduler_append_block_hashes(f->s, 3, f->four.bytes, OVERFLOW_N, 12),                \
      INVALID_ARGUMENT, "n_hashes", KEPT)                                                       \
    X(append_size_max, kvo_scheduler_append_block_hashes(f->s, 3, f->four.bytes, SIZE_MAX, 12), \
      INVALID_ARGUMENT, "n_hashes", KEPT)                                                       \
    X(alloc_short,                                                                              \
      kvo_scheduler_on_alloc(f->s, 2, f->b5.ids, f->b5.n, 24, &f->o.has_job, &f->o.job),        \
      INVALID_ARGUMENT, "block_ids", KEPT)                                                      \
    X(alloc_beyond_hit,                                                                         \
      kvo_scheduler_on_alloc(f->s, 2, f->b7.ids, f->b7.n, 36, &f->o.has_job, &f->o.job),        \
      INVALID_STATE, "num_external_tokens", KEPT)                                               \
    X(build_short, kvo_scheduler_build_step(f->s, &f->short_ids, 1, NULL, 0, f->st),            \
      INVALID_ARGUMENT, "scheduled[0].new_block_ids", KEPT)                                     \
    X(build_twice, kvo_scheduler_build_step(f->s, f->twice, 2, NULL, 0, f->st),                 \
      INVALID_ARGUMENT, "twice", KEPT)                                                          \
    X(build_overflow, kvo_scheduler_build_step(f->s, &f->overflowing, 1, NULL, 0, f->st),       \
      INVALID_ARGUMENT, "overflows", KEPT)
CASE_TABLE(bad_arguments, BAD_ARGUMENTS);

/* The load of request 2 is made but not in a step yet: reset must wait for build_step, and the
 * load cannot be reported complete. Stats and events with too small a struct or buffer. */
#define LOAD_NOT_SHIPPED(X)                                                                     \
    X(reset_load_unshipped, kvo_scheduler_reset(f->s), INVALID_STATE, "build the step", KEPT)   \
    X(complete_unshipped, kvo_scheduler_complete_jobs(f->s, &f->reps[0], 1), INVALID_STATE,     \
      "not in a step", KEPT)                                                                    \
    X(complete_unknown, /* nothing applied, not even a valid report before it */                \
      kvo_scheduler_complete_jobs(f->s, &f->reps[1], 1), NOT_FOUND, "reports[0].job_id", KEPT)  \
    X(stats_size_0, kvo_scheduler_get_stats(f->s, &f->o.size0), INVALID_ARGUMENT,               \
      "struct_size", KEPT)                                                                      \
    X(stats_size_short, kvo_scheduler_get_stats(f->s, &f->o.size7), INVALID_ARGUMENT,           \
      "struct_size", KEPT)                                                                      \
    X(events_cap, /* gives the counts and keeps the events */                                   \
      kvo_scheduler_take_events(f->s, f->o.events, 0, f->o.keys, 0, &f->o.n_events,             \
                                &f->o.n_keys),                                                  \
      BUFFER_TOO_SMALL, "events_cap", f->o.n_events == 1 && f->o.n_keys == 2)                   \
    X(events_keys_cap,                                                                          \
      kvo_scheduler_take_events(f->s, f->o.events, 4, f->o.keys, 1, &f->o.n_events,             \
                                &f->o.n_keys),                                                  \
      BUFFER_TOO_SMALL, "keys_cap", f->o.n_events == 1 && f->o.n_keys == 2)
CASE_TABLE(load_not_shipped, LOAD_NOT_SHIPPED);

/* The plan holds the load (one job, no flush): bad indices and capacities, NULL handles and
 * outputs, damaged bytes. */
#define PLAN_WITH_LOAD(X)                                                                       \
    X(job_index, kvo_step_get_job(f->st, 1, &f->o.job_info), INVALID_ARGUMENT, "index", KEPT)   \
    X(job_index_max, kvo_step_get_job(f->st, SIZE_MAX, &f->o.job_info), INVALID_ARGUMENT,       \
      "index", KEPT)                                                                            \
    X(blocks_index, kvo_step_get_job_blocks(f->st, 1, f->o.src, MAX_IDS, f->o.dst, MAX_IDS),    \
      INVALID_ARGUMENT, "index", KEPT)                                                          \
    X(blocks_src_cap, kvo_step_get_job_blocks(f->st, 0, f->o.src, 1, f->o.dst, MAX_IDS),        \
      BUFFER_TOO_SMALL, "src_cap", KEPT)                                                        \
    X(blocks_dst_cap, kvo_step_get_job_blocks(f->st, 0, f->o.src, MAX_IDS, f->o.dst, 5),        \
      BUFFER_TOO_SMALL, "dst_cap", KEPT)                                                        \
    X(new_no_out, kvo_step_new(NULL), NULL_ARGUMENT, "out", KEPT)                               \
    X(info_no_step, kvo_step_get_info(NULL, &f->o.info), NULL_ARGUMENT, "step", KEPT)           \
    X(info_no_out, kvo_step_get_info(f->st, NULL), NULL_ARGUMENT, "out", KEPT)                  \
    X(job_no_step, kvo_step_get_job(NULL, 0, &f->o.job_info), NULL_ARGUMENT, "step", KEPT)      \
    X(job_no_out, kvo_step_get_job(f->st, 0, NULL), NULL_ARGUMENT, "out", KEPT)                 \
    X(blocks_no_step, kvo_step_get_job_blocks(NULL, 0, f->o.src, MAX_IDS, f->o.dst, MAX_IDS),   \
      NULL_ARGUMENT, "step", KEPT)                                                              \
    X(blocks_no_src, kvo_step_get_job_blocks(f->st, 0, NULL, MAX_IDS, f->o.dst, MAX_IDS),       \
      NULL_ARGUMENT, "out_src", KEPT)                                                           \
    X(flush_no_step, kvo_step_get_flush(NULL, f->o.flush, MAX_IDS, &f->o.n), NULL_ARGUMENT,     \
      "step", KEPT)                                                                             \
    X(flush_no_n, kvo_step_get_flush(f->st, f->o.flush, MAX_IDS, NULL), NULL_ARGUMENT, "out_n", \
      KEPT)                                                                                     \
    X(encode_no_step, kvo_step_encode(NULL, f->o.bytes, STEP_BYTES, &f->o.n), NULL_ARGUMENT,    \
      "step", KEPT)                                                                             \
    X(encode_no_len, kvo_step_encode(f->st, f->o.bytes, STEP_BYTES, NULL), NULL_ARGUMENT,       \
      "out_len", KEPT)                                                                          \
    X(decode_no_step, kvo_step_decode(NULL, f->o.bytes, 4), NULL_ARGUMENT, "step", KEPT)        \
    X(decode_no_bytes, kvo_step_decode(f->st, NULL, 4), NULL_ARGUMENT, "bytes", KEPT)           \
    X(decode_damaged, kvo_step_decode(f->st, (const uint8_t *)"KVO", 3), CORRUPT_DATA,          \
      "step bytes", KEPT)
CASE_TABLE(plan_with_load, PLAN_WITH_LOAD);

/* After a reset the plan flushes the load (one id): too small a buffer gets the count only. */
#define PLAN_WITH_FLUSH(X)                                                                      \
    X(flush_cap, kvo_step_get_flush(f->st, f->o.flush, 0, &f->o.n), BUFFER_TOO_SMALL, "cap",    \
      f->o.n == 1 && f->o.flush[0] == SENT64)
CASE_TABLE(plan_with_flush, PLAN_WITH_FLUSH);

/* Request 4 finished while its store is in flight: fenced until its last job. */
#define FINISHED_STORING(X)                                                                     \
    X(finish_again, kvo_scheduler_finish_request(f->s, 4), INVALID_STATE, "request_id", KEPT)   \
    X(match_finished, kvo_scheduler_match(f->s, 4, 0, &f->o.match), INVALID_STATE,              \
      "request_id", KEPT)                                                                       \
    X(alloc_finished,                                                                           \
      kvo_scheduler_on_alloc(f->s, 4, f->b50.ids, f->b50.n, 0, &f->o.has_job, &f->o.job),       \
      INVALID_STATE, "request_id", KEPT)                                                        \
    X(append_finished, kvo_scheduler_append_block_hashes(f->s, 4, NULL, 0, 12), INVALID_STATE,  \
      "request_id", KEPT)                                                                       \
    X(build_finished, kvo_scheduler_build_step(f->s, &f->r4, 1, NULL, 0, f->st), INVALID_STATE, \
      "request_id", KEPT)
CASE_TABLE(finished_storing, FINISHED_STORING);

/* ... and dropped with its last job. */
#define FINISHED_GONE(X)                                                                        \
    X(match_gone, kvo_scheduler_match(f->s, 4, 0, &f->o.match), NOT_FOUND, "request_id", KEPT)
CASE_TABLE(finished_gone, FINISHED_GONE);

/* Request 1 offloads chunks 0, 1 (job 0) and finishes; request 2 shares them; request 3 has
 * no hashes yet. */
static void bad_inputs_on_requests(fixture *f) {
    kvo_scheduler *s = f->s;
    kvo_step *st = f->st;
    ADD(s, 1, 1, 24);
    MATCH_MISS(s, 1, 0);
    blocks_t b = blocks(0, 6);
    STEP1(s, st, sched(1, 0, 24, 24, &b));
    COMPLETE(s, 1, 0);
    CHECK_OK(kvo_scheduler_finish_request(s, 1));
    ADD(s, 2, 1, 26);
    MATCH_HIT(s, 2, 0, 24);
    CHECK_OK(kvo_scheduler_add_request(s, 3, 12, KVO_NO_LIMIT));

    RUN_CASES(f, &scheduler_hooks, null_handles);
    RUN_CASES(f, &scheduler_hooks, null_pointers);
    RUN_CASES(f, &scheduler_hooks, unknown_requests);
    RUN_CASES(f, &scheduler_hooks, bad_arguments);
}

/* Request 2's load made, then shipped in a plan. */
static void bad_inputs_on_a_load(fixture *f) {
    kvo_scheduler *s = f->s;
    uint64_t load = ON_ALLOC(s, 2, blocks(10, 17), 24);
    CHECK(load == 1);
    f->reps[0] = (kvo_job_report){load, 1, 1};
    f->reps[1] = (kvo_job_report){999, 1, 1};
    RUN_CASES(f, &scheduler_hooks, load_not_shipped);
    CHECK(stats(s).loads_in_flight == 1);

    /* Stats written only up to the caller's struct_size. */
    kvo_scheduler_stats small;
    memset(&small, 0xAB, sizeof small);
    small.struct_size = offsetof(kvo_scheduler_stats, matches) + sizeof small.matches;
    CHECK_OK(kvo_scheduler_get_stats(s, &small));
    CHECK(small.struct_size == offsetof(kvo_scheduler_stats, matches) + sizeof small.matches);
    CHECK(small.requests == 2 && small.matches == 2);
    CHECK(small.deferred_jobs_in_flight == 0xABABABABABABABABull);
    struct {
        kvo_scheduler_stats stats;
        uint64_t appended;
    } newer;
    memset(&newer, 0xAB, sizeof newer);
    newer.stats.struct_size = sizeof newer; /* a newer caller: only what this library knows */
    CHECK_OK(kvo_scheduler_get_stats(s, &newer.stats));
    CHECK(newer.stats.struct_size == sizeof(kvo_scheduler_stats));
    CHECK(newer.stats.requests == 2 && newer.stats.manager.capacity == NUM_SLOTS);
    CHECK(newer.appended == 0xABABABABABABABABull);

    kvo_event ev[4];
    uint8_t keys[4 * KEY_LEN];
    size_t ne = 99, nk = 99;
    CHECK_OK(kvo_scheduler_take_events(s, ev, 4, keys, 4, &ne, &nk));
    CHECK(ne == 1 && nk == 2 && ev[0].removed == 0);

    STEP0(s, f->st);
    CHECK_COUNTS(f->st, 1, 0);
    RUN_CASES(f, &scheduler_hooks, plan_with_load);
}

/* Reset: the in-flight load is flushed by the next step and its report ignored. */
static void bad_inputs_after_reset(fixture *f) {
    kvo_scheduler *s = f->s;
    uint64_t flush[MAX_IDS];
    CHECK_OK(kvo_scheduler_reset(s));
    check_invariants(s, __LINE__);
    kvo_scheduler_stats t = stats(s);
    CHECK(t.loads_in_flight == 0 && t.manager.used == 0 && t.requests == 2);
    STEP0(s, f->st);
    CHECK_COUNTS(f->st, 0, 1);
    RUN_CASES(f, &scheduler_hooks, plan_with_flush);
    size_t n = FLUSH(f->st, flush);
    CHECK_U64(flush, n, 1);
    COMPLETE(s, 1, f->reps[0].job_id); /* a stale report: ignored */
    MATCH_MISS(s, 2, 0); /* not deferred forever: the tier is empty */

    /* A finished request with a store in flight: fenced, then dropped with its last job. */
    ADD(s, 4, 4, 12);
    MATCH_MISS(s, 4, 0);
    STEP1(s, f->st, sched(4, 0, 12, 12, &f->b50));
    CHECK_COUNTS(f->st, 1, 0);
    CHECK_OK(kvo_scheduler_finish_request(s, 4));
    RUN_CASES(f, &scheduler_hooks, finished_storing);
    CHECK(stats(s).requests == 3);
    /* Its GPU block 51 is allocated again: the next step flushes the store. */
    CHECK(ON_ALLOC(s, 2, blocks(51, 52), 0) == NO_JOB);
    STEP0(s, f->st);
    n = FLUSH(f->st, flush);
    CHECK_U64(flush, n, 2);
    COMPLETE(s, 1, 2);
    CHECK(stats(s).requests == 2);
    RUN_CASES(f, &scheduler_hooks, finished_gone);
}

static void test_bad_inputs(void) {
    fixture f;
    memset(&f, 0, sizeof f);
    f.s = new_scheduler(1);
    f.st = new_step();
    setup_inputs(&f);
    bad_inputs_on_requests(&f);
    bad_inputs_on_a_load(&f);
    bad_inputs_after_reset(&f);
    kvo_step_free(f.st);
    kvo_scheduler_free(f.s);
}

/* 5c. Documented behaviour the library does not have (KNOWN_ISSUE: reported, not counted):
 * "Outputs are written only on success" (header, top) for calls that fail after having written
 * an output, and statuses the header promises but the library does not return. */
/* Contracts once reported broken by this program: outputs untouched on failure, and so on. */
static void test_output_contracts(void) {
    kvo_scheduler *s = new_scheduler(1);
    kvo_step *st = new_step();
    blocks_t b;
    ADD(s, 1, 1, 24);
    MATCH_MISS(s, 1, 0);
    b = blocks(0, 6);
    STEP1(s, st, sched(1, 0, 24, 24, &b));
    const uint64_t preempted = 1;
    kvo_step *fl = new_step();
    BUILD(s, fl, NULL, 0, &preempted, 1);
    CHECK_COUNTS(fl, 0, 1);

    /* get_job_blocks with a good src buffer and a NULL dst buffer. */
    uint32_t src[MAX_IDS];
    memset(src, 0xEE, sizeof src);
    CHECK_BAD_STEP(st, kvo_step_get_job_blocks(st, 0, src, MAX_IDS, NULL, MAX_IDS),
                   KVO_STATUS_NULL_ARGUMENT, "out_dst");
    CHECK(src[0] == 0xEEEEEEEEu);

    /* get_flush with a NULL buffer that claims room. */
    size_t n = 12345;
    CHECK_BAD_STEP(fl, kvo_step_get_flush(fl, NULL, 8, &n), KVO_STATUS_NULL_ARGUMENT,
                   "out_ids");
    CHECK(n == 12345);

    /* encode with a NULL buffer that claims room. */
    n = 12345;
    CHECK_BAD_STEP(st, kvo_step_encode(st, NULL, STEP_BYTES, &n), KVO_STATUS_NULL_ARGUMENT,
                   "buf");
    CHECK(n == 12345);

    /* on_alloc with 0 external tokens only records the blocks: OK even with jobs in flight. */
    uint32_t has_job = 7;
    uint64_t job = 77;
    b = blocks(40, 46);
    kvo_status got = kvo_scheduler_on_alloc(s, 1, b.ids, b.n, 0, &has_job, &job);
    CHECK(got == KVO_STATUS_OK && has_job == 0 && job == 77);

    /* complete_jobs: "KVO_STATUS_INVALID_ARGUMENT for a zero count or more reports than
     * workers", also for a job id from before a reset (which is otherwise ignored). */
    CHECK_OK(kvo_scheduler_reset(s));
    const kvo_job_report stale_zero = {0, 0, 1};
    CHECK_STATUS(kvo_scheduler_complete_jobs(s, &stale_zero, 1), KVO_STATUS_INVALID_ARGUMENT,
                 "count");
    const kvo_job_report stale_many = {0, 2, 1};
    CHECK_STATUS(kvo_scheduler_complete_jobs(s, &stale_many, 1), KVO_STATUS_INVALID_ARGUMENT,
                 "count");
    const kvo_job_report stale_one = {0, 1, 1};
    CHECK_OK(kvo_scheduler_complete_jobs(s, &stale_one, 1));

    check_invariants(s, __LINE__);
    kvo_step_free(fl);
    kvo_step_free(st);
    kvo_scheduler_free(s);
}

/* The scheduler's Prometheus text holds its own metrics and its tier's. */
static void test_metrics_text(void) {
    kvo_scheduler_config c;
    CHECK_OK(kvo_scheduler_config_default(&c));
    c.num_slots = 8;
    kvo_scheduler *s = NULL;
    CHECK_OK(kvo_scheduler_new(&c, &s));
    if (s == NULL) {
        return;
    }
    char text[16384];
    size_t len = 0;
    CHECK_OK(kvo_scheduler_metrics_text(s, "vllm:kv_offload", NULL, 0, text, sizeof text, &len));
    CHECK(len == strlen(text));
    CHECK(strstr(text, "\nvllm:kv_offload_deferred_matches_total{reason=\"jobs_in_flight\"} 0\n") != NULL);
    CHECK(strstr(text, "\nvllm:kv_offload_host_slots 8\n") != NULL);
    CHECK(strstr(text, "\nvllm:kv_offload_requests 0\n") != NULL);
    size_t keep = 5;
    CHECK_STATUS(kvo_scheduler_metrics_text(NULL, "p", NULL, 0, text, sizeof text, &keep),
                 KVO_STATUS_NULL_ARGUMENT, "scheduler");
    const kvo_label reason[1] = {{"reason", "x"}};
    CHECK_STATUS(kvo_scheduler_metrics_text(s, "p", reason, 1, text, sizeof text, &keep),
                 KVO_STATUS_INVALID_ARGUMENT, "labels[0].name");
    CHECK(keep == 5);
    kvo_scheduler_free(s);
}

/* kvo_scheduler_build_step_arrays gives the plan kvo_scheduler_build_step gives, and refuses
 * bad arrays naming them, changing nothing; kvo_step_get_jobs reads every job at once. */
static void test_arrays(void) {
    kvo_scheduler *a = new_scheduler(1), *b = new_scheduler(1);
    kvo_step *sa = new_step(), *sb = new_step();
    for (int k = 0; k < 2; k++) {
        kvo_scheduler *s = k ? b : a;
        ADD(s, 1, 100, 24);
        ADD(s, 2, 200, 12);
        MATCH_MISS(s, 1, 0);
        MATCH_MISS(s, 2, 0);
    }
    blocks_t b1 = blocks(0, 6), b2 = blocks(10, 13);
    kvo_scheduled_request reqs[2] = {sched(1, 0, 24, 24, &b1), sched(2, 0, 12, 12, &b2)};
    BUILD(a, sa, reqs, 2, NULL, 0);

    const uint64_t ids[2] = {1, 2}, computed[2] = {0, 0}, scheduled[2] = {24, 12},
                   tokens[2] = {24, 12}, counts[2] = {6, 3};
    uint32_t all[9];
    memcpy(all, b1.ids, 6 * sizeof all[0]);
    memcpy(all + 6, b2.ids, 3 * sizeof all[0]);
    const uint64_t too_many[2] = {6, 4}, overflow[2] = {UINT64_MAX, 10}, unknown[2] = {1, 9};
    const uint64_t short_counts[2] = {1, 3};
    const uint8_t resumed[2] = {0, 0};

    CHECK_BAD(b, kvo_scheduler_build_step_arrays(NULL, 2, ids, computed, scheduled, tokens,
                                                 counts, all, 9, NULL, NULL, 0, sb),
              KVO_STATUS_NULL_ARGUMENT, "scheduler");
    CHECK_BAD(b, kvo_scheduler_build_step_arrays(b, 2, ids, computed, scheduled, tokens, counts,
                                                 all, 9, NULL, NULL, 0, NULL),
              KVO_STATUS_NULL_ARGUMENT, "step");
    CHECK_BAD(b, kvo_scheduler_build_step_arrays(b, 2, NULL, computed, scheduled, tokens,
                                                 counts, all, 9, NULL, NULL, 0, sb),
              KVO_STATUS_NULL_ARGUMENT, "request_ids");
    CHECK_BAD(b, kvo_scheduler_build_step_arrays(b, 2, ids, NULL, scheduled, tokens, counts, all,
                                                 9, NULL, NULL, 0, sb),
              KVO_STATUS_NULL_ARGUMENT, "num_computed_tokens");
    CHECK_BAD(b, kvo_scheduler_build_step_arrays(b, 2, ids, computed, NULL, tokens, counts, all,
                                                 9, NULL, NULL, 0, sb),
              KVO_STATUS_NULL_ARGUMENT, "num_scheduled_tokens");
    CHECK_BAD(b, kvo_scheduler_build_step_arrays(b, 2, ids, computed, scheduled, NULL, counts,
                                                 all, 9, NULL, NULL, 0, sb),
              KVO_STATUS_NULL_ARGUMENT, "num_tokens");
    CHECK_BAD(b, kvo_scheduler_build_step_arrays(b, 2, ids, computed, scheduled, tokens, NULL,
                                                 all, 9, NULL, NULL, 0, sb),
              KVO_STATUS_NULL_ARGUMENT, "n_new_block_ids");
    CHECK_BAD(b, kvo_scheduler_build_step_arrays(b, 2, ids, computed, scheduled, tokens, counts,
                                                 NULL, 9, NULL, NULL, 0, sb),
              KVO_STATUS_NULL_ARGUMENT, "block_ids");
    CHECK_BAD(b, kvo_scheduler_build_step_arrays(b, 2, ids, computed, scheduled, tokens, counts,
                                                 all, 9, NULL, NULL, 1, sb),
              KVO_STATUS_NULL_ARGUMENT, "preempted");
    CHECK_BAD(b, kvo_scheduler_build_step_arrays(b, 2, ids, computed, scheduled, tokens,
                                                 too_many, all, 9, NULL, NULL, 0, sb),
              KVO_STATUS_INVALID_ARGUMENT, "n_new_block_ids");
    CHECK_BAD(b, kvo_scheduler_build_step_arrays(b, 2, ids, computed, scheduled, tokens,
                                                 overflow, all, 9, NULL, NULL, 0, sb),
              KVO_STATUS_INVALID_ARGUMENT, "n_new_block_ids");
    CHECK_BAD(b, kvo_scheduler_build_step_arrays(b, 2, ids, computed, scheduled, tokens, counts,
                                                 all, OVERFLOW_N, NULL, NULL, 0, sb),
              KVO_STATUS_INVALID_ARGUMENT, "block_ids");
    CHECK_BAD(b, kvo_scheduler_build_step_arrays(b, 2, unknown, computed, scheduled, tokens,
                                                 counts, all, 9, NULL, NULL, 0, sb),
              KVO_STATUS_NOT_FOUND, "request_id");
    /* request 1 given 1 block for 24 tokens (request 2 then gets the other 8 ids: the counts add
     * up to 9 only with them; here they add up to 4, so use 4 ids). */
    CHECK_BAD(b, kvo_scheduler_build_step_arrays(b, 2, ids, computed, scheduled, tokens,
                                                 short_counts, all, 4, NULL, NULL, 0, sb),
              KVO_STATUS_INVALID_ARGUMENT, "scheduled[0].new_block_ids");
    CHECK(INFO(sb).num_jobs == 0); /* never written */

    CHECK_OK(kvo_scheduler_build_step_arrays(b, 2, ids, computed, scheduled, tokens, counts, all,
                                             9, resumed, NULL, 0, sb));
    check_invariants(b, __LINE__);
    CHECK(steps_equal(sa, sb, __LINE__));

    /* kvo_step_get_jobs: the jobs and their blocks, back to back, as the per-job calls give. */
    kvo_step_info info = INFO(sa);
    CHECK(info.num_jobs == 2); /* one store job per request: 2 chunks, then 1 */
    kvo_job_info infos[8];
    uint32_t ids_out[64];
    size_t nj = 12345, nb = 12345;
    memset(infos, 0xab, sizeof infos);
    CHECK_BAD_STEP(sa, kvo_step_get_jobs(sa, infos, 1, ids_out, 64, &nj, &nb),
                   KVO_STATUS_BUFFER_TOO_SMALL, "jobs_cap");
    CHECK(nj == 2 && nb == 12);
    CHECK(infos[0].id == 0xababababababababULL);
    nj = nb = 12345;
    CHECK_BAD_STEP(sa, kvo_step_get_jobs(sa, infos, 8, ids_out, 11, &nj, &nb),
                   KVO_STATUS_BUFFER_TOO_SMALL, "blocks_cap");
    CHECK(nj == 2 && nb == 12);
    nj = nb = 12345;
    CHECK_BAD_STEP(sa, kvo_step_get_jobs(sa, NULL, 0, NULL, 0, &nj, &nb),
                   KVO_STATUS_BUFFER_TOO_SMALL, "jobs_cap");
    CHECK(nj == 2 && nb == 12);
    nj = nb = 12345;
    CHECK_BAD_STEP(sa, kvo_step_get_jobs(sa, NULL, 8, ids_out, 64, &nj, &nb),
                   KVO_STATUS_NULL_ARGUMENT, "out_jobs");
    CHECK_BAD_STEP(sa, kvo_step_get_jobs(sa, infos, 8, NULL, 64, &nj, &nb),
                   KVO_STATUS_NULL_ARGUMENT, "out_blocks");
    CHECK_BAD_STEP(sa, kvo_step_get_jobs(sa, infos, 8, ids_out, 64, NULL, &nb),
                   KVO_STATUS_NULL_ARGUMENT, "out_n_jobs");
    CHECK_BAD_STEP(sa, kvo_step_get_jobs(sa, infos, 8, ids_out, 64, &nj, NULL),
                   KVO_STATUS_NULL_ARGUMENT, "out_n_blocks");
    CHECK_STATUS(kvo_step_get_jobs(NULL, infos, 8, ids_out, 64, &nj, &nb),
                 KVO_STATUS_NULL_ARGUMENT, "step");
    CHECK(nj == 12345 && nb == 12345);
    CHECK_OK(kvo_step_get_jobs(sa, infos, 8, ids_out, 64, &nj, &nb));
    CHECK(nj == 2 && nb == 12);
    size_t at = 0;
    for (size_t k = 0; k < nj && k < 8; k++) {
        job_t j = JOB(sa, k);
        CHECK(memcmp(&j.info, &infos[k], sizeof j.info) == 0);
        CHECK(memcmp(j.src, ids_out + at, j.info.n_src * sizeof ids_out[0]) == 0);
        at += j.info.n_src;
        CHECK(memcmp(j.dst, ids_out + at, j.info.n_dst * sizeof ids_out[0]) == 0);
        at += j.info.n_dst;
    }
    CHECK(at == nb);
    kvo_step *empty = new_step();
    nj = nb = 12345;
    CHECK_OK(kvo_step_get_jobs(empty, NULL, 0, NULL, 0, &nj, &nb));
    CHECK(nj == 0 && nb == 0);

    kvo_step_free(empty);
    kvo_step_free(sa);
    kvo_step_free(sb);
    kvo_scheduler_free(a);
    kvo_scheduler_free(b);
}

int main(void) {
    test_config_default();
    test_life_cycle();
    test_race();
    test_step_encoding();
    test_failures();
    test_bad_config();
    test_bad_inputs();
    test_output_contracts();
    test_metrics_text();
    test_arrays();
    printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
