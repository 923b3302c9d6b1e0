/* A fake HIP runtime (libamdhip64.so) for tests, linked against the fake ROCr
 * (libhsa-runtime64.so.1) as the real one is: mapping it maps ROCr too, as `import torch` does
 * on a ROCm build, and nothing is initialised until a HIP call.
 *
 * Like HIP: hipInit(0) (and the first hipGetDeviceCount, which initialises implicitly) calls
 * hsa_init, then reads HIP_VISIBLE_DEVICES, else CUDA_VISIBLE_DEVICES, once. The visible count is
 * a rough model (number of comma-separated entries, capped at FAKE_HIP_DEVICE_COUNT, default 4):
 * tests that need the exact rules test autogpu_jupyter.core.visibility instead.
 *
 * Test-only extra: fakeHipInitVisibleDevices() returns the HIP list hipInit saw (NULL: none).
 */
#include <stdlib.h>
#include <string.h>

int hsa_init(void);

#define hipSuccess 0
#define hipErrorInvalidValue 1
#define hipErrorNoDevice 100

static int g_inited = 0;
static int g_visible = 0;
static char g_list[4096];
static int g_list_set = 0;

static int host_count(void) {
    const char *s = getenv("FAKE_HIP_DEVICE_COUNT");
    int n = s ? atoi(s) : 4;
    return n < 0 ? 0 : n;
}

int hipInit(unsigned int flags) {
    const char *list;
    int n = 1;
    if (flags != 0) return hipErrorInvalidValue;
    if (g_inited) return g_visible > 0 ? hipSuccess : hipErrorNoDevice;
    hsa_init();
    g_inited = 1;
    list = getenv("HIP_VISIBLE_DEVICES");
    if (list == NULL || *list == '\0') list = getenv("CUDA_VISIBLE_DEVICES");
    if (list != NULL && *list == '\0') list = NULL;
    g_list_set = list != NULL;
    if (list) {
        strncpy(g_list, list, sizeof g_list - 1);
        g_list[sizeof g_list - 1] = '\0';
        for (const char *p = list; *p; p++)
            if (*p == ',') n++;
        g_visible = n < host_count() ? n : host_count();
    } else {
        g_visible = host_count();
    }
    return g_visible > 0 ? hipSuccess : hipErrorNoDevice;
}

int hipGetDeviceCount(int *count) {
    int rc;
    if (count == NULL) return hipErrorInvalidValue;
    rc = hipInit(0);
    *count = g_visible;
    return rc;
}

const char *fakeHipInitVisibleDevices(void) { return (g_inited && g_list_set) ? g_list : NULL; }
