// The header alone must compile as strict C++17 (-std=c++17 -Wall -Wextra -Werror -pedantic),
// twice included, with the enums typed as in the C ABI. Compiled, linked and run by
// tests/c_api.rs.
#include "kvoffload.h"
#include "kvoffload.h"  // the include guard works

#include <cstddef>
#include <cstdint>
#include <type_traits>

static_assert(KVO_STATUS_OK == 0, "KVO_STATUS_OK is 0");
static_assert(std::is_same<std::underlying_type<kvo_status>::type, std::int32_t>::value,
              "kvo_status is an int32_t enum");
static_assert(std::is_same<std::underlying_type<kvo_policy>::type, std::uint32_t>::value,
              "kvo_policy is a uint32_t enum");
static_assert(std::is_same<std::underlying_type<kvo_lookup>::type, std::uint32_t>::value,
              "kvo_lookup is a uint32_t enum");
static_assert(std::is_standard_layout<kvo_manager_config>::value, "C layout");
static_assert(std::is_trivially_copyable<kvo_manager_stats>::value, "C layout");
static_assert(offsetof(kvo_manager_config, struct_size) == 0, "struct_size first");
static_assert(sizeof(kvo_event) == 24, "kvo_event is 24 bytes");

int main() {
    kvo_manager_config cfg{};
    cfg.policy = KVO_POLICY_LRU;
    kvo_manager *m = nullptr;
    kvo_manager_free(m);
    const kvo_status st = kvo_manager_config_default(&cfg);
    return st == KVO_STATUS_OK && kvo_abi_version() == KVO_ABI_VERSION ? 0 : 1;
}
