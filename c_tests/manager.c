/* Exercises the whole kvo_manager_* C API from C11 with 8-byte keys (integers, big-endian).
 * Prints one line per failed check and `N passed, M failed`; exits non-zero on any failure.
 * Compiled and run by tests/c_api.rs. */
#include "kvoffload.h"

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define KEY_LEN 8
#define MAX_KEYS 16
#define OVERFLOW_N (SIZE_MAX / 2) /* n_keys * KEY_LEN overflows size_t */

#include "check.h"

/* ---- keys ------------------------------------------------------------------------------- */

typedef struct {
    uint8_t bytes[MAX_KEYS * KEY_LEN];
    size_t n;
} keys_t;

static void put_key(uint8_t *dst, uint64_t v) {
    for (int i = KEY_LEN - 1; i >= 0; i--) {
        dst[i] = (uint8_t)(v & 0xff);
        v >>= 8;
    }
}

static uint64_t get_key(const uint8_t *src) {
    uint64_t v = 0;
    for (int i = 0; i < KEY_LEN; i++) {
        v = (v << 8) | src[i];
    }
    return v;
}

static keys_t make_keys(const uint64_t *v, size_t n) {
    keys_t k;
    memset(&k, 0, sizeof k);
    k.n = n;
    for (size_t i = 0; i < n; i++) {
        put_key(k.bytes + i * KEY_LEN, v[i]);
    }
    return k;
}

/* U64S(1, 2, 3) expands to `array, length`. */
#define KEYS(...) make_keys(U64S(__VA_ARGS__))

static int eq_keys(const uint8_t *got, size_t n, const uint64_t *want, size_t wn) {
    uint64_t g[MAX_KEYS];
    int ok = n == wn && n <= MAX_KEYS;
    for (size_t i = 0; i < n && i < MAX_KEYS; i++) {
        g[i] = get_key(got + i * KEY_LEN);
        ok = ok && g[i] == want[i];
    }
    if (!ok) {
        print_got("keys", g, n < MAX_KEYS ? n : MAX_KEYS);
    }
    return ok;
}

/* CHECK_U32(array, n, 1, 2): the first n entries are exactly {1, 2}. */
#define CHECK_U32(got, n, ...)                                                                  \
    check(eq_u32((got), (n), U64S(__VA_ARGS__)), __LINE__, #got " == {" #__VA_ARGS__ "}")
#define CHECK_KEYS(got, n, ...)                                                                 \
    check(eq_keys((got), (n), U64S(__VA_ARGS__)), __LINE__, #got " == keys {" #__VA_ARGS__ "}")

/* ---- manager helpers -------------------------------------------------------------------- */

static kvo_manager *new_manager_in(uint32_t semantics, uint32_t policy, uint64_t num_slots,
                                   uint32_t enable_events) {
    kvo_manager_config cfg;
    kvo_manager *m = NULL;
    CHECK_OK(kvo_manager_config_default(&cfg));
    cfg.key_len = KEY_LEN;
    cfg.policy = policy;
    cfg.num_slots = num_slots;
    cfg.enable_events = enable_events;
    cfg.semantics = semantics;
    CHECK_OK(kvo_manager_new(&cfg, &m));
    CHECK(m != NULL);
    return m;
}

/* A manager with the default semantics (vLLM 0.24). */
static kvo_manager *new_manager(uint32_t policy, uint64_t num_slots, uint32_t enable_events) {
    return new_manager_in(KVO_SEMANTICS_VLLM_0_24, policy, num_slots, enable_events);
}

static kvo_manager_stats stats(const kvo_manager *m) {
    kvo_manager_stats s;
    memset(&s, 0, sizeof s);
    s.struct_size = sizeof s;
    CHECK_OK(kvo_manager_get_stats(m, &s));
    return s;
}

static void check_invariants(const kvo_manager *m, int line) {
    check_status(kvo_manager_check_invariants(m), KVO_STATUS_OK, NULL, line, "check_invariants");
}

static uint32_t lookup_(kvo_manager *m, uint64_t key, int line) {
    uint8_t k[KEY_LEN];
    uint32_t r = 12345;
    put_key(k, key);
    check_status(kvo_manager_lookup(m, k, &r), KVO_STATUS_OK, NULL, line, "lookup");
    return r;
}
#define LOOKUP(m, key) lookup_((m), (key), __LINE__)

typedef struct {
    size_t n_store, n_evicted;
    uint32_t indices[MAX_KEYS], slots[MAX_KEYS];
    uint8_t evicted[MAX_KEYS * KEY_LEN];
} store_out;

static store_out prepare_store_(kvo_manager *m, keys_t k, kvo_status want, int line) {
    store_out o;
    memset(&o, 0, sizeof o);
    check_status(kvo_manager_prepare_store(m, k.bytes, k.n, o.indices, o.slots, o.evicted,
                                           MAX_KEYS, &o.n_store, &o.n_evicted),
                 want, NULL, line, "prepare_store");
    return o;
}
#define PREPARE_STORE(m, want, ...) prepare_store_((m), KEYS(__VA_ARGS__), (want), __LINE__)

#define COMPLETE_STORE(m, success, ...)                                                         \
    do {                                                                                        \
        keys_t k_ = KEYS(__VA_ARGS__);                                                          \
        CHECK_OK(kvo_manager_complete_store((m), k_.bytes, k_.n, (success)));                   \
    } while (0)

#define PREPARE_LOAD(m, slots, want, ...)                                                       \
    do {                                                                                        \
        keys_t k_ = KEYS(__VA_ARGS__);                                                          \
        CHECK_STATUS(kvo_manager_prepare_load((m), k_.bytes, k_.n, (slots), MAX_KEYS), (want),  \
                     NULL);                                                                     \
    } while (0)

#define COMPLETE_LOAD(m, ...)                                                                   \
    do {                                                                                        \
        keys_t k_ = KEYS(__VA_ARGS__);                                                          \
        CHECK_OK(kvo_manager_complete_load((m), k_.bytes, k_.n));                               \
    } while (0)

#define TOUCH(m, ...)                                                                           \
    do {                                                                                        \
        keys_t k_ = KEYS(__VA_ARGS__);                                                          \
        CHECK_OK(kvo_manager_touch((m), k_.bytes, k_.n));                                       \
    } while (0)

/* POS(16, 32): the keys' positions, an array. */
#define POS(...) ((const uint64_t[]){__VA_ARGS__})

/* kvo_manager_prepare_store_for request `req` of keys with positions `pos`; must succeed. */
static store_out store_for_(kvo_manager *m, uint64_t req, const uint64_t *pos, keys_t k,
                            int line) {
    store_out o;
    memset(&o, 0, sizeof o);
    check_status(kvo_manager_prepare_store_for(m, req, k.bytes, pos, k.n, o.indices, o.slots,
                                               o.evicted, MAX_KEYS, &o.n_store, &o.n_evicted),
                 KVO_STATUS_OK, NULL, line, "kvo_manager_prepare_store_for");
    return o;
}
#define STORE_FOR(m, req, pos, ...) store_for_((m), (req), (pos), KEYS(__VA_ARGS__), __LINE__)

#define LOAD_FOR(m, req, slots, pos, ...)                                                       \
    do {                                                                                        \
        keys_t k_ = KEYS(__VA_ARGS__);                                                          \
        CHECK_OK(kvo_manager_prepare_load_for((m), (req), k_.bytes, (pos), k_.n, (slots),       \
                                              MAX_KEYS));                                       \
    } while (0)

static int stats_eq(const kvo_manager_stats *a, const kvo_manager_stats *b) {
    return a->capacity == b->capacity && a->used == b->used && a->ready == b->ready &&
           a->evictable == b->evictable && a->pinned == b->pinned &&
           a->stores_in_flight == b->stores_in_flight && a->lookups == b->lookups &&
           a->hits == b->hits && a->stores_skipped == b->stores_skipped &&
           a->evictions == b->evictions && a->events_dropped == b->events_dropped;
}

static void print_stats(const char *what, const kvo_manager_stats *s) {
    printf("  %s: capacity %llu used %llu ready %llu evictable %llu pinned %llu in_flight %llu "
           "lookups %llu hits %llu skipped %llu evictions %llu\n",
           what, (unsigned long long)s->capacity, (unsigned long long)s->used,
           (unsigned long long)s->ready, (unsigned long long)s->evictable,
           (unsigned long long)s->pinned, (unsigned long long)s->stores_in_flight,
           (unsigned long long)s->lookups, (unsigned long long)s->hits,
           (unsigned long long)s->stores_skipped, (unsigned long long)s->evictions);
}

/* After a failed call: the manager's stats are what they were and its invariants hold. */
static void check_unchanged(const kvo_manager *m, const kvo_manager_stats *before, int line,
                            const char *what) {
    kvo_manager_stats after = stats(m);
    if (stats_eq(before, &after)) {
        passed++;
    } else {
        failed++;
        printf("FAIL line %d: %s changed the manager\n", line, what);
        print_stats("before", before);
        print_stats("after", &after);
    }
    check_invariants(m, line);
}

/* A call that must fail with `want`, name `arg` in its message and leave `m` unchanged. */
#define CHECK_BAD(m, call, want, arg)                                                           \
    do {                                                                                        \
        kvo_manager_stats before_ = stats(m);                                                   \
        check_status((call), (want), (arg), __LINE__, #call);                                   \
        check_unchanged((m), &before_, __LINE__, #call);                                        \
    } while (0)

/* A call that must succeed without changing `m`. */
#define CHECK_NOOP(m, call)                                                                     \
    do {                                                                                        \
        kvo_manager_stats before_ = stats(m);                                                   \
        check_status((call), KVO_STATUS_OK, NULL, __LINE__, #call);                             \
        check_unchanged((m), &before_, __LINE__, #call);                                        \
    } while (0)

/* Number of buffered events (they are taken). */
static size_t drain_events(kvo_manager *m) {
    kvo_event ev[MAX_KEYS];
    uint8_t keys[4 * MAX_KEYS * KEY_LEN];
    size_t ne = 999, nk = 999;
    CHECK_OK(kvo_manager_take_events(m, ev, MAX_KEYS, keys, 4 * MAX_KEYS, &ne, &nk));
    return ne;
}

/* ---- tests ------------------------------------------------------------------------------ */

static void test_versions(void) {
    CHECK(kvo_abi_version() == KVO_ABI_VERSION);
    const char *v = kvo_version();
    CHECK(v != NULL && v[0] != '\0');
    kvo_manager_free(NULL);
}

static void test_config_default(void) {
    kvo_manager_config cfg;
    memset(&cfg, 0xAB, sizeof cfg);
    CHECK_OK(kvo_manager_config_default(&cfg));
    CHECK(cfg.struct_size == sizeof(kvo_manager_config));
    CHECK(cfg.key_len == 32);
    CHECK(cfg.policy == KVO_POLICY_LRU);
    CHECK(cfg.num_slots == 0);
    CHECK(cfg.store_threshold == 0);
    CHECK(cfg.enable_events == 0);
    CHECK(cfg.max_tracker_size == 64000);
    CHECK(cfg.semantics == KVO_SEMANTICS_VLLM_0_24);

    /* The defaults (0 slots) make a valid manager. */
    kvo_manager *m = NULL;
    CHECK_OK(kvo_manager_new(&cfg, &m));
    CHECK(m != NULL);
    kvo_manager_stats s = stats(m);
    CHECK(s.capacity == 0 && s.used == 0);
    kvo_manager_free(m);

    /* Extreme key widths. */
    cfg.key_len = 1;
    m = NULL;
    CHECK_OK(kvo_manager_new(&cfg, &m));
    kvo_manager_free(m);
    cfg.key_len = KVO_MAX_KEY_LEN;
    m = NULL;
    CHECK_OK(kvo_manager_new(&cfg, &m));
    kvo_manager_free(m);
}

/* The worked LRU example (capacity 4). */
static void test_lru_example(void) {
    kvo_manager *m = new_manager(KVO_POLICY_LRU, 4, 1);
    kvo_manager_stats s, before;
    store_out o;
    uint32_t slots[MAX_KEYS];
    size_t hits = 99;
    uint32_t retry = 99;

    o = PREPARE_STORE(m, KVO_STATUS_OK, 1, 2);
    CHECK(o.n_store == 2 && o.n_evicted == 0);
    CHECK_U32(o.indices, o.n_store, 0, 1);
    CHECK_U32(o.slots, o.n_store, 0, 1);
    s = stats(m);
    CHECK(s.capacity == 4 && s.used == 2 && s.stores_in_flight == 2 && s.ready == 0);

    /* In flight: lookup says retry, the prefix lookup counts it with the retry flag. */
    CHECK(LOOKUP(m, 1) == KVO_LOOKUP_RETRY);
    CHECK(LOOKUP(m, 1) == KVO_LOOKUP_RETRY);
    CHECK(LOOKUP(m, 3) == KVO_LOOKUP_MISS);
    keys_t k = KEYS(1, 2, 3);
    CHECK_OK(kvo_manager_lookup_prefix(m, k.bytes, k.n, &hits, &retry));
    CHECK(hits == 2 && retry == 1);
    /* Keys already stored or in flight are skipped. */
    o = PREPARE_STORE(m, KVO_STATUS_OK, 1, 2);
    CHECK(o.n_store == 0 && o.n_evicted == 0);

    COMPLETE_STORE(m, 1, 1, 2);
    CHECK(LOOKUP(m, 1) == KVO_LOOKUP_HIT);
    CHECK_OK(kvo_manager_lookup_prefix(m, k.bytes, k.n, &hits, &retry));
    CHECK(hits == 2 && retry == 0);
    k = KEYS(3, 1);
    CHECK_OK(kvo_manager_lookup_prefix(m, k.bytes, k.n, &hits, &retry));
    CHECK(hits == 0 && retry == 0);
    CHECK_OK(kvo_manager_lookup_prefix(m, NULL, 0, &hits, &retry));
    CHECK(hits == 0 && retry == 0);
    s = stats(m);
    CHECK(s.used == 2 && s.ready == 2 && s.evictable == 2 && s.stores_in_flight == 0);

    /* 2 is present; 3, 4, 5 take the fresh slots 2, 3 and the slot of the evicted 1. */
    o = PREPARE_STORE(m, KVO_STATUS_OK, 2, 3, 4, 5);
    CHECK(o.n_store == 3 && o.n_evicted == 1);
    CHECK_U32(o.indices, o.n_store, 1, 2, 3);
    CHECK_U32(o.slots, o.n_store, 2, 3, 0);
    CHECK_KEYS(o.evicted, o.n_evicted, 1);
    CHECK(LOOKUP(m, 1) == KVO_LOOKUP_MISS);

    /* Only 2 is evictable and it is named in the call: no room, nothing changes. */
    before = stats(m);
    o = PREPARE_STORE(m, KVO_STATUS_NO_ROOM, 1, 6);
    check_unchanged(m, &before, __LINE__, "prepare_store [1, 6]");

    COMPLETE_STORE(m, 1, 2, 3, 4, 5);
    s = stats(m);
    CHECK(s.used == 4 && s.ready == 4 && s.evictable == 4 && s.pinned == 0);

    PREPARE_LOAD(m, slots, KVO_STATUS_OK, 2, 3);
    CHECK_U32(slots, 2, 1, 2);
    s = stats(m);
    CHECK(s.pinned == 2 && s.evictable == 2);

    /* 2 and 3 are pinned: only 4 and 5 are evictable. */
    before = stats(m);
    o = PREPARE_STORE(m, KVO_STATUS_NO_ROOM, 6, 7, 8);
    check_unchanged(m, &before, __LINE__, "prepare_store [6, 7, 8]");

    /* Completing the loads makes 2 then 3 the most recent. */
    COMPLETE_LOAD(m, 2, 3);
    s = stats(m);
    CHECK(s.pinned == 0 && s.evictable == 4);
    o = PREPARE_STORE(m, KVO_STATUS_OK, 6, 7, 8);
    CHECK(o.n_store == 3 && o.n_evicted == 3);
    CHECK_U32(o.indices, o.n_store, 0, 1, 2);
    CHECK_KEYS(o.evicted, o.n_evicted, 4, 5, 2);
    CHECK_U32(o.slots, o.n_store, 1, 0, 3); /* freed 3, 0, 1: taken LIFO */
    COMPLETE_STORE(m, 1, 6, 7, 8);

    /* The first touched key ends most recent: LRU order is now 8, 7, 6, 3. */
    TOUCH(m, 3, 6, 7);
    o = PREPARE_STORE(m, KVO_STATUS_OK, 9);
    CHECK(o.n_store == 1 && o.n_evicted == 1);
    CHECK_KEYS(o.evicted, o.n_evicted, 8);
    CHECK_U32(o.slots, o.n_store, 3);

    /* A failed completion drops 9; 7 is already ready and stays. */
    COMPLETE_STORE(m, 0, 7, 9);
    CHECK(LOOKUP(m, 7) == KVO_LOOKUP_HIT);
    CHECK(LOOKUP(m, 9) == KVO_LOOKUP_MISS);
    CHECK(LOOKUP(m, 3) == KVO_LOOKUP_HIT);
    CHECK(LOOKUP(m, 6) == KVO_LOOKUP_HIT);
    s = stats(m);
    CHECK(s.used == 3 && s.ready == 3 && s.evictable == 3 && s.stores_in_flight == 0);
    CHECK(s.evictions == 5);
    check_invariants(m, __LINE__);

    /* Events: stored {1,2}, removed {1}, stored {3,4,5}, removed {4,5,2}, stored {6,7,8},
     * removed {8}. Too small a buffer reports the needed counts and keeps them buffered. */
    kvo_event ev[MAX_KEYS];
    uint8_t ev_keys[MAX_KEYS * KEY_LEN];
    size_t ne = 0, nk = 0;
    CHECK_STATUS(kvo_manager_take_events(m, NULL, 0, NULL, 0, &ne, &nk),
                 KVO_STATUS_BUFFER_TOO_SMALL, "events_cap");
    CHECK(ne == 6 && nk == 13);
    ne = nk = 0;
    CHECK_STATUS(kvo_manager_take_events(m, ev, 5, ev_keys, MAX_KEYS, &ne, &nk),
                 KVO_STATUS_BUFFER_TOO_SMALL, "events_cap");
    CHECK(ne == 6 && nk == 13);
    ne = nk = 0;
    CHECK_STATUS(kvo_manager_take_events(m, ev, 6, ev_keys, 12, &ne, &nk),
                 KVO_STATUS_BUFFER_TOO_SMALL, "keys_cap");
    CHECK(ne == 6 && nk == 13);
    ne = nk = 0;
    CHECK_OK(kvo_manager_take_events(m, ev, 6, ev_keys, 13, &ne, &nk));
    CHECK(ne == 6 && nk == 13);
    if (ne == 6 && nk == 13) {
        static const uint32_t removed[6] = {0, 1, 0, 1, 0, 1};
        static const uint64_t first[6] = {0, 2, 3, 6, 9, 12};
        static const uint64_t count[6] = {2, 1, 3, 3, 3, 1};
        for (int i = 0; i < 6; i++) {
            CHECK(ev[i].removed == removed[i]);
            CHECK(ev[i].first_key == first[i]);
            CHECK(ev[i].n_keys == count[i]);
            CHECK(ev[i].metadata_only == 0);
        }
        CHECK_KEYS(ev_keys, nk, 1, 2, 1, 3, 4, 5, 4, 5, 2, 6, 7, 8, 8);
    }
    /* Taken: nothing left. */
    ne = nk = 99;
    CHECK_OK(kvo_manager_take_events(m, NULL, 0, NULL, 0, &ne, &nk));
    CHECK(ne == 0 && nk == 0);

    kvo_manager_free(m);
}

static void test_store_extras(void) {
    kvo_manager *m = new_manager(KVO_POLICY_LRU, 4, 0);
    /* A key listed twice is stored once. */
    store_out o = PREPARE_STORE(m, KVO_STATUS_OK, 1, 1, 2);
    CHECK(o.n_store == 2 && o.n_evicted == 0);
    CHECK_U32(o.indices, o.n_store, 0, 2);
    CHECK_U32(o.slots, o.n_store, 0, 1);
    /* A completion may be repeated; a key listed twice is loaded and released twice. */
    COMPLETE_STORE(m, 1, 1, 2);
    COMPLETE_STORE(m, 1, 1, 2);
    uint32_t slots[MAX_KEYS];
    PREPARE_LOAD(m, slots, KVO_STATUS_OK, 1, 1);
    CHECK_U32(slots, 2, 0, 0);
    kvo_manager_stats s = stats(m);
    CHECK(s.pinned == 1 && s.evictable == 1);
    COMPLETE_LOAD(m, 1);
    CHECK(stats(m).pinned == 1);
    COMPLETE_LOAD(m, 1);
    CHECK(stats(m).pinned == 0);
    /* A failed store frees its slot; fresh slots are taken first, then freed ones. */
    o = PREPARE_STORE(m, KVO_STATUS_OK, 3);
    CHECK_U32(o.slots, o.n_store, 2);
    COMPLETE_STORE(m, 0, 3);
    CHECK(LOOKUP(m, 3) == KVO_LOOKUP_MISS);
    o = PREPARE_STORE(m, KVO_STATUS_OK, 4);
    CHECK_U32(o.slots, o.n_store, 3);
    o = PREPARE_STORE(m, KVO_STATUS_OK, 5);
    CHECK_U32(o.slots, o.n_store, 2);
    /* Empty calls are fine. */
    size_t n_store = 9, n_evicted = 9;
    CHECK_OK(kvo_manager_prepare_store(m, NULL, 0, NULL, NULL, NULL, 0, &n_store, &n_evicted));
    CHECK(n_store == 0 && n_evicted == 0);
    CHECK_OK(kvo_manager_prepare_load(m, NULL, 0, NULL, 0));
    CHECK_OK(kvo_manager_complete_load(m, NULL, 0));
    CHECK_OK(kvo_manager_touch(m, NULL, 0));
    CHECK_OK(kvo_manager_complete_store(m, NULL, 0, 1));
    check_invariants(m, __LINE__);

    /* Lookup counters. */
    kvo_manager_stats before = stats(m);
    CHECK(LOOKUP(m, 1) == KVO_LOOKUP_HIT);
    CHECK(LOOKUP(m, 4) == KVO_LOOKUP_RETRY);
    CHECK(LOOKUP(m, 77) == KVO_LOOKUP_MISS);
    s = stats(m);
    CHECK(s.lookups == before.lookups + 3);
    CHECK(s.hits == before.hits + 1);
    kvo_manager_free(m);
}

/* complete_store_at: the slots from prepare_store are used; wrong ones are only hints; bad
 * ones fail, naming them, and change nothing. */
static void test_complete_store_at(void) {
    kvo_manager *m = new_manager(KVO_POLICY_LRU, 4, 0);
    store_out o = PREPARE_STORE(m, KVO_STATUS_OK, 1, 2, 3);
    keys_t k = KEYS(1, 2, 3);
    CHECK_OK(kvo_manager_complete_store_at(m, k.bytes, o.slots, k.n, 1));
    CHECK(LOOKUP(m, 1) == KVO_LOOKUP_HIT && LOOKUP(m, 3) == KVO_LOOKUP_HIT);
    CHECK(stats(m).stores_in_flight == 0);
    /* Wrong hints (other keys' slots): the keys are found anyway. */
    o = PREPARE_STORE(m, KVO_STATUS_OK, 4);
    k = KEYS(4);
    uint32_t wrong[1] = {0};
    CHECK_OK(kvo_manager_complete_store_at(m, k.bytes, wrong, 1, 1));
    CHECK(LOOKUP(m, 4) == KVO_LOOKUP_HIT);
    /* Bad input. */
    o = PREPARE_STORE(m, KVO_STATUS_OK, 5);
    CHECK(o.n_store == 1 && o.n_evicted == 1);
    k = KEYS(5);
    uint32_t beyond[1] = {4};
    CHECK_BAD(m, kvo_manager_complete_store_at(NULL, k.bytes, o.slots, 1, 1),
              KVO_STATUS_NULL_ARGUMENT, "manager");
    CHECK_BAD(m, kvo_manager_complete_store_at(m, NULL, o.slots, 1, 1), KVO_STATUS_NULL_ARGUMENT,
              "keys");
    CHECK_BAD(m, kvo_manager_complete_store_at(m, k.bytes, NULL, 1, 1), KVO_STATUS_NULL_ARGUMENT,
              "slots");
    CHECK_BAD(m, kvo_manager_complete_store_at(m, k.bytes, o.slots, OVERFLOW_N, 1),
              KVO_STATUS_INVALID_ARGUMENT, "n_keys");
    CHECK_BAD(m, kvo_manager_complete_store_at(m, k.bytes, beyond, 1, 1),
              KVO_STATUS_INVALID_ARGUMENT, "slots[0]");
    CHECK(LOOKUP(m, 5) == KVO_LOOKUP_RETRY);
    CHECK_OK(kvo_manager_complete_store_at(m, k.bytes, o.slots, 1, 0));
    CHECK(LOOKUP(m, 5) == KVO_LOOKUP_MISS);
    CHECK_OK(kvo_manager_complete_store_at(m, NULL, NULL, 0, 1));
    check_invariants(m, __LINE__);
    kvo_manager_free(m);
}

/* store_threshold 2: a key is stored only once it has been looked up twice. */
static void test_store_threshold(void) {
    kvo_manager_config cfg;
    kvo_manager *m = NULL;
    CHECK_OK(kvo_manager_config_default(&cfg));
    cfg.key_len = KEY_LEN;
    cfg.num_slots = 4;
    cfg.store_threshold = 2;
    cfg.max_tracker_size = 16;
    CHECK_OK(kvo_manager_new(&cfg, &m));
    store_out o = PREPARE_STORE(m, KVO_STATUS_OK, 1);
    CHECK(o.n_store == 0);
    CHECK(stats(m).stores_skipped == 1);
    CHECK(LOOKUP(m, 1) == KVO_LOOKUP_MISS);
    o = PREPARE_STORE(m, KVO_STATUS_OK, 1);
    CHECK(o.n_store == 0);
    CHECK(LOOKUP(m, 1) == KVO_LOOKUP_MISS);
    o = PREPARE_STORE(m, KVO_STATUS_OK, 1, 2);
    CHECK(o.n_store == 1);
    CHECK_U32(o.indices, o.n_store, 0);
    kvo_manager_stats s = stats(m);
    CHECK(s.stores_skipped == 3 && s.stores_in_flight == 1);
    check_invariants(m, __LINE__);
    kvo_manager_free(m);
}

static void test_stats_struct_size(void) {
    kvo_manager *m = new_manager(KVO_POLICY_LRU, 4, 0);
    store_out o = PREPARE_STORE(m, KVO_STATUS_OK, 1, 2, 3);
    CHECK(o.n_store == 3);

    /* An older caller knowing only struct_size, capacity and used. */
    kvo_manager_stats s;
    const size_t known = offsetof(kvo_manager_stats, used) + sizeof(uint64_t);
    memset(&s, 0xAB, sizeof s);
    s.struct_size = known;
    CHECK_OK(kvo_manager_get_stats(m, &s));
    CHECK(s.struct_size == known);
    CHECK(s.capacity == 4);
    CHECK(s.used == 3);
    const unsigned char *bytes = (const unsigned char *)&s;
    int untouched = 1;
    for (size_t i = known; i < sizeof s; i++) {
        untouched = untouched && bytes[i] == 0xAB;
    }
    CHECK(untouched);

    /* Just the size field. */
    memset(&s, 0xAB, sizeof s);
    s.struct_size = sizeof(size_t);
    CHECK_OK(kvo_manager_get_stats(m, &s));
    CHECK(s.struct_size == sizeof(size_t));
    untouched = 1;
    for (size_t i = sizeof(size_t); i < sizeof s; i++) {
        untouched = untouched && bytes[i] == 0xAB;
    }
    CHECK(untouched);

    /* A newer caller with a longer struct: the library writes what it knows. */
    struct {
        kvo_manager_stats s;
        uint64_t newer;
    } big;
    memset(&big, 0xAB, sizeof big);
    big.s.struct_size = sizeof big;
    CHECK_OK(kvo_manager_get_stats(m, &big.s));
    CHECK(big.s.capacity == 4 && big.s.used == 3 && big.s.stores_in_flight == 3);
    CHECK(big.newer == 0xABABABABABABABABull);
    kvo_manager_free(m);
}

static void test_last_error(void) {
    CHECK_STATUS(kvo_manager_config_default(NULL), KVO_STATUS_NULL_ARGUMENT, "out");
    size_t full = kvo_last_error_message(NULL, 0);
    CHECK(full > 3);
    char big[512];
    CHECK(kvo_last_error_message(big, sizeof big) == full);
    CHECK(strlen(big) == full);
    char small[4];
    memset(small, 'x', sizeof small);
    CHECK(kvo_last_error_message(small, sizeof small) == full);
    CHECK(small[3] == '\0' && strlen(small) == 3 && memcmp(small, big, 3) == 0);
    char one[1] = {'x'};
    CHECK(kvo_last_error_message(one, 1) == full);
    CHECK(one[0] == '\0');
    /* Reading the message does not clear it... */
    CHECK(kvo_last_error_message(NULL, 0) == full);
    /* ...a successful call does. */
    kvo_manager_config cfg;
    CHECK_OK(kvo_manager_config_default(&cfg));
    memset(big, 'x', sizeof big);
    CHECK(kvo_last_error_message(big, sizeof big) == 0);
    CHECK(big[0] == '\0');
}

/* ---- bad inputs, as tables (check.h) ---------------------------------------------------- */

/* The outputs a case may be given; outputs_reset fills them with 0xA5 before each case. */
typedef struct {
    uint32_t lookup, retry;
    uint64_t request;
    size_t hits, n_store, n_evicted, n_events, n_keys;
    uint32_t slots[MAX_KEYS], indices[MAX_KEYS];
    uint8_t evicted[MAX_KEYS * KEY_LEN];
    kvo_event events[4];
    uint8_t event_keys[4 * KEY_LEN];
    kvo_manager_stats stats, size0, size7; /* struct_size: sizeof, 0, sizeof(size_t) - 1 */
} outputs;

struct fixture {
    kvo_manager *m;
    kvo_manager_stats before; /* m's stats before the case */
    outputs o;
    uint64_t a, done;        /* 0.33: an active request, a finished one */
    kvo_manager_config cfg;  /* bad configs: the good one, edited by the case */
    kvo_manager *out;        /* bad configs: *out, which a failure must not write */
};

static void outputs_reset(outputs *o) {
    memset(o, 0xA5, sizeof *o);
    o->stats.struct_size = sizeof o->stats;
    o->size0.struct_size = 0;
    o->size7.struct_size = sizeof(size_t) - 1;
}

/* The case wrote no output; prints the first byte it wrote. */
static int outputs_kept(const fixture *f) {
    outputs ref;
    outputs_reset(&ref);
    return bytes_kept(&f->o, &ref, sizeof ref);
}
#define KEPT outputs_kept(f)

/* Before each case: the manager's stats, fresh outputs; after it: the same stats, invariants. */
static void manager_before(fixture *f) {
    f->before = stats(f->m);
    outputs_reset(&f->o);
}
static void manager_after(fixture *f, int line, const char *what) {
    check_unchanged(f->m, &f->before, line, what);
}
static const fixture_hooks manager_hooks = {manager_before, manager_after};

/* KB(1, 2): the bytes of keys 1, 2 (a temporary, for the one call it is passed to). */
#define KB(...) (KEYS(__VA_ARGS__).bytes)

/* A good config edited by `edit` (the case's one bad field), as kvo_manager_new's argument. */
#define CFG(edit) ((edit), &f->cfg)
static int sentinel_marker;
#define SENTINEL ((kvo_manager *)(void *)&sentinel_marker)
#define NO_HANDLE (f->out == SENTINEL)

static void config_before(fixture *f) {
    CHECK_OK(kvo_manager_config_default(&f->cfg));
    f->cfg.key_len = KEY_LEN;
    f->cfg.num_slots = 4;
    f->out = SENTINEL;
}
static void config_after(fixture *f, int line, const char *what) {
    (void)f, (void)line, (void)what;
}
static const fixture_hooks config_hooks = {config_before, config_after};

/* Every bad config is refused with its status, names the field and writes no handle. */
#define BAD_CONFIGS(X)                                                                          \
    X(default_no_out, kvo_manager_config_default(NULL), NULL_ARGUMENT, "out", NO_HANDLE)        \
    X(no_cfg, kvo_manager_new(NULL, &f->out), NULL_ARGUMENT, "cfg", NO_HANDLE)                  \
    X(no_out, kvo_manager_new(&f->cfg, NULL), NULL_ARGUMENT, "out", NO_HANDLE)                  \
    X(size_short, kvo_manager_new(CFG(f->cfg.struct_size = sizeof f->cfg - 1), &f->out),        \
      INVALID_ARGUMENT, "struct_size", NO_HANDLE)                                               \
    X(size_0, kvo_manager_new(CFG(f->cfg.struct_size = 0), &f->out), INVALID_ARGUMENT,          \
      "struct_size", NO_HANDLE)                                                                 \
    X(size_below_older, /* one byte short of the struct before `semantics` */                   \
      kvo_manager_new(CFG(f->cfg.struct_size = offsetof(kvo_manager_config, semantics) - 1),    \
                      &f->out),                                                                 \
      INVALID_ARGUMENT, "struct_size", NO_HANDLE)                                               \
    X(key_len_0, kvo_manager_new(CFG(f->cfg.key_len = 0), &f->out), INVALID_ARGUMENT,           \
      "key_len", NO_HANDLE)                                                                     \
    X(key_len_big, kvo_manager_new(CFG(f->cfg.key_len = KVO_MAX_KEY_LEN + 1), &f->out),         \
      INVALID_ARGUMENT, "key_len", NO_HANDLE)                                                   \
    X(policy, kvo_manager_new(CFG(f->cfg.policy = 7), &f->out), INVALID_ARGUMENT, "policy",     \
      NO_HANDLE)                                                                                \
    X(semantics, kvo_manager_new(CFG(f->cfg.semantics = 2), &f->out), INVALID_ARGUMENT,         \
      "semantics", NO_HANDLE)                                                                   \
    X(slots_lru, kvo_manager_new(CFG(f->cfg.num_slots = UINT32_MAX), &f->out),                  \
      INVALID_ARGUMENT, "num_slots", NO_HANDLE)                                                 \
    X(slots_arc, /* ARC also names its ghosts: at most UINT32_MAX / 5 slots */                  \
      kvo_manager_new(CFG((f->cfg.policy = KVO_POLICY_ARC,                                      \
                           f->cfg.num_slots = UINT32_MAX / 5 + 1)),                             \
                      &f->out),                                                                 \
      INVALID_ARGUMENT, "num_slots", NO_HANDLE)                                                 \
    X(tracker_0,                                                                                \
      kvo_manager_new(CFG((f->cfg.store_threshold = 2, f->cfg.max_tracker_size = 0)), &f->out), \
      INVALID_ARGUMENT, "max_tracker_size", NO_HANDLE)
CASE_TABLE(bad_configs, BAD_CONFIGS);

static void test_bad_config(void) {
    fixture f;
    memset(&f, 0, sizeof f);
    RUN_CASES(&f, &config_hooks, bad_configs);

    /* A tier whose index cannot be allocated: KVO_STATUS_OUT_OF_MEMORY naming num_slots (with
     * heuristic overcommit, the Linux default, an allocation beyond RAM + swap is refused). */
    FILE *file = fopen("/proc/sys/vm/overcommit_memory", "r");
    int mode = -1;
    if (file != NULL) {
        if (fscanf(file, "%d", &mode) != 1) mode = -1;
        fclose(file);
    }
    if (mode == 0) {
        config_before(&f);
        f.cfg.key_len = KVO_MAX_KEY_LEN;
        f.cfg.num_slots = UINT32_MAX - 1;
        CHECK_STATUS(kvo_manager_new(&f.cfg, &f.out), KVO_STATUS_OUT_OF_MEMORY, "num_slots");
        CHECK(strstr(last_error(), "cfg->out of memory") == NULL);
        CHECK(f.out == SENTINEL);
    } else {
        printf("skipped the out-of-memory check: needs vm.overcommit_memory = 0\n");
    }
}

/* A caller built against the header before `semantics` passes the older struct_size: accepted,
 * with the default semantics (0.24: a key in flight answers RETRY), whatever follows it. */
static void test_config_older_size(void) {
    const size_t older = offsetof(kvo_manager_config, semantics);
    kvo_manager_config cfg;
    kvo_manager *m = NULL;
    CHECK_OK(kvo_manager_config_default(&cfg));
    cfg.key_len = KEY_LEN;
    cfg.num_slots = 4;
    cfg.semantics = KVO_SEMANTICS_VLLM_0_33; /* beyond the older struct: not read */
    cfg.struct_size = older;
    /* Exactly the older struct's bytes (valgrind flags a read beyond them), then the whole one. */
    unsigned char *bytes = malloc(older);
    CHECK(bytes != NULL);
    memcpy(bytes, &cfg, older);
    const kvo_manager_config *older_cfg = (const kvo_manager_config *)(const void *)bytes;
    const kvo_manager_config *given[2] = {older_cfg, &cfg};
    for (int i = 0; i < 2; i++) {
        m = NULL;
        CHECK_OK(kvo_manager_new(given[i], &m));
        store_out o = PREPARE_STORE(m, KVO_STATUS_OK, 1);
        CHECK(o.n_store == 1);
        CHECK(LOOKUP(m, 1) == KVO_LOOKUP_RETRY);
        kvo_manager_free(m);
    }
    free(bytes);
    /* The current struct_size reads the field. */
    cfg.struct_size = sizeof cfg;
    m = NULL;
    CHECK_OK(kvo_manager_new(&cfg, &m));
    store_out o = PREPARE_STORE(m, KVO_STATUS_OK, 1);
    CHECK(o.n_store == 1);
    CHECK(LOOKUP(m, 1) == KVO_LOOKUP_HIT_PENDING);
    kvo_manager_free(m);
}

/* On the manager of test_bad_inputs: 1 ready and pinned once, 2 ready and evictable, 3 in
 * flight, one slot free. Each case fails (or, for complete_store, is ignored on purpose: the
 * keys unknown or already ready) and changes nothing. */
#define BAD_INPUTS(X)                                                                           \
    X(lookup_no_manager, kvo_manager_lookup(NULL, KB(1), &f->o.lookup), NULL_ARGUMENT,          \
      "manager", KEPT)                                                                          \
    X(lookup_no_key, kvo_manager_lookup(f->m, NULL, &f->o.lookup), NULL_ARGUMENT, "key", KEPT)  \
    X(lookup_no_out, kvo_manager_lookup(f->m, KB(1), NULL), NULL_ARGUMENT, "out_result", KEPT)  \
    X(prefix_no_manager, kvo_manager_lookup_prefix(NULL, KB(1, 2), 2, &f->o.hits, &f->o.retry), \
      NULL_ARGUMENT, "manager", KEPT)                                                           \
    X(prefix_no_keys, kvo_manager_lookup_prefix(f->m, NULL, 2, &f->o.hits, &f->o.retry),        \
      NULL_ARGUMENT, "keys", KEPT)                                                              \
    X(prefix_no_hits, kvo_manager_lookup_prefix(f->m, KB(1, 2), 2, NULL, &f->o.retry),          \
      NULL_ARGUMENT, "out_hits", KEPT)                                                          \
    X(prefix_no_retry, kvo_manager_lookup_prefix(f->m, KB(1, 2), 2, &f->o.hits, NULL),          \
      NULL_ARGUMENT, "out_retry", KEPT)                                                         \
    X(prefix_overflow,                                                                          \
      kvo_manager_lookup_prefix(f->m, KB(1, 2), OVERFLOW_N, &f->o.hits, &f->o.retry),           \
      INVALID_ARGUMENT, "n_keys", KEPT)                                                         \
    X(load_no_manager, kvo_manager_prepare_load(NULL, KB(1, 2), 2, f->o.slots, MAX_KEYS),       \
      NULL_ARGUMENT, "manager", KEPT)                                                           \
    X(load_no_keys, kvo_manager_prepare_load(f->m, NULL, 2, f->o.slots, MAX_KEYS),              \
      NULL_ARGUMENT, "keys", KEPT)                                                              \
    X(load_no_slots, kvo_manager_prepare_load(f->m, KB(1, 2), 2, NULL, MAX_KEYS),               \
      NULL_ARGUMENT, "out_slots", KEPT)                                                         \
    X(load_overflow,                                                                            \
      kvo_manager_prepare_load(f->m, KB(1, 2), OVERFLOW_N, f->o.slots, MAX_KEYS),               \
      INVALID_ARGUMENT, "n_keys", KEPT)                                                         \
    X(load_slots_cap, kvo_manager_prepare_load(f->m, KB(1, 2), 2, f->o.slots, 1),               \
      BUFFER_TOO_SMALL, "out_slots", KEPT)                                                      \
    X(load_not_stored, /* 2 is stored, 99 is not: 2 must not stay pinned */                     \
      kvo_manager_prepare_load(f->m, KB(2, 99), 2, f->o.slots, MAX_KEYS), NOT_FOUND, "keys",    \
      KEPT)                                                                                     \
    X(load_in_flight, kvo_manager_prepare_load(f->m, KB(2, 3), 2, f->o.slots, MAX_KEYS),        \
      INVALID_STATE, "keys", KEPT)                                                              \
    X(touch_no_manager, kvo_manager_touch(NULL, KB(1, 2), 2), NULL_ARGUMENT, "manager", KEPT)   \
    X(touch_no_keys, kvo_manager_touch(f->m, NULL, 2), NULL_ARGUMENT, "keys", KEPT)             \
    X(touch_overflow, kvo_manager_touch(f->m, KB(1, 2), OVERFLOW_N), INVALID_ARGUMENT,          \
      "n_keys", KEPT)                                                                           \
    X(unload_no_manager, kvo_manager_complete_load(NULL, KB(1), 1), NULL_ARGUMENT, "manager",   \
      KEPT)                                                                                     \
    X(unload_no_keys, kvo_manager_complete_load(f->m, NULL, 1), NULL_ARGUMENT, "keys", KEPT)    \
    X(unload_overflow, kvo_manager_complete_load(f->m, KB(1), OVERFLOW_N), INVALID_ARGUMENT,    \
      "n_keys", KEPT)                                                                           \
    X(unload_not_stored, kvo_manager_complete_load(f->m, KB(99), 1), NOT_FOUND, "keys", KEPT)   \
    X(unload_not_pinned, kvo_manager_complete_load(f->m, KB(2), 1), INVALID_STATE, "keys",      \
      KEPT)                                                                                     \
    X(unload_in_flight, kvo_manager_complete_load(f->m, KB(3), 1), INVALID_STATE, "keys", KEPT) \
    X(unload_twice, /* pinned once, released twice: the first release must be undone */         \
      kvo_manager_complete_load(f->m, KB(1, 1), 2), INVALID_STATE, "keys", KEPT)                \
    X(unload_one_pinned, kvo_manager_complete_load(f->m, KB(1, 2), 2), INVALID_STATE, "keys",   \
      KEPT)                                                                                     \
    X(store_no_manager,                                                                         \
      kvo_manager_prepare_store(NULL, KB(4, 5), 2, f->o.indices, f->o.slots, f->o.evicted,      \
                                MAX_KEYS, &f->o.n_store, &f->o.n_evicted),                      \
      NULL_ARGUMENT, "manager", KEPT)                                                           \
    X(store_no_keys,                                                                            \
      kvo_manager_prepare_store(f->m, NULL, 2, f->o.indices, f->o.slots, f->o.evicted,          \
                                MAX_KEYS, &f->o.n_store, &f->o.n_evicted),                      \
      NULL_ARGUMENT, "keys", KEPT)                                                              \
    X(store_no_indices,                                                                         \
      kvo_manager_prepare_store(f->m, KB(4, 5), 2, NULL, f->o.slots, f->o.evicted, MAX_KEYS,    \
                                &f->o.n_store, &f->o.n_evicted),                                \
      NULL_ARGUMENT, "out_indices", KEPT)                                                       \
    X(store_no_slots,                                                                           \
      kvo_manager_prepare_store(f->m, KB(4, 5), 2, f->o.indices, NULL, f->o.evicted, MAX_KEYS,  \
                                &f->o.n_store, &f->o.n_evicted),                                \
      NULL_ARGUMENT, "out_slots", KEPT)                                                         \
    X(store_no_evicted,                                                                         \
      kvo_manager_prepare_store(f->m, KB(4, 5), 2, f->o.indices, f->o.slots, NULL, MAX_KEYS,    \
                                &f->o.n_store, &f->o.n_evicted),                                \
      NULL_ARGUMENT, "out_evicted_keys", KEPT)                                                  \
    X(store_no_n_store,                                                                         \
      kvo_manager_prepare_store(f->m, KB(4, 5), 2, f->o.indices, f->o.slots, f->o.evicted,      \
                                MAX_KEYS, NULL, &f->o.n_evicted),                               \
      NULL_ARGUMENT, "out_n_store", KEPT)                                                       \
    X(store_no_n_evicted,                                                                       \
      kvo_manager_prepare_store(f->m, KB(4, 5), 2, f->o.indices, f->o.slots, f->o.evicted,      \
                                MAX_KEYS, &f->o.n_store, NULL),                                 \
      NULL_ARGUMENT, "out_n_evicted", KEPT)                                                     \
    X(store_overflow,                                                                           \
      kvo_manager_prepare_store(f->m, KB(4, 5), OVERFLOW_N, f->o.indices, f->o.slots,           \
                                f->o.evicted, MAX_KEYS, &f->o.n_store, &f->o.n_evicted),        \
      INVALID_ARGUMENT, "n_keys", KEPT)                                                         \
    X(store_out_cap, /* writes n_keys to *out_n_store */                                        \
      kvo_manager_prepare_store(f->m, KB(4, 5), 2, f->o.indices, f->o.slots, f->o.evicted, 1,   \
                                &f->o.n_store, &f->o.n_evicted),                                \
      BUFFER_TOO_SMALL, "out_cap", f->o.n_store == 2)                                           \
    X(store_no_room, /* 3 keys, 1 free slot, 1 evictable key */                                 \
      kvo_manager_prepare_store(f->m, KB(4, 5, 6), 3, f->o.indices, f->o.slots, f->o.evicted,   \
                                MAX_KEYS, &f->o.n_store, &f->o.n_evicted),                      \
      NO_ROOM, NULL, KEPT)                                                                      \
    X(stored_no_manager, kvo_manager_complete_store(NULL, KB(1, 2), 2, 1), NULL_ARGUMENT,       \
      "manager", KEPT)                                                                          \
    X(stored_no_keys, kvo_manager_complete_store(f->m, NULL, 2, 1), NULL_ARGUMENT, "keys",      \
      KEPT)                                                                                     \
    X(stored_overflow, kvo_manager_complete_store(f->m, KB(1, 2), OVERFLOW_N, 1),               \
      INVALID_ARGUMENT, "n_keys", KEPT)                                                         \
    X(stored_ignored_ok, kvo_manager_complete_store(f->m, KB(98, 99, 2, 1), 4, 1), OK, NULL,    \
      KEPT)                                                                                     \
    X(stored_ignored_failed, kvo_manager_complete_store(f->m, KB(98, 99, 2, 1), 4, 0), OK,      \
      NULL, KEPT)                                                                               \
    X(events_no_manager,                                                                        \
      kvo_manager_take_events(NULL, f->o.events, 4, f->o.event_keys, 4, &f->o.n_events,         \
                              &f->o.n_keys),                                                    \
      NULL_ARGUMENT, "manager", KEPT)                                                           \
    X(events_no_n_events,                                                                       \
      kvo_manager_take_events(f->m, f->o.events, 4, f->o.event_keys, 4, NULL, &f->o.n_keys),    \
      NULL_ARGUMENT, "out_n_events", KEPT)                                                      \
    X(events_no_n_keys,                                                                         \
      kvo_manager_take_events(f->m, f->o.events, 4, f->o.event_keys, 4, &f->o.n_events, NULL),  \
      NULL_ARGUMENT, "out_n_keys", KEPT)                                                        \
    X(stats_no_manager, kvo_manager_get_stats(NULL, &f->o.stats), NULL_ARGUMENT, "manager",     \
      KEPT)                                                                                     \
    X(stats_no_out, kvo_manager_get_stats(f->m, NULL), NULL_ARGUMENT, "out", KEPT)              \
    X(stats_size_0, kvo_manager_get_stats(f->m, &f->o.size0), INVALID_ARGUMENT, "struct_size",  \
      KEPT)                                                                                     \
    X(stats_size_short, kvo_manager_get_stats(f->m, &f->o.size7), INVALID_ARGUMENT,             \
      "struct_size", KEPT)                                                                      \
    X(reset_no_manager, kvo_manager_reset(NULL), NULL_ARGUMENT, "manager", KEPT)                \
    X(invariants_no_manager, kvo_manager_check_invariants(NULL), NULL_ARGUMENT, "manager", KEPT)
CASE_TABLE(bad_inputs, BAD_INPUTS);

static void test_bad_inputs(void) {
    fixture f;
    memset(&f, 0, sizeof f);
    f.m = new_manager(KVO_POLICY_LRU, 4, 1);
    store_out o = PREPARE_STORE(f.m, KVO_STATUS_OK, 1, 2, 3);
    CHECK(o.n_store == 3);
    COMPLETE_STORE(f.m, 1, 1, 2);
    uint32_t slots[MAX_KEYS];
    PREPARE_LOAD(f.m, slots, KVO_STATUS_OK, 1);
    CHECK(drain_events(f.m) == 1);
    kvo_manager_stats s = stats(f.m);
    CHECK(s.used == 3 && s.ready == 2 && s.pinned == 1 && s.evictable == 1);
    CHECK(s.stores_in_flight == 1);

    RUN_CASES(&f, &manager_hooks, bad_inputs);

    /* No failed call recorded an event, and the keys are as they were. */
    CHECK(drain_events(f.m) == 0);
    CHECK(LOOKUP(f.m, 1) == KVO_LOOKUP_HIT);
    CHECK(LOOKUP(f.m, 2) == KVO_LOOKUP_HIT);
    CHECK(LOOKUP(f.m, 3) == KVO_LOOKUP_RETRY);
    CHECK(LOOKUP(f.m, 99) == KVO_LOOKUP_MISS);

    /* The manager still works: release, complete, and everything is evictable. */
    COMPLETE_LOAD(f.m, 1);
    COMPLETE_STORE(f.m, 1, 3);
    s = stats(f.m);
    CHECK(s.used == 3 && s.ready == 3 && s.evictable == 3 && s.pinned == 0);
    CHECK(s.stores_in_flight == 0);
    check_invariants(f.m, __LINE__);
    kvo_manager_free(f.m);
}

/* On the 0.33 manager of test_bad_requests: request `a` stored 1, 2, 3 at positions 16, 32,
 * 48 and loads 1; 1 is ready and pinned, 2 ready and evictable, 3 in flight, one slot free;
 * request `done` has finished, request 0 was never begun. */
#define BAD_REQUESTS(X)                                                                         \
    X(begin_no_manager, kvo_manager_begin_request(NULL, &f->o.request), NULL_ARGUMENT,          \
      "manager", KEPT)                                                                          \
    X(begin_no_out, kvo_manager_begin_request(f->m, NULL), NULL_ARGUMENT, "out_request", KEPT)  \
    X(finish_no_manager, kvo_manager_finish_request(NULL, f->a), NULL_ARGUMENT, "manager",      \
      KEPT)                                                                                     \
    X(finish_finished, kvo_manager_finish_request(f->m, f->done), INVALID_ARGUMENT, "request",  \
      KEPT)                                                                                     \
    X(finish_never_begun, kvo_manager_finish_request(f->m, 0), INVALID_ARGUMENT, "request",     \
      KEPT)                                                                                     \
    X(finish_unknown, kvo_manager_finish_request(f->m, UINT64_MAX), INVALID_ARGUMENT,           \
      "request", KEPT)                                                                          \
    X(load_for_no_manager,                                                                      \
      kvo_manager_prepare_load_for(NULL, f->a, KB(2), POS(32), 1, f->o.slots, MAX_KEYS),        \
      NULL_ARGUMENT, "manager", KEPT)                                                           \
    X(load_for_finished,                                                                        \
      kvo_manager_prepare_load_for(f->m, f->done, KB(2), POS(32), 1, f->o.slots, MAX_KEYS),     \
      INVALID_ARGUMENT, "request", KEPT)                                                        \
    X(load_for_never_begun,                                                                     \
      kvo_manager_prepare_load_for(f->m, 0, KB(2), POS(32), 1, f->o.slots, MAX_KEYS),           \
      INVALID_ARGUMENT, "request", KEPT)                                                        \
    X(load_for_no_keys,                                                                         \
      kvo_manager_prepare_load_for(f->m, f->a, NULL, POS(32), 1, f->o.slots, MAX_KEYS),         \
      NULL_ARGUMENT, "keys", KEPT)                                                              \
    X(load_for_no_slots,                                                                        \
      kvo_manager_prepare_load_for(f->m, f->a, KB(2), POS(32), 1, NULL, MAX_KEYS),              \
      NULL_ARGUMENT, "out_slots", KEPT)                                                         \
    X(load_for_position_max,                                                                    \
      kvo_manager_prepare_load_for(f->m, f->a, KB(1, 2), POS(16, UINT64_MAX), 2, f->o.slots,    \
                                   MAX_KEYS),                                                   \
      INVALID_ARGUMENT, "positions[1]", KEPT)                                                   \
    X(load_for_overflow,                                                                        \
      kvo_manager_prepare_load_for(f->m, f->a, KB(2), NULL, OVERFLOW_N, f->o.slots, MAX_KEYS),  \
      INVALID_ARGUMENT, "n_keys", KEPT)                                                         \
    X(load_for_slots_cap,                                                                       \
      kvo_manager_prepare_load_for(f->m, f->a, KB(1, 2), POS(16, 32), 2, f->o.slots, 1),        \
      BUFFER_TOO_SMALL, "out_slots", KEPT)                                                      \
    X(load_for_not_stored,                                                                      \
      kvo_manager_prepare_load_for(f->m, f->a, KB(2, 99), POS(32, 64), 2, f->o.slots,           \
                                   MAX_KEYS),                                                   \
      NOT_FOUND, "keys", KEPT)                                                                  \
    X(load_for_in_flight,                                                                       \
      kvo_manager_prepare_load_for(f->m, f->a, KB(2, 3), POS(32, 48), 2, f->o.slots, MAX_KEYS), \
      INVALID_STATE, "keys", KEPT)                                                              \
    X(store_for_no_manager,                                                                     \
      kvo_manager_prepare_store_for(NULL, f->a, KB(4, 5), POS(64, 80), 2, f->o.indices,         \
                                    f->o.slots, f->o.evicted, MAX_KEYS, &f->o.n_store,          \
                                    &f->o.n_evicted),                                           \
      NULL_ARGUMENT, "manager", KEPT)                                                           \
    X(store_for_finished,                                                                       \
      kvo_manager_prepare_store_for(f->m, f->done, KB(4, 5), POS(64, 80), 2, f->o.indices,      \
                                    f->o.slots, f->o.evicted, MAX_KEYS, &f->o.n_store,          \
                                    &f->o.n_evicted),                                           \
      INVALID_ARGUMENT, "request", KEPT)                                                        \
    X(store_for_never_begun,                                                                    \
      kvo_manager_prepare_store_for(f->m, 0, KB(4, 5), POS(64, 80), 2, f->o.indices,            \
                                    f->o.slots, f->o.evicted, MAX_KEYS, &f->o.n_store,          \
                                    &f->o.n_evicted),                                           \
      INVALID_ARGUMENT, "request", KEPT)                                                        \
    X(store_for_no_keys,                                                                        \
      kvo_manager_prepare_store_for(f->m, f->a, NULL, POS(64, 80), 2, f->o.indices, f->o.slots, \
                                    f->o.evicted, MAX_KEYS, &f->o.n_store, &f->o.n_evicted),    \
      NULL_ARGUMENT, "keys", KEPT)                                                              \
    X(store_for_no_indices,                                                                     \
      kvo_manager_prepare_store_for(f->m, f->a, KB(4, 5), POS(64, 80), 2, NULL, f->o.slots,     \
                                    f->o.evicted, MAX_KEYS, &f->o.n_store, &f->o.n_evicted),    \
      NULL_ARGUMENT, "out_indices", KEPT)                                                       \
    X(store_for_no_slots,                                                                       \
      kvo_manager_prepare_store_for(f->m, f->a, KB(4, 5), POS(64, 80), 2, f->o.indices, NULL,   \
                                    f->o.evicted, MAX_KEYS, &f->o.n_store, &f->o.n_evicted),    \
      NULL_ARGUMENT, "out_slots", KEPT)                                                         \
    X(store_for_no_evicted,                                                                     \
      kvo_manager_prepare_store_for(f->m, f->a, KB(4, 5), POS(64, 80), 2, f->o.indices,         \
                                    f->o.slots, NULL, MAX_KEYS, &f->o.n_store,                  \
                                    &f->o.n_evicted),                                           \
      NULL_ARGUMENT, "out_evicted_keys", KEPT)                                                  \
    X(store_for_no_n_store,                                                                     \
      kvo_manager_prepare_store_for(f->m, f->a, KB(4, 5), POS(64, 80), 2, f->o.indices,         \
                                    f->o.slots, f->o.evicted, MAX_KEYS, NULL, &f->o.n_evicted), \
      NULL_ARGUMENT, "out_n_store", KEPT)                                                       \
    X(store_for_no_n_evicted,                                                                   \
      kvo_manager_prepare_store_for(f->m, f->a, KB(4, 5), POS(64, 80), 2, f->o.indices,         \
                                    f->o.slots, f->o.evicted, MAX_KEYS, &f->o.n_store, NULL),   \
      NULL_ARGUMENT, "out_n_evicted", KEPT)                                                     \
    X(store_for_position_max,                                                                   \
      kvo_manager_prepare_store_for(f->m, f->a, KB(4, 5), POS(UINT64_MAX, 80), 2, f->o.indices, \
                                    f->o.slots, f->o.evicted, MAX_KEYS, &f->o.n_store,          \
                                    &f->o.n_evicted),                                           \
      INVALID_ARGUMENT, "positions[0]", KEPT)                                                   \
    X(store_for_overflow,                                                                       \
      kvo_manager_prepare_store_for(f->m, f->a, KB(4, 5), NULL, OVERFLOW_N, f->o.indices,       \
                                    f->o.slots, f->o.evicted, MAX_KEYS, &f->o.n_store,          \
                                    &f->o.n_evicted),                                           \
      INVALID_ARGUMENT, "n_keys", KEPT)                                                         \
    X(store_for_out_cap, /* writes n_keys to *out_n_store */                                    \
      kvo_manager_prepare_store_for(f->m, f->a, KB(4, 5), POS(64, 80), 2, f->o.indices,         \
                                    f->o.slots, f->o.evicted, 1, &f->o.n_store,                 \
                                    &f->o.n_evicted),                                           \
      BUFFER_TOO_SMALL, "out_cap", f->o.n_store == 2)                                           \
    X(store_for_no_room, /* 3 keys, 1 free slot, 1 evictable key */                             \
      kvo_manager_prepare_store_for(f->m, f->a, KB(4, 5, 6), POS(64, 80, 96), 3, f->o.indices,  \
                                    f->o.slots, f->o.evicted, MAX_KEYS, &f->o.n_store,          \
                                    &f->o.n_evicted),                                           \
      NO_ROOM, NULL, KEPT)
CASE_TABLE(bad_requests, BAD_REQUESTS);

/* The 0.33 manager of BAD_REQUESTS. */
static void setup_requests(fixture *f) {
    memset(f, 0, sizeof *f);
    f->m = new_manager_in(KVO_SEMANTICS_VLLM_0_33, KVO_POLICY_LRU, 4, 1);
    CHECK_OK(kvo_manager_begin_request(f->m, &f->a));
    CHECK_OK(kvo_manager_begin_request(f->m, &f->done));
    CHECK_OK(kvo_manager_finish_request(f->m, f->done));
    CHECK(f->a != f->done && f->a != 0 && f->done != 0);
    store_out o = STORE_FOR(f->m, f->a, POS(16, 32, 48), 1, 2, 3);
    CHECK(o.n_store == 3 && o.n_evicted == 0);
    COMPLETE_STORE(f->m, 1, 1, 2);
    uint32_t slots[MAX_KEYS];
    LOAD_FOR(f->m, f->a, slots, POS(16), 1);
    kvo_manager_stats s = stats(f->m);
    CHECK(s.used == 3 && s.ready == 2 && s.pinned == 1 && s.evictable == 1);
}

static void print_keys(const char *what, const uint8_t *keys, size_t n) {
    uint64_t v[MAX_KEYS];
    for (size_t i = 0; i < n && i < MAX_KEYS; i++) {
        v[i] = get_key(keys + i * KEY_LEN);
    }
    print_got(what, v, n < MAX_KEYS ? n : MAX_KEYS);
}

/* Ends what the setup began (load, store, request) and stores 4 new keys, which evicts every
 * key: returns the events since the setup and the eviction order, as one record. */
typedef struct {
    kvo_event events[MAX_KEYS];
    uint8_t keys[4 * MAX_KEYS * KEY_LEN];
    size_t n_events, n_keys;
    store_out evicting;
} ending;

static ending end_requests(fixture *f) {
    ending e;
    memset(&e, 0, sizeof e);
    COMPLETE_LOAD(f->m, 1);
    COMPLETE_STORE(f->m, 1, 3);
    CHECK_OK(kvo_manager_finish_request(f->m, f->a));
    e.evicting = PREPARE_STORE(f->m, KVO_STATUS_OK, 11, 12, 13, 14);
    CHECK(e.evicting.n_store == 4 && e.evicting.n_evicted == 3);
    CHECK_OK(kvo_manager_take_events(f->m, e.events, MAX_KEYS, e.keys, 4 * MAX_KEYS,
                                     &e.n_events, &e.n_keys));
    check_invariants(f->m, __LINE__);
    return e;
}

/* The request calls' bad inputs change nothing, not even what stats do not show (the requests'
 * records, the recency they commit): afterwards the manager ends as a twin that saw none. */
static void test_bad_requests(void) {
    fixture f, twin;
    setup_requests(&f);
    setup_requests(&twin);
    CHECK(drain_events(f.m) == 1 && drain_events(twin.m) == 1);

    RUN_CASES(&f, &manager_hooks, bad_requests);

    CHECK(LOOKUP(f.m, 3) == KVO_LOOKUP_HIT_PENDING);
    CHECK(LOOKUP(twin.m, 3) == KVO_LOOKUP_HIT_PENDING);
    ending got = end_requests(&f), want = end_requests(&twin);
    int same = memcmp(&got, &want, sizeof got) == 0;
    CHECK(same);
    if (!same) {
        print_keys("evicted after the cases", got.evicting.evicted, got.evicting.n_evicted);
        print_keys("evicted by the twin", want.evicting.evicted, want.evicting.n_evicted);
    }
    kvo_manager_free(f.m);
    kvo_manager_free(twin.m);
}

/* The events of test_vllm033_lru_example: stored {1, 2}, {3}, {4, 5}, removed {5}, stored {6}. */
static void check_example_events(kvo_manager *m) {
    static const uint32_t removed[5] = {0, 0, 0, 1, 0};
    static const uint64_t first[5] = {0, 2, 3, 5, 6}, count[5] = {2, 1, 2, 1, 1};
    kvo_event ev[MAX_KEYS];
    uint8_t keys[MAX_KEYS * KEY_LEN];
    size_t ne = 0, nk = 0;
    CHECK_OK(kvo_manager_take_events(m, ev, MAX_KEYS, keys, MAX_KEYS, &ne, &nk));
    CHECK(ne == 5 && nk == 7);
    for (size_t i = 0; i < ne && i < 5; i++) {
        CHECK(ev[i].removed == removed[i] && ev[i].metadata_only == 0);
        CHECK(ev[i].first_key == first[i] && ev[i].n_keys == count[i]);
    }
    CHECK_KEYS(keys, nk, 1, 2, 3, 4, 5, 5, 6);
}

/* The worked example of vLLM 0.33 LRU (capacity 5): recency is request-scoped and committed when
 * a request finishes, its head newest of all; eviction takes tails before heads. */
static void test_vllm033_lru_example(void) {
    kvo_manager *m = new_manager_in(KVO_SEMANTICS_VLLM_0_33, KVO_POLICY_LRU, 5, 1);
    uint64_t a = 0, b = 0, c = 0;
    uint32_t slots[MAX_KEYS];
    CHECK_OK(kvo_manager_begin_request(m, &a));
    CHECK_OK(kvo_manager_begin_request(m, &b));
    CHECK_OK(kvo_manager_begin_request(m, &c));
    CHECK(a != b && b != c && a != c);

    CHECK(LOOKUP(m, 1) == KVO_LOOKUP_MISS);
    store_out o = STORE_FOR(m, a, POS(16, 32), 1, 2);
    CHECK(o.n_store == 2 && o.n_evicted == 0);
    CHECK_U32(o.slots, o.n_store, 0, 1);
    CHECK(LOOKUP(m, 1) == KVO_LOOKUP_HIT_PENDING);
    COMPLETE_STORE(m, 1, 1, 2);
    o = STORE_FOR(m, a, POS(48), 3);
    CHECK(o.n_store == 1 && o.n_evicted == 0);
    CHECK_U32(o.slots, o.n_store, 2);
    COMPLETE_STORE(m, 1, 3);
    o = STORE_FOR(m, b, POS(16, 32), 4, 5);
    CHECK(o.n_store == 2 && o.n_evicted == 0);
    CHECK_U32(o.slots, o.n_store, 3, 4);
    COMPLETE_STORE(m, 1, 4, 5);
    CHECK_OK(kvo_manager_finish_request(m, a));

    LOAD_FOR(m, c, slots, POS(16, 32), 1, 2);
    CHECK_U32(slots, 2, 0, 1);
    o = STORE_FOR(m, c, POS(48), 6);
    CHECK(o.n_store == 1 && o.n_evicted == 1);
    CHECK_U32(o.slots, o.n_store, 4);
    CHECK_KEYS(o.evicted, o.n_evicted, 5);
    COMPLETE_LOAD(m, 1, 2);
    COMPLETE_STORE(m, 1, 6);
    CHECK_OK(kvo_manager_finish_request(m, c));
    CHECK_OK(kvo_manager_finish_request(m, b));

    check_example_events(m);
    /* Without a request: the oldest first, tails before heads. */
    o = PREPARE_STORE(m, KVO_STATUS_OK, 10, 11, 12, 13, 14);
    CHECK(o.n_store == 5 && o.n_evicted == 5);
    CHECK_KEYS(o.evicted, o.n_evicted, 3, 6, 2, 1, 4);
    check_invariants(m, __LINE__);
    kvo_manager_free(m);
}

static void test_reset(void) {
    kvo_manager *m = new_manager(KVO_POLICY_ARC, 4, 1);
    store_out o = PREPARE_STORE(m, KVO_STATUS_OK, 1, 2, 3, 4);
    CHECK(o.n_store == 4);
    COMPLETE_STORE(m, 1, 1, 2, 3);
    uint32_t slots[MAX_KEYS];
    PREPARE_LOAD(m, slots, KVO_STATUS_OK, 1);
    o = PREPARE_STORE(m, KVO_STATUS_OK, 5); /* evicts 2 or 3 */
    CHECK(o.n_store == 1 && o.n_evicted == 1);
    CHECK(LOOKUP(m, 1) == KVO_LOOKUP_HIT);
    CHECK(drain_events(m) == 2);
    kvo_manager_stats before = stats(m);

    CHECK_OK(kvo_manager_reset(m));
    kvo_manager_stats s = stats(m);
    CHECK(s.capacity == 4 && s.used == 0 && s.ready == 0 && s.evictable == 0);
    CHECK(s.pinned == 0 && s.stores_in_flight == 0);
    CHECK(s.lookups == before.lookups && s.hits == before.hits);
    CHECK(s.evictions == before.evictions);
    CHECK(drain_events(m) == 0); /* reset records no event */
    check_invariants(m, __LINE__);
    for (uint64_t key = 1; key <= 5; key++) {
        CHECK(LOOKUP(m, key) == KVO_LOOKUP_MISS);
    }

    /* Completions from before the reset: ignored (stores) or refused (loads). */
    COMPLETE_STORE(m, 1, 4, 5);
    keys_t k = KEYS(1);
    CHECK_BAD(m, kvo_manager_complete_load(m, k.bytes, k.n), KVO_STATUS_NOT_FOUND, "keys");
    CHECK(stats(m).used == 0);

    /* Every slot is free again. */
    o = PREPARE_STORE(m, KVO_STATUS_OK, 11, 12, 13, 14);
    CHECK(o.n_store == 4 && o.n_evicted == 0);
    COMPLETE_STORE(m, 1, 11, 12, 13, 14);
    s = stats(m);
    CHECK(s.used == 4 && s.ready == 4);
    check_invariants(m, __LINE__);
    kvo_manager_free(m);
}

/* The Prometheus text of a manager: vLLM's usage gauge (store in flight counts as not
 * evictable), the handle and buffer checks. */
static void test_metrics_text(void) {
    kvo_manager *m = new_manager(KVO_POLICY_LRU, 4, 0);
    store_out o = PREPARE_STORE(m, KVO_STATUS_OK, 1, 2);
    CHECK(o.n_store == 2);
    char text[8192];
    size_t len = 0;
    const kvo_label rank[1] = {{"rank", "0"}};
    CHECK_OK(kvo_manager_metrics_text(m, "kvo", rank, 1, text, sizeof text, &len));
    CHECK(len == strlen(text));
    CHECK(strstr(text, "# TYPE kvo_cpu_cache_usage_perc gauge\nkvo_cpu_cache_usage_perc{rank=\"0\"} 0.5\n") != NULL);
    CHECK(strstr(text, "\nkvo_store_in_flight_slots{rank=\"0\"} 2\n") != NULL);
    size_t keep = 5;
    CHECK_STATUS(kvo_manager_metrics_text(NULL, "kvo", NULL, 0, text, sizeof text, &keep),
                 KVO_STATUS_NULL_ARGUMENT, "manager");
    CHECK_STATUS(kvo_manager_metrics_text(m, "kvo", NULL, 0, text, 10, &keep),
                 KVO_STATUS_BUFFER_TOO_SMALL, "cap");
    size_t bare = 0;
    CHECK_OK(kvo_manager_metrics_text(m, "kvo", NULL, 0, text, sizeof text, &bare));
    CHECK(keep == bare && bare < len);
    kvo_manager_free(m);
}

int main(void) {
    test_versions();
    test_config_default();
    test_lru_example();
    test_store_extras();
    test_complete_store_at();
    test_store_threshold();
    test_stats_struct_size();
    test_last_error();
    test_bad_config();
    test_config_older_size();
    test_bad_inputs();
    test_bad_requests();
    test_vllm033_lru_example();
    test_reset();
    test_metrics_text();
    printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
