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

// With KVO_STATUS_LOG set, appends "<function> <status>" for each checked call of a kvo_
// function to that file (tests/c_api.rs compares them with the header's docs).
[[maybe_unused]] void log_status(const char *what, kvo_status got) {
    const char *path = std::getenv("KVO_STATUS_LOG");
    const std::size_t n = std::strspn(what, "abcdefghijklmnopqrstuvwxyz_0123456789");
    if (path == nullptr || std::strncmp(what, "kvo_", 4) != 0 || what[n] != '(') {
        return;
    }
    if (std::FILE *f = std::fopen(path, "a")) {
        std::fprintf(f, "%.*s %d\n", static_cast<int>(n), what, static_cast<int>(got));
        std::fclose(f);
    }
}

#define CHECK_STATUS(call, want)                                                               \
    do {                                                                                       \
        const kvo_status st_ = (call);                                                         \
        log_status(#call, st_);                                                                \
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
