/* The checks shared by the C test programs: counters, CHECK for conditions, and check_status
 * for kvo_status results (exact status; a failure's last-error message names the argument; a
 * success leaves no message). Each program prints `N passed, M failed` from the counters.
 * Included once per program (the functions are static). */
#ifndef KVO_TEST_CHECK_H
#define KVO_TEST_CHECK_H

#include "kvoffload.h"

#include <stdio.h>
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

/* `got` must be `want`; a failure must leave a message naming `arg` (when given), a success an
 * empty message. Reads the message first, so call it right after the call being checked. */
static void check_status(kvo_status got, kvo_status want, const char *arg, int line,
                         const char *what) {
    const char *msg = last_error();
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

#endif
