// The manager through kvoffload.hpp: an ARC manager stores, completes and looks up keys, and
// answers "no room" while everything is pinned; the wrappers' errors carry the status and the
// library's message, as kvo::Error and as kvo::Result. Prints one line per failed check and
// `N passed, M failed`; exits non-zero on any failure. Compiled and run by tests/c_api.rs.
#include "kvoffload.hpp"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace {

#include "check.hpp"

constexpr std::uint32_t kKeyLen = 8;

static_assert(!std::is_copy_constructible<kvo::Manager>::value, "handles are move-only");
static_assert(std::is_nothrow_move_constructible<kvo::Manager>::value, "handles move");

kvo::Manager make_manager(std::uint32_t policy, std::uint64_t num_slots) {
    kvo_manager_config cfg = kvo::Manager::default_config();
    cfg.key_len = kKeyLen;
    cfg.policy = policy;
    cfg.num_slots = num_slots;
    return kvo::Manager::create(cfg);
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

kvo_lookup lookup(kvo::Manager &m, std::uint64_t key) { return m.lookup(keys({key})); }

// The status a throwing call failed with (KVO_STATUS_OK if it did not throw).
template <class F>
kvo_status thrown(F f, std::string *message = nullptr) {
    try {
        f();
    } catch (const kvo::Error &e) {
        if (message) *message = e.what();
        return e.status();
    }
    return KVO_STATUS_OK;
}

// The worked example of vLLM 0.33 LRU (capacity 5) through the request calls: recency is
// request-scoped and committed when a request finishes, its head newest of all; eviction takes
// tails before heads.
void vllm033_lru_example() {
    kvo_manager_config cfg = kvo::Manager::default_config();
    cfg.key_len = kKeyLen;
    cfg.policy = KVO_POLICY_LRU;
    cfg.num_slots = 5;
    cfg.semantics = KVO_SEMANTICS_VLLM_0_33;
    kvo::Manager m = kvo::Manager::create(cfg);
    const kvo::Request a = m.begin_request();
    const kvo::Request b = m.begin_request();
    const kvo::Request c = m.begin_request();
    CHECK(m.semantics() == KVO_SEMANTICS_VLLM_0_33);
    CHECK(a.id != b.id && b.id != c.id && a.id != c.id);

    CHECK(lookup(m, 1) == KVO_LOOKUP_MISS);
    kvo::StorePlan s = m.prepare_store(a, keys({1, 2}), std::vector<std::uint64_t>{16, 32});
    CHECK((s.slots == std::vector<std::uint32_t>{0, 1}) && s.evicted_keys.empty());
    CHECK(lookup(m, 1) == KVO_LOOKUP_HIT_PENDING);
    m.complete_store(keys({1, 2}), true);
    s = m.prepare_store(a, keys({3}), std::vector<std::uint64_t>{48});
    CHECK((s.slots == std::vector<std::uint32_t>{2}));
    m.complete_store(keys({3}), true);
    s = m.prepare_store(b, keys({4, 5}), std::vector<std::uint64_t>{16, 32});
    CHECK((s.slots == std::vector<std::uint32_t>{3, 4}));
    m.complete_store(keys({4, 5}), true);
    m.finish_request(a);

    CHECK((m.prepare_load(c, keys({1, 2}), std::vector<std::uint64_t>{16, 32}) ==
           std::vector<std::uint32_t>{0, 1}));
    s = m.prepare_store(c, keys({6}), std::vector<std::uint64_t>{48});
    CHECK((s.slots == std::vector<std::uint32_t>{4}));
    CHECK(s.evicted_keys.size() == kKeyLen && key_at(s.evicted_keys, 0) == 5);
    m.complete_load(keys({1, 2}));
    m.complete_store(keys({6}), true);
    m.finish_request(c);
    m.finish_request(b);

    // Without a request: the oldest first, tails before heads.
    s = m.prepare_store(keys({10, 11, 12, 13, 14}));
    CHECK(s.slots.size() == 5 && s.evicted_keys.size() == 5 * kKeyLen);
    const std::uint64_t order[] = {3, 6, 2, 1, 4};
    for (std::size_t i = 0; i < 5 && i * kKeyLen < s.evicted_keys.size(); ++i) {
        CHECK(key_at(s.evicted_keys, i) == order[i]);
    }
    m.check_invariants();

    // Errors name the argument and change nothing.
    std::string msg;
    const kvo::Request d = m.begin_request();
    CHECK(thrown([&] { (void)m.prepare_store(d, keys({20, 21}), std::vector<std::uint64_t>{16}); },
                 &msg) == KVO_STATUS_INVALID_ARGUMENT);
    CHECK(msg.find("positions: 1 for 2 keys") != std::string::npos);
    CHECK(thrown([&] { (void)m.prepare_load(a, keys({10})); }, &msg) ==
          KVO_STATUS_INVALID_ARGUMENT);
    CHECK(msg.find("request") != std::string::npos);
    const kvo::Result<void> again = m.try_finish_request(a);
    CHECK(!again.ok() && again.status().code() == KVO_STATUS_INVALID_ARGUMENT);
    CHECK(lookup(m, 20) == KVO_LOOKUP_MISS);
    CHECK(m.stats().pinned == 0 && m.stats().stores_in_flight == 5);
    m.finish_request(d);
}

}  // namespace

int main() {
    vllm033_lru_example();

    CHECK(kvo::abi_compatible());
    CHECK(std::string(kvo::version()).size() > 0);

    kvo::Manager m = make_manager(KVO_POLICY_ARC, 3);
    CHECK(m.get() != nullptr && m.key_len() == kKeyLen);

    kvo::StorePlan s = m.prepare_store(keys({1, 2, 3}));
    CHECK(!s.no_room && s.evicted_keys.empty());
    CHECK((s.slots == std::vector<std::uint32_t>{0, 1, 2}));
    CHECK((s.indices == std::vector<std::uint32_t>{0, 1, 2}));
    CHECK(lookup(m, 1) == KVO_LOOKUP_RETRY);
    m.complete_store_at(keys({1, 2, 3}), s.slots, true);
    CHECK(lookup(m, 1) == KVO_LOOKUP_HIT);
    CHECK(lookup(m, 3) == KVO_LOOKUP_HIT);
    CHECK(lookup(m, 4) == KVO_LOOKUP_MISS);

    const kvo::PrefixHits p = m.lookup_prefix(keys({1, 2, 4, 3}));
    CHECK(p.hits == 2 && !p.retry);

    // Everything pinned by loads: no room for a new key (a normal answer), nothing changes.
    const std::vector<std::uint8_t> all = keys({1, 2, 3});
    CHECK((m.prepare_load(all) == std::vector<std::uint32_t>{0, 1, 2}));
    CHECK(m.stats().pinned == 3);
    s = m.prepare_store(keys({4}));
    CHECK(s.no_room && s.slots.empty());
    CHECK(m.stats().used == 3);
    CHECK(lookup(m, 4) == KVO_LOOKUP_MISS);

    // Released: 4 takes the slot of one evicted key (never a key it names itself).
    m.complete_load(all);
    m.touch(keys({2, 3}));  // 2 and 3 promoted: 1 goes first
    s = m.prepare_store(keys({4, 2}));
    CHECK(!s.no_room && s.slots.size() == 1 && s.evicted_keys.size() == kKeyLen);
    CHECK(s.evicted_keys.size() == kKeyLen && key_at(s.evicted_keys, 0) == 1);
    CHECK(s.indices.size() == 1 && s.indices[0] == 0 && s.slots[0] == 0);
    m.complete_store(keys({4}), true);
    CHECK(lookup(m, 4) == KVO_LOOKUP_HIT);
    CHECK(lookup(m, 1) == KVO_LOOKUP_MISS);
    const kvo_manager_stats st = m.stats();
    CHECK(st.capacity == 3 && st.used == 3 && st.ready == 3 && st.evictions == 1);
    m.check_invariants();

    // Errors: kvo::Error carries the status and the library's message, naming the argument.
    std::string msg;
    CHECK(thrown([&] { m.complete_load(keys({9})); }, &msg) == KVO_STATUS_NOT_FOUND);
    CHECK(!msg.empty());
    CHECK(thrown([&] { m.lookup(std::vector<std::uint8_t>(3)); }, &msg) ==
          KVO_STATUS_INVALID_ARGUMENT);
    CHECK(msg.find("key_len is 8") != std::string::npos);
    CHECK(thrown([&] { m.touch(std::vector<std::uint8_t>(12)); }, &msg) ==
          KVO_STATUS_INVALID_ARGUMENT);
    CHECK(msg.find("keys: 12 bytes") != std::string::npos);
    kvo_manager_config bad = kvo::Manager::default_config();
    bad.key_len = 0;
    CHECK(thrown([&] { (void)kvo::Manager::create(bad); }, &msg) ==
          KVO_STATUS_INVALID_ARGUMENT);
    CHECK(msg.find("key_len") != std::string::npos);

    // The same without exceptions: try_ forms return a Result.
    const kvo::Result<kvo::Manager> none = kvo::Manager::try_create(bad);
    CHECK(!none.ok() && none.status().code() == KVO_STATUS_INVALID_ARGUMENT);
    CHECK(none.status().message().find("key_len") != std::string::npos);
    const kvo::Result<void> r = m.try_complete_load(keys({9}));
    CHECK(!r.ok() && r.status().code() == KVO_STATUS_NOT_FOUND);
    kvo::Result<kvo_lookup> l = m.try_lookup(keys({4}));
    CHECK(l.ok() && l.value() == KVO_LOOKUP_HIT);

    // Moves hand the handle over; the moved-from wrapper frees nothing.
    kvo::Manager moved = std::move(m);
    CHECK(lookup(moved, 4) == KVO_LOOKUP_HIT);
    kvo::Manager other = make_manager(KVO_POLICY_LRU, 1);
    other = std::move(moved);  // frees `other`'s manager, takes `moved`'s
    CHECK(lookup(other, 4) == KVO_LOOKUP_HIT);

    // Events through the wrapper, sized by the library.
    kvo_manager_config ecfg = kvo::Manager::default_config();
    ecfg.key_len = kKeyLen;
    ecfg.num_slots = 2;
    ecfg.enable_events = 1;
    kvo::Manager e = kvo::Manager::create(ecfg);
    e.complete_store(keys({5}), true);  // not prepared: ignored, no event
    CHECK(!e.prepare_store(keys({5, 6})).no_room);
    e.complete_store(keys({5, 6}), true);
    const kvo::Events ev = e.take_events();
    CHECK(ev.events.size() == 1 && ev.events[0].n_keys == 2 && ev.events[0].removed == 0);
    CHECK(ev.keys.size() == 2 * kKeyLen && key_at(ev.keys, 0) == 5 && key_at(ev.keys, 1) == 6);
    CHECK(e.take_events().events.empty());

    // The metrics text.
    const std::string text = e.metrics_text("kvo", {{"engine", "a"}});
    CHECK(text.find("\nkvo_ready_slots{engine=\"a\"} 2\n") != std::string::npos);
    CHECK(thrown([&] { (void)e.metrics_text("bad prefix"); }, &msg) ==
          KVO_STATUS_INVALID_ARGUMENT);
    CHECK(msg.find("prefix") != std::string::npos);

    // The last error is per thread: another thread's failure is not seen here.
    CHECK_STATUS(kvo_manager_reset(nullptr), KVO_STATUS_NULL_ARGUMENT);
    std::size_t other_len = 12345;
    std::thread([&other_len] {
        kvo_manager_stats bad_stats{};
        bad_stats.struct_size = 0;
        other_len = kvo_last_error_message(nullptr, 0);  // fresh thread: empty
        if (kvo_manager_get_stats(nullptr, &bad_stats) != KVO_STATUS_NULL_ARGUMENT) {
            other_len = 99999;
        }
    }).join();
    CHECK(other_len == 0);
    CHECK(kvo::last_error_message().find("manager") != std::string::npos);

    std::printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
