/* A small replay through the C ABI: the shortest complete picture of a server's integration.
 *
 * A built-in seeded workload (REQUESTS prompts, most of them starting with one of a few shared
 * system prompts, each ending with a unique suffix) runs on a simulated engine, one engine step
 * at a time:
 *   1. admit: requests whose load finished run now; arrived requests are matched against the
 *      host tier (kvo_scheduler_match; DEFER: try again next step), get GPU blocks from a free
 *      list, and are recorded (kvo_scheduler_on_alloc); a HIT waits for its load, a MISS runs;
 *   2. kvo_scheduler_build_step with the running requests, kvo_worker_submit_step on a KV tensor
 *      in host memory (it holds the plan's stores until the next submit or a wait naming them);
 *   3. the forward pass: each computed block is filled with its hash (so loads can be checked),
 *      each request ends after its prefill (kvo_scheduler_finish_request, blocks freed);
 *   4. completions: the jobs shipped one step earlier are waited for, polled and reported
 *      (kvo_scheduler_complete_jobs); each loaded block's content is checked.
 * Reporting completions one step after shipping keeps the run deterministic (a server reports
 * whatever kvo_worker_poll returns); examples/replay.py is the same program in Python and
 * prints the same lines. Build and run from the repository root, after `cargo build`:
 *   cc -std=c11 examples/replay.c -Iinclude -Ltarget/debug -lkvoffload -Wl,-rpath,target/debug \
 *     -o replay && ./replay
 */
#include <kvoffload.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define REQUESTS 200
#define ARRIVALS_PER_STEP 2
#define BLOCK_TOKENS 16
#define GPU_BLOCKS 64
#define HOST_SLOTS 64
#define PAGE_BYTES 128 /* KV bytes per GPU block in this toy tensor */
#define KEY_LEN 8
#define MAX_BLOCKS 16 /* blocks of the longest prompt */
#define MAX_JOBS 64   /* jobs in flight at once */

static const uint32_t PREFIX_BLOCKS[4] = {4, 6, 8, 10}; /* the shared system prompts */

#define CHECK(call)                                                        \
  do {                                                                     \
    if ((call) != KVO_STATUS_OK) {                                         \
      char msg[256];                                                       \
      kvo_last_error_message(msg, sizeof msg);                             \
      fprintf(stderr, "%s: %s\n", #call, msg);                             \
      exit(1);                                                             \
    }                                                                      \
  } while (0)

#define FAIL(...)                 \
  do {                            \
    fprintf(stderr, __VA_ARGS__); \
    exit(1);                      \
  } while (0)

/* splitmix64: the workload's generator (examples/replay.py has the same). */
static uint64_t rng_state = 1;
static uint64_t next_random(void) {
  uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

enum state { ARRIVING, WAITING, LOADING, LOADED, DONE };

typedef struct {
  uint64_t tokens;
  uint32_t n_hashes; /* full blocks */
  uint64_t hashes[MAX_BLOCKS];
  uint32_t blocks[MAX_BLOCKS]; /* GPU blocks while admitted */
  uint32_t n_blocks;
  uint64_t host_tokens; /* the load's tokens */
  enum state state;
} request;

typedef struct {
  uint64_t id;
  uint64_t request;
  uint64_t shipped; /* step */
  uint32_t kind;
  int done; /* polled */
} in_flight;

static request reqs[REQUESTS];
static in_flight jobs[MAX_JOBS];
static size_t n_jobs;
static uint32_t free_list[GPU_BLOCKS];
static uint32_t n_free;
static uint8_t *kv; /* the KV tensor: GPU_BLOCKS pages of PAGE_BYTES */

/* Request i: a shared prefix (or none, one in five), 1-3 unique blocks, 0-15 more tokens. */
static void make_workload(void) {
  for (uint64_t i = 0; i < REQUESTS; i++) {
    request *r = &reqs[i];
    uint64_t p = next_random() % 5;
    uint32_t prefix = p < 4 ? PREFIX_BLOCKS[p] : 0;
    uint32_t suffix = 1 + (uint32_t)(next_random() % 3);
    r->n_hashes = prefix + suffix;
    r->tokens = (uint64_t)r->n_hashes * BLOCK_TOKENS + next_random() % BLOCK_TOKENS;
    for (uint32_t j = 0; j < r->n_hashes; j++)
      r->hashes[j] = j < prefix ? ((p + 1) << 56) | j : ((i + 1) << 16) | j;
    r->state = ARRIVING;
  }
}

static void put_key(uint8_t *out, uint64_t hash) { /* big-endian */
  for (int b = 0; b < KEY_LEN; b++) out[b] = (uint8_t)(hash >> (8 * (KEY_LEN - 1 - b)));
}

static void fill_block(uint32_t block, uint64_t hash) {
  for (size_t at = 0; at < PAGE_BYTES; at += KEY_LEN)
    put_key(kv + (size_t)block * PAGE_BYTES + at, hash);
}

static int block_holds(uint32_t block, uint64_t hash) {
  uint8_t want[PAGE_BYTES];
  for (size_t at = 0; at < PAGE_BYTES; at += KEY_LEN) put_key(want + at, hash);
  return memcmp(kv + (size_t)block * PAGE_BYTES, want, PAGE_BYTES) == 0;
}

int main(void) {
  make_workload();
  for (uint32_t b = 0; b < GPU_BLOCKS; b++) free_list[b] = GPU_BLOCKS - 1 - b;
  n_free = GPU_BLOCKS;

  kvo_scheduler_config cfg;
  CHECK(kvo_scheduler_config_default(&cfg));
  cfg.key_len = KEY_LEN;
  cfg.gpu_block_size = BLOCK_TOKENS;
  cfg.num_slots = HOST_SLOTS;
  kvo_scheduler *s = NULL;
  CHECK(kvo_scheduler_new(&cfg, &s));

  kv = calloc(GPU_BLOCKS, PAGE_BYTES);
  if (!kv) FAIL("out of memory\n");
  kvo_kv_tensor tensor = {.base = (uint64_t)(uintptr_t)kv, .block_stride = PAGE_BYTES,
                          .page_size = PAGE_BYTES, .num_blocks = GPU_BLOCKS, .on_device = 0};
  kvo_worker_config wcfg;
  CHECK(kvo_worker_config_default(&wcfg));
  wcfg.num_host_slots = HOST_SLOTS;
  kvo_worker *w = NULL;
  CHECK(kvo_worker_new(&wcfg, &tensor, 1, NULL, &w));
  kvo_step *step = NULL;
  CHECK(kvo_step_new(&step));

  uint64_t prompt_tokens = 0, flushed = 0, checked_blocks = 0, steps = 0;
  size_t finished = 0;
  uint8_t keys[MAX_BLOCKS * KEY_LEN];
  kvo_scheduled_request sched[REQUESTS];
  uint64_t running[REQUESTS];
  for (uint64_t now = 0; finished < REQUESTS || n_jobs > 0; now++, steps++) {
    /* 1. Admission. Loaded requests run first; then the arrived ones, in order. */
    size_t n_sched = 0;
    for (uint64_t i = 0; i < REQUESTS; i++) {
      request *r = &reqs[i];
      if (r->state == LOADED) {
        sched[n_sched] = (kvo_scheduled_request){
            .request_id = i, .num_computed_tokens = r->host_tokens,
            .num_scheduled_tokens = r->tokens - r->host_tokens, .num_tokens = r->tokens,
            .new_block_ids = r->blocks, .n_new_block_ids = r->n_blocks};
        running[n_sched++] = i;
      }
    }
    for (uint64_t i = 0; i < REQUESTS && i / ARRIVALS_PER_STEP <= now; i++) {
      request *r = &reqs[i];
      if (r->state == ARRIVING) {
        prompt_tokens += r->tokens;
        CHECK(kvo_scheduler_add_request(s, i, r->tokens, KVO_NO_LIMIT));
        for (uint32_t j = 0; j < r->n_hashes; j++) put_key(keys + j * KEY_LEN, r->hashes[j]);
        CHECK(kvo_scheduler_append_block_hashes(s, i, keys, r->n_hashes, r->tokens));
        r->state = WAITING;
      }
      if (r->state != WAITING) continue;
      uint32_t need = (uint32_t)((r->tokens + BLOCK_TOKENS - 1) / BLOCK_TOKENS);
      if (need > n_free) break; /* the first request that does not fit ends admission */
      kvo_match_result m;
      CHECK(kvo_scheduler_match(s, i, 0, &m)); /* no GPU prefix cache: 0 computed tokens */
      if (m.kind == KVO_MATCH_DEFER) continue; /* stays waiting; asked again next step */
      for (uint32_t b = 0; b < need; b++) r->blocks[b] = free_list[--n_free];
      r->n_blocks = need;
      r->host_tokens = m.kind == KVO_MATCH_HIT ? m.tokens : 0;
      uint32_t has_job;
      uint64_t job_id;
      CHECK(kvo_scheduler_on_alloc(s, i, r->blocks, need, r->host_tokens, &has_job, &job_id));
      if (has_job) {
        r->state = LOADING; /* runs once its load is reported */
      } else {
        sched[n_sched] = (kvo_scheduled_request){
            .request_id = i, .num_scheduled_tokens = r->tokens, .num_tokens = r->tokens,
            .new_block_ids = r->blocks, .n_new_block_ids = need};
        running[n_sched++] = i;
      }
    }

    /* 2. The step's plan: this step's loads and stores, and the jobs to flush first. */
    CHECK(kvo_scheduler_build_step(s, sched, n_sched, NULL, 0, step));
    CHECK(kvo_worker_submit_step(w, step, 0));
    kvo_step_info info;
    CHECK(kvo_step_get_info(step, &info));
    flushed += info.num_flush;
    for (size_t k = 0; k < info.num_jobs; k++) {
      kvo_job_info job;
      CHECK(kvo_step_get_job(step, k, &job));
      if (n_jobs == MAX_JOBS) FAIL("more than %d jobs in flight\n", MAX_JOBS);
      jobs[n_jobs++] = (in_flight){.id = job.id, .request = job.request_id, .shipped = now,
                                   .kind = job.kind, .done = 0};
    }

    /* 3. The forward pass computes the running requests' blocks; each ends after its prefill. */
    for (size_t k = 0; k < n_sched; k++) {
      request *r = &reqs[running[k]];
      for (uint32_t b = (uint32_t)(r->host_tokens / BLOCK_TOKENS); b < r->n_hashes; b++)
        fill_block(r->blocks[b], r->hashes[b]);
      CHECK(kvo_scheduler_finish_request(s, running[k]));
      for (uint32_t b = 0; b < r->n_blocks; b++) free_list[n_free++] = r->blocks[b];
      r->state = DONE;
      finished++;
    }

    /* 4. Completions of the jobs shipped last step (waiting submits their held stores). */
    uint64_t due[MAX_JOBS];
    size_t n_due = 0;
    for (size_t k = 0; k < n_jobs; k++)
      if (jobs[k].shipped < now && !jobs[k].done) due[n_due++] = jobs[k].id;
    if (n_due > 0) CHECK(kvo_worker_wait(w, due, n_due, 10000));
    kvo_completion done[MAX_JOBS];
    size_t n_done = 0;
    CHECK(kvo_worker_poll(w, done, MAX_JOBS, &n_done));
    for (size_t c = 0; c < n_done; c++) {
      if (!done[c].success) FAIL("job %llu failed\n", (unsigned long long)done[c].job_id);
      for (size_t k = 0; k < n_jobs; k++)
        if (jobs[k].id == done[c].job_id) jobs[k].done = 1;
    }
    kvo_job_report reports[MAX_JOBS];
    size_t n_reports = 0, kept = 0;
    for (size_t k = 0; k < n_jobs; k++) {
      in_flight j = jobs[k];
      if (j.shipped == now) { /* reported next step */
        jobs[kept++] = j;
        continue;
      }
      if (!j.done) FAIL("job %llu was waited for but not polled\n", (unsigned long long)j.id);
      reports[n_reports++] = (kvo_job_report){.job_id = j.id, .count = 1, .success = 1};
      request *r = &reqs[j.request];
      if (j.kind == KVO_JOB_KIND_LOAD) {
        for (uint32_t b = 0; b < r->host_tokens / BLOCK_TOKENS; b++, checked_blocks++)
          if (!block_holds(r->blocks[b], r->hashes[b]))
            FAIL("request %llu: block %u was not loaded\n", (unsigned long long)j.request, b);
        r->state = LOADED;
      }
    }
    n_jobs = kept;
    if (n_reports > 0) CHECK(kvo_scheduler_complete_jobs(s, reports, n_reports));
  }

  kvo_scheduler_stats st;
  memset(&st, 0, sizeof st);
  st.struct_size = sizeof st;
  CHECK(kvo_scheduler_get_stats(s, &st));
  CHECK(kvo_scheduler_check_invariants(s));
  if (st.loads_in_flight || st.stores_in_flight || st.manager.pinned || st.requests)
    FAIL("left over: %llu loads, %llu stores in flight, %llu slots pinned, %llu requests\n",
         (unsigned long long)st.loads_in_flight, (unsigned long long)st.stores_in_flight,
         (unsigned long long)st.manager.pinned, (unsigned long long)st.requests);
  uint64_t tenths = (st.hit_tokens * 1000 + prompt_tokens / 2) / prompt_tokens;
  printf("requests: %d\n", REQUESTS);
  printf("steps: %llu\n", (unsigned long long)steps);
  printf("prompt tokens: %llu\n", (unsigned long long)prompt_tokens);
  printf("host hit tokens: %llu (%llu.%llu %%)\n", (unsigned long long)st.hit_tokens,
         (unsigned long long)(tenths / 10), (unsigned long long)(tenths % 10));
  printf("load jobs: %llu\n", (unsigned long long)st.load_jobs);
  printf("store jobs: %llu (%llu blocks)\n", (unsigned long long)st.store_jobs,
         (unsigned long long)st.stored_chunks);
  printf("deferrals: %llu (jobs in flight %llu, store in flight %llu, being loaded %llu)\n",
         (unsigned long long)(st.deferred_jobs_in_flight + st.deferred_store_in_flight +
                              st.deferred_being_loaded),
         (unsigned long long)st.deferred_jobs_in_flight,
         (unsigned long long)st.deferred_store_in_flight,
         (unsigned long long)st.deferred_being_loaded);
  printf("flushed jobs: %llu\n", (unsigned long long)flushed);
  printf("host evictions: %llu\n", (unsigned long long)st.manager.evictions);
  printf("loaded blocks checked: %llu\n", (unsigned long long)checked_blocks);
  printf("invariants: ok\n");

  kvo_step_free(step);
  kvo_worker_free(w);
  kvo_scheduler_free(s);
  free(kv);
  return 0;
}
