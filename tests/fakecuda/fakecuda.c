/* A fake CUDA driver (libcuda.so.1) for tests: just enough of the driver API to tell whether
 * cuInit has run, and what CUDA_VISIBLE_DEVICES said when it did.
 *
 * Like the real driver: every call but cuDriverGetVersion returns CUDA_ERROR_NOT_INITIALIZED (3)
 * until cuInit(0) succeeds; CUDA_VISIBLE_DEVICES is read once, inside cuInit; cuInit with no
 * visible device returns CUDA_ERROR_NO_DEVICE (100) and later calls return it too.
 *
 * The fake host has FAKE_CUDA_DEVICE_COUNT devices (default 4). The visible count is a rough
 * model of CUDA's rule (unset = all; "" or a leading "-1" / "NoDevFiles" = none; otherwise the
 * number of comma-separated entries, capped at the device count): tests that need the exact
 * rules test autogpu_jupyter.core.visibility instead.
 *
 * Test-only extras: fakeCudaInitVisibleDevices() returns the CUDA_VISIBLE_DEVICES value cuInit
 * saw (NULL when unset or before cuInit); fakeCudaInitCount() how many times cuInit ran.
 */
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_NO_DEVICE 100
#define CUDA_ERROR_INVALID_DEVICE 101

static int g_state = CUDA_ERROR_NOT_INITIALIZED; /* what calls return until initialised */
static int g_visible = 0;
static int g_init_calls = 0;
static char g_cvd[4096];
static int g_cvd_set = 0;

static int host_count(void) {
    const char *s = getenv("FAKE_CUDA_DEVICE_COUNT");
    int n = s ? atoi(s) : 4;
    return n < 0 ? 0 : n;
}

static int visible_count(const char *cvd, int total) {
    if (cvd == NULL) return total;
    while (*cvd == ' ' || *cvd == '\t') cvd++;
    if (*cvd == '\0' || *cvd == '-' || strncmp(cvd, "NoDevFiles", 10) == 0) return 0;
    int n = 1;
    for (const char *p = cvd; *p; p++)
        if (*p == ',') n++;
    return n < total ? n : total;
}

CUresult cuInit(unsigned int flags) {
    g_init_calls++;
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (g_state != CUDA_ERROR_NOT_INITIALIZED) return g_state; /* read once */
    const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
    g_cvd_set = cvd != NULL;
    if (cvd) {
        strncpy(g_cvd, cvd, sizeof g_cvd - 1);
        g_cvd[sizeof g_cvd - 1] = '\0';
    }
    g_visible = visible_count(cvd, host_count());
    g_state = g_visible > 0 ? CUDA_SUCCESS : CUDA_ERROR_NO_DEVICE;
    return g_state;
}

CUresult cuDriverGetVersion(int *version) {
    if (version == NULL) return CUDA_ERROR_INVALID_VALUE;
    *version = 12040;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
    if (count == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (g_state != CUDA_SUCCESS) return g_state;
    *count = g_visible;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    if (device == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (g_state != CUDA_SUCCESS) return g_state;
    if (ordinal < 0 || ordinal >= g_visible) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult error, const char **name) {
    if (name == NULL) return CUDA_ERROR_INVALID_VALUE;
    switch (error) {
    case CUDA_SUCCESS: *name = "CUDA_SUCCESS"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; return CUDA_SUCCESS;
    case CUDA_ERROR_NOT_INITIALIZED: *name = "CUDA_ERROR_NOT_INITIALIZED"; return CUDA_SUCCESS;
    case CUDA_ERROR_NO_DEVICE: *name = "CUDA_ERROR_NO_DEVICE"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_DEVICE: *name = "CUDA_ERROR_INVALID_DEVICE"; return CUDA_SUCCESS;
    default: *name = NULL; return CUDA_ERROR_INVALID_VALUE;
    }
}

const char *fakeCudaInitVisibleDevices(void) {
    return (g_state != CUDA_ERROR_NOT_INITIALIZED && g_cvd_set) ? g_cvd : NULL;
}

int fakeCudaInitCount(void) { return g_init_calls; }
