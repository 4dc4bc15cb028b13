// kvoffload.hpp alone (it includes kvoffload.h itself), twice: compiled as C++17 and C++20, with
// and without exceptions, with -Wall -Wextra -Werror -pedantic, linked and run by tests/c_api.rs.
#include "kvoffload.hpp"
#include "kvoffload.hpp"  // the include guard works

#include <type_traits>

static_assert(!std::is_copy_constructible_v<kvo::Manager>, "move-only");
static_assert(!std::is_copy_assignable_v<kvo::Scheduler>, "move-only");
static_assert(std::is_nothrow_move_constructible_v<kvo::Step>, "movable");
static_assert(std::is_nothrow_move_assignable_v<kvo::Worker>, "movable");
static_assert(std::is_constructible_v<kvo::Keys, std::vector<std::uint8_t> &>, "from a vector");
static_assert(std::is_constructible_v<kvo::Span<const std::uint32_t>, const std::uint32_t (&)[3]>,
              "from an array");
static_assert(
    !std::is_constructible_v<kvo::Span<std::uint32_t>, const std::vector<std::uint32_t> &>,
    "no mutable span over const data");
#if KVO_HPP_EXCEPTIONS
static_assert(std::is_base_of_v<std::runtime_error, kvo::Error>, "kvo::Error is an exception");
#endif

int main() {
    const kvo::Result<kvo::Step> step = kvo::Step::try_create();
    return kvo::abi_compatible() && step.ok() && step.value().try_info().ok() ? 0 : 1;
}
