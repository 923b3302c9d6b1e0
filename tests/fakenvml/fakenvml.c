/*
 * A fake libnvidia-ml.so.1 for tests and benchmarks: the real pynvml binding (nvidia-ml-py) loads
 * it with CDLL("libnvidia-ml.so.1") and calls it as it would call NVIDIA's library.
 *
 * What the "driver" shows comes from a scenario file named by the environment variable
 * FAKE_NVML_SCENARIO. The variable is read at every call and the file is re-read whenever its path,
 * inode, size or mtime changes, so a test can move load while processes run. Writers replace the
 * file atomically (write a temp file, rename); a file without its final "end" line is ignored and
 * the last good parse stays in force. tests/fakenvml/__init__.py writes these files from the
 * fleet JSON schema; the format is line based:
 *
 *   driver 550.54.15            driver version; "driver none" = no driver: nvmlInit fails (9)
 *   init_error N                nvmlInit returns NVML error N
 *   mem_v2_error N              nvmlDeviceGetMemoryInfo_v2 returns N (e.g. 25 version mismatch)
 *   gpu                         starts a physical GPU (index = order of appearance)
 *   mig                         starts a MIG device of the last gpu (MIG index = order)
 *   uuid / name / pci S         strings (pci = bus id "00000000:07:00.0")
 *   pci_device_id N             e.g. 0x20B210DE
 *   mem_total / mem_used / mem_reserved N    bytes; v1 "used" = used + reserved
 *   util_gpu / util_mem / temp / power_mw / power_limit_mw / compute_mode N
 *   enforced_limit_mw N         nvmlDeviceGetEnforcedPowerLimit (default: power_limit_mw, the
 *                               management limit); lower where another limit applies
 *   mig_mode N                  current MIG mode of a gpu
 *   mig_pending N               pending MIG mode (default: the current one); they differ after
 *                               "nvidia-smi -mig 1" until the GPU is reset
 *   max_mig N                   nvmlDeviceGetMaxMigDeviceCount of a gpu
 *   slot N                      the MIG slot of a mig (default: its order); the slots no MIG
 *                               device holds answer NOT_FOUND, as after a destroyed instance
 *   error N                     every call on this device (and its handle lookup) returns N
 *   unsupported a,b,...         these queries return NOT_SUPPORTED (3): util temp power
 *                               power_limit (both limits) enforced_power_limit compute_mode
 *                               memory processes mig_mode pci name
 *   proc PID USED               a compute process; USED = -1 means "not available"
 *   procs_outgrow 1             the process list grows faster than any reader: every read of it
 *                               answers INSUFFICIENT_SIZE, needing more than the caller offered
 *   end                         required last line
 *
 * Without a scenario (variable unset, file never readable) the library behaves as a host whose
 * driver is not loaded. Built with -DNO_V3 it lacks nvmlDeviceGetComputeRunningProcesses_v3
 * (an R470-era driver); -DNO_V2 also drops the _v2 call; -DNO_MEMORY_V2 drops
 * nvmlDeviceGetMemoryInfo_v2; -DNO_TEMPERATURE_V drops nvmlDeviceGetTemperatureV.
 *
 * Extra, non-NVML symbols for tests: fakenvml_calls(name) -> number of calls of that NVML function
 * in this process; fakenvml_total_calls() -> all NVML calls; fakenvml_reset_calls().
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define EXPORT __attribute__((visibility("default")))

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

#define MAX_GPUS 32
#define MAX_MIGS 7
#define MAX_PROCS 64
#define STR_LEN 96
#define NOT_AVAILABLE 0xFFFFFFFFFFFFFFFFULL

enum {
    U_UTIL = 1 << 0,
    U_TEMP = 1 << 1,
    U_POWER = 1 << 2,
    U_POWER_LIMIT = 1 << 3,
    U_COMPUTE_MODE = 1 << 4,
    U_MEMORY = 1 << 5,
    U_PROCESSES = 1 << 6,
    U_MIG_MODE = 1 << 7,
    U_PCI = 1 << 8,
    U_NAME = 1 << 9,
    U_ENFORCED_LIMIT = 1 << 10,
};

struct proc {
    unsigned int pid;
    unsigned long long used;
    unsigned int gi, ci;
};

struct dev {
    char uuid[STR_LEN], name[STR_LEN], pci[32];
    unsigned int pci_device_id;
    unsigned long long mem_total, mem_used, mem_reserved;
    unsigned int util_gpu, util_mem, temp, power_mw, power_limit_mw, compute_mode;
    unsigned int mig_mode, max_mig;
    int mig_pending;       /* -1: the current mode */
    long long enforced_mw; /* -1: power_limit_mw */
    int procs_outgrow;
    int slot; /* a MIG device's slot under its GPU (nvmlDeviceGetMigDeviceHandleByIndex) */
    int error;
    unsigned int unsupported;
    int nproc;
    struct proc procs[MAX_PROCS];
};

struct scenario {
    int loaded;
    int no_driver;
    int init_error;
    int mem_v2_error;
    char driver[80];
    int ngpu;
    struct dev gpus[MAX_GPUS];
    int nmig[MAX_GPUS];
    struct dev migs[MAX_GPUS][MAX_MIGS];
};

/* The opaque nvmlDevice_t: pointers into these arrays, stable for the life of the process. */
struct nvmlDevice_st {
    int gpu;
    int mig; /* -1 for a physical GPU */
};
typedef struct nvmlDevice_st *nvmlDevice_t;

static struct nvmlDevice_st gpu_handles[MAX_GPUS];
static struct nvmlDevice_st mig_handles[MAX_GPUS][MAX_MIGS];

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct scenario cur, tmp;
static char cur_path[4096];
static struct stat cur_st;
static int init_count;

/* ---- call counters (for tests: how many NVML calls did a snapshot make?) ---- */
#define MAX_COUNTERS 160
static struct {
    const char *name;
    unsigned long count;
} counters[MAX_COUNTERS];
static int ncounters;

static void count_call(const char *name) {
    int i;
    for (i = 0; i < ncounters; i++) {
        if (counters[i].name == name) {
            counters[i].count++;
            return;
        }
    }
    if (ncounters < MAX_COUNTERS) {
        counters[ncounters].name = name;
        counters[ncounters].count = 1;
        ncounters++;
    }
}

EXPORT unsigned long fakenvml_calls(const char *name) {
    unsigned long n = 0;
    int i;
    pthread_mutex_lock(&mu);
    for (i = 0; i < ncounters; i++)
        if (strcmp(counters[i].name, name) == 0) n += counters[i].count;
    pthread_mutex_unlock(&mu);
    return n;
}

EXPORT unsigned long fakenvml_total_calls(void) {
    unsigned long n = 0;
    int i;
    pthread_mutex_lock(&mu);
    for (i = 0; i < ncounters; i++) n += counters[i].count;
    pthread_mutex_unlock(&mu);
    return n;
}

EXPORT void fakenvml_reset_calls(void) {
    int i;
    pthread_mutex_lock(&mu);
    for (i = 0; i < ncounters; i++) counters[i].count = 0;
    pthread_mutex_unlock(&mu);
}

__attribute__((constructor)) static void fake_init_handles(void) {
    int g, m;
    for (g = 0; g < MAX_GPUS; g++) {
        gpu_handles[g].gpu = g;
        gpu_handles[g].mig = -1;
        for (m = 0; m < MAX_MIGS; m++) {
            mig_handles[g][m].gpu = g;
            mig_handles[g][m].mig = m;
        }
    }
}

/* ---- scenario parsing ---- */
static void copy_str(char *dst, size_t n, const char *src) {
    snprintf(dst, n, "%s", src);
}

static unsigned int parse_unsupported(const char *s) {
    static const struct {
        const char *name;
        unsigned int bit;
    } names[] = {
        {"util", U_UTIL},
        {"temp", U_TEMP},
        {"power", U_POWER},
        {"power_limit", U_POWER_LIMIT},
        {"compute_mode", U_COMPUTE_MODE},
        {"memory", U_MEMORY},
        {"processes", U_PROCESSES},
        {"mig_mode", U_MIG_MODE},
        {"pci", U_PCI},
        {"name", U_NAME},
        {"enforced_power_limit", U_ENFORCED_LIMIT},
    };
    unsigned int bits = 0;
    char buf[256], *tok, *save = NULL;
    size_t i;
    copy_str(buf, sizeof buf, s);
    for (tok = strtok_r(buf, ", ", &save); tok; tok = strtok_r(NULL, ", ", &save)) {
        for (i = 0; i < sizeof names / sizeof names[0]; i++)
            if (strcmp(tok, names[i].name) == 0) bits |= names[i].bit;
    }
    return bits;
}

/* Parse `path` into `sc`. Returns 0 when the file is complete (ends with "end"). */
static int parse_file(const char *path, struct scenario *sc) {
    FILE *fh = fopen(path, "r");
    char line[1024];
    struct dev *d = NULL;
    int complete = 0, g = -1;
    if (!fh) return -1;
    memset(sc, 0, sizeof *sc);
    copy_str(sc->driver, sizeof sc->driver, "550.54.15");
    while (fgets(line, sizeof line, fh)) {
        char *key = line, *val, *nl;
        nl = strchr(line, '\n');
        if (nl) *nl = 0;
        while (*key == ' ' || *key == '\t') key++;
        if (*key == 0 || *key == '#') continue;
        val = strchr(key, ' ');
        if (val) {
            *val++ = 0;
            while (*val == ' ') val++;
        } else {
            val = key + strlen(key);
        }
        if (strcmp(key, "end") == 0) {
            complete = 1;
            break;
        } else if (strcmp(key, "driver") == 0) {
            if (strcmp(val, "none") == 0)
                sc->no_driver = 1;
            else
                copy_str(sc->driver, sizeof sc->driver, val);
        } else if (strcmp(key, "init_error") == 0) {
            sc->init_error = atoi(val);
        } else if (strcmp(key, "mem_v2_error") == 0) {
            sc->mem_v2_error = atoi(val);
        } else if (strcmp(key, "gpu") == 0) {
            if (sc->ngpu >= MAX_GPUS) break;
            g = sc->ngpu++;
            d = &sc->gpus[g];
            d->mig_pending = -1;
            d->enforced_mw = -1;
        } else if (strcmp(key, "mig") == 0) {
            if (g < 0 || sc->nmig[g] >= MAX_MIGS) break;
            d = &sc->migs[g][sc->nmig[g]];
            d->mig_pending = -1;
            d->enforced_mw = -1;
            d->slot = sc->nmig[g]++;
        } else if (d == NULL) {
            continue; /* device keys before any device: ignored */
        } else if (strcmp(key, "uuid") == 0) {
            copy_str(d->uuid, sizeof d->uuid, val);
        } else if (strcmp(key, "name") == 0) {
            copy_str(d->name, sizeof d->name, val);
        } else if (strcmp(key, "pci") == 0) {
            copy_str(d->pci, sizeof d->pci, val);
        } else if (strcmp(key, "pci_device_id") == 0) {
            d->pci_device_id = (unsigned int)strtoul(val, NULL, 0);
        } else if (strcmp(key, "mem_total") == 0) {
            d->mem_total = strtoull(val, NULL, 10);
        } else if (strcmp(key, "mem_used") == 0) {
            d->mem_used = strtoull(val, NULL, 10);
        } else if (strcmp(key, "mem_reserved") == 0) {
            d->mem_reserved = strtoull(val, NULL, 10);
        } else if (strcmp(key, "util_gpu") == 0) {
            d->util_gpu = (unsigned int)strtoul(val, NULL, 10);
        } else if (strcmp(key, "util_mem") == 0) {
            d->util_mem = (unsigned int)strtoul(val, NULL, 10);
        } else if (strcmp(key, "temp") == 0) {
            d->temp = (unsigned int)strtoul(val, NULL, 10);
        } else if (strcmp(key, "power_mw") == 0) {
            d->power_mw = (unsigned int)strtoul(val, NULL, 10);
        } else if (strcmp(key, "power_limit_mw") == 0) {
            d->power_limit_mw = (unsigned int)strtoul(val, NULL, 10);
        } else if (strcmp(key, "compute_mode") == 0) {
            d->compute_mode = (unsigned int)strtoul(val, NULL, 10);
        } else if (strcmp(key, "mig_mode") == 0) {
            d->mig_mode = (unsigned int)strtoul(val, NULL, 10);
        } else if (strcmp(key, "mig_pending") == 0) {
            d->mig_pending = atoi(val);
        } else if (strcmp(key, "enforced_limit_mw") == 0) {
            d->enforced_mw = strtoll(val, NULL, 10);
        } else if (strcmp(key, "procs_outgrow") == 0) {
            d->procs_outgrow = atoi(val);
        } else if (strcmp(key, "max_mig") == 0) {
            d->max_mig = (unsigned int)strtoul(val, NULL, 10);
            if (d->max_mig > MAX_MIGS) d->max_mig = MAX_MIGS;
        } else if (strcmp(key, "slot") == 0) {
            d->slot = atoi(val);
        } else if (strcmp(key, "error") == 0) {
            d->error = atoi(val);
        } else if (strcmp(key, "unsupported") == 0) {
            d->unsupported |= parse_unsupported(val);
        } else if (strcmp(key, "proc") == 0) {
            char *end = NULL;
            long long used;
            unsigned long pid = strtoul(val, &end, 10);
            used = strtoll(end, NULL, 10);
            if (d->nproc < MAX_PROCS) {
                d->procs[d->nproc].pid = (unsigned int)pid;
                d->procs[d->nproc].used = used < 0 ? NOT_AVAILABLE : (unsigned long long)used;
                d->nproc++;
            }
        }
    }
    fclose(fh);
    sc->loaded = complete;
    return complete ? 0 : -1;
}

/* Called with `mu` held: make `cur` reflect the scenario file, if it changed. */
static void refresh(void) {
    const char *path = getenv("FAKE_NVML_SCENARIO");
    struct stat st;
    if (!path || !*path) return;
    if (stat(path, &st) != 0) return; /* keep the last good scenario */
    if (cur.loaded && strcmp(path, cur_path) == 0 && st.st_ino == cur_st.st_ino &&
        st.st_dev == cur_st.st_dev && st.st_size == cur_st.st_size &&
        st.st_mtim.tv_sec == cur_st.st_mtim.tv_sec && st.st_mtim.tv_nsec == cur_st.st_mtim.tv_nsec)
        return;
    if (parse_file(path, &tmp) == 0) {
        int g, m;
        /* MIG devices get their GPU-instance ids; a parent lists its MIG devices' processes. */
        for (g = 0; g < tmp.ngpu; g++) {
            for (m = 0; m < tmp.nmig[g]; m++) {
                struct dev *md = &tmp.migs[g][m];
                int p;
                for (p = 0; p < md->nproc; p++) {
                    md->procs[p].gi = (unsigned int)(m + 1);
                    if (tmp.gpus[g].nproc < MAX_PROCS)
                        tmp.gpus[g].procs[tmp.gpus[g].nproc++] = md->procs[p];
                }
            }
        }
        memcpy(&cur, &tmp, sizeof cur);
        copy_str(cur_path, sizeof cur_path, path);
        cur_st = st;
    }
}

/* ---- common entry: lock, count, refresh, check init ---- */
#define ENTER()                 \
    pthread_mutex_lock(&mu);    \
    count_call(__func__);       \
    refresh()

#define RETURN(code)              \
    do {                          \
        nvmlReturn_t rc_ = (code); \
        pthread_mutex_unlock(&mu); \
        return rc_;               \
    } while (0)

#define REQUIRE_INIT()                                           \
    do {                                                         \
        if (!cur.loaded || cur.no_driver) RETURN(NVML_ERROR_DRIVER_NOT_LOADED); \
        if (init_count == 0) RETURN(NVML_ERROR_UNINITIALIZED);  \
    } while (0)

/* Resolve a handle to its scenario device (mu held). Returns an NVML code. */
static nvmlReturn_t lookup(nvmlDevice_t h, struct dev **out, struct dev **parent) {
    int g, m;
    if (h == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (h >= &gpu_handles[0] && h < &gpu_handles[MAX_GPUS]) {
        g = (int)(h - &gpu_handles[0]);
        m = -1;
    } else if (h >= &mig_handles[0][0] && h < &mig_handles[0][0] + MAX_GPUS * MAX_MIGS) {
        g = h->gpu;
        m = h->mig;
    } else {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (g >= cur.ngpu) return NVML_ERROR_GPU_IS_LOST; /* the GPU went away since */
    if (cur.gpus[g].error) return cur.gpus[g].error;
    if (m >= 0) {
        if (m >= cur.nmig[g] || !cur.gpus[g].mig_mode) return NVML_ERROR_INVALID_ARGUMENT;
        if (cur.migs[g][m].error) return cur.migs[g][m].error;
        *out = &cur.migs[g][m];
        if (parent) *parent = &cur.gpus[g];
    } else {
        *out = &cur.gpus[g];
        if (parent) *parent = NULL;
    }
    return NVML_SUCCESS;
}

#define DEVICE(h, d)                                  \
    struct dev *d = NULL;                             \
    ENTER();                                          \
    REQUIRE_INIT();                                   \
    do {                                              \
        nvmlReturn_t lrc_ = lookup((h), &d, NULL);    \
        if (lrc_ != NVML_SUCCESS) RETURN(lrc_);       \
    } while (0)

#define UNSUPPORTED(d, bit) \
    if ((d)->unsupported & (bit)) RETURN(NVML_ERROR_NOT_SUPPORTED)

static nvmlReturn_t put_str(char *dst, unsigned int len, const char *src) {
    if (dst == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > len) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return NVML_SUCCESS;
}

/* ---- init / shutdown / errors ---- */
static nvmlReturn_t do_init(void) {
    if (!cur.loaded || cur.no_driver) return NVML_ERROR_DRIVER_NOT_LOADED;
    if (cur.init_error) return cur.init_error;
    init_count++;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlInit(void) {
    ENTER();
    RETURN(do_init());
}

EXPORT nvmlReturn_t nvmlInit_v2(void) {
    ENTER();
    RETURN(do_init());
}

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    ENTER();
    RETURN(do_init());
}

EXPORT nvmlReturn_t nvmlShutdown(void) {
    ENTER();
    if (init_count == 0) RETURN(NVML_ERROR_UNINITIALIZED);
    init_count--;
    RETURN(NVML_SUCCESS);
}

EXPORT const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 8: return "Insufficient External Power";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 11: return "Interrupt Request Issue";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 14: return "Corrupted infoROM";
    case 15: return "GPU is lost";
    case 16: return "GPU requires restart";
    case 17: return "The operating system has blocked the request.";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    case 19: return "In use by another client";
    case 20: return "Insufficient Memory";
    case 21: return "No data";
    case 25: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

/* ---- system ---- */
EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    ENTER();
    REQUIRE_INIT();
    RETURN(put_str(version, length, cur.driver));
}

EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    char buf[96];
    ENTER();
    REQUIRE_INIT();
    snprintf(buf, sizeof buf, "12.%s", cur.driver);
    RETURN(put_str(version, length, buf));
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v) {
    ENTER();
    REQUIRE_INIT();
    if (!v) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *v = 12040;
    RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) {
    ENTER();
    REQUIRE_INIT();
    if (!v) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *v = 12040;
    RETURN(NVML_SUCCESS);
}

/* ---- enumeration ---- */
static nvmlReturn_t get_count(unsigned int *count) {
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = (unsigned int)cur.ngpu;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) {
    ENTER();
    REQUIRE_INIT();
    RETURN(get_count(count));
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    ENTER();
    REQUIRE_INIT();
    RETURN(get_count(count));
}

static nvmlReturn_t by_index(unsigned int index, nvmlDevice_t *device) {
    if (!device || index >= (unsigned int)cur.ngpu) return NVML_ERROR_INVALID_ARGUMENT;
    /* Lost / forbidden GPUs fail already here, as NVIDIA's library does for nvidia-smi. */
    if (cur.gpus[index].error) return cur.gpus[index].error;
    *device = &gpu_handles[index];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    ENTER();
    REQUIRE_INIT();
    RETURN(by_index(index, device));
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    ENTER();
    REQUIRE_INIT();
    RETURN(by_index(index, device));
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    int g, m;
    ENTER();
    REQUIRE_INIT();
    if (!uuid || !device) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    for (g = 0; g < cur.ngpu; g++) {
        if (strcmp(cur.gpus[g].uuid, uuid) == 0) {
            if (cur.gpus[g].error) RETURN(cur.gpus[g].error);
            *device = &gpu_handles[g];
            RETURN(NVML_SUCCESS);
        }
        for (m = 0; m < cur.nmig[g]; m++) {
            if (cur.gpus[g].mig_mode && strcmp(cur.migs[g][m].uuid, uuid) == 0) {
                if (cur.gpus[g].error) RETURN(cur.gpus[g].error);
                *device = &mig_handles[g][m];
                RETURN(NVML_SUCCESS);
            }
        }
    }
    RETURN(NVML_ERROR_NOT_FOUND);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *bus, nvmlDevice_t *device) {
    int g;
    ENTER();
    REQUIRE_INIT();
    if (!bus || !device) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    for (g = 0; g < cur.ngpu; g++) {
        if (strcasecmp(cur.gpus[g].pci, bus) == 0) {
            if (cur.gpus[g].error) RETURN(cur.gpus[g].error);
            *device = &gpu_handles[g];
            RETURN(NVML_SUCCESS);
        }
    }
    RETURN(NVML_ERROR_NOT_FOUND);
}

EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t h, unsigned int *index) {
    DEVICE(h, d);
    (void)d;
    if (!index) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *index = (unsigned int)h->gpu;
    RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t h, unsigned int *minor) {
    DEVICE(h, d);
    (void)d;
    if (!minor) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *minor = (unsigned int)h->gpu;
    RETURN(NVML_SUCCESS);
}

/* ---- identity ---- */
EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t h, char *uuid, unsigned int length) {
    DEVICE(h, d);
    RETURN(put_str(uuid, length, d->uuid));
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t h, char *name, unsigned int length) {
    DEVICE(h, d);
    UNSUPPORTED(d, U_NAME);
    RETURN(put_str(name, length, d->name));
}

EXPORT nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t h, char *serial, unsigned int length) {
    DEVICE(h, d);
    (void)d;
    (void)serial;
    (void)length;
    RETURN(NVML_ERROR_NOT_SUPPORTED);
}

/* nvmlPciInfo_t of NVML >= 9: legacy 16-char bus id, ids, then the 32-char bus id. */
typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

static nvmlReturn_t fill_pci(struct dev *d, nvmlPciInfo_t *pci) {
    unsigned int dom = 0, bus = 0, dev = 0, fn = 0;
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof *pci);
    sscanf(d->pci, "%x:%x:%x.%x", &dom, &bus, &dev, &fn);
    copy_str(pci->busId, sizeof pci->busId, d->pci);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", dom & 0xFFFF, bus, dev,
             fn);
    pci->domain = dom;
    pci->bus = bus;
    pci->device = dev;
    pci->pciDeviceId = d->pci_device_id;
    pci->pciSubSystemId = 0x145F10DE;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t h, nvmlPciInfo_t *pci) {
    DEVICE(h, d);
    UNSUPPORTED(d, U_PCI);
    RETURN(fill_pci(d, pci));
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t h, nvmlPciInfo_t *pci) {
    DEVICE(h, d);
    UNSUPPORTED(d, U_PCI);
    RETURN(fill_pci(d, pci));
}

/* ---- memory ---- */
typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

#define NVML_MEMORY_V2 0x02000028u

static unsigned long long sat_sub(unsigned long long a, unsigned long long b) {
    return a > b ? a - b : 0;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t h, nvmlMemory_t *mem) {
    DEVICE(h, d);
    UNSUPPORTED(d, U_MEMORY);
    if (!mem) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    /* v1 counts the driver's reserved memory as used. */
    mem->total = d->mem_total;
    mem->used = d->mem_used + d->mem_reserved;
    mem->free = sat_sub(d->mem_total, mem->used);
    RETURN(NVML_SUCCESS);
}

#ifndef NO_MEMORY_V2
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t h, nvmlMemory_v2_t *mem) {
    DEVICE(h, d);
    UNSUPPORTED(d, U_MEMORY);
    if (!mem) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    if (cur.mem_v2_error) RETURN(cur.mem_v2_error);
    if (mem->version != NVML_MEMORY_V2) RETURN(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    mem->total = d->mem_total;
    mem->reserved = d->mem_reserved;
    mem->used = d->mem_used;
    mem->free = sat_sub(sat_sub(d->mem_total, d->mem_reserved), d->mem_used);
    RETURN(NVML_SUCCESS);
}
#endif

typedef struct {
    unsigned long long bar1Total, bar1Free, bar1Used;
} nvmlBAR1Memory_t;

EXPORT nvmlReturn_t nvmlDeviceGetBAR1MemoryInfo(nvmlDevice_t h, nvmlBAR1Memory_t *bar1) {
    DEVICE(h, d);
    (void)d;
    if (!bar1) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    bar1->bar1Total = 256ULL << 20;
    bar1->bar1Used = 4ULL << 20;
    bar1->bar1Free = bar1->bar1Total - bar1->bar1Used;
    RETURN(NVML_SUCCESS);
}

/* ---- load ---- */
typedef struct {
    unsigned int gpu, memory;
} nvmlUtilization_t;

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t h, nvmlUtilization_t *util) {
    DEVICE(h, d);
    UNSUPPORTED(d, U_UTIL);
    if (!util) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    util->gpu = d->util_gpu;
    util->memory = d->util_mem;
    RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t h, int sensor, unsigned int *temp) {
    DEVICE(h, d);
    UNSUPPORTED(d, U_TEMP);
    if (!temp || sensor != 0) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *temp = d->temp;
    RETURN(NVML_SUCCESS);
}

typedef struct {
    unsigned int version;
    int sensorType;
    int temperature;
} nvmlTemperature_v1_t;
#define NVML_TEMPERATURE_V1 0x100000Cu

#ifndef NO_TEMPERATURE_V
EXPORT nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t h, nvmlTemperature_v1_t *t) {
    DEVICE(h, d);
    UNSUPPORTED(d, U_TEMP);
    if (!t || t->sensorType != 0) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    if (t->version != NVML_TEMPERATURE_V1) RETURN(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    t->temperature = (int)d->temp;
    RETURN(NVML_SUCCESS);
}
#endif

EXPORT nvmlReturn_t nvmlDeviceGetTemperatureThreshold(nvmlDevice_t h, int type, unsigned int *t) {
    DEVICE(h, d);
    UNSUPPORTED(d, U_TEMP);
    if (!t) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *t = type == 0 ? 92 : 87; /* shutdown, slowdown */
    RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t h, unsigned int *power) {
    DEVICE(h, d);
    UNSUPPORTED(d, U_POWER);
    if (!power) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *power = d->power_mw;
    RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t h, unsigned int *limit) {
    DEVICE(h, d);
    UNSUPPORTED(d, U_POWER_LIMIT);
    UNSUPPORTED(d, U_ENFORCED_LIMIT);
    if (!limit) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *limit = d->enforced_mw < 0 ? d->power_limit_mw : (unsigned int)d->enforced_mw;
    RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t h, unsigned int *limit) {
    DEVICE(h, d);
    UNSUPPORTED(d, U_POWER_LIMIT);
    if (!limit) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *limit = d->power_limit_mw;
    RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t h, int *mode) {
    DEVICE(h, d);
    UNSUPPORTED(d, U_COMPUTE_MODE);
    if (!mode) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *mode = (int)d->compute_mode;
    RETURN(NVML_SUCCESS);
}

/* ---- MIG ---- */
EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t h, unsigned int *current,
                                         unsigned int *pending) {
    DEVICE(h, d);
    if (h->mig >= 0) RETURN(NVML_ERROR_NOT_SUPPORTED);
    UNSUPPORTED(d, U_MIG_MODE);
    if (!current || !pending) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *current = d->mig_mode;
    *pending = d->mig_pending < 0 ? d->mig_mode : (unsigned int)d->mig_pending;
    RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t h, unsigned int *count) {
    DEVICE(h, d);
    if (h->mig >= 0) RETURN(NVML_ERROR_NOT_SUPPORTED);
    UNSUPPORTED(d, U_MIG_MODE);
    if (!count) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *count = d->mig_mode ? d->max_mig : 0;
    RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t h, unsigned int index,
                                                        nvmlDevice_t *mig) {
    DEVICE(h, d);
    if (h->mig >= 0 || !mig) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    UNSUPPORTED(d, U_MIG_MODE);
    if (!d->mig_mode || index >= d->max_mig) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    /* Slots without a MIG device: NOT_FOUND, as NVIDIA's library says. */
    for (int m = 0; m < cur.nmig[h->gpu]; m++) {
        if (cur.migs[h->gpu][m].slot == (int)index) {
            *mig = &mig_handles[h->gpu][m];
            RETURN(NVML_SUCCESS);
        }
    }
    RETURN(NVML_ERROR_NOT_FOUND);
}

EXPORT nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t h, unsigned int *is_mig) {
    DEVICE(h, d);
    (void)d;
    if (!is_mig) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *is_mig = h->mig >= 0;
    RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t h,
                                                                 nvmlDevice_t *parent) {
    DEVICE(h, d);
    (void)d;
    if (!parent || h->mig < 0) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *parent = &gpu_handles[h->gpu];
    RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t h, unsigned int *id) {
    DEVICE(h, d);
    (void)d;
    if (!id || h->mig < 0) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *id = (unsigned int)h->mig + 1;
    RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t h, unsigned int *id) {
    DEVICE(h, d);
    (void)d;
    if (!id || h->mig < 0) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *id = 0;
    RETURN(NVML_SUCCESS);
}

/* ---- processes ---- */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_v2_t;

/* The NVML sizing protocol: NULL/short array -> INSUFFICIENT_SIZE with the count needed. */
static nvmlReturn_t list_procs(nvmlDevice_t h, unsigned int *count, void *infos, int version) {
    struct dev *d = NULL;
    nvmlReturn_t rc;
    unsigned int i, n;
    if (!cur.loaded || cur.no_driver) return NVML_ERROR_DRIVER_NOT_LOADED;
    if (init_count == 0) return NVML_ERROR_UNINITIALIZED;
    rc = lookup(h, &d, NULL);
    if (rc != NVML_SUCCESS) return rc;
    if (d->unsupported & U_PROCESSES) return NVML_ERROR_NOT_SUPPORTED;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    n = (unsigned int)d->nproc;
    if (d->procs_outgrow) {
        *count += MAX_PROCS; /* by the next read, more processes than this one offered room for */
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if (*count < n || (n > 0 && infos == NULL)) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    *count = n;
    for (i = 0; i < n; i++) {
        if (version == 1) {
            nvmlProcessInfo_v1_t *p = (nvmlProcessInfo_v1_t *)infos + i;
            p->pid = d->procs[i].pid;
            p->usedGpuMemory = d->procs[i].used;
        } else {
            nvmlProcessInfo_v2_t *p = (nvmlProcessInfo_v2_t *)infos + i;
            p->pid = d->procs[i].pid;
            p->usedGpuMemory = d->procs[i].used;
            p->gpuInstanceId = h->mig >= 0 ? (unsigned int)h->mig + 1 : d->procs[i].gi;
            p->computeInstanceId = 0;
        }
    }
    return NVML_SUCCESS;
}

static nvmlReturn_t no_procs(nvmlDevice_t h, unsigned int *count) {
    struct dev *d = NULL;
    nvmlReturn_t rc;
    if (!cur.loaded || cur.no_driver) return NVML_ERROR_DRIVER_NOT_LOADED;
    if (init_count == 0) return NVML_ERROR_UNINITIALIZED;
    rc = lookup(h, &d, NULL);
    if (rc != NVML_SUCCESS) return rc;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t h, unsigned int *count,
                                                         nvmlProcessInfo_v1_t *infos) {
    ENTER();
    RETURN(list_procs(h, count, infos, 1));
}

#ifndef NO_V2
EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t h, unsigned int *count,
                                                            nvmlProcessInfo_v2_t *infos) {
    ENTER();
    RETURN(list_procs(h, count, infos, 2));
}

EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t h, unsigned int *count,
                                                             nvmlProcessInfo_v2_t *infos) {
    (void)infos;
    ENTER();
    RETURN(no_procs(h, count));
}
#endif

#ifndef NO_V3
EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t h, unsigned int *count,
                                                            nvmlProcessInfo_v2_t *infos) {
    ENTER();
    RETURN(list_procs(h, count, infos, 3));
}

EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t h, unsigned int *count,
                                                             nvmlProcessInfo_v2_t *infos) {
    (void)infos;
    ENTER();
    RETURN(no_procs(h, count));
}

EXPORT nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t h,
                                                               unsigned int *count,
                                                               nvmlProcessInfo_v2_t *infos) {
    (void)infos;
    ENTER();
    RETURN(no_procs(h, count));
}
#endif

EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t h, unsigned int *count,
                                                          nvmlProcessInfo_v1_t *infos) {
    (void)infos;
    ENTER();
    RETURN(no_procs(h, count));
}

/* ---- extras other tools read (nvitop, gpustat): realistic constants or NOT_SUPPORTED ---- */
#define NOT_SUPPORTED_FN(fname, ...)          \
    EXPORT nvmlReturn_t fname(nvmlDevice_t h, __VA_ARGS__) { \
        DEVICE(h, d);                         \
        (void)d;                              \
        RETURN(NVML_ERROR_NOT_SUPPORTED);     \
    }

EXPORT nvmlReturn_t nvmlDeviceGetFanSpeed(nvmlDevice_t h, unsigned int *speed) {
    DEVICE(h, d);
    if (h->mig >= 0 || d->unsupported & U_TEMP) RETURN(NVML_ERROR_NOT_SUPPORTED);
    if (!speed) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *speed = 30 + d->util_gpu / 3;
    RETURN(NVML_SUCCESS);
}

static nvmlReturn_t codec_util(nvmlDevice_t h, unsigned int *util, unsigned int *period) {
    struct dev *d = NULL;
    nvmlReturn_t rc;
    if (!cur.loaded || cur.no_driver) return NVML_ERROR_DRIVER_NOT_LOADED;
    if (init_count == 0) return NVML_ERROR_UNINITIALIZED;
    rc = lookup(h, &d, NULL);
    if (rc != NVML_SUCCESS) return rc;
    if (d->unsupported & U_UTIL) return NVML_ERROR_NOT_SUPPORTED;
    if (!util || !period) return NVML_ERROR_INVALID_ARGUMENT;
    *util = 0;
    *period = 167000;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetEncoderUtilization(nvmlDevice_t h, unsigned int *util,
                                                    unsigned int *period) {
    ENTER();
    RETURN(codec_util(h, util, period));
}

EXPORT nvmlReturn_t nvmlDeviceGetDecoderUtilization(nvmlDevice_t h, unsigned int *util,
                                                    unsigned int *period) {
    ENTER();
    RETURN(codec_util(h, util, period));
}

EXPORT nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t h, int type, unsigned int *clock) {
    static const unsigned int mhz[] = {1410, 1410, 1593, 1275}; /* graphics, sm, mem, video */
    DEVICE(h, d);
    if (h->mig >= 0) RETURN(NVML_ERROR_NOT_SUPPORTED);
    (void)d;
    if (!clock || type < 0 || type > 3) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *clock = mhz[type];
    RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t h, int type, unsigned int *clock) {
    static const unsigned int mhz[] = {1980, 1980, 1593, 1980};
    DEVICE(h, d);
    if (h->mig >= 0) RETURN(NVML_ERROR_NOT_SUPPORTED);
    (void)d;
    if (!clock || type < 0 || type > 3) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *clock = mhz[type];
    RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetPerformanceState(nvmlDevice_t h, int *state) {
    DEVICE(h, d);
    if (h->mig >= 0) RETURN(NVML_ERROR_NOT_SUPPORTED);
    if (!state) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *state = d->util_gpu > 0 ? 0 : 8;
    RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t h, int *mode) {
    DEVICE(h, d);
    (void)d;
    if (!mode) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *mode = 1;
    RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetDisplayActive(nvmlDevice_t h, int *active) {
    DEVICE(h, d);
    (void)d;
    if (!active) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *active = 0;
    RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetDisplayMode(nvmlDevice_t h, int *mode) {
    DEVICE(h, d);
    (void)d;
    if (!mode) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *mode = 0;
    RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t h, int *major, int *minor) {
    DEVICE(h, d);
    if (!major || !minor) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *major = strstr(d->name, "L4") ? 8 : strstr(d->name, "H100") ? 9 : 8;
    *minor = strstr(d->name, "L4") ? 9 : 0;
    RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t h, int counter, unsigned int *kbs) {
    DEVICE(h, d);
    if (h->mig >= 0) RETURN(NVML_ERROR_NOT_SUPPORTED);
    if (!kbs || counter < 0 || counter > 1) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *kbs = d->util_gpu * 1000u;
    RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t h, int type, int counter,
                                                unsigned long long *count) {
    DEVICE(h, d);
    (void)d;
    if (!count || type < 0 || counter < 0) RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *count = 0;
    RETURN(NVML_SUCCESS);
}

NOT_SUPPORTED_FN(nvmlDeviceGetCurrentDriverModel, int *current, int *pending)
NOT_SUPPORTED_FN(nvmlDeviceGetDriverModel, int *current, int *pending)
NOT_SUPPORTED_FN(nvmlDeviceGetDriverModel_v2, int *current, int *pending)
NOT_SUPPORTED_FN(nvmlDeviceGetFanSpeed_v2, unsigned int fan, unsigned int *speed)
NOT_SUPPORTED_FN(nvmlDeviceGetNumFans, unsigned int *n)
NOT_SUPPORTED_FN(nvmlDeviceGetTotalEnergyConsumption, unsigned long long *mj)
NOT_SUPPORTED_FN(nvmlDeviceGetAccountingMode, int *mode)
NOT_SUPPORTED_FN(nvmlDeviceGetBoardPartNumber, char *s, unsigned int n)
NOT_SUPPORTED_FN(nvmlDeviceGetVbiosVersion, char *s, unsigned int n)
NOT_SUPPORTED_FN(nvmlDeviceGetNvLinkState, unsigned int link, int *active)
NOT_SUPPORTED_FN(nvmlDeviceGetFieldValues, int n, void *values)
NOT_SUPPORTED_FN(nvmlDeviceGetSamples, int type, unsigned long long since, int *vtype,
                 unsigned int *n, void *samples)
NOT_SUPPORTED_FN(nvmlDeviceGetProcessUtilization, void *u, unsigned int *n,
                 unsigned long long since)
NOT_SUPPORTED_FN(nvmlDeviceGetMemoryErrorCounter, int a, int b, int c, unsigned long long *n)
NOT_SUPPORTED_FN(nvmlDeviceGetArchitecture, unsigned int *arch)
NOT_SUPPORTED_FN(nvmlDeviceGetBrand, int *brand)
NOT_SUPPORTED_FN(nvmlDeviceGetCurrPcieLinkGeneration, unsigned int *g)
NOT_SUPPORTED_FN(nvmlDeviceGetCurrPcieLinkWidth, unsigned int *w)
NOT_SUPPORTED_FN(nvmlDeviceGetMaxPcieLinkGeneration, unsigned int *g)
NOT_SUPPORTED_FN(nvmlDeviceGetMaxPcieLinkWidth, unsigned int *w)
NOT_SUPPORTED_FN(nvmlDeviceGetCurrentClocksThrottleReasons, unsigned long long *r)
NOT_SUPPORTED_FN(nvmlDeviceGetCurrentClocksEventReasons, unsigned long long *r)
NOT_SUPPORTED_FN(nvmlDeviceGetRunningProcessDetailList, void *plist)
NOT_SUPPORTED_FN(nvmlDeviceGetMarginTemperature, void *t)
