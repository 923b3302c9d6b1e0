/* A fake ROCr runtime (libhsa-runtime64.so.1) for tests: just enough of the HSA API to tell
 * whether hsa_init has run, and what ROCR_VISIBLE_DEVICES said when it did.
 *
 * Like ROCr: hsa_system_get_info returns HSA_STATUS_ERROR_NOT_INITIALIZED (0x100B) until
 * hsa_init succeeds (ROCr's IS_OPEN check), and ROCR_VISIBLE_DEVICES is read once, inside the
 * first hsa_init (ROCr's Runtime::Load refreshes its flags then). The real runtime also opens
 * /dev/kfd at that moment; this host has no /dev/kfd, so the fake does not.
 *
 * Test-only extras: fakeHsaInitVisibleDevices() returns the ROCR_VISIBLE_DEVICES value hsa_init
 * saw (NULL when unset or before hsa_init); fakeHsaInitCount() how many times it ran.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define HSA_STATUS_SUCCESS 0
#define HSA_STATUS_ERROR_INVALID_ARGUMENT 0x1001
#define HSA_STATUS_ERROR_NOT_INITIALIZED 0x100B

static int g_open = 0;
static int g_init_calls = 0;
static char g_rvd[4096];
static int g_rvd_set = 0;

int hsa_init(void) {
    g_init_calls++;
    if (g_open++ == 0) {
        const char *rvd = getenv("ROCR_VISIBLE_DEVICES");
        g_rvd_set = rvd != NULL;
        if (rvd) {
            strncpy(g_rvd, rvd, sizeof g_rvd - 1);
            g_rvd[sizeof g_rvd - 1] = '\0';
        }
    }
    return HSA_STATUS_SUCCESS;
}

int hsa_shut_down(void) {
    if (g_open == 0) return HSA_STATUS_ERROR_NOT_INITIALIZED;
    g_open--;
    return HSA_STATUS_SUCCESS;
}

int hsa_system_get_info(int attribute, void *value) {
    if (g_open == 0) return HSA_STATUS_ERROR_NOT_INITIALIZED;
    if (value == NULL) return HSA_STATUS_ERROR_INVALID_ARGUMENT;
    if (attribute == 0) *(uint16_t *)value = 1; /* HSA_SYSTEM_INFO_VERSION_MAJOR */
    else if (attribute == 1) *(uint16_t *)value = 18;
    else return HSA_STATUS_ERROR_INVALID_ARGUMENT;
    return HSA_STATUS_SUCCESS;
}

const char *fakeHsaInitVisibleDevices(void) { return (g_init_calls && g_rvd_set) ? g_rvd : NULL; }

int fakeHsaInitCount(void) { return g_init_calls; }
