/* kvoffload.hpp: header-only C++17 wrappers over the C API of kvoffload.h.
 *
 * - Handles (kvo::Manager, kvo::Scheduler, kvo::Step, kvo::Worker) are move-only and free their
 *   C handle exactly once.
 * - Every fallible call comes twice: `try_x(...)` returns a kvo::Result<T> (the status, the
 *   library's message, and the value on success) and never throws; `x(...)` returns the value
 *   and throws kvo::Error (status + message) on failure. Without exceptions (-fno-exceptions)
 *   only the try_ forms exist, and Result::value() on a failure prints the message and aborts.
 * - Inputs are kvo::Span<T> (pointer + length; converts from std::vector, std::array, C arrays,
 *   std::span, or a pointer and a length). Keys are flat byte buffers of whole keys of the handle's
 *   key_len, checked here before the C call.
 * - Thread-safety is the C API's: any thread may call; each handle serializes its own calls;
 *   destroying (or moving from) a handle must not race with other calls on it.
 */
#ifndef KVOFFLOAD_HPP
#define KVOFFLOAD_HPP

#include "kvoffload.h"

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#ifndef KVO_HPP_EXCEPTIONS
#if defined(__cpp_exceptions) || defined(__EXCEPTIONS) || defined(_CPPUNWIND)
#define KVO_HPP_EXCEPTIONS 1
#else
#define KVO_HPP_EXCEPTIONS 0
#endif
#endif

#if KVO_HPP_EXCEPTIONS
#include <stdexcept>
#endif

namespace kvo {

/// A view of `size()` contiguous elements (std::span's subset for C++17). It does not own them:
/// pass it to a call, do not keep it.
template <class T>
class Span {
public:
    constexpr Span() noexcept = default;
    constexpr Span(T *data, std::size_t size) noexcept : data_(data), size_(size) {}
    template <std::size_t N>
    constexpr Span(T (&array)[N]) noexcept : data_(array), size_(N) {}
    /// Any contiguous container whose data() converts to T*: std::vector, std::array,
    /// std::span.
    template <class C,
              class = std::enable_if_t<
                  !std::is_same_v<std::decay_t<C>, Span> &&
                  std::is_convertible_v<decltype(std::declval<C &>().data()), T *>>>
    constexpr Span(C &&c) noexcept : data_(c.data()), size_(c.size()) {}

    constexpr T *data() const noexcept { return data_; }
    constexpr std::size_t size() const noexcept { return size_; }
    constexpr bool empty() const noexcept { return size_ == 0; }
    constexpr T *begin() const noexcept { return data_; }
    constexpr T *end() const noexcept { return data_ + size_; }
    constexpr T &operator[](std::size_t i) const noexcept { return data_[i]; }

private:
    T *data_ = nullptr;
    std::size_t size_ = 0;
};

/// Flat key bytes: `n * key_len` bytes, key after key.
using Keys = Span<const std::uint8_t>;

/// Constant labels of the metrics text, in order: {{"engine", "0"}, {"rank", "1"}}.
using Labels = std::vector<std::pair<std::string, std::string>>;

/// The calling thread's last error message (empty after a successful call).
inline std::string last_error_message() {
    const std::size_t n = kvo_last_error_message(nullptr, 0);
    std::string msg(n + 1, '\0');
    (void)kvo_last_error_message(&msg[0], msg.size());
    msg.resize(n);
    return msg;
}

/// The library's ABI version (compare with KVO_ABI_VERSION of this header).
inline std::uint32_t abi_version() noexcept { return kvo_abi_version(); }
/// True when the loaded library has this header's ABI.
inline bool abi_compatible() noexcept { return kvo_abi_version() == KVO_ABI_VERSION; }
/// The library version string.
inline const char *version() noexcept { return kvo_version(); }
/// True when a CUDA driver and device are usable.
inline bool cuda_available() noexcept { return kvo_cuda_available() != 0; }

/// The outcome of a call: KVO_STATUS_OK, or a status with the library's message.
class Status {
public:
    Status() = default;
    Status(kvo_status code, std::string message) : code_(code), message_(std::move(message)) {}
    /// The status of a C call just made: its message is the calling thread's last error.
    static Status of(kvo_status code) {
        return code == KVO_STATUS_OK ? Status() : Status(code, last_error_message());
    }
    bool ok() const noexcept { return code_ == KVO_STATUS_OK; }
    kvo_status code() const noexcept { return code_; }
    const std::string &message() const noexcept { return message_; }

private:
    kvo_status code_ = KVO_STATUS_OK;
    std::string message_;
};

#if KVO_HPP_EXCEPTIONS
/// A failed call: its status and the library's message (what()).
class Error : public std::runtime_error {
public:
    explicit Error(const Status &s) : std::runtime_error(s.message()), status_(s.code()) {}
    kvo_status status() const noexcept { return status_; }

private:
    kvo_status status_;
};
#endif

namespace detail {
[[noreturn]] inline void fail(const Status &s) {
#if KVO_HPP_EXCEPTIONS
    throw Error(s);
#else
    std::fprintf(stderr, "kvoffload: status %d: %s\n", static_cast<int>(s.code()),
                 s.message().c_str());
    std::abort();
#endif
}
}  // namespace detail

/// A value or the status of the failure. value() on a failure throws kvo::Error (aborts without
/// exceptions): test ok() first in code built without them.
template <class T>
class [[nodiscard]] Result {
public:
    Result(T value) : value_(std::move(value)) {}
    Result(Status status) : status_(std::move(status)) {}
    bool ok() const noexcept { return status_.ok(); }
    const Status &status() const noexcept { return status_; }
    T &value() & {
        if (!ok()) detail::fail(status_);
        return *value_;
    }
    const T &value() const & {
        if (!ok()) detail::fail(status_);
        return *value_;
    }
    T value() && {
        if (!ok()) detail::fail(status_);
        return std::move(*value_);
    }

private:
    Status status_;
    std::optional<T> value_;
};

/// The outcome of a call without a value.
template <>
class [[nodiscard]] Result<void> {
public:
    Result() = default;
    Result(Status status) : status_(std::move(status)) {}
    bool ok() const noexcept { return status_.ok(); }
    const Status &status() const noexcept { return status_; }
    void value() const {
        if (!ok()) detail::fail(status_);
    }

private:
    Status status_;
};

namespace detail {

inline Result<void> call(kvo_status code) { return Status::of(code); }

inline Status invalid(std::string message) {
    return Status(KVO_STATUS_INVALID_ARGUMENT, std::move(message));
}

/// The number of keys in `keys`, or an INVALID_ARGUMENT status naming `what`.
inline Result<std::size_t> key_count(Keys keys, std::uint32_t key_len, const char *what) {
    if (key_len == 0 || keys.size() % key_len != 0) {
        return invalid(std::string(what) + ": " + std::to_string(keys.size()) +
                       " bytes are not whole keys of " + std::to_string(key_len) + " bytes");
    }
    return keys.size() / key_len;
}

/// Move-only owner of a C handle; frees it exactly once.
template <class H, void (*Free)(H *)>
class Handle {
public:
    Handle() = default;
    explicit Handle(H *p) noexcept : p_(p) {}
    Handle(Handle &&o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
    Handle &operator=(Handle &&o) noexcept {
        if (this != &o) {
            Free(p_);
            p_ = std::exchange(o.p_, nullptr);
        }
        return *this;
    }
    Handle(const Handle &) = delete;
    Handle &operator=(const Handle &) = delete;
    ~Handle() { Free(p_); }
    H *get() const noexcept { return p_; }

private:
    H *p_ = nullptr;
};

/// Renders metrics text with `render` (a kvo_*_metrics_text call), growing the buffer until the
/// text fits (counters may grow between the calls).
template <class F>
Result<std::string> metrics_text(const std::string &prefix, const Labels &labels, F render) {
    std::vector<kvo_label> ls;
    ls.reserve(labels.size());
    for (const auto &l : labels) {
        ls.push_back(kvo_label{l.first.c_str(), l.second.c_str()});
    }
    std::string text(4096, '\0');
    for (;;) {
        std::size_t len = 0;
        const kvo_status st =
            render(prefix.c_str(), ls.data(), ls.size(), &text[0], text.size(), &len);
        if (st == KVO_STATUS_OK) {
            text.resize(len);
            return text;
        }
        if (st != KVO_STATUS_BUFFER_TOO_SMALL) {
            return Status::of(st);
        }
        text.assign(len + len / 4 + 64, '\0');
    }
}

struct Events {
    /// The events, oldest first; event i's keys are keys[first_key .. first_key + n_keys).
    std::vector<kvo_event> events;
    /// Their keys, back to back (key_len bytes each).
    std::vector<std::uint8_t> keys;
};

/// Takes buffered events with `take` (a kvo_*_take_events call), sized by asking first.
template <class F>
Result<Events> take_events(std::uint32_t key_len, F take) {
    Events e;
    for (;;) {
        std::size_t n_events = 0, n_keys = 0;
        const kvo_status st = take(e.events.data(), e.events.size(), e.keys.data(),
                                   e.keys.size() / key_len, &n_events, &n_keys);
        if (st == KVO_STATUS_OK) {
            e.events.resize(n_events);
            e.keys.resize(n_keys * key_len);
            return e;
        }
        if (st != KVO_STATUS_BUFFER_TOO_SMALL) {
            return Status::of(st);
        }
        e.events.resize(n_events);
        e.keys.resize(n_keys * key_len);
    }
}

}  // namespace detail

using Events = detail::Events;

/// The answer of a prefix lookup.
struct PrefixHits {
    /// Leading keys stored.
    std::size_t hits = 0;
    /// A key's store is in flight: ask again later.
    bool retry = false;
};

/// The answer of prepare_store. `no_room` is a normal answer (retry on a later step), not an
/// error: then nothing else is filled.
struct StorePlan {
    bool no_room = false;
    /// Indices into the keys passed, of the keys to store.
    std::vector<std::uint32_t> indices;
    /// Their host slots.
    std::vector<std::uint32_t> slots;
    /// Keys evicted for them, back to back.
    std::vector<std::uint8_t> evicted_keys;
};

/// A request's access record with KVO_SEMANTICS_VLLM_0_33 (Manager::begin_request), valid
/// until Manager::finish_request on the manager that began it.
struct Request {
    std::uint64_t id = 0;
};

/// An offload tier index (kvo_manager). Its semantics (vLLM 0.24 or 0.33) is the config's
/// `semantics` field.
class Manager {
public:
    /// The defaults of kvo_manager_config (struct_size set).
    static kvo_manager_config default_config() noexcept {
        kvo_manager_config c{};
        const kvo_status st = kvo_manager_config_default(&c);  // fails only for NULL
        (void)st;
        return c;
    }
    static Result<Manager> try_create(const kvo_manager_config &cfg) {
        kvo_manager *p = nullptr;
        const kvo_status st = kvo_manager_new(&cfg, &p);
        if (st != KVO_STATUS_OK) return Status::of(st);
        return Manager(p, cfg.key_len, cfg.semantics);
    }

    kvo_manager *get() const noexcept { return h_.get(); }
    std::uint32_t key_len() const noexcept { return key_len_; }
    /// The vLLM release whose semantics it follows (a kvo_semantics value).
    std::uint32_t semantics() const noexcept { return semantics_; }

    Result<kvo_lookup> try_lookup(Keys key) {
        if (key.size() != key_len_) {
            return detail::invalid("key: " + std::to_string(key.size()) + " bytes, key_len is " +
                                   std::to_string(key_len_));
        }
        std::uint32_t r = 0;
        const kvo_status st = kvo_manager_lookup(get(), key.data(), &r);
        if (st != KVO_STATUS_OK) return Status::of(st);
        return static_cast<kvo_lookup>(r);
    }
    Result<PrefixHits> try_lookup_prefix(Keys keys) {
        auto n = detail::key_count(keys, key_len_, "keys");
        if (!n.ok()) return n.status();
        PrefixHits out;
        std::uint32_t retry = 0;
        const kvo_status st =
            kvo_manager_lookup_prefix(get(), keys.data(), n.value(), &out.hits, &retry);
        if (st != KVO_STATUS_OK) return Status::of(st);
        out.retry = retry != 0;
        return out;
    }
    /// Pins the keys for a load; their slots in input order.
    Result<std::vector<std::uint32_t>> try_prepare_load(Keys keys) {
        auto n = detail::key_count(keys, key_len_, "keys");
        if (!n.ok()) return n.status();
        return load(n.value(), [&](std::uint32_t *slots, std::size_t cap) {
            return kvo_manager_prepare_load(get(), keys.data(), n.value(), slots, cap);
        });
    }
    /// prepare_load for `request`, with the keys' positions (tokens up to the end of each key's
    /// block; empty: none): see kvo_manager_prepare_load_for.
    Result<std::vector<std::uint32_t>> try_prepare_load(Request request, Keys keys,
                                                        Span<const std::uint64_t> positions = {}) {
        auto n = detail::key_count(keys, key_len_, "keys");
        if (!n.ok()) return n.status();
        const Status bad = check_positions(positions, n.value());
        if (!bad.ok()) return bad;
        return load(n.value(), [&](std::uint32_t *slots, std::size_t cap) {
            return kvo_manager_prepare_load_for(get(), request.id, keys.data(),
                                                positions_or_null(positions), n.value(), slots,
                                                cap);
        });
    }
    Result<void> try_touch(Keys keys) {
        auto n = detail::key_count(keys, key_len_, "keys");
        if (!n.ok()) return n.status();
        return detail::call(kvo_manager_touch(get(), keys.data(), n.value()));
    }
    Result<void> try_complete_load(Keys keys) {
        auto n = detail::key_count(keys, key_len_, "keys");
        if (!n.ok()) return n.status();
        return detail::call(kvo_manager_complete_load(get(), keys.data(), n.value()));
    }
    Result<StorePlan> try_prepare_store(Keys keys) {
        auto n = detail::key_count(keys, key_len_, "keys");
        if (!n.ok()) return n.status();
        return store(n.value(), [&](std::uint32_t *indices, std::uint32_t *slots,
                                    std::uint8_t *evicted, std::size_t cap, std::size_t *n_store,
                                    std::size_t *n_evicted) {
            return kvo_manager_prepare_store(get(), keys.data(), n.value(), indices, slots,
                                             evicted, cap, n_store, n_evicted);
        });
    }
    /// prepare_store for `request`, with the keys' positions (empty: none): see
    /// kvo_manager_prepare_store_for.
    Result<StorePlan> try_prepare_store(Request request, Keys keys,
                                        Span<const std::uint64_t> positions = {}) {
        auto n = detail::key_count(keys, key_len_, "keys");
        if (!n.ok()) return n.status();
        const Status bad = check_positions(positions, n.value());
        if (!bad.ok()) return bad;
        return store(n.value(), [&](std::uint32_t *indices, std::uint32_t *slots,
                                    std::uint8_t *evicted, std::size_t cap, std::size_t *n_store,
                                    std::size_t *n_evicted) {
            return kvo_manager_prepare_store_for(get(), request.id, keys.data(),
                                                 positions_or_null(positions), n.value(), indices,
                                                 slots, evicted, cap, n_store, n_evicted);
        });
    }
    /// Begins a request (vLLM 0.33 on_new_request); end it with finish_request.
    Result<Request> try_begin_request() {
        Request r;
        const kvo_status st = kvo_manager_begin_request(get(), &r.id);
        if (st != KVO_STATUS_OK) return Status::of(st);
        return r;
    }
    /// Finishes `request` (vLLM 0.33 on_request_finished): commits its recency to the policy.
    Result<void> try_finish_request(Request request) {
        return detail::call(kvo_manager_finish_request(get(), request.id));
    }
    Result<void> try_complete_store(Keys keys, bool success) {
        auto n = detail::key_count(keys, key_len_, "keys");
        if (!n.ok()) return n.status();
        return detail::call(
            kvo_manager_complete_store(get(), keys.data(), n.value(), success ? 1 : 0));
    }
    /// complete_store with the slots prepare_store gave (slots[i] for key i).
    Result<void> try_complete_store_at(Keys keys, Span<const std::uint32_t> slots, bool success) {
        auto n = detail::key_count(keys, key_len_, "keys");
        if (!n.ok()) return n.status();
        if (slots.size() != n.value()) {
            return detail::invalid("slots: " + std::to_string(slots.size()) + " for " +
                                   std::to_string(n.value()) + " keys");
        }
        return detail::call(kvo_manager_complete_store_at(get(), keys.data(), slots.data(),
                                                          n.value(), success ? 1 : 0));
    }
    Result<Events> try_take_events() {
        kvo_manager *m = get();
        return detail::take_events(key_len_, [m](kvo_event *ev, std::size_t ecap, std::uint8_t *k,
                                                 std::size_t kcap, std::size_t *ne,
                                                 std::size_t *nk) {
            return kvo_manager_take_events(m, ev, ecap, k, kcap, ne, nk);
        });
    }
    Result<kvo_manager_stats> try_stats() const {
        kvo_manager_stats s{};
        s.struct_size = sizeof s;
        const kvo_status st = kvo_manager_get_stats(get(), &s);
        if (st != KVO_STATUS_OK) return Status::of(st);
        return s;
    }
    Result<void> try_reset() { return detail::call(kvo_manager_reset(get())); }
    Result<void> try_check_invariants() const {
        return detail::call(kvo_manager_check_invariants(get()));
    }
    /// The Prometheus text (see kvo_manager_metrics_text).
    Result<std::string> try_metrics_text(const std::string &prefix,
                                         const Labels &labels = {}) const {
        const kvo_manager *m = get();
        return detail::metrics_text(prefix, labels,
                                    [m](const char *p, const kvo_label *l, std::size_t n,
                                        char *buf, std::size_t cap, std::size_t *len) {
                                        return kvo_manager_metrics_text(m, p, l, n, buf, cap, len);
                                    });
    }

#if KVO_HPP_EXCEPTIONS
    static Manager create(const kvo_manager_config &cfg) { return try_create(cfg).value(); }
    kvo_lookup lookup(Keys key) { return try_lookup(key).value(); }
    PrefixHits lookup_prefix(Keys keys) { return try_lookup_prefix(keys).value(); }
    std::vector<std::uint32_t> prepare_load(Keys keys) { return try_prepare_load(keys).value(); }
    void touch(Keys keys) { try_touch(keys).value(); }
    void complete_load(Keys keys) { try_complete_load(keys).value(); }
    StorePlan prepare_store(Keys keys) { return try_prepare_store(keys).value(); }
    std::vector<std::uint32_t> prepare_load(Request request, Keys keys,
                                            Span<const std::uint64_t> positions = {}) {
        return try_prepare_load(request, keys, positions).value();
    }
    StorePlan prepare_store(Request request, Keys keys, Span<const std::uint64_t> positions = {}) {
        return try_prepare_store(request, keys, positions).value();
    }
    Request begin_request() { return try_begin_request().value(); }
    void finish_request(Request request) { try_finish_request(request).value(); }
    void complete_store(Keys keys, bool success) { try_complete_store(keys, success).value(); }
    void complete_store_at(Keys keys, Span<const std::uint32_t> slots, bool success) {
        try_complete_store_at(keys, slots, success).value();
    }
    Events take_events() { return try_take_events().value(); }
    kvo_manager_stats stats() const { return try_stats().value(); }
    void reset() { try_reset().value(); }
    void check_invariants() const { try_check_invariants().value(); }
    std::string metrics_text(const std::string &prefix, const Labels &labels = {}) const {
        return try_metrics_text(prefix, labels).value();
    }
#endif

private:
    Manager(kvo_manager *p, std::uint32_t key_len, std::uint32_t semantics) noexcept
        : h_(p), key_len_(key_len), semantics_(semantics) {}

    static Status check_positions(Span<const std::uint64_t> positions, std::size_t n_keys) {
        if (positions.empty() || positions.size() == n_keys) return Status();
        return detail::invalid("positions: " + std::to_string(positions.size()) + " for " +
                               std::to_string(n_keys) + " keys");
    }
    static const std::uint64_t *positions_or_null(Span<const std::uint64_t> positions) noexcept {
        return positions.empty() ? nullptr : positions.data();
    }
    /// Runs a prepare_load call `f(slots, cap)` for `n` keys.
    template <class F>
    static Result<std::vector<std::uint32_t>> load(std::size_t n, F f) {
        std::vector<std::uint32_t> slots(n);
        const kvo_status st = f(slots.data(), slots.size());
        if (st != KVO_STATUS_OK) return Status::of(st);
        return slots;
    }
    /// Runs a prepare_store call `f(indices, slots, evicted, cap, n_store, n_evicted)` for `n`
    /// keys; NO_ROOM is the answer StorePlan::no_room.
    template <class F>
    Result<StorePlan> store(std::size_t n, F f) const {
        StorePlan p;
        p.indices.resize(n);
        p.slots.resize(n);
        p.evicted_keys.resize(n * key_len_);
        std::size_t n_store = 0, n_evicted = 0;
        const kvo_status st =
            f(p.indices.data(), p.slots.data(), p.evicted_keys.data(), n, &n_store, &n_evicted);
        if (st == KVO_STATUS_NO_ROOM) {
            StorePlan none;
            none.no_room = true;
            return none;
        }
        if (st != KVO_STATUS_OK) return Status::of(st);
        p.indices.resize(n_store);
        p.slots.resize(n_store);
        p.evicted_keys.resize(n_evicted * key_len_);
        return p;
    }

    detail::Handle<kvo_manager, kvo_manager_free> h_;
    std::uint32_t key_len_ = 0;
    std::uint32_t semantics_ = KVO_SEMANTICS_VLLM_0_24;
};

/// A step plan (kvo_step): filled by Scheduler::build_step or decode.
class Step {
public:
    /// A job's block ids.
    struct Blocks {
        std::vector<std::uint32_t> src, dst;
    };

    static Result<Step> try_create() {
        kvo_step *p = nullptr;
        const kvo_status st = kvo_step_new(&p);
        if (st != KVO_STATUS_OK) return Status::of(st);
        return Step(p);
    }

    kvo_step *get() const noexcept { return h_.get(); }

    Result<kvo_step_info> try_info() const {
        kvo_step_info i{};
        const kvo_status st = kvo_step_get_info(get(), &i);
        if (st != KVO_STATUS_OK) return Status::of(st);
        return i;
    }
    Result<kvo_job_info> try_job(std::size_t index) const {
        kvo_job_info j{};
        const kvo_status st = kvo_step_get_job(get(), index, &j);
        if (st != KVO_STATUS_OK) return Status::of(st);
        return j;
    }
    Result<Blocks> try_job_blocks(std::size_t index) const {
        auto j = try_job(index);
        if (!j.ok()) return j.status();
        Blocks b;
        b.src.resize(j.value().n_src);
        b.dst.resize(j.value().n_dst);
        const kvo_status st = kvo_step_get_job_blocks(get(), index, b.src.data(), b.src.size(),
                                                      b.dst.data(), b.dst.size());
        if (st != KVO_STATUS_OK) return Status::of(st);
        return b;
    }
    /// Job ids to wait for before the forward pass.
    Result<std::vector<std::uint64_t>> try_flush() const {
        auto i = try_info();
        if (!i.ok()) return i.status();
        std::vector<std::uint64_t> ids(i.value().num_flush);
        std::size_t n = 0;
        const kvo_status st = kvo_step_get_flush(get(), ids.data(), ids.size(), &n);
        if (st != KVO_STATUS_OK) return Status::of(st);
        ids.resize(n);
        return ids;
    }
    /// The plan's bytes for another process.
    Result<std::vector<std::uint8_t>> try_encode() const {
        std::size_t len = 0;
        kvo_status st = kvo_step_encode(get(), nullptr, 0, &len);
        if (st != KVO_STATUS_OK && st != KVO_STATUS_BUFFER_TOO_SMALL) return Status::of(st);
        std::vector<std::uint8_t> bytes(len);
        st = kvo_step_encode(get(), bytes.data(), bytes.size(), &len);
        if (st != KVO_STATUS_OK) return Status::of(st);
        bytes.resize(len);
        return bytes;
    }
    Result<void> try_decode(Span<const std::uint8_t> bytes) {
        return detail::call(kvo_step_decode(get(), bytes.data(), bytes.size()));
    }

#if KVO_HPP_EXCEPTIONS
    static Step create() { return try_create().value(); }
    kvo_step_info info() const { return try_info().value(); }
    kvo_job_info job(std::size_t index) const { return try_job(index).value(); }
    Blocks job_blocks(std::size_t index) const { return try_job_blocks(index).value(); }
    std::vector<std::uint64_t> flush() const { return try_flush().value(); }
    std::vector<std::uint8_t> encode() const { return try_encode().value(); }
    void decode(Span<const std::uint8_t> bytes) { try_decode(bytes).value(); }
#endif

private:
    explicit Step(kvo_step *p) noexcept : h_(p) {}
    detail::Handle<kvo_step, kvo_step_free> h_;
};

/// The tokens a failed load left to recompute: [from_token, to_token).
struct LoadFailure {
    std::uint64_t from_token = 0, to_token = 0;
};

/// The scheduler side of KV offloading (kvo_scheduler).
class Scheduler {
public:
    static kvo_scheduler_config default_config() noexcept {
        kvo_scheduler_config c{};
        const kvo_status st = kvo_scheduler_config_default(&c);  // fails only for NULL
        (void)st;
        return c;
    }
    static Result<Scheduler> try_create(const kvo_scheduler_config &cfg) {
        kvo_scheduler *p = nullptr;
        const kvo_status st = kvo_scheduler_new(&cfg, &p);
        if (st != KVO_STATUS_OK) return Status::of(st);
        return Scheduler(p, cfg.key_len, cfg.semantics);
    }

    kvo_scheduler *get() const noexcept { return h_.get(); }
    std::uint32_t key_len() const noexcept { return key_len_; }
    /// The vLLM release whose semantics it follows (a kvo_semantics value).
    std::uint32_t semantics() const noexcept { return semantics_; }

    Result<void> try_add_request(std::uint64_t request_id, std::uint64_t prompt_tokens,
                                 std::uint64_t max_offload_tokens = KVO_NO_LIMIT) {
        return detail::call(
            kvo_scheduler_add_request(get(), request_id, prompt_tokens, max_offload_tokens));
    }
    Result<void> try_append_block_hashes(std::uint64_t request_id, Keys hashes,
                                         std::uint64_t num_tokens) {
        auto n = detail::key_count(hashes, key_len_, "hashes");
        if (!n.ok()) return n.status();
        return detail::call(kvo_scheduler_append_block_hashes(get(), request_id, hashes.data(),
                                                              n.value(), num_tokens));
    }
    Result<kvo_match_result> try_match(std::uint64_t request_id,
                                       std::uint64_t num_computed_tokens) {
        kvo_match_result r{};
        const kvo_status st = kvo_scheduler_match(get(), request_id, num_computed_tokens, &r);
        if (st != KVO_STATUS_OK) return Status::of(st);
        return r;
    }
    /// Records the request's GPU blocks; with external tokens, the id of its load job.
    Result<std::optional<std::uint64_t>> try_on_alloc(std::uint64_t request_id,
                                                      Span<const std::uint32_t> block_ids,
                                                      std::uint64_t num_external_tokens) {
        std::uint32_t has_job = 0;
        std::uint64_t job_id = 0;
        const kvo_status st =
            kvo_scheduler_on_alloc(get(), request_id, block_ids.data(), block_ids.size(),
                                   num_external_tokens, &has_job, &job_id);
        if (st != KVO_STATUS_OK) return Status::of(st);
        return has_job ? std::optional<std::uint64_t>(job_id) : std::nullopt;
    }
    Result<void> try_build_step(Span<const kvo_scheduled_request> scheduled,
                                Span<const std::uint64_t> preempted, Step &step) {
        return detail::call(kvo_scheduler_build_step(get(), scheduled.data(), scheduled.size(),
                                                     preempted.data(), preempted.size(),
                                                     step.get()));
    }
    Result<void> try_complete_jobs(Span<const kvo_job_report> reports) {
        return detail::call(kvo_scheduler_complete_jobs(get(), reports.data(), reports.size()));
    }
    Result<void> try_finish_request(std::uint64_t request_id) {
        return detail::call(kvo_scheduler_finish_request(get(), request_id));
    }
    /// The tokens to recompute after the request's last load failed, if it failed.
    Result<std::optional<LoadFailure>> try_load_failure(std::uint64_t request_id) const {
        std::uint32_t failed = 0;
        LoadFailure f;
        const kvo_status st = kvo_scheduler_load_failure(get(), request_id, &failed,
                                                         &f.from_token, &f.to_token);
        if (st != KVO_STATUS_OK) return Status::of(st);
        return failed ? std::optional<LoadFailure>(f) : std::nullopt;
    }
    Result<void> try_reset() { return detail::call(kvo_scheduler_reset(get())); }
    Result<Events> try_take_events() {
        kvo_scheduler *s = get();
        return detail::take_events(key_len_, [s](kvo_event *ev, std::size_t ecap, std::uint8_t *k,
                                                 std::size_t kcap, std::size_t *ne,
                                                 std::size_t *nk) {
            return kvo_scheduler_take_events(s, ev, ecap, k, kcap, ne, nk);
        });
    }
    Result<kvo_scheduler_stats> try_stats() const {
        kvo_scheduler_stats s{};
        s.struct_size = sizeof s;
        const kvo_status st = kvo_scheduler_get_stats(get(), &s);
        if (st != KVO_STATUS_OK) return Status::of(st);
        return s;
    }
    Result<void> try_check_invariants() const {
        return detail::call(kvo_scheduler_check_invariants(get()));
    }
    /// The Prometheus text, the tier's metrics included (see kvo_scheduler_metrics_text).
    Result<std::string> try_metrics_text(const std::string &prefix,
                                         const Labels &labels = {}) const {
        const kvo_scheduler *s = get();
        return detail::metrics_text(prefix, labels,
                                    [s](const char *p, const kvo_label *l, std::size_t n,
                                        char *buf, std::size_t cap, std::size_t *len) {
                                        return kvo_scheduler_metrics_text(s, p, l, n, buf, cap,
                                                                          len);
                                    });
    }

#if KVO_HPP_EXCEPTIONS
    static Scheduler create(const kvo_scheduler_config &cfg) { return try_create(cfg).value(); }
    void add_request(std::uint64_t request_id, std::uint64_t prompt_tokens,
                     std::uint64_t max_offload_tokens = KVO_NO_LIMIT) {
        try_add_request(request_id, prompt_tokens, max_offload_tokens).value();
    }
    void append_block_hashes(std::uint64_t request_id, Keys hashes, std::uint64_t num_tokens) {
        try_append_block_hashes(request_id, hashes, num_tokens).value();
    }
    kvo_match_result match(std::uint64_t request_id, std::uint64_t num_computed_tokens) {
        return try_match(request_id, num_computed_tokens).value();
    }
    std::optional<std::uint64_t> on_alloc(std::uint64_t request_id,
                                          Span<const std::uint32_t> block_ids,
                                          std::uint64_t num_external_tokens) {
        return try_on_alloc(request_id, block_ids, num_external_tokens).value();
    }
    void build_step(Span<const kvo_scheduled_request> scheduled,
                    Span<const std::uint64_t> preempted, Step &step) {
        try_build_step(scheduled, preempted, step).value();
    }
    void complete_jobs(Span<const kvo_job_report> reports) { try_complete_jobs(reports).value(); }
    void finish_request(std::uint64_t request_id) { try_finish_request(request_id).value(); }
    std::optional<LoadFailure> load_failure(std::uint64_t request_id) const {
        return try_load_failure(request_id).value();
    }
    void reset() { try_reset().value(); }
    Events take_events() { return try_take_events().value(); }
    kvo_scheduler_stats stats() const { return try_stats().value(); }
    void check_invariants() const { try_check_invariants().value(); }
    std::string metrics_text(const std::string &prefix, const Labels &labels = {}) const {
        return try_metrics_text(prefix, labels).value();
    }
#endif

private:
    Scheduler(kvo_scheduler *p, std::uint32_t key_len, std::uint32_t semantics) noexcept
        : h_(p), key_len_(key_len), semantics_(semantics) {}
    detail::Handle<kvo_scheduler, kvo_scheduler_free> h_;
    std::uint32_t key_len_ = 0;
    std::uint32_t semantics_ = KVO_SEMANTICS_VLLM_0_24;
};

/// A host tier buffer of a worker: valid until the worker is destroyed.
struct HostBuffer {
    void *ptr = nullptr;
    std::size_t len = 0;
};

/// Block copies between registered KV tensors and the host tier (kvo_worker).
class Worker {
public:
    static kvo_worker_config default_config() noexcept {
        kvo_worker_config c{};
        const kvo_status st = kvo_worker_config_default(&c);  // fails only for NULL
        (void)st;
        return c;
    }
    /// A worker over `tensors`; `host_buffers` empty (the worker allocates the host tier) or
    /// one per tensor. The registered memory must outlive the worker.
    static Result<Worker> try_create(const kvo_worker_config &cfg,
                                     Span<const kvo_kv_tensor> tensors,
                                     Span<const kvo_host_buffer> host_buffers = {}) {
        if (!host_buffers.empty() && host_buffers.size() != tensors.size()) {
            return detail::invalid("host_buffers: " + std::to_string(host_buffers.size()) +
                                   " for " + std::to_string(tensors.size()) + " tensors");
        }
        kvo_worker *p = nullptr;
        const kvo_status st =
            kvo_worker_new(&cfg, tensors.data(), tensors.size(),
                           host_buffers.empty() ? nullptr : host_buffers.data(), &p);
        if (st != KVO_STATUS_OK) return Status::of(st);
        return Worker(p);
    }

    kvo_worker *get() const noexcept { return h_.get(); }

    Result<void> try_submit_job(std::uint64_t job_id, kvo_job_kind kind,
                                Span<const std::uint32_t> src, Span<const std::uint32_t> dst,
                                std::uint32_t block_index = 0, std::uint64_t compute_stream = 0) {
        return detail::call(kvo_worker_submit_job(get(), job_id, static_cast<std::uint32_t>(kind),
                                                  src.data(), src.size(), dst.data(), dst.size(),
                                                  block_index, compute_stream));
    }
    Result<void> try_submit_step(const Step &step, std::uint64_t compute_stream = 0) {
        return detail::call(kvo_worker_submit_step(get(), step.get(), compute_stream));
    }
    /// Submits the stores held from the last plan (once its forward pass has been issued).
    Result<void> try_submit_stores() { return detail::call(kvo_worker_submit_stores(get())); }
    /// Up to `max` finished jobs, oldest first.
    Result<std::vector<kvo_completion>> try_poll(std::size_t max = 1024) {
        std::vector<kvo_completion> out(max);
        std::size_t n = 0;
        const kvo_status st = kvo_worker_poll(get(), out.data(), out.size(), &n);
        if (st != KVO_STATUS_OK) return Status::of(st);
        out.resize(n);
        return out;
    }
    /// The message of a failed job handed out by poll.
    Result<std::string> try_job_error(std::uint64_t job_id) const {
        std::size_t len = 0;
        kvo_status st = kvo_worker_job_error(get(), job_id, nullptr, 0, &len);
        if (st != KVO_STATUS_OK) return Status::of(st);
        std::string msg(len + 1, '\0');
        st = kvo_worker_job_error(get(), job_id, &msg[0], msg.size(), &len);
        if (st != KVO_STATUS_OK) return Status::of(st);
        msg.resize(len);
        return msg;
    }
    Result<void> try_wait(Span<const std::uint64_t> job_ids, std::uint64_t timeout_ms) {
        return detail::call(kvo_worker_wait(get(), job_ids.data(), job_ids.size(), timeout_ms));
    }
    /// Copies src_blocks[i] of tensor src_tensor to dst_blocks[i] of dst_tensor, now.
    Result<void> try_swap_blocks(std::uint32_t src_tensor, std::uint32_t dst_tensor,
                                 Span<const std::uint32_t> src_blocks,
                                 Span<const std::uint32_t> dst_blocks) {
        return swap(src_tensor, dst_tensor, src_blocks, dst_blocks, 0, 0);
    }
    /// The same copy queued as job `job_id` (reported by poll).
    Result<void> try_swap_blocks_as_job(std::uint32_t src_tensor, std::uint32_t dst_tensor,
                                        Span<const std::uint32_t> src_blocks,
                                        Span<const std::uint32_t> dst_blocks,
                                        std::uint64_t job_id) {
        return swap(src_tensor, dst_tensor, src_blocks, dst_blocks, 1, job_id);
    }
    Result<HostBuffer> try_host_buffer(std::uint32_t tensor) const {
        HostBuffer b;
        const kvo_status st = kvo_worker_get_host_buffer(get(), tensor, &b.ptr, &b.len);
        if (st != KVO_STATUS_OK) return Status::of(st);
        return b;
    }
    Result<void> try_shutdown() { return detail::call(kvo_worker_shutdown(get())); }
    Result<kvo_worker_stats> try_stats() const {
        kvo_worker_stats s{};
        s.struct_size = sizeof s;
        const kvo_status st = kvo_worker_get_stats(get(), &s);
        if (st != KVO_STATUS_OK) return Status::of(st);
        return s;
    }
    /// The Prometheus text (see kvo_worker_metrics_text).
    Result<std::string> try_metrics_text(const std::string &prefix,
                                         const Labels &labels = {}) const {
        const kvo_worker *w = get();
        return detail::metrics_text(prefix, labels,
                                    [w](const char *p, const kvo_label *l, std::size_t n,
                                        char *buf, std::size_t cap, std::size_t *len) {
                                        return kvo_worker_metrics_text(w, p, l, n, buf, cap, len);
                                    });
    }

#if KVO_HPP_EXCEPTIONS
    static Worker create(const kvo_worker_config &cfg, Span<const kvo_kv_tensor> tensors,
                         Span<const kvo_host_buffer> host_buffers = {}) {
        return try_create(cfg, tensors, host_buffers).value();
    }
    void submit_job(std::uint64_t job_id, kvo_job_kind kind, Span<const std::uint32_t> src,
                    Span<const std::uint32_t> dst, std::uint32_t block_index = 0,
                    std::uint64_t compute_stream = 0) {
        try_submit_job(job_id, kind, src, dst, block_index, compute_stream).value();
    }
    void submit_step(const Step &step, std::uint64_t compute_stream = 0) {
        try_submit_step(step, compute_stream).value();
    }
    void submit_stores() { try_submit_stores().value(); }
    std::vector<kvo_completion> poll(std::size_t max = 1024) { return try_poll(max).value(); }
    std::string job_error(std::uint64_t job_id) const { return try_job_error(job_id).value(); }
    void wait(Span<const std::uint64_t> job_ids, std::uint64_t timeout_ms) {
        try_wait(job_ids, timeout_ms).value();
    }
    void swap_blocks(std::uint32_t src_tensor, std::uint32_t dst_tensor,
                     Span<const std::uint32_t> src_blocks, Span<const std::uint32_t> dst_blocks) {
        try_swap_blocks(src_tensor, dst_tensor, src_blocks, dst_blocks).value();
    }
    void swap_blocks_as_job(std::uint32_t src_tensor, std::uint32_t dst_tensor,
                            Span<const std::uint32_t> src_blocks,
                            Span<const std::uint32_t> dst_blocks, std::uint64_t job_id) {
        try_swap_blocks_as_job(src_tensor, dst_tensor, src_blocks, dst_blocks, job_id).value();
    }
    HostBuffer host_buffer(std::uint32_t tensor) const { return try_host_buffer(tensor).value(); }
    void shutdown() { try_shutdown().value(); }
    kvo_worker_stats stats() const { return try_stats().value(); }
    std::string metrics_text(const std::string &prefix, const Labels &labels = {}) const {
        return try_metrics_text(prefix, labels).value();
    }
#endif

private:
    explicit Worker(kvo_worker *p) noexcept : h_(p) {}
    Result<void> swap(std::uint32_t src_tensor, std::uint32_t dst_tensor,
                      Span<const std::uint32_t> src, Span<const std::uint32_t> dst,
                      std::uint32_t as_job, std::uint64_t job_id) {
        if (src.size() != dst.size()) {
            return detail::invalid("dst_blocks: " + std::to_string(dst.size()) + " ids for " +
                                   std::to_string(src.size()) + " sources");
        }
        return detail::call(kvo_worker_swap_blocks(get(), src_tensor, dst_tensor, src.data(),
                                                   dst.data(), src.size(), as_job, job_id));
    }
    detail::Handle<kvo_worker, kvo_worker_free> h_;
};

/// Upper bounds in bytes of kvo_transfer_stats.size_buckets (the last bucket has none).
inline constexpr std::uint64_t size_bucket_bounds[KVO_SIZE_BUCKETS - 1] = {
    1000000,  5000000,  10000000,  20000000,  40000000,
    60000000, 80000000, 100000000, 150000000, 200000000};

}  // namespace kvo

#endif /* KVOFFLOAD_HPP */
