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

static kvo_manager *new_manager(uint32_t policy, uint64_t num_slots, uint32_t enable_events) {
    kvo_manager_config cfg;
    kvo_manager *m = NULL;
    CHECK_OK(kvo_manager_config_default(&cfg));
    cfg.key_len = KEY_LEN;
    cfg.policy = policy;
    cfg.num_slots = num_slots;
    cfg.enable_events = enable_events;
    CHECK_OK(kvo_manager_new(&cfg, &m));
    CHECK(m != NULL);
    return m;
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

static int stats_eq(const kvo_manager_stats *a, const kvo_manager_stats *b) {
    return a->capacity == b->capacity && a->used == b->used && a->ready == b->ready &&
           a->evictable == b->evictable && a->pinned == b->pinned &&
           a->stores_in_flight == b->stores_in_flight && a->lookups == b->lookups &&
           a->hits == b->hits && a->stores_skipped == b->stores_skipped &&
           a->evictions == b->evictions;
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

static void test_bad_config(void) {
    kvo_manager_config cfg;
    kvo_manager *sentinel = (kvo_manager *)&cfg; /* never dereferenced */
    kvo_manager *m = sentinel;

    CHECK_STATUS(kvo_manager_config_default(NULL), KVO_STATUS_NULL_ARGUMENT, "out");
    CHECK_OK(kvo_manager_config_default(&cfg));
    cfg.key_len = KEY_LEN;
    cfg.num_slots = 4;
    CHECK_STATUS(kvo_manager_new(NULL, &m), KVO_STATUS_NULL_ARGUMENT, "cfg");
    CHECK_STATUS(kvo_manager_new(&cfg, NULL), KVO_STATUS_NULL_ARGUMENT, "out");

    kvo_manager_config bad = cfg;
    bad.struct_size = sizeof bad - 1;
    CHECK_STATUS(kvo_manager_new(&bad, &m), KVO_STATUS_INVALID_ARGUMENT, "struct_size");
    bad.struct_size = 0;
    CHECK_STATUS(kvo_manager_new(&bad, &m), KVO_STATUS_INVALID_ARGUMENT, "struct_size");
    bad = cfg;
    bad.key_len = 0;
    CHECK_STATUS(kvo_manager_new(&bad, &m), KVO_STATUS_INVALID_ARGUMENT, "key_len");
    bad.key_len = KVO_MAX_KEY_LEN + 1;
    CHECK_STATUS(kvo_manager_new(&bad, &m), KVO_STATUS_INVALID_ARGUMENT, "key_len");
    bad = cfg;
    bad.policy = 7;
    CHECK_STATUS(kvo_manager_new(&bad, &m), KVO_STATUS_INVALID_ARGUMENT, "policy");
    bad = cfg;
    bad.num_slots = UINT32_MAX;
    CHECK_STATUS(kvo_manager_new(&bad, &m), KVO_STATUS_INVALID_ARGUMENT, "num_slots");
    bad.policy = KVO_POLICY_ARC; /* ARC also names its ghosts: at most UINT32_MAX / 5 slots */
    bad.num_slots = UINT32_MAX / 5 + 1;
    CHECK_STATUS(kvo_manager_new(&bad, &m), KVO_STATUS_INVALID_ARGUMENT, "num_slots");
    bad = cfg;
    bad.store_threshold = 2;
    bad.max_tracker_size = 0;
    CHECK_STATUS(kvo_manager_new(&bad, &m), KVO_STATUS_INVALID_ARGUMENT, "max_tracker_size");
    CHECK(m == sentinel); /* *out is not written on failure */

    /* A tier whose index cannot be allocated: KVO_STATUS_OUT_OF_MEMORY naming num_slots (with
     * heuristic overcommit, the Linux default, an allocation beyond RAM + swap is refused). */
    FILE *f = fopen("/proc/sys/vm/overcommit_memory", "r");
    int mode = -1;
    if (f != NULL) {
        if (fscanf(f, "%d", &mode) != 1) mode = -1;
        fclose(f);
    }
    if (mode == 0) {
        bad = cfg;
        bad.key_len = KVO_MAX_KEY_LEN;
        bad.num_slots = UINT32_MAX - 1;
        CHECK_STATUS(kvo_manager_new(&bad, &m), KVO_STATUS_OUT_OF_MEMORY, "num_slots");
        CHECK(strstr(last_error(), "cfg->out of memory") == NULL);
        CHECK(m == sentinel);
    } else {
        printf("skipped the out-of-memory check: needs vm.overcommit_memory = 0\n");
    }
}

/* Every bad input fails with its status, names the argument and changes nothing. The manager
 * holds: 1 ready and pinned once, 2 ready and evictable, 3 in flight, one slot free. */
static void test_bad_inputs(void) {
    kvo_manager *m = new_manager(KVO_POLICY_LRU, 4, 1);
    store_out o = PREPARE_STORE(m, KVO_STATUS_OK, 1, 2, 3);
    CHECK(o.n_store == 3);
    COMPLETE_STORE(m, 1, 1, 2);
    uint32_t slots[MAX_KEYS];
    PREPARE_LOAD(m, slots, KVO_STATUS_OK, 1);
    CHECK(drain_events(m) == 1);
    kvo_manager_stats s = stats(m);
    CHECK(s.used == 3 && s.ready == 2 && s.pinned == 1 && s.evictable == 1);
    CHECK(s.stores_in_flight == 1);

    keys_t k12 = KEYS(1, 2);
    uint8_t *keys = k12.bytes;
    uint32_t r = 12345;
    size_t hits = 12345;
    uint32_t retry = 12345;

    /* lookup */
    CHECK_BAD(m, kvo_manager_lookup(NULL, keys, &r), KVO_STATUS_NULL_ARGUMENT, "manager");
    CHECK_BAD(m, kvo_manager_lookup(m, NULL, &r), KVO_STATUS_NULL_ARGUMENT, "key");
    CHECK_BAD(m, kvo_manager_lookup(m, keys, NULL), KVO_STATUS_NULL_ARGUMENT, "out_result");
    CHECK(r == 12345);

    /* lookup_prefix */
    CHECK_BAD(m, kvo_manager_lookup_prefix(NULL, keys, 2, &hits, &retry),
              KVO_STATUS_NULL_ARGUMENT, "manager");
    CHECK_BAD(m, kvo_manager_lookup_prefix(m, NULL, 2, &hits, &retry), KVO_STATUS_NULL_ARGUMENT,
              "keys");
    CHECK_BAD(m, kvo_manager_lookup_prefix(m, keys, 2, NULL, &retry), KVO_STATUS_NULL_ARGUMENT,
              "out_hits");
    CHECK_BAD(m, kvo_manager_lookup_prefix(m, keys, 2, &hits, NULL), KVO_STATUS_NULL_ARGUMENT,
              "out_retry");
    CHECK_BAD(m, kvo_manager_lookup_prefix(m, keys, OVERFLOW_N, &hits, &retry),
              KVO_STATUS_INVALID_ARGUMENT, "n_keys");
    CHECK(hits == 12345 && retry == 12345);

    /* prepare_load */
    for (int i = 0; i < MAX_KEYS; i++) {
        slots[i] = 777;
    }
    CHECK_BAD(m, kvo_manager_prepare_load(NULL, keys, 2, slots, MAX_KEYS),
              KVO_STATUS_NULL_ARGUMENT, "manager");
    CHECK_BAD(m, kvo_manager_prepare_load(m, NULL, 2, slots, MAX_KEYS), KVO_STATUS_NULL_ARGUMENT,
              "keys");
    CHECK_BAD(m, kvo_manager_prepare_load(m, keys, 2, NULL, MAX_KEYS), KVO_STATUS_NULL_ARGUMENT,
              "out_slots");
    CHECK_BAD(m, kvo_manager_prepare_load(m, keys, OVERFLOW_N, slots, MAX_KEYS),
              KVO_STATUS_INVALID_ARGUMENT, "n_keys");
    CHECK_BAD(m, kvo_manager_prepare_load(m, keys, 2, slots, 1), KVO_STATUS_BUFFER_TOO_SMALL,
              "out_slots");
    keys_t k = KEYS(2, 99); /* 2 is stored, 99 is not: 2 must not stay pinned */
    CHECK_BAD(m, kvo_manager_prepare_load(m, k.bytes, k.n, slots, MAX_KEYS),
              KVO_STATUS_NOT_FOUND, "keys");
    k = KEYS(2, 3); /* 3's store is in flight */
    CHECK_BAD(m, kvo_manager_prepare_load(m, k.bytes, k.n, slots, MAX_KEYS),
              KVO_STATUS_INVALID_STATE, "keys");
    int untouched = 1;
    for (int i = 0; i < MAX_KEYS; i++) {
        untouched = untouched && slots[i] == 777;
    }
    CHECK(untouched);

    /* touch */
    CHECK_BAD(m, kvo_manager_touch(NULL, keys, 2), KVO_STATUS_NULL_ARGUMENT, "manager");
    CHECK_BAD(m, kvo_manager_touch(m, NULL, 2), KVO_STATUS_NULL_ARGUMENT, "keys");
    CHECK_BAD(m, kvo_manager_touch(m, keys, OVERFLOW_N), KVO_STATUS_INVALID_ARGUMENT, "n_keys");

    /* complete_load */
    CHECK_BAD(m, kvo_manager_complete_load(NULL, keys, 1), KVO_STATUS_NULL_ARGUMENT, "manager");
    CHECK_BAD(m, kvo_manager_complete_load(m, NULL, 1), KVO_STATUS_NULL_ARGUMENT, "keys");
    CHECK_BAD(m, kvo_manager_complete_load(m, keys, OVERFLOW_N), KVO_STATUS_INVALID_ARGUMENT,
              "n_keys");
    k = KEYS(99);
    CHECK_BAD(m, kvo_manager_complete_load(m, k.bytes, k.n), KVO_STATUS_NOT_FOUND, "keys");
    k = KEYS(2); /* stored, not pinned */
    CHECK_BAD(m, kvo_manager_complete_load(m, k.bytes, k.n), KVO_STATUS_INVALID_STATE, "keys");
    k = KEYS(3); /* in flight, not pinned */
    CHECK_BAD(m, kvo_manager_complete_load(m, k.bytes, k.n), KVO_STATUS_INVALID_STATE, "keys");
    k = KEYS(1, 1); /* pinned once, released twice: the first release must be undone */
    CHECK_BAD(m, kvo_manager_complete_load(m, k.bytes, k.n), KVO_STATUS_INVALID_STATE, "keys");
    k = KEYS(1, 2);
    CHECK_BAD(m, kvo_manager_complete_load(m, k.bytes, k.n), KVO_STATUS_INVALID_STATE, "keys");

    /* prepare_store */
    uint32_t idx[MAX_KEYS], st_slots[MAX_KEYS];
    uint8_t evicted[MAX_KEYS * KEY_LEN];
    size_t n_store = 12345, n_evicted = 12345;
    k = KEYS(4, 5);
    CHECK_BAD(m,
              kvo_manager_prepare_store(NULL, k.bytes, 2, idx, st_slots, evicted, MAX_KEYS,
                                        &n_store, &n_evicted),
              KVO_STATUS_NULL_ARGUMENT, "manager");
    CHECK_BAD(m,
              kvo_manager_prepare_store(m, NULL, 2, idx, st_slots, evicted, MAX_KEYS, &n_store,
                                        &n_evicted),
              KVO_STATUS_NULL_ARGUMENT, "keys");
    CHECK_BAD(m,
              kvo_manager_prepare_store(m, k.bytes, 2, NULL, st_slots, evicted, MAX_KEYS,
                                        &n_store, &n_evicted),
              KVO_STATUS_NULL_ARGUMENT, "out_indices");
    CHECK_BAD(m,
              kvo_manager_prepare_store(m, k.bytes, 2, idx, NULL, evicted, MAX_KEYS, &n_store,
                                        &n_evicted),
              KVO_STATUS_NULL_ARGUMENT, "out_slots");
    CHECK_BAD(m,
              kvo_manager_prepare_store(m, k.bytes, 2, idx, st_slots, NULL, MAX_KEYS, &n_store,
                                        &n_evicted),
              KVO_STATUS_NULL_ARGUMENT, "out_evicted_keys");
    CHECK_BAD(m,
              kvo_manager_prepare_store(m, k.bytes, 2, idx, st_slots, evicted, MAX_KEYS, NULL,
                                        &n_evicted),
              KVO_STATUS_NULL_ARGUMENT, "out_n_store");
    CHECK_BAD(m,
              kvo_manager_prepare_store(m, k.bytes, 2, idx, st_slots, evicted, MAX_KEYS,
                                        &n_store, NULL),
              KVO_STATUS_NULL_ARGUMENT, "out_n_evicted");
    CHECK_BAD(m,
              kvo_manager_prepare_store(m, k.bytes, OVERFLOW_N, idx, st_slots, evicted,
                                        MAX_KEYS, &n_store, &n_evicted),
              KVO_STATUS_INVALID_ARGUMENT, "n_keys");
    CHECK(n_store == 12345 && n_evicted == 12345);
    CHECK_BAD(m,
              kvo_manager_prepare_store(m, k.bytes, 2, idx, st_slots, evicted, 1, &n_store,
                                        &n_evicted),
              KVO_STATUS_BUFFER_TOO_SMALL, "out_cap");
    CHECK(n_store == 2);
    /* 3 keys, 1 free slot, 1 evictable key: no room now. */
    k = KEYS(4, 5, 6);
    CHECK_BAD(m,
              kvo_manager_prepare_store(m, k.bytes, k.n, idx, st_slots, evicted, MAX_KEYS,
                                        &n_store, &n_evicted),
              KVO_STATUS_NO_ROOM, NULL);

    /* complete_store */
    CHECK_BAD(m, kvo_manager_complete_store(NULL, keys, 2, 1), KVO_STATUS_NULL_ARGUMENT,
              "manager");
    CHECK_BAD(m, kvo_manager_complete_store(m, NULL, 2, 1), KVO_STATUS_NULL_ARGUMENT, "keys");
    CHECK_BAD(m, kvo_manager_complete_store(m, keys, OVERFLOW_N, 1),
              KVO_STATUS_INVALID_ARGUMENT, "n_keys");
    /* Unknown and already ready keys are ignored on purpose, with either outcome. */
    k = KEYS(98, 99, 2, 1);
    CHECK_NOOP(m, kvo_manager_complete_store(m, k.bytes, k.n, 1));
    CHECK_NOOP(m, kvo_manager_complete_store(m, k.bytes, k.n, 0));

    /* take_events */
    kvo_event ev[4];
    uint8_t ev_keys[4 * KEY_LEN];
    size_t ne = 12345, nk = 12345;
    CHECK_BAD(m, kvo_manager_take_events(NULL, ev, 4, ev_keys, 4, &ne, &nk),
              KVO_STATUS_NULL_ARGUMENT, "manager");
    CHECK_BAD(m, kvo_manager_take_events(m, ev, 4, ev_keys, 4, NULL, &nk),
              KVO_STATUS_NULL_ARGUMENT, "out_n_events");
    CHECK_BAD(m, kvo_manager_take_events(m, ev, 4, ev_keys, 4, &ne, NULL),
              KVO_STATUS_NULL_ARGUMENT, "out_n_keys");
    CHECK(ne == 12345 && nk == 12345);

    /* get_stats, reset, check_invariants */
    kvo_manager_stats bad;
    memset(&bad, 0, sizeof bad);
    bad.struct_size = sizeof bad;
    CHECK_BAD(m, kvo_manager_get_stats(NULL, &bad), KVO_STATUS_NULL_ARGUMENT, "manager");
    CHECK_BAD(m, kvo_manager_get_stats(m, NULL), KVO_STATUS_NULL_ARGUMENT, "out");
    bad.struct_size = 0;
    CHECK_BAD(m, kvo_manager_get_stats(m, &bad), KVO_STATUS_INVALID_ARGUMENT, "struct_size");
    bad.struct_size = sizeof(size_t) - 1;
    CHECK_BAD(m, kvo_manager_get_stats(m, &bad), KVO_STATUS_INVALID_ARGUMENT, "struct_size");
    CHECK(bad.capacity == 0);
    CHECK_BAD(m, kvo_manager_reset(NULL), KVO_STATUS_NULL_ARGUMENT, "manager");
    CHECK_BAD(m, kvo_manager_check_invariants(NULL), KVO_STATUS_NULL_ARGUMENT, "manager");

    /* No failed call recorded an event, and the keys are as they were. */
    CHECK(drain_events(m) == 0);
    CHECK(LOOKUP(m, 1) == KVO_LOOKUP_HIT);
    CHECK(LOOKUP(m, 2) == KVO_LOOKUP_HIT);
    CHECK(LOOKUP(m, 3) == KVO_LOOKUP_RETRY);
    CHECK(LOOKUP(m, 99) == KVO_LOOKUP_MISS);

    /* The manager still works: release, complete, and everything is evictable. */
    COMPLETE_LOAD(m, 1);
    COMPLETE_STORE(m, 1, 3);
    s = stats(m);
    CHECK(s.used == 3 && s.ready == 3 && s.evictable == 3 && s.pinned == 0);
    CHECK(s.stores_in_flight == 0);
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
    test_bad_inputs();
    test_reset();
    test_metrics_text();
    printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
