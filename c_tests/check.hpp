// The checks shared by the C++ test programs: counters, CHECK for conditions and CHECK_STATUS
// for raw kvo_status results (printing the last error on a mismatch). Each program prints
// `N passed, M failed` from the counters. Included once per program, after kvoffload.hpp, inside
// its anonymous namespace.
#ifndef KVO_TEST_CHECK_HPP
#define KVO_TEST_CHECK_HPP

int passed = 0;
int failed = 0;

void check(bool ok, int line, const char *what) {
    if (ok) {
        ++passed;
    } else {
        ++failed;
        std::printf("FAIL line %d: %s\n", line, what);
    }
}

#define CHECK(cond) check(static_cast<bool>(cond), __LINE__, #cond)

#define CHECK_STATUS(call, want)                                                               \
    do {                                                                                       \
        const kvo_status st_ = (call);                                                         \
        if (st_ == (want)) {                                                                   \
            ++passed;                                                                          \
        } else {                                                                               \
            ++failed;                                                                          \
            std::printf("FAIL line %d: %s returned %d, want %d (%s)\n", __LINE__, #call,       \
                        static_cast<int>(st_), static_cast<int>(want),                         \
                        kvo::last_error_message().c_str());                                    \
        }                                                                                      \
    } while (0)
#define CHECK_OK(call) CHECK_STATUS(call, KVO_STATUS_OK)

#endif
