/* Abort while loading, with real bytes: request 2's load of prefix A is still queued on the
 * worker when request 2 is aborted and its GPU blocks go to request 3. The step that schedules
 * request 3 must flush the load (kvo_worker_submit_step waits for it), so that the load cannot
 * overwrite request 3's KV after request 3 computed it. Checked on the bytes of request 3's
 * blocks after every copy has drained. */
#include "check.h"

#include <stdlib.h>

#define PAGE (1u << 20) /* bytes per GPU block */
#define NUM_BLOCKS 48u
#define NUM_SLOTS 64u
#define BLOCK_TOKENS 4u
#define BUSY_JOBS 8u /* big loads queued ahead, so request 2's load waits in the lane */

static uint8_t *kv;

static uint64_t word(uint64_t req, uint64_t block) { return req << 32 | block; }

/* The forward pass of `req`: writes its tokens' KV into its blocks. */
static void compute(uint64_t req, const uint32_t *blocks, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint64_t *p = (uint64_t *)(kv + (size_t)blocks[i] * PAGE);
        for (size_t w = 0; w < PAGE / 8; w++) p[w] = word(req, i);
    }
}

/* Blocks of `blocks` not holding `req`'s KV (block i of the request). */
static size_t blocks_overwritten(uint64_t req, const uint32_t *blocks, size_t n) {
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        const uint64_t *p = (const uint64_t *)(kv + (size_t)blocks[i] * PAGE);
        for (size_t w = 0; w < PAGE / 8; w++) {
            if (p[w] != word(req, i)) {
                bad++;
                break;
            }
        }
    }
    return bad;
}

static void hashes(uint64_t family, size_t n, uint8_t *out) {
    for (size_t i = 0; i < n; i++) {
        uint64_t h = family * 1000000 + i;
        for (int b = 0; b < 8; b++) out[i * 8 + (size_t)b] = (uint8_t)(h >> (56 - 8 * b));
    }
}

/* Waits for jobs `ids` (and everything queued before them), polls every completion, and
 * reports the scheduler's jobs (ids below 1000). */
static void drain(kvo_scheduler *s, kvo_worker *w, const uint64_t *ids, size_t n_ids,
                  size_t expected) {
    CHECK_OK(kvo_worker_wait(w, ids, n_ids, 10000));
    kvo_completion done[32];
    size_t n = 0;
    CHECK_OK(kvo_worker_poll(w, done, 32, &n));
    CHECK(n == expected);
    for (size_t i = 0; i < n; i++) {
        CHECK(done[i].success);
        if (done[i].job_id >= 1000) continue;
        kvo_job_report r = {.job_id = done[i].job_id, .count = 1, .success = 1};
        CHECK_OK(kvo_scheduler_complete_jobs(s, &r, 1));
    }
}

/* The id of the step's only job. */
static uint64_t only_job(const kvo_step *step) {
    kvo_step_info info;
    CHECK_OK(kvo_step_get_info(step, &info));
    CHECK(info.num_jobs == 1);
    kvo_job_info job;
    CHECK_OK(kvo_step_get_job(step, 0, &job));
    return job.id;
}

static void run_step(kvo_worker *w, kvo_step *step) { CHECK_OK(kvo_worker_submit_step(w, step, 0)); }

int main(void) {
    kv = aligned_alloc(4096, (size_t)NUM_BLOCKS * PAGE);
    CHECK(kv != NULL);
    if (kv == NULL) return 1;
    memset(kv, 0, (size_t)NUM_BLOCKS * PAGE);

    kvo_scheduler_config cfg;
    CHECK_OK(kvo_scheduler_config_default(&cfg));
    cfg.key_len = 8;
    cfg.gpu_block_size = BLOCK_TOKENS;
    cfg.num_slots = NUM_SLOTS;
    cfg.offload_prompt_only = 1;
    kvo_scheduler *s = NULL;
    CHECK_OK(kvo_scheduler_new(&cfg, &s));

    kvo_kv_tensor tensor = {.base = (uint64_t)(uintptr_t)kv, .block_stride = PAGE,
                            .page_size = PAGE, .num_blocks = NUM_BLOCKS, .on_device = 0};
    kvo_worker_config wcfg;
    CHECK_OK(kvo_worker_config_default(&wcfg));
    wcfg.num_host_slots = NUM_SLOTS;
    kvo_worker *w = NULL;
    CHECK_OK(kvo_worker_new(&wcfg, &tensor, 1, NULL, &w));
    kvo_step *step = NULL;
    CHECK_OK(kvo_step_new(&step));

    /* 1. Request 1 computes prefix A in blocks 0..15, stores it, finishes. */
    uint32_t b1[16], b2[16], b3[16];
    for (uint32_t i = 0; i < 16; i++) b1[i] = i, b2[i] = 16 + i, b3[i] = 16 + i;
    uint8_t a[16 * 8], b[16 * 8];
    hashes(1, 16, a);
    hashes(2, 16, b);
    kvo_match_result m;
    uint32_t has_job;
    uint64_t load_id = 0, none;
    CHECK_OK(kvo_scheduler_add_request(s, 1, 64, KVO_NO_LIMIT));
    CHECK_OK(kvo_scheduler_append_block_hashes(s, 1, a, 16, 64));
    CHECK_OK(kvo_scheduler_match(s, 1, 0, &m));
    CHECK(m.kind == KVO_MATCH_MISS);
    CHECK_OK(kvo_scheduler_on_alloc(s, 1, b1, 16, 0, &has_job, &none));
    compute(1, b1, 16);
    kvo_scheduled_request r1 = {.request_id = 1, .num_scheduled_tokens = 64, .num_tokens = 64,
                                .new_block_ids = b1, .n_new_block_ids = 16};
    CHECK_OK(kvo_scheduler_build_step(s, &r1, 1, NULL, 0, step));
    uint64_t store1 = only_job(step);
    run_step(w, step);
    drain(s, w, &store1, 1, 1);
    CHECK_OK(kvo_scheduler_finish_request(s, 1));

    /* 2. Request 2 shares prefix A: a hit of 60 tokens, loaded into blocks 16..31. The load
     * lane is busy with big loads into blocks 32..47, so the load stays queued. */
    CHECK_OK(kvo_scheduler_add_request(s, 2, 61, KVO_NO_LIMIT));
    CHECK_OK(kvo_scheduler_append_block_hashes(s, 2, a, 15, 61));
    CHECK_OK(kvo_scheduler_match(s, 2, 0, &m));
    CHECK(m.kind == KVO_MATCH_HIT && m.tokens == 60);
    CHECK_OK(kvo_scheduler_on_alloc(s, 2, b2, 16, 60, &has_job, &load_id));
    CHECK(has_job == 1);
    uint32_t busy_src[16], busy_dst[16];
    for (uint32_t i = 0; i < 16; i++) busy_src[i] = 40 + i, busy_dst[i] = 32 + i;
    for (uint32_t j = 0; j < BUSY_JOBS; j++) {
        CHECK_OK(kvo_worker_submit_job(w, 1000 + j, KVO_JOB_KIND_LOAD, busy_src, 16, busy_dst,
                                       16, 0, 0));
    }
    CHECK_OK(kvo_scheduler_build_step(s, NULL, 0, NULL, 0, step));
    CHECK(only_job(step) == load_id);
    run_step(w, step);

    /* 3. Request 2 is aborted; its blocks go to request 3 (prefix B), scheduled at once. */
    CHECK_OK(kvo_scheduler_finish_request(s, 2));
    CHECK_OK(kvo_scheduler_add_request(s, 3, 64, KVO_NO_LIMIT));
    CHECK_OK(kvo_scheduler_append_block_hashes(s, 3, b, 16, 64));
    CHECK_OK(kvo_scheduler_match(s, 3, 0, &m));
    CHECK(m.kind == KVO_MATCH_MISS);
    CHECK_OK(kvo_scheduler_on_alloc(s, 3, b3, 16, 0, &has_job, &none));
    kvo_scheduled_request r3 = {.request_id = 3, .num_scheduled_tokens = 64, .num_tokens = 64,
                                .new_block_ids = b3, .n_new_block_ids = 16};
    CHECK_OK(kvo_scheduler_build_step(s, &r3, 1, NULL, 0, step));
    uint64_t flush[4];
    size_t n_flush = 0;
    CHECK_OK(kvo_step_get_flush(step, flush, 4, &n_flush));
    CHECK(n_flush == 1 && flush[0] == load_id);
    uint64_t store3 = only_job(step);
    run_step(w, step); /* waits for request 2's load */
    compute(3, b3, 16);

    /* 4. Every copy drains (the busy loads, request 2's load, request 3's store). */
    uint64_t last[2] = {load_id, store3};
    drain(s, w, last, 2, BUSY_JOBS + 2);
    size_t bad = blocks_overwritten(3, b3, 16);
    if (bad != 0) printf("request 3: %zu of 16 blocks overwritten by request 2's load\n", bad);
    CHECK(bad == 0);
    CHECK_OK(kvo_scheduler_check_invariants(s));
    kvo_scheduler_stats st = {.struct_size = sizeof st};
    CHECK_OK(kvo_scheduler_get_stats(s, &st));
    CHECK(st.loads_in_flight == 0 && st.stores_in_flight == 0 && st.manager.pinned == 0);
    CHECK(st.requests == 1);

    kvo_step_free(step);
    kvo_worker_free(w);
    kvo_scheduler_free(s);
    free(kv);
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
