// The worker through kvoffload.hpp's non-throwing forms (try_*, kvo::Result), so that it builds
// with and without exceptions: stores and loads jobs between a host "KV tensor" and the host
// tier, checks the bytes, a failed job's message, the stats and the metrics text. Prints one
// line per failed check and `N passed, M failed`; exits non-zero on any failure. Compiled (as
// C++17 with exceptions and as C++20 with -fno-exceptions) and run by tests/c_api.rs.
#include "kvoffload.hpp"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

#include "check.hpp"

constexpr std::uint32_t kBlocks = 16;
constexpr std::uint64_t kPage = 256;

template <class T>
bool ok_value(const kvo::Result<T> &r, const T &want) {
    return r.ok() && r.value() == want;
}

}  // namespace

int main() {
    alignas(64) static std::uint8_t kv[kBlocks * kPage];
    for (std::size_t i = 0; i < sizeof kv; ++i) {
        kv[i] = static_cast<std::uint8_t>(i * 7 + 1);
    }
    const kvo_kv_tensor tensor{reinterpret_cast<std::uintptr_t>(kv), kPage, kPage, kBlocks, 0};
    kvo_worker_config cfg = kvo::Worker::default_config();
    cfg.num_host_slots = 8;

    // A config the library refuses: the status and its message, no exception.
    kvo_worker_config bad = cfg;
    bad.num_host_slots = 0;
    const kvo::Result<kvo::Worker> refused = kvo::Worker::try_create(bad, {&tensor, 1});
    CHECK(!refused.ok() && refused.status().code() == KVO_STATUS_INVALID_ARGUMENT);
    CHECK(refused.status().message().find("num_host_slots") != std::string::npos);
    const kvo::Result<kvo::Worker> mismatch =
        kvo::Worker::try_create(cfg, {&tensor, 1}, std::vector<kvo_host_buffer>(2));
    CHECK(!mismatch.ok() && mismatch.status().message().find("host_buffers") != std::string::npos);

    kvo::Result<kvo::Worker> made = kvo::Worker::try_create(cfg, {&tensor, 1});
    CHECK(made.ok());
    if (!made.ok()) {
        std::printf("%d passed, %d failed\n", passed, failed);
        return 1;
    }
    kvo::Worker w = std::move(made).value();

    // Store blocks 2, 3 into slots 0, 1; job 2 names a block outside the tensor and fails.
    const std::vector<std::uint32_t> blocks = {2, 3}, slots = {0, 1};
    CHECK(w.try_submit_job(1, KVO_JOB_KIND_STORE, blocks, slots).ok());
    CHECK(w.try_submit_job(2, KVO_JOB_KIND_STORE, std::vector<std::uint32_t>{kBlocks},
                           std::vector<std::uint32_t>{2})
              .ok());
    const kvo::Result<void> dup = w.try_submit_job(1, KVO_JOB_KIND_STORE, blocks, slots);
    CHECK(!dup.ok() && dup.status().code() == KVO_STATUS_INVALID_STATE);
    const std::vector<std::uint64_t> ids = {1, 2};
    CHECK(w.try_wait(ids, 10000).ok());
    kvo::Result<std::vector<kvo_completion>> done = w.try_poll();
    CHECK(done.ok() && done.value().size() == 2);
    if (done.ok()) {
        for (const kvo_completion &c : done.value()) {
            CHECK(c.success == (c.job_id == 1 ? 1u : 0u));
        }
    }
    const kvo::Result<std::string> why = w.try_job_error(2);
    CHECK(why.ok() && !why.value().empty());
    CHECK(!w.try_job_error(1).ok());

    // The host tier holds the blocks' bytes.
    const kvo::Result<kvo::HostBuffer> host = w.try_host_buffer(0);
    CHECK(host.ok() && host.value().len >= 2 * kPage);
    if (host.ok()) {
        CHECK(std::memcmp(host.value().ptr, kv + 2 * kPage, 2 * kPage) == 0);
    }

    // Load slot 1 into block 9, and a swap 9 -> 10 in the tensor itself.
    CHECK(w.try_submit_job(3, KVO_JOB_KIND_LOAD, std::vector<std::uint32_t>{1},
                           std::vector<std::uint32_t>{9})
              .ok());
    const std::vector<std::uint64_t> three = {3};
    CHECK(w.try_wait(three, 10000).ok());
    CHECK(w.try_poll().ok());
    CHECK(std::memcmp(kv + 9 * kPage, kv + 3 * kPage, kPage) == 0);
    CHECK(w.try_swap_blocks(0, 0, std::vector<std::uint32_t>{9}, std::vector<std::uint32_t>{10})
              .ok());
    CHECK(std::memcmp(kv + 10 * kPage, kv + 3 * kPage, kPage) == 0);
    const kvo::Result<void> uneven =
        w.try_swap_blocks(0, 0, std::vector<std::uint32_t>{1, 2}, std::vector<std::uint32_t>{4});
    CHECK(!uneven.ok() && uneven.status().code() == KVO_STATUS_INVALID_ARGUMENT);

    // Stats: per direction; the swap lands in a host tensor, so it counts as a store.
    const kvo::Result<kvo_worker_stats> st = w.try_stats();
    CHECK(st.ok());
    if (st.ok()) {
        const kvo_worker_stats &s = st.value();
        CHECK(s.struct_size == sizeof s && s.jobs_in_flight == 0);
        CHECK(s.store.jobs == 3 && s.store.failed_jobs == 1 && s.store.bytes == 3 * kPage);
        CHECK(s.load.jobs == 1 && s.load.bytes == kPage && s.load.size_buckets[0] == 1);
        CHECK(kvo::size_bucket_bounds[0] == 1000000);
    }
    const kvo::Result<std::string> text = w.try_metrics_text("kvo", {{"rank", "2"}});
    CHECK(text.ok() && text.value().find("\nkvo_store_failed_jobs_total{rank=\"2\"} 1\n") !=
                           std::string::npos);
    const kvo::Result<std::string> bad_label = w.try_metrics_text("kvo", {{"le", "2"}});
    CHECK(!bad_label.ok() && bad_label.status().code() == KVO_STATUS_INVALID_ARGUMENT);

    CHECK(w.try_shutdown().ok());
    const kvo::Result<void> late = w.try_submit_job(4, KVO_JOB_KIND_STORE, blocks, slots);
    CHECK(!late.ok() && late.status().code() == KVO_STATUS_INVALID_STATE);

    std::printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
