// The manager C API from C++17 through a tiny RAII wrapper: an ARC manager stores, completes and
// looks up keys, and answers NO_ROOM while everything is pinned. Prints one line per failed
// check and `N passed, M failed`; exits non-zero on any failure. Compiled and run by
// tests/c_api.rs.
#include "kvoffload.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace {

#include "check.hpp"

// The RAII wrapper: the handle is freed exactly once, whatever path leaves the scope.
struct ManagerFree {
    void operator()(kvo_manager *m) const noexcept { kvo_manager_free(m); }
};
using Manager = std::unique_ptr<kvo_manager, ManagerFree>;

constexpr std::uint32_t kKeyLen = 8;

Manager make_manager(std::uint32_t policy, std::uint64_t num_slots) {
    kvo_manager_config cfg{};
    if (kvo_manager_config_default(&cfg) != KVO_STATUS_OK) {
        return nullptr;
    }
    cfg.key_len = kKeyLen;
    cfg.policy = policy;
    cfg.num_slots = num_slots;
    kvo_manager *raw = nullptr;
    if (kvo_manager_new(&cfg, &raw) != KVO_STATUS_OK) {
        return nullptr;
    }
    return Manager(raw);
}

// Integer keys, 8 bytes big-endian each, back to back.
std::vector<std::uint8_t> keys(std::initializer_list<std::uint64_t> values) {
    std::vector<std::uint8_t> out;
    for (std::uint64_t v : values) {
        for (int shift = 56; shift >= 0; shift -= 8) {
            out.push_back(static_cast<std::uint8_t>(v >> shift));
        }
    }
    return out;
}

std::uint64_t key_at(const std::vector<std::uint8_t> &buf, std::size_t i) {
    std::uint64_t v = 0;
    for (std::size_t b = 0; b < kKeyLen; ++b) {
        v = (v << 8) | buf[i * kKeyLen + b];
    }
    return v;
}

struct Store {
    kvo_status status = KVO_STATUS_INTERNAL;
    std::vector<std::uint32_t> indices, slots;
    std::vector<std::uint8_t> evicted;
    std::size_t n_store = 0, n_evicted = 0;
};

Store prepare_store(const Manager &m, const std::vector<std::uint8_t> &k) {
    const std::size_t n = k.size() / kKeyLen;
    Store s;
    s.indices.resize(n);
    s.slots.resize(n);
    s.evicted.resize(n * kKeyLen);
    s.status = kvo_manager_prepare_store(m.get(), k.data(), n, s.indices.data(), s.slots.data(),
                                         s.evicted.data(), n, &s.n_store, &s.n_evicted);
    return s;
}

kvo_status complete_store(const Manager &m, const std::vector<std::uint8_t> &k, bool success) {
    return kvo_manager_complete_store(m.get(), k.data(), k.size() / kKeyLen, success ? 1 : 0);
}

std::uint32_t lookup(const Manager &m, std::uint64_t key) {
    const std::vector<std::uint8_t> k = keys({key});
    std::uint32_t r = 12345;
    CHECK_OK(kvo_manager_lookup(m.get(), k.data(), &r));
    return r;
}

kvo_manager_stats stats(const Manager &m) {
    kvo_manager_stats s{};
    s.struct_size = sizeof s;
    CHECK_OK(kvo_manager_get_stats(m.get(), &s));
    return s;
}

}  // namespace

int main() {
    CHECK(kvo_abi_version() == KVO_ABI_VERSION);
    {
        Manager none;  // an empty wrapper frees nothing
    }

    Manager m = make_manager(KVO_POLICY_ARC, 3);
    CHECK(m != nullptr);
    if (!m) {
        std::printf("%d passed, %d failed\n", passed, failed);
        return 1;
    }

    Store s = prepare_store(m, keys({1, 2, 3}));
    CHECK(s.status == KVO_STATUS_OK);
    CHECK(s.n_store == 3 && s.n_evicted == 0);
    CHECK((s.slots == std::vector<std::uint32_t>{0, 1, 2}));
    CHECK(lookup(m, 1) == KVO_LOOKUP_RETRY);
    CHECK_OK(complete_store(m, keys({1, 2, 3}), true));
    CHECK(lookup(m, 1) == KVO_LOOKUP_HIT);
    CHECK(lookup(m, 3) == KVO_LOOKUP_HIT);
    CHECK(lookup(m, 4) == KVO_LOOKUP_MISS);

    std::size_t hits = 0;
    std::uint32_t retry = 1;
    const std::vector<std::uint8_t> prefix = keys({1, 2, 4, 3});
    CHECK_OK(kvo_manager_lookup_prefix(m.get(), prefix.data(), 4, &hits, &retry));
    CHECK(hits == 2 && retry == 0);

    // Everything pinned by loads: no room for a new key, and nothing changes.
    std::vector<std::uint32_t> load_slots(3, 0);
    const std::vector<std::uint8_t> all = keys({1, 2, 3});
    CHECK_OK(kvo_manager_prepare_load(m.get(), all.data(), 3, load_slots.data(), 3));
    CHECK((load_slots == std::vector<std::uint32_t>{0, 1, 2}));
    CHECK(stats(m).pinned == 3);
    s = prepare_store(m, keys({4}));
    CHECK_STATUS(s.status, KVO_STATUS_NO_ROOM);
    CHECK(!last_error().empty());
    CHECK(stats(m).used == 3);
    CHECK(lookup(m, 4) == KVO_LOOKUP_MISS);

    // Released: 4 takes the slot of one evicted key (never a key it names itself).
    CHECK_OK(kvo_manager_complete_load(m.get(), all.data(), 3));
    const std::vector<std::uint8_t> touched = keys({2, 3});
    CHECK_OK(kvo_manager_touch(m.get(), touched.data(), 2));  // 2 and 3 promoted: 1 goes first
    s = prepare_store(m, keys({4, 2}));
    CHECK(s.status == KVO_STATUS_OK);
    CHECK(s.n_store == 1 && s.n_evicted == 1);
    CHECK(s.n_evicted == 1 && key_at(s.evicted, 0) == 1);
    CHECK(s.n_store == 1 && s.indices[0] == 0 && s.slots[0] == 0);
    CHECK_OK(complete_store(m, keys({4}), true));
    CHECK(lookup(m, 4) == KVO_LOOKUP_HIT);
    CHECK(lookup(m, 1) == KVO_LOOKUP_MISS);
    const kvo_manager_stats st = stats(m);
    CHECK(st.capacity == 3 && st.used == 3 && st.ready == 3 && st.evictions == 1);
    CHECK_OK(kvo_manager_check_invariants(m.get()));

    // The last error is per thread: another thread's failure is not seen here.
    CHECK_STATUS(kvo_manager_reset(nullptr), KVO_STATUS_NULL_ARGUMENT);
    std::size_t other_len = 12345;
    std::thread([&other_len] {
        kvo_manager_stats bad{};
        bad.struct_size = 0;
        other_len = kvo_last_error_message(nullptr, 0);  // fresh thread: empty
        if (kvo_manager_get_stats(nullptr, &bad) != KVO_STATUS_NULL_ARGUMENT) {
            other_len = 99999;
        }
    }).join();
    CHECK(other_len == 0);
    CHECK(last_error().find("manager") != std::string::npos);

    std::printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
