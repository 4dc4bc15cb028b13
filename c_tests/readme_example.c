/* The C example of README.md, kept identical to it; compiled and run by tests/c_api.rs. */
#include <kvoffload.h>
#include <stdio.h>

static void die(const char *what) {
  char msg[256];
  kvo_last_error_message(msg, sizeof msg);
  fprintf(stderr, "%s: %s\n", what, msg);
}

int main(void) {
  kvo_scheduler_config cfg;
  if (kvo_scheduler_config_default(&cfg) != KVO_STATUS_OK) return 1;
  cfg.key_len = 8;            /* block hash width */
  cfg.gpu_block_size = 16;    /* tokens per GPU block */
  cfg.block_size_factor = 1;  /* GPU blocks per host slot */
  cfg.num_slots = 1024;       /* host slots */
  kvo_scheduler *s = NULL;
  if (kvo_scheduler_new(&cfg, &s) != KVO_STATUS_OK) { die("new"); return 1; }
  kvo_step *step = NULL;
  if (kvo_step_new(&step) != KVO_STATUS_OK) return 1;

  /* A 32-token prompt: two full blocks, two block hashes. */
  uint8_t hashes[16] = {0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 2};
  if (kvo_scheduler_add_request(s, 7, 32, KVO_NO_LIMIT) != KVO_STATUS_OK ||
      kvo_scheduler_append_block_hashes(s, 7, hashes, 2, 32) != KVO_STATUS_OK) { die("add"); return 1; }

  kvo_match_result m;
  if (kvo_scheduler_match(s, 7, 0, &m) != KVO_STATUS_OK) { die("match"); return 1; }
  /* m.kind: KVO_MATCH_MISS here; KVO_MATCH_DEFER means: try again next step. */
  uint32_t blocks[2] = {40, 41}, has_job;
  uint64_t load_job;
  if (kvo_scheduler_on_alloc(s, 7, blocks, 2, m.tokens, &has_job, &load_job) != KVO_STATUS_OK) return 1;

  kvo_scheduled_request r = {.request_id = 7, .num_computed_tokens = 0, .num_scheduled_tokens = 32,
                             .num_tokens = 32, .new_block_ids = blocks, .n_new_block_ids = 2};
  if (kvo_scheduler_build_step(s, &r, 1, NULL, 0, step) != KVO_STATUS_OK) { die("step"); return 1; }
  kvo_step_info info;
  kvo_job_info job;
  if (kvo_step_get_info(step, &info) != KVO_STATUS_OK || info.num_jobs != 1 ||
      kvo_step_get_job(step, 0, &job) != KVO_STATUS_OK) return 1;
  /* job.kind == KVO_JOB_KIND_STORE: copy GPU blocks 40, 41 to the host slots of the job ... */
  kvo_job_report done = {.job_id = job.id, .count = 1, .success = 1};
  if (kvo_scheduler_complete_jobs(s, &done, 1) != KVO_STATUS_OK) return 1;
  if (kvo_scheduler_finish_request(s, 7) != KVO_STATUS_OK) return 1;

  kvo_step_free(step);
  kvo_scheduler_free(s);
  return 0;
}
