/* README.md's C example, kept identical; run by tests/c_api.rs and tests/install.rs. */
#include <kvoffload.h>
#include <stdio.h>
#include <stdlib.h>

#define CHECK(call)                                                        \
  do {                                                                     \
    if ((call) != KVO_STATUS_OK) {                                         \
      char msg[256];                                                       \
      kvo_last_error_message(msg, sizeof msg);                             \
      fprintf(stderr, "%s: %s\n", #call, msg);                             \
      exit(1);                                                             \
    }                                                                      \
  } while (0)

/* Runs one step's plan on the worker and reports its completions to the scheduler. */
static void run_step(kvo_scheduler *s, kvo_worker *w, kvo_step *step) {
  CHECK(kvo_worker_submit_step(w, step, 0)); /* waits for the flush set, queues the loads */
  kvo_step_info info;
  CHECK(kvo_step_get_info(step, &info));
  for (size_t i = 0; i < info.num_jobs; i++) {
    kvo_job_info job;
    CHECK(kvo_step_get_job(step, i, &job));
    CHECK(kvo_worker_wait(w, &job.id, 1, 10000));
  }
  kvo_completion done[16];
  size_t n = 0;
  CHECK(kvo_worker_poll(w, done, 16, &n));
  for (size_t i = 0; i < n; i++) {
    kvo_job_report r = {.job_id = done[i].job_id, .count = 1, .success = done[i].success};
    CHECK(kvo_scheduler_complete_jobs(s, &r, 1));
  }
}

int main(void) {
  /* The scheduler: 8-byte block hashes, 16-token GPU blocks, 1024 host slots. */
  kvo_scheduler_config cfg;
  CHECK(kvo_scheduler_config_default(&cfg));
  cfg.key_len = 8;
  cfg.gpu_block_size = 16;
  cfg.num_slots = 1024;
  kvo_scheduler *s = NULL;
  CHECK(kvo_scheduler_new(&cfg, &s));

  /* A worker over the KV cache: here 64 blocks of 4 KiB in host memory (on a GPU: the device
   * address of the KV tensor, on_device = 1 and backend = KVO_BACKEND_CUDA). */
  static _Alignas(4096) uint8_t kv[64 * 4096];
  kvo_kv_tensor tensor = {.base = (uint64_t)(uintptr_t)kv, .block_stride = 4096,
                          .page_size = 4096, .num_blocks = 64, .on_device = 0};
  kvo_worker_config wcfg;
  CHECK(kvo_worker_config_default(&wcfg));
  wcfg.num_host_slots = 1024;
  kvo_worker *w = NULL;
  CHECK(kvo_worker_new(&wcfg, &tensor, 1, NULL, &w));
  kvo_step *step = NULL;
  CHECK(kvo_step_new(&step));

  /* Request 7: a 32-token prompt, two full blocks, two block hashes. Nothing offloaded yet. */
  uint8_t hashes[24] = {0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 3};
  CHECK(kvo_scheduler_add_request(s, 7, 32, KVO_NO_LIMIT));
  CHECK(kvo_scheduler_append_block_hashes(s, 7, hashes, 2, 32));
  kvo_match_result m;
  CHECK(kvo_scheduler_match(s, 7, 0, &m)); /* KVO_MATCH_MISS; DEFER: ask again next step */
  uint32_t blocks7[2] = {40, 41}, has_job;
  uint64_t job_id;
  CHECK(kvo_scheduler_on_alloc(s, 7, blocks7, 2, m.tokens, &has_job, &job_id));
  kvo_scheduled_request r7 = {.request_id = 7, .num_scheduled_tokens = 32, .num_tokens = 32,
                              .new_block_ids = blocks7, .n_new_block_ids = 2};
  CHECK(kvo_scheduler_build_step(s, &r7, 1, NULL, 0, step)); /* stores blocks 40, 41 */
  run_step(s, w, step);
  CHECK(kvo_scheduler_finish_request(s, 7));

  /* Request 8 shares the prefix: its first 32 tokens are loaded from the host tier. */
  CHECK(kvo_scheduler_add_request(s, 8, 48, KVO_NO_LIMIT));
  CHECK(kvo_scheduler_append_block_hashes(s, 8, hashes, 3, 48));
  CHECK(kvo_scheduler_match(s, 8, 0, &m));
  if (m.kind != KVO_MATCH_HIT || m.tokens != 32) return 1;
  uint32_t blocks8[3] = {10, 11, 12};
  CHECK(kvo_scheduler_on_alloc(s, 8, blocks8, 3, m.tokens, &has_job, &job_id));
  CHECK(kvo_scheduler_build_step(s, NULL, 0, NULL, 0, step)); /* the load: slots → 10, 11 */
  run_step(s, w, step);
  printf("request 8 loaded %llu tokens\n", (unsigned long long)m.tokens);

  kvo_step_free(step);
  kvo_worker_free(w);
  kvo_scheduler_free(s);
  return 0;
}
