/* The checks shared by the C test programs: counters, CHECK for conditions, and check_status
 * for kvo_status results (exact status; a failure's last-error message names the argument; a
 * success leaves no message). Each program prints `N passed, M failed` from the counters.
 * Included once per program (the functions are static). */
#ifndef KVO_TEST_CHECK_H
#define KVO_TEST_CHECK_H

#include "kvoffload.h"

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int passed, failed;

static void check(int ok, int line, const char *what) {
    if (ok) {
        passed++;
    } else {
        failed++;
        printf("FAIL line %d: %s\n", line, what);
    }
}

#define CHECK(cond) check((cond) != 0, __LINE__, #cond)

static char err_buf[512];

/* The calling thread's last error message. */
static const char *last_error(void) {
    (void)kvo_last_error_message(err_buf, sizeof err_buf);
    return err_buf;
}

/* With KVO_STATUS_LOG set, appends "<function> <status>" for each checked call of a kvo_
 * function to that file (tests/c_api.rs compares them with the header's docs). */
static void log_status(const char *what, kvo_status got) {
    const char *path = getenv("KVO_STATUS_LOG");
    size_t n = strspn(what, "abcdefghijklmnopqrstuvwxyz_0123456789");
    if (path == NULL || strncmp(what, "kvo_", 4) != 0 || (what[n] != '(' && what[n] != '\0')) {
        return;
    }
    FILE *f = fopen(path, "a");
    if (f != NULL) {
        fprintf(f, "%.*s %d\n", (int)n, what, (int)got);
        fclose(f);
    }
}

/* `got` must be `want`; a failure must leave a message naming `arg` (when given), a success an
 * empty message. Reads the message first, so call it right after the call being checked. */
static void check_status(kvo_status got, kvo_status want, const char *arg, int line,
                         const char *what) {
    const char *msg = last_error();
    log_status(what, got);
    if (got != want) {
        failed++;
        printf("FAIL line %d: %s returned %d, want %d (last error: \"%s\")\n", line, what,
               (int)got, (int)want, msg);
    } else if (want == KVO_STATUS_OK && msg[0] != '\0') {
        failed++;
        printf("FAIL line %d: %s succeeded but left the message \"%s\"\n", line, what, msg);
    } else if (want != KVO_STATUS_OK && msg[0] == '\0') {
        failed++;
        printf("FAIL line %d: %s failed without a message\n", line, what);
    } else if (arg != NULL && strstr(msg, arg) == NULL) {
        failed++;
        printf("FAIL line %d: %s: message \"%s\" does not name \"%s\"\n", line, what, msg, arg);
    } else {
        passed++;
    }
}

#define CHECK_OK(call) check_status((call), KVO_STATUS_OK, NULL, __LINE__, #call)
#define CHECK_STATUS(call, want, arg) check_status((call), (want), (arg), __LINE__, #call)

/* U64S(1, 2, 3) expands to `array, length`. */
#define U64S(...)                                                                               \
    ((const uint64_t[]){__VA_ARGS__}),                                                          \
        (sizeof((const uint64_t[]){__VA_ARGS__}) / sizeof(uint64_t))

static inline void print_got(const char *what, const uint64_t *got, size_t n) {
    printf("  %s: got {", what);
    for (size_t i = 0; i < n; i++) {
        printf("%s%llu", i ? ", " : "", (unsigned long long)got[i]);
    }
    printf("}\n");
}

/* The first n entries of `got` are exactly `want` (wn entries); prints them otherwise. */
static inline int eq_u32(const uint32_t *got, size_t n, const uint64_t *want, size_t wn) {
    enum { CAP = 256 };
    uint64_t g[CAP];
    int ok = n == wn && n <= CAP;
    for (size_t i = 0; i < n && i < CAP; i++) {
        g[i] = got[i];
        ok = ok && g[i] == want[i];
    }
    if (!ok) {
        print_got("u32 array", g, n < CAP ? n : CAP);
    }
    return ok;
}

/* ---- tables of bad-input cases -------------------------------------------------------------
 * A table lists cases, each ONE call with ONE bad argument: the status the call must return,
 * a word its message must contain (the bad argument's name; NULL: any message), and what must
 * hold afterwards of the outputs it was given (`then`). Calls run on the program's fixture
 * (`struct fixture`, defined by each program that has tables): its `before` hook runs before
 * each case (a snapshot of the object, the outputs reset to their sentinels), its `after` hook
 * after it (nothing changed). A table is written as an X-macro list of rows
 * `X(name, call, STATUS, "arg", then)` (STATUS without its KVO_STATUS_ prefix; `call` and
 * `then` are expressions of `f`, the fixture) and made with CASE_TABLE(table, LIST). */
typedef struct fixture fixture;

/* The `n` bytes at `got` equal those at `want` (a case wrote none of its outputs); prints the
 * first byte written. */
static inline int bytes_kept(const void *got, const void *want, size_t n) {
    const unsigned char *g = (const unsigned char *)got, *w = (const unsigned char *)want;
    for (size_t i = 0; i < n; i++) {
        if (g[i] != w[i]) {
            printf("  output byte %zu written\n", i);
            return 0;
        }
    }
    return 1;
}

typedef struct {
    const char *name;      /* the case, in a word */
    const char *call_text; /* the call as written, starting with the kvo_ function's name */
    kvo_status (*call)(fixture *f);
    kvo_status want;
    const char *arg;
    int (*then)(const fixture *f); /* NULL: nothing more to check */
    const char *then_text;
} bad_case;

typedef struct {
    void (*before)(fixture *f);
    void (*after)(fixture *f, int line, const char *what);
} fixture_hooks;

#define CASE_DEFINE(name, call, want, arg, then)                                                \
    static kvo_status name(fixture *f) {                                                        \
        (void)f;                                                                                \
        return (call);                                                                          \
    }                                                                                           \
    static int name##_then(const fixture *f) {                                                  \
        (void)f;                                                                                \
        return (then);                                                                          \
    }
#define CASE_ROW(name, call, want, arg, then)                                                   \
    {#name, #call, name, KVO_STATUS_##want, arg, name##_then, #then},
/* Defines the functions of the rows of LIST and the array `table` of them. */
#define CASE_TABLE(table, LIST)                                                                 \
    LIST(CASE_DEFINE)                                                                           \
    static const bad_case table[] = {LIST(CASE_ROW)}

/* Runs every case of `cases` (n) on `f`; a failure names the case. */
static inline void run_cases(fixture *f, const fixture_hooks *hooks, const bad_case *cases,
                             size_t n, int line) {
    for (size_t i = 0; i < n; i++) {
        const bad_case *c = &cases[i];
        int failed_before = failed;
        hooks->before(f);
        kvo_status got = c->call(f);
        check_status(got, c->want, c->arg, line, c->call_text);
        if (c->then != NULL) {
            check(c->then(f), line, c->then_text);
        }
        hooks->after(f, line, c->call_text);
        if (failed != failed_before) {
            printf("  (in case %s)\n", c->name);
        }
    }
}
#define RUN_CASES(f, hooks, table)                                                              \
    run_cases((f), (hooks), (table), sizeof(table) / sizeof((table)[0]), __LINE__)

#endif
