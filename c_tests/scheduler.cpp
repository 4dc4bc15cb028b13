// The scheduler and step C API from C++17 through RAII handles (std::unique_ptr with custom
// deleters): request 1 offloads its prompt, request 2 shares the prefix and loads it; each step
// plan goes through kvo_step_encode / kvo_step_decode as it would to a worker process. Then
// four threads drive their own requests on one shared scheduler. Prints one line per failed
// check and `N passed, M failed`; exits non-zero on any failure. Compiled and run by
// tests/c_api.rs.
#include "kvoffload.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace {

#include "check.hpp"

// The RAII handles: each is freed exactly once, whatever path leaves the scope.
struct SchedulerFree {
    void operator()(kvo_scheduler *s) const noexcept { kvo_scheduler_free(s); }
};
struct StepFree {
    void operator()(kvo_step *s) const noexcept { kvo_step_free(s); }
};
using Scheduler = std::unique_ptr<kvo_scheduler, SchedulerFree>;
using Step = std::unique_ptr<kvo_step, StepFree>;

constexpr std::uint32_t kKeyLen = 8;
constexpr std::uint32_t kBlockTokens = 4;  // a chunk is 3 blocks = 12 tokens

Scheduler make_scheduler() {
    kvo_scheduler_config cfg{};
    if (kvo_scheduler_config_default(&cfg) != KVO_STATUS_OK) {
        return nullptr;
    }
    cfg.key_len = kKeyLen;
    cfg.gpu_block_size = kBlockTokens;
    cfg.block_size_factor = 3;
    cfg.num_slots = 1000;
    cfg.offload_prompt_only = 0;
    cfg.enable_events = 1;
    kvo_scheduler *raw = nullptr;
    if (kvo_scheduler_new(&cfg, &raw) != KVO_STATUS_OK) {
        return nullptr;
    }
    return Scheduler(raw);
}

Step make_step() {
    kvo_step *raw = nullptr;
    if (kvo_step_new(&raw) != KVO_STATUS_OK) {
        return nullptr;
    }
    return Step(raw);
}

// Hashes of GPU blocks [0, n) of prompt family `seed`: 8 bytes big-endian each.
std::vector<std::uint8_t> hashes(std::uint64_t seed, std::uint64_t n) {
    std::vector<std::uint8_t> out;
    for (std::uint64_t i = 0; i < n; ++i) {
        const std::uint64_t v = seed * 1000000 + i;
        for (int shift = 56; shift >= 0; shift -= 8) {
            out.push_back(static_cast<std::uint8_t>(v >> shift));
        }
    }
    return out;
}

std::vector<std::uint32_t> range(std::uint32_t from, std::uint32_t to) {
    std::vector<std::uint32_t> out;
    for (std::uint32_t i = from; i < to; ++i) {
        out.push_back(i);
    }
    return out;
}

kvo_status add(const Scheduler &s, std::uint64_t id, std::uint64_t seed, std::uint64_t tokens) {
    const kvo_status st = kvo_scheduler_add_request(s.get(), id, tokens, KVO_NO_LIMIT);
    if (st != KVO_STATUS_OK) {
        return st;
    }
    const std::vector<std::uint8_t> h = hashes(seed, tokens / kBlockTokens);
    return kvo_scheduler_append_block_hashes(s.get(), id, h.data(), h.size() / kKeyLen, tokens);
}

kvo_match_result match(const Scheduler &s, std::uint64_t id, std::uint64_t gpu_hit) {
    kvo_match_result r{99, 99, 99};
    CHECK_OK(kvo_scheduler_match(s.get(), id, gpu_hit, &r));
    return r;
}

kvo_scheduled_request scheduled(std::uint64_t id, std::uint64_t computed, std::uint64_t n,
                                std::uint64_t tokens, const std::vector<std::uint32_t> &blocks) {
    kvo_scheduled_request r{};
    r.request_id = id;
    r.num_computed_tokens = computed;
    r.num_scheduled_tokens = n;
    r.num_tokens = tokens;
    r.new_block_ids = blocks.data();
    r.n_new_block_ids = blocks.size();
    return r;
}

// The worker's view of a job, read from a decoded plan.
struct Job {
    kvo_job_info info{};
    std::vector<std::uint32_t> src, dst;
};

std::vector<Job> jobs(const Step &step) {
    kvo_step_info info{};
    std::vector<Job> out;
    if (kvo_step_get_info(step.get(), &info) != KVO_STATUS_OK) {
        return out;
    }
    for (std::size_t i = 0; i < info.num_jobs; ++i) {
        Job j;
        CHECK_OK(kvo_step_get_job(step.get(), i, &j.info));
        j.src.resize(j.info.n_src);
        j.dst.resize(j.info.n_dst);
        CHECK_OK(kvo_step_get_job_blocks(step.get(), i, j.src.data(), j.src.size(), j.dst.data(),
                                         j.dst.size()));
        out.push_back(std::move(j));
    }
    return out;
}

// Ships `plan` to a fresh step as bytes, as to a worker process.
Step ship(const Step &plan) {
    std::size_t len = 0;
    CHECK_STATUS(kvo_step_encode(plan.get(), nullptr, 0, &len), KVO_STATUS_BUFFER_TOO_SMALL);
    std::vector<std::uint8_t> bytes(len);
    CHECK_OK(kvo_step_encode(plan.get(), bytes.data(), bytes.size(), &len));
    CHECK(len == bytes.size());
    Step worker = make_step();
    CHECK(worker != nullptr);
    if (!worker) {
        return worker;
    }
    CHECK_OK(kvo_step_decode(worker.get(), bytes.data(), bytes.size()));
    bytes.pop_back();  // truncated: refused
    CHECK_STATUS(kvo_step_decode(worker.get(), bytes.data(), bytes.size()),
                 KVO_STATUS_CORRUPT_DATA);
    return worker;
}

kvo_status complete(const Scheduler &s, std::uint64_t job_id) {
    const kvo_job_report r{job_id, 1, 1};
    return kvo_scheduler_complete_jobs(s.get(), &r, 1);
}

kvo_scheduler_stats stats(const Scheduler &s) {
    kvo_scheduler_stats st{};
    st.struct_size = sizeof st;
    CHECK_OK(kvo_scheduler_get_stats(s.get(), &st));
    return st;
}

// One thread's requests on the shared scheduler: each stores its 24-token prompt (2 chunks).
// Returns the number of store jobs that went wrong.
int store_requests(kvo_scheduler *s, std::uint64_t first_id, int n) {
    int bad = 0;
    kvo_step *raw = nullptr;
    if (kvo_step_new(&raw) != KVO_STATUS_OK) {
        return n;
    }
    const Step step(raw);
    const std::uint32_t base = static_cast<std::uint32_t>(first_id);
    const std::vector<std::uint32_t> blocks = range(base, base + 6);
    for (std::uint64_t id = first_id; id < first_id + static_cast<std::uint64_t>(n); ++id) {
        const std::vector<std::uint8_t> h = hashes(id, 6);
        kvo_match_result m{};
        kvo_job_info info{};
        kvo_step_info si{};
        const kvo_scheduled_request r = scheduled(id, 0, 24, 24, blocks);
        const bool ok = kvo_scheduler_add_request(s, id, 24, KVO_NO_LIMIT) == KVO_STATUS_OK &&
                        kvo_scheduler_append_block_hashes(s, id, h.data(), 6, 24) ==
                            KVO_STATUS_OK &&
                        kvo_scheduler_match(s, id, 0, &m) == KVO_STATUS_OK &&
                        m.kind == KVO_MATCH_MISS &&
                        kvo_scheduler_build_step(s, &r, 1, nullptr, 0, step.get()) ==
                            KVO_STATUS_OK &&
                        kvo_step_get_info(step.get(), &si) == KVO_STATUS_OK &&
                        si.num_jobs == 1 &&
                        kvo_step_get_job(step.get(), 0, &info) == KVO_STATUS_OK &&
                        info.request_id == id && info.kind == KVO_JOB_KIND_STORE &&
                        info.n_dst == 2;
        const kvo_job_report rep{info.id, 1, 1};
        if (!ok || kvo_scheduler_complete_jobs(s, &rep, 1) != KVO_STATUS_OK ||
            kvo_scheduler_finish_request(s, id) != KVO_STATUS_OK) {
            ++bad;
        }
    }
    return bad;
}

}  // namespace

int main() {
    {
        Scheduler none;  // empty wrappers free nothing
        Step none_step;
    }
    Scheduler s = make_scheduler();
    Step plan = make_step();
    CHECK(s != nullptr && plan != nullptr);
    if (!s || !plan) {
        std::printf("%d passed, %d failed\n", passed, failed);
        return 1;
    }

    // Request 1 (24 tokens, 2 chunks) offloads its prompt from GPU blocks 10..15.
    CHECK_OK(add(s, 1, 1, 24));
    kvo_match_result m = match(s, 1, 0);
    CHECK(m.kind == KVO_MATCH_MISS && m.tokens == 0);
    const std::vector<std::uint32_t> b1 = range(10, 16);
    std::uint32_t has_job = 9;
    std::uint64_t job = 99;
    CHECK_OK(kvo_scheduler_on_alloc(s.get(), 1, b1.data(), b1.size(), 0, &has_job, &job));
    CHECK(has_job == 0 && job == 99);
    const kvo_scheduled_request r1 = scheduled(1, 0, 24, 24, b1);
    CHECK_OK(kvo_scheduler_build_step(s.get(), &r1, 1, nullptr, 0, plan.get()));
    Step worker = ship(plan);
    std::vector<Job> js = jobs(worker);
    CHECK(js.size() == 1);
    if (js.size() == 1) {
        CHECK(js[0].info.kind == KVO_JOB_KIND_STORE && js[0].info.request_id == 1);
        CHECK(js[0].info.block_index == 0 && js[0].info.group_size == 6);
        CHECK(js[0].src == b1);
        CHECK((js[0].dst == std::vector<std::uint32_t>{0, 1}));
        CHECK_OK(complete(s, js[0].info.id));
    }
    CHECK_OK(kvo_scheduler_finish_request(s.get(), 1));

    // Request 2 (30 tokens) shares the prefix: its 24 offloaded tokens load into blocks 20..25.
    CHECK_OK(add(s, 2, 1, 30));
    m = match(s, 2, 0);
    CHECK(m.kind == KVO_MATCH_HIT && m.tokens == 24);
    const std::vector<std::uint32_t> b2 = range(20, 28);
    CHECK_OK(kvo_scheduler_on_alloc(s.get(), 2, b2.data(), b2.size(), 24, &has_job, &job));
    CHECK(has_job == 1);
    CHECK_OK(kvo_scheduler_build_step(s.get(), nullptr, 0, nullptr, 0, plan.get()));
    worker = ship(plan);
    js = jobs(worker);
    CHECK(js.size() == 1);
    if (js.size() == 1) {
        CHECK(js[0].info.id == job && js[0].info.kind == KVO_JOB_KIND_LOAD);
        CHECK(js[0].info.request_id == 2 && js[0].info.block_index == 0);
        CHECK((js[0].src == std::vector<std::uint32_t>{0, 1}));
        CHECK(js[0].dst == range(20, 26));
    }
    CHECK_OK(complete(s, job));
    const kvo_scheduled_request r2 = scheduled(2, 24, 6, 30, b2);
    CHECK_OK(kvo_scheduler_build_step(s.get(), &r2, 1, nullptr, 0, plan.get()));
    CHECK(jobs(ship(plan)).empty());  // the loaded chunks are not stored again
    CHECK_OK(kvo_scheduler_finish_request(s.get(), 2));

    kvo_scheduler_stats st = stats(s);
    CHECK(st.hits == 1 && st.hit_tokens == 24 && st.load_jobs == 1 && st.store_jobs == 1);
    CHECK(st.requests == 0 && st.loads_in_flight == 0 && st.stores_in_flight == 0);
    CHECK(st.manager.pinned == 0 && st.manager.ready == 2);
    CHECK_OK(kvo_scheduler_check_invariants(s.get()));

    // Errors: a status, a message on this thread only.
    CHECK_STATUS(kvo_scheduler_finish_request(s.get(), 2), KVO_STATUS_NOT_FOUND);
    CHECK(last_error().find("request_id") != std::string::npos);

    // Four threads, each with its own requests and step handle, on the shared scheduler.
    constexpr int kThreads = 4, kPerThread = 25;
    std::vector<int> bad(kThreads, -1);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&s, &bad, t] {
            bad[t] = store_requests(s.get(), 1000 + static_cast<std::uint64_t>(t) * 100,
                                    kPerThread);
        });
    }
    for (std::thread &t : threads) {
        t.join();
    }
    for (int t = 0; t < kThreads; ++t) {
        CHECK(bad[t] == 0);
    }
    st = stats(s);
    CHECK(st.requests == 0 && st.store_jobs == 1 + kThreads * kPerThread);
    CHECK(st.manager.ready == 2 + 2 * kThreads * kPerThread && st.stores_in_flight == 0);
    CHECK_OK(kvo_scheduler_check_invariants(s.get()));

    std::printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
