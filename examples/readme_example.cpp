// README.md's C++ example, kept identical; run by tests/c_api.rs and tests/install.rs.
#include <kvoffload.hpp>

#include <cstdint>
#include <cstdio>
#include <vector>

// Runs one step's plan on the worker and reports its completions to the scheduler.
static void run_step(kvo::Scheduler &s, kvo::Worker &w, const kvo::Step &step) {
  w.submit_step(step);  // waits for the flush set, queues the copies
  for (std::size_t i = 0; i < step.info().num_jobs; i++) {
    const std::uint64_t id = step.job(i).id;
    w.wait({&id, 1}, 10000);
  }
  std::vector<kvo_job_report> reports;
  for (const kvo_completion &c : w.poll()) {
    reports.push_back(kvo_job_report{c.job_id, 1, c.success});
  }
  s.complete_jobs(reports);
}

int main() try {
  // The scheduler: 8-byte block hashes, 16-token GPU blocks, 1024 host slots.
  kvo_scheduler_config cfg = kvo::Scheduler::default_config();
  cfg.key_len = 8;
  cfg.gpu_block_size = 16;
  cfg.num_slots = 1024;
  kvo::Scheduler s = kvo::Scheduler::create(cfg);

  // A worker over the KV cache: here 64 blocks of 4 KiB in host memory (on a GPU: the device
  // address of the KV tensor, on_device = 1 and backend = KVO_BACKEND_CUDA).
  alignas(4096) static std::uint8_t kv[64 * 4096];
  const kvo_kv_tensor tensor{reinterpret_cast<std::uintptr_t>(kv), 4096, 4096, 64, 0};
  kvo_worker_config wcfg = kvo::Worker::default_config();
  wcfg.num_host_slots = 1024;
  kvo::Worker w = kvo::Worker::create(wcfg, {&tensor, 1});
  kvo::Step step = kvo::Step::create();

  // Request 7: a 32-token prompt, two full blocks, two block hashes. Nothing offloaded yet.
  const std::vector<std::uint8_t> hashes = {0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 2,
                                            0, 0, 0, 0, 0, 0, 0, 3};
  s.add_request(7, 32);
  s.append_block_hashes(7, {hashes.data(), 16}, 32);
  kvo_match_result m = s.match(7, 0);  // KVO_MATCH_MISS; DEFER: ask again next step
  const std::vector<std::uint32_t> blocks7 = {40, 41};
  s.on_alloc(7, blocks7, m.tokens);
  const kvo_scheduled_request r7{7, 0, 32, 32, blocks7.data(), blocks7.size(), 0, 0};
  s.build_step({&r7, 1}, {}, step);  // stores blocks 40, 41
  run_step(s, w, step);
  s.finish_request(7);

  // Request 8 shares the prefix: its first 32 tokens are loaded from the host tier.
  s.add_request(8, 48);
  s.append_block_hashes(8, hashes, 48);
  m = s.match(8, 0);
  if (m.kind != KVO_MATCH_HIT || m.tokens != 32) return 1;
  const std::vector<std::uint32_t> blocks8 = {10, 11, 12};
  s.on_alloc(8, blocks8, m.tokens);
  s.build_step({}, {}, step);  // the load: slots -> 10, 11
  run_step(s, w, step);
  std::printf("request 8 loaded %llu tokens; %llu bytes loaded\n",
              static_cast<unsigned long long>(m.tokens),
              static_cast<unsigned long long>(w.stats().load.bytes));
  std::printf("%s", w.metrics_text("vllm:kv_offload", {{"rank", "0"}}).c_str());
  return 0;
} catch (const kvo::Error &e) {
  std::fprintf(stderr, "kvoffload error %d: %s\n", static_cast<int>(e.status()), e.what());
  return 1;
}
