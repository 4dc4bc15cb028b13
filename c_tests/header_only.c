/* The header alone must compile as strict C11 (-std=c11 -Wall -Wextra -Werror -pedantic),
 * twice included, and its types must have the layout the library was built with.
 * Compiled, linked and run by tests/c_api.rs. */
#include "kvoffload.h"
#include "kvoffload.h" /* the include guard works */

#include <stddef.h>

_Static_assert(KVO_STATUS_OK == 0, "KVO_STATUS_OK is 0");
_Static_assert(KVO_STATUS_INTERNAL == 12, "status values are never renumbered");
_Static_assert(KVO_MAX_KEY_LEN == 64, "KVO_MAX_KEY_LEN");
_Static_assert(sizeof(kvo_status) == 4, "kvo_status is 32 bits");
_Static_assert(sizeof(kvo_policy) == 4, "kvo_policy is 32 bits");
_Static_assert(sizeof(kvo_lookup) == 4, "kvo_lookup is 32 bits");
_Static_assert(offsetof(kvo_manager_config, struct_size) == 0, "struct_size first");
_Static_assert(offsetof(kvo_manager_stats, struct_size) == 0, "struct_size first");
_Static_assert(sizeof(kvo_event) == 24, "kvo_event is 24 bytes");
_Static_assert(sizeof(kvo_manager_stats) ==
                   sizeof(size_t) + (12 + KVO_ALLOCATION_SIZE_BUCKETS) * sizeof(uint64_t),
               "kvo_manager_stats has no padding");

int main(void) {
    /* Names from the header are usable as C types (struct tags and typedefs alike). */
    struct kvo_manager_config cfg;
    kvo_manager_config *pcfg = &cfg;
    kvo_manager *m = NULL;
    kvo_policy policy = KVO_POLICY_ARC;
    kvo_lookup lookup = KVO_LOOKUP_RETRY;
    (void)pcfg;
    (void)policy;
    (void)lookup;
    kvo_manager_free(m);
    return kvo_abi_version() == KVO_ABI_VERSION ? 0 : 1;
}
