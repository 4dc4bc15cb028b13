// The scheduler and step through kvoffload.hpp: request 1 offloads its prompt, request 2 shares
// the prefix and loads it; each step plan goes through encode / decode as it would to a worker
// process. Then four threads drive their own requests on one shared scheduler, and a worker
// executes a plan. Prints one line per failed check and `N passed, M failed`; exits non-zero on
// any failure. Compiled and run by tests/c_api.rs.
#include "kvoffload.hpp"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace {

#include "check.hpp"

constexpr std::uint32_t kKeyLen = 8;
constexpr std::uint32_t kBlockTokens = 4;  // a chunk is 3 blocks = 12 tokens

kvo::Scheduler make_scheduler(std::uint32_t semantics = KVO_SEMANTICS_VLLM_0_24) {
    kvo_scheduler_config cfg = kvo::Scheduler::default_config();
    cfg.semantics = semantics;
    cfg.key_len = kKeyLen;
    cfg.gpu_block_size = kBlockTokens;
    cfg.block_size_factor = 3;
    cfg.num_slots = 1000;
    cfg.offload_prompt_only = 0;
    cfg.enable_events = 1;
    return kvo::Scheduler::create(cfg);
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

void add(kvo::Scheduler &s, std::uint64_t id, std::uint64_t seed, std::uint64_t tokens) {
    s.add_request(id, tokens);
    s.append_block_hashes(id, hashes(seed, tokens / kBlockTokens), tokens);
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

std::vector<Job> jobs(const kvo::Step &step) {
    std::vector<Job> out;
    for (std::size_t i = 0; i < step.info().num_jobs; ++i) {
        const kvo::Step::Blocks b = step.job_blocks(i);
        out.push_back(Job{step.job(i), b.src, b.dst});
    }
    return out;
}

// Ships `plan` to a fresh step as bytes, as to a worker process.
kvo::Step ship(const kvo::Step &plan) {
    std::vector<std::uint8_t> bytes = plan.encode();
    kvo::Step worker = kvo::Step::create();
    worker.decode(bytes);
    bytes.pop_back();  // truncated: refused, the plan unchanged
    const kvo::Result<void> r = worker.try_decode(bytes);
    CHECK(!r.ok() && r.status().code() == KVO_STATUS_CORRUPT_DATA);
    CHECK(worker.info().num_jobs == plan.info().num_jobs);
    return worker;
}

void complete(kvo::Scheduler &s, std::uint64_t job_id) {
    const kvo_job_report r{job_id, 1, 1};
    s.complete_jobs({&r, 1});
}

// One thread's requests on the shared scheduler: each stores its 24-token prompt (2 chunks).
// Returns the number of store jobs that went wrong. Uses the non-throwing forms.
int store_requests(kvo::Scheduler &s, std::uint64_t first_id, int n) {
    int bad = 0;
    kvo::Result<kvo::Step> made = kvo::Step::try_create();
    if (!made.ok()) {
        return n;
    }
    kvo::Step step = std::move(made).value();
    const std::uint32_t base = static_cast<std::uint32_t>(first_id);
    const std::vector<std::uint32_t> blocks = range(base, base + 6);
    for (std::uint64_t id = first_id; id < first_id + static_cast<std::uint64_t>(n); ++id) {
        const kvo_scheduled_request r = scheduled(id, 0, 24, 24, blocks);
        kvo::Result<kvo_match_result> m{kvo::Status()};
        kvo::Result<kvo_job_info> info{kvo::Status()};
        const bool ok = s.try_add_request(id, 24).ok() &&
                        s.try_append_block_hashes(id, hashes(id, 6), 24).ok() &&
                        (m = s.try_match(id, 0)).ok() && m.value().kind == KVO_MATCH_MISS &&
                        s.try_build_step({&r, 1}, {}, step).ok() &&
                        step.try_info().ok() && step.try_info().value().num_jobs == 1 &&
                        (info = step.try_job(0)).ok() && info.value().request_id == id &&
                        info.value().kind == KVO_JOB_KIND_STORE && info.value().n_dst == 2;
        if (!ok) {
            ++bad;
            continue;
        }
        const kvo_job_report rep{info.value().id, 1, 1};
        if (!s.try_complete_jobs({&rep, 1}).ok() || !s.try_finish_request(id).ok()) {
            ++bad;
        }
    }
    return bad;
}

// Request 1 offloads its prompt, request 2 loads the shared prefix: the same jobs, blocks and
// figures in either semantics.
void offload_and_load(kvo::Scheduler &s) {
    kvo::Step plan = kvo::Step::create();

    // Request 1 (24 tokens, 2 chunks) offloads its prompt from GPU blocks 10..15.
    add(s, 1, 1, 24);
    kvo_match_result m = s.match(1, 0);
    CHECK(m.kind == KVO_MATCH_MISS && m.tokens == 0);
    const std::vector<std::uint32_t> b1 = range(10, 16);
    CHECK(!s.on_alloc(1, b1, 0).has_value());
    const kvo_scheduled_request r1 = scheduled(1, 0, 24, 24, b1);
    s.build_step({&r1, 1}, {}, plan);
    kvo::Step worker = ship(plan);
    std::vector<Job> js = jobs(worker);
    CHECK(js.size() == 1);
    if (js.size() == 1) {
        CHECK(js[0].info.kind == KVO_JOB_KIND_STORE && js[0].info.request_id == 1);
        CHECK(js[0].info.block_index == 0 && js[0].info.group_size == 6);
        CHECK(js[0].src == b1);
        CHECK((js[0].dst == std::vector<std::uint32_t>{0, 1}));
        complete(s, js[0].info.id);
    }
    s.finish_request(1);
    const kvo::Events ev = s.take_events();
    CHECK(ev.events.size() == 1 && ev.events[0].n_keys == 2 && ev.keys.size() == 2 * kKeyLen);

    // Request 2 (30 tokens) shares the prefix: its 24 offloaded tokens load into blocks 20..25.
    add(s, 2, 1, 30);
    m = s.match(2, 0);
    CHECK(m.kind == KVO_MATCH_HIT && m.tokens == 24);
    const std::vector<std::uint32_t> b2 = range(20, 28);
    const std::optional<std::uint64_t> job = s.on_alloc(2, b2, 24);
    CHECK(job.has_value());
    s.build_step({}, {}, plan);
    CHECK(plan.flush().empty());
    worker = ship(plan);
    js = jobs(worker);
    CHECK(js.size() == 1);
    if (js.size() == 1 && job) {
        CHECK(js[0].info.id == *job && js[0].info.kind == KVO_JOB_KIND_LOAD);
        CHECK(js[0].info.request_id == 2 && js[0].info.block_index == 0);
        CHECK((js[0].src == std::vector<std::uint32_t>{0, 1}));
        CHECK(js[0].dst == range(20, 26));
        complete(s, *job);
    }
    CHECK(!s.load_failure(2).has_value());
    const kvo_scheduled_request r2 = scheduled(2, 24, 6, 30, b2);
    s.build_step({&r2, 1}, {}, plan);
    CHECK(jobs(ship(plan)).empty());  // the loaded chunks are not stored again
    s.finish_request(2);
    // Nothing in flight and no chunk left for a final store (6 tokens are not a chunk): both
    // semantics forget the request at once (0.33 commits its record in the next step).
    CHECK(s.stats().requests == 0);
    s.build_step({}, {}, plan);
    CHECK(plan.info().num_jobs == 0);

    kvo_scheduler_stats st = s.stats();
    CHECK(st.hits == 1 && st.hit_tokens == 24 && st.load_jobs == 1 && st.store_jobs == 1);
    CHECK(st.requests == 0 && st.loads_in_flight == 0 && st.stores_in_flight == 0);
    CHECK(st.manager.pinned == 0 && st.manager.ready == 2);
    s.check_invariants();
    const std::string text = s.metrics_text("vllm:kv_offload", {{"engine", "0"}});
    CHECK(text.find("\nvllm:kv_offload_match_hits_total{engine=\"0\"} 1\n") != std::string::npos);
    CHECK(text.find("\nvllm:kv_offload_ready_slots{engine=\"0\"} 2\n") != std::string::npos);
}

}  // namespace

int main() try {
    kvo::Scheduler s033 = make_scheduler(KVO_SEMANTICS_VLLM_0_33);
    offload_and_load(s033);
    kvo::Scheduler s = make_scheduler();
    offload_and_load(s);

    // Errors: kvo::Error with the status and a message naming the argument; this thread only.
    try {
        s.finish_request(2);
        CHECK(false);
    } catch (const kvo::Error &e) {
        CHECK(e.status() == KVO_STATUS_NOT_FOUND);
        CHECK(std::string(e.what()).find("request_id") != std::string::npos);
    }
    CHECK(kvo::last_error_message().find("request_id") != std::string::npos);

    // Four threads, each with its own requests and step handle, on the shared scheduler.
    constexpr int kThreads = 4, kPerThread = 25;
    std::vector<int> bad(kThreads, -1);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&s, &bad, t] {
            bad[t] = store_requests(s, 1000 + static_cast<std::uint64_t>(t) * 100, kPerThread);
        });
    }
    for (std::thread &t : threads) {
        t.join();
    }
    for (int t = 0; t < kThreads; ++t) {
        CHECK(bad[t] == 0);
    }
    const kvo_scheduler_stats st = s.stats();
    CHECK(st.requests == 0 && st.store_jobs == 1 + kThreads * kPerThread);
    CHECK(st.manager.ready == 2 + 2 * kThreads * kPerThread && st.stores_in_flight == 0);
    s.check_invariants();

    std::printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
} catch (const kvo::Error &e) {
    std::printf("FAIL: kvo::Error %d: %s\n%d passed, %d failed\n", static_cast<int>(e.status()),
                e.what(), passed, failed + 1);
    return 1;
}
