/*
 * A fake libamd_smi.so for tests and benchmarks: the real `amdsmi` Python package (AMD's
 * binding) loads it with CDLL("libamd_smi.so") and calls it as it would call AMD's library.
 *
 * The wrapper binds every `amdsmi_*` symbol at import time, so the library must export all of
 * them: tests/fakeamdsmi/__init__.py reads the symbol list of the installed wrapper and generates
 * `stubs.c` (every symbol not implemented here returns AMDSMI_STATUS_NOT_SUPPORTED) and
 * `layout.h` (the offsets and sizes of the structures below, read from the wrapper's own ctypes
 * definitions, so this file never restates AMD's structure layouts by hand).
 *
 * What the "driver" shows comes from a scenario file named by FAKE_AMDSMI_SCENARIO, re-read
 * whenever its path, inode, size or mtime changes (writers replace it atomically; a file without
 * its final "end" line is ignored). The format is line based:
 *
 *   driver 6.10.5               driver version; "driver none": amdsmi_init returns
 *                               AMDSMI_STATUS_DRIVER_NOT_LOADED (34)
 *   init_error N                amdsmi_init returns status N
 *   gpu                         starts a processor (a GPU, or one compute partition of a GPU);
 *                               processors are listed in this order
 *   socket N                    the socket (physical GPU) it belongs to (default: its own)
 *   uuid / name / hip_uuid / asic_serial S      strings (name = the ASIC's market name)
 *   bdf S                       "0000:07:00.0"
 *   hip_id / node_id / partition_id / device_id N
 *   compute_partition / memory_partition S      "SPX", "CPX" / "NPS1", "NPS4"
 *   vram_total / vram_used N    bytes
 *   gfx / umc N                 activity, percent
 *   temp_hotspot / temp_edge N  degrees Celsius
 *   power_w / power_cap_w N     current socket power and power cap, watts
 *   error N                     every call on this processor returns status N
 *   unsupported a,b,...         these return NOT_SUPPORTED (2): activity temp_hotspot temp_edge
 *                               power power_cap memory processes partition enumeration kfd asic
 *                               uuid bdf driver
 *   proc PID VRAM NAME          a process using the processor (VRAM in bytes)
 *   end                         required last line
 *
 * Calls before amdsmi_init (or after the matching amdsmi_shut_down) return
 * AMDSMI_STATUS_NOT_INIT (32), as AMD's library does.
 *
 * Extra, non-amdsmi symbols for tests: fakeamdsmi_calls(name), fakeamdsmi_total_calls(),
 * fakeamdsmi_reset_calls().
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "layout.h"

#define EXPORT __attribute__((visibility("default")))

typedef int amdsmi_status_t;
enum {
    ST_SUCCESS = 0,
    ST_INVAL = 1,
    ST_NOT_SUPPORTED = 2,
    ST_OUT_OF_RESOURCES = 15,
    ST_NOT_FOUND = 31,
    ST_NOT_INIT = 32,
    ST_DRIVER_NOT_LOADED = 34,
    ST_INSUFFICIENT_SIZE = 41,
};

#define MAX_PROCESSORS 64
#define MAX_PROCS 64
#define STR 96

enum {
    U_ACTIVITY = 1 << 0,
    U_TEMP_HOTSPOT = 1 << 1,
    U_TEMP_EDGE = 1 << 2,
    U_POWER = 1 << 3,
    U_POWER_CAP = 1 << 4,
    U_MEMORY = 1 << 5,
    U_PROCESSES = 1 << 6,
    U_PARTITION = 1 << 7,
    U_ENUMERATION = 1 << 8,
    U_KFD = 1 << 9,
    U_ASIC = 1 << 10,
    U_UUID = 1 << 11,
    U_BDF = 1 << 12,
    U_DRIVER = 1 << 13,
};

struct proc {
    uint32_t pid;
    uint64_t vram;
    char name[STR];
};

struct processor {
    int socket;
    char uuid[STR], name[STR], hip_uuid[STR], asic_serial[STR], bdf[32];
    char compute_partition[16], memory_partition[16];
    uint32_t hip_id, node_id, partition_id, device_id;
    uint64_t vram_total, vram_used;
    uint32_t gfx, umc, power_w, power_cap_w;
    int64_t temp_hotspot, temp_edge;
    int error;
    unsigned int unsupported;
    int nproc;
    struct proc procs[MAX_PROCS];
};

struct scenario {
    int loaded;
    int no_driver;
    int init_error;
    char driver[80];
    int n;
    struct processor p[MAX_PROCESSORS];
    int nsockets;
    int socket_ids[MAX_PROCESSORS]; /* socket number of each socket handle, in first-seen order */
};

/* Opaque handles: pointers into these arrays, stable for the life of the process. */
static char processor_handles[MAX_PROCESSORS];
static char socket_handles[MAX_PROCESSORS];

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct scenario cur, tmp;
static char cur_path[4096];
static struct stat cur_st;
static int init_count;

/* ---- call counters ---- */
#define MAX_COUNTERS 64
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

EXPORT unsigned long fakeamdsmi_calls(const char *name) {
    unsigned long n = 0;
    int i;
    pthread_mutex_lock(&mu);
    for (i = 0; i < ncounters; i++)
        if (strcmp(counters[i].name, name) == 0) n += counters[i].count;
    pthread_mutex_unlock(&mu);
    return n;
}

EXPORT unsigned long fakeamdsmi_total_calls(void) {
    unsigned long n = 0;
    int i;
    pthread_mutex_lock(&mu);
    for (i = 0; i < ncounters; i++) n += counters[i].count;
    pthread_mutex_unlock(&mu);
    return n;
}

EXPORT void fakeamdsmi_reset_calls(void) {
    int i;
    pthread_mutex_lock(&mu);
    for (i = 0; i < ncounters; i++) counters[i].count = 0;
    pthread_mutex_unlock(&mu);
}

/* ---- scenario parsing ---- */
static void copy_str(char *dst, size_t n, const char *src) { snprintf(dst, n, "%s", src); }

static unsigned int parse_unsupported(const char *s) {
    static const struct {
        const char *name;
        unsigned int bit;
    } names[] = {
        {"activity", U_ACTIVITY}, {"temp_hotspot", U_TEMP_HOTSPOT}, {"temp_edge", U_TEMP_EDGE},
        {"power", U_POWER},       {"power_cap", U_POWER_CAP},       {"memory", U_MEMORY},
        {"processes", U_PROCESSES}, {"partition", U_PARTITION},     {"enumeration", U_ENUMERATION},
        {"kfd", U_KFD},           {"asic", U_ASIC},                 {"uuid", U_UUID},
        {"bdf", U_BDF},           {"driver", U_DRIVER},
    };
    unsigned int bits = 0;
    char buf[512], *tok, *save = NULL;
    size_t i;
    copy_str(buf, sizeof buf, s);
    for (tok = strtok_r(buf, ", ", &save); tok; tok = strtok_r(NULL, ", ", &save))
        for (i = 0; i < sizeof names / sizeof names[0]; i++)
            if (strcmp(tok, names[i].name) == 0) bits |= names[i].bit;
    return bits;
}

static int parse_file(const char *path, struct scenario *sc) {
    FILE *fh = fopen(path, "r");
    char line[1024];
    struct processor *d = NULL;
    int complete = 0, i;
    if (!fh) return -1;
    memset(sc, 0, sizeof *sc);
    copy_str(sc->driver, sizeof sc->driver, "6.10.5");
    while (fgets(line, sizeof line, fh)) {
        char *key = line, *val, *nl = strchr(line, '\n');
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
        } else if (strcmp(key, "gpu") == 0) {
            if (sc->n >= MAX_PROCESSORS) break;
            d = &sc->p[sc->n];
            d->socket = 1000 + sc->n; /* its own socket unless told */
            copy_str(d->compute_partition, sizeof d->compute_partition, "SPX");
            copy_str(d->memory_partition, sizeof d->memory_partition, "NPS1");
            d->hip_id = (uint32_t)sc->n;
            d->node_id = (uint32_t)sc->n + 1;
            d->device_id = 0x74a1;
            copy_str(d->bdf, sizeof d->bdf, "0000:00:00.0");
            sc->n++;
        } else if (d == NULL) {
            continue;
        } else if (strcmp(key, "socket") == 0) {
            d->socket = atoi(val);
        } else if (strcmp(key, "uuid") == 0) {
            copy_str(d->uuid, sizeof d->uuid, val);
        } else if (strcmp(key, "name") == 0) {
            copy_str(d->name, sizeof d->name, val);
        } else if (strcmp(key, "hip_uuid") == 0) {
            copy_str(d->hip_uuid, sizeof d->hip_uuid, val);
        } else if (strcmp(key, "asic_serial") == 0) {
            copy_str(d->asic_serial, sizeof d->asic_serial, val);
        } else if (strcmp(key, "bdf") == 0) {
            copy_str(d->bdf, sizeof d->bdf, val);
        } else if (strcmp(key, "compute_partition") == 0) {
            copy_str(d->compute_partition, sizeof d->compute_partition, val);
        } else if (strcmp(key, "memory_partition") == 0) {
            copy_str(d->memory_partition, sizeof d->memory_partition, val);
        } else if (strcmp(key, "hip_id") == 0) {
            d->hip_id = (uint32_t)strtoul(val, NULL, 0);
        } else if (strcmp(key, "node_id") == 0) {
            d->node_id = (uint32_t)strtoul(val, NULL, 0);
        } else if (strcmp(key, "partition_id") == 0) {
            d->partition_id = (uint32_t)strtoul(val, NULL, 0);
        } else if (strcmp(key, "device_id") == 0) {
            d->device_id = (uint32_t)strtoul(val, NULL, 0);
        } else if (strcmp(key, "vram_total") == 0) {
            d->vram_total = strtoull(val, NULL, 10);
        } else if (strcmp(key, "vram_used") == 0) {
            d->vram_used = strtoull(val, NULL, 10);
        } else if (strcmp(key, "gfx") == 0) {
            d->gfx = (uint32_t)strtoul(val, NULL, 10);
        } else if (strcmp(key, "umc") == 0) {
            d->umc = (uint32_t)strtoul(val, NULL, 10);
        } else if (strcmp(key, "temp_hotspot") == 0) {
            d->temp_hotspot = strtoll(val, NULL, 10);
        } else if (strcmp(key, "temp_edge") == 0) {
            d->temp_edge = strtoll(val, NULL, 10);
        } else if (strcmp(key, "power_w") == 0) {
            d->power_w = (uint32_t)strtoul(val, NULL, 10);
        } else if (strcmp(key, "power_cap_w") == 0) {
            d->power_cap_w = (uint32_t)strtoul(val, NULL, 10);
        } else if (strcmp(key, "error") == 0) {
            d->error = atoi(val);
        } else if (strcmp(key, "unsupported") == 0) {
            d->unsupported |= parse_unsupported(val);
        } else if (strcmp(key, "proc") == 0) {
            char *end = NULL, *name;
            unsigned long pid = strtoul(val, &end, 10);
            unsigned long long vram = strtoull(end, &name, 10);
            while (name && *name == ' ') name++;
            if (d->nproc < MAX_PROCS) {
                d->procs[d->nproc].pid = (uint32_t)pid;
                d->procs[d->nproc].vram = vram;
                copy_str(d->procs[d->nproc].name, STR, name ? name : "");
                d->nproc++;
            }
        }
    }
    fclose(fh);
    /* sockets in first-seen order */
    for (i = 0; i < sc->n; i++) {
        int s, found = 0;
        for (s = 0; s < sc->nsockets; s++)
            if (sc->socket_ids[s] == sc->p[i].socket) found = 1;
        if (!found) sc->socket_ids[sc->nsockets++] = sc->p[i].socket;
    }
    sc->loaded = complete;
    return complete ? 0 : -1;
}

static void refresh(void) {
    const char *path = getenv("FAKE_AMDSMI_SCENARIO");
    struct stat st;
    if (!path || !*path) return;
    if (stat(path, &st) != 0) return;
    if (cur.loaded && strcmp(path, cur_path) == 0 && st.st_ino == cur_st.st_ino &&
        st.st_dev == cur_st.st_dev && st.st_size == cur_st.st_size &&
        st.st_mtim.tv_sec == cur_st.st_mtim.tv_sec && st.st_mtim.tv_nsec == cur_st.st_mtim.tv_nsec)
        return;
    if (parse_file(path, &tmp) == 0) {
        memcpy(&cur, &tmp, sizeof cur);
        copy_str(cur_path, sizeof cur_path, path);
        cur_st = st;
    }
}

#define ENTER()              \
    pthread_mutex_lock(&mu); \
    count_call(__func__);    \
    refresh()

#define RETURN(code)                  \
    do {                              \
        amdsmi_status_t rc_ = (code); \
        pthread_mutex_unlock(&mu);    \
        return rc_;                   \
    } while (0)

#define REQUIRE_INIT()                                                    \
    do {                                                                  \
        if (!cur.loaded || cur.no_driver) RETURN(ST_DRIVER_NOT_LOADED);   \
        if (init_count == 0) RETURN(ST_NOT_INIT);                         \
    } while (0)

static amdsmi_status_t lookup(void *h, struct processor **out) {
    char *c = (char *)h;
    long i;
    if (c < processor_handles || c >= processor_handles + MAX_PROCESSORS) return ST_INVAL;
    i = c - processor_handles;
    if (i >= cur.n) return ST_NOT_FOUND;
    *out = &cur.p[i];
    if (cur.p[i].error) return cur.p[i].error;
    return ST_SUCCESS;
}

#define PROCESSOR(h, d)                               \
    struct processor *d = NULL;                       \
    ENTER();                                          \
    REQUIRE_INIT();                                   \
    {                                                 \
        amdsmi_status_t lrc_ = lookup((h), &d);       \
        if (lrc_ != ST_SUCCESS) RETURN(lrc_);         \
    }

#define UNSUPPORTED(d, bit) \
    if ((d)->unsupported & (bit)) RETURN(ST_NOT_SUPPORTED)

/* Field access by the wrapper's own offsets (layout.h). */
#define AT(p, st, f) ((char *)(p) + OFF_##st##__##f)
#define PUT32(p, st, f, v) (*(uint32_t *)AT(p, st, f) = (uint32_t)(v))
#define PUT64(p, st, f, v) (*(uint64_t *)AT(p, st, f) = (uint64_t)(v))
#define PUTSTR(p, st, f, s) snprintf(AT(p, st, f), LEN_##st##__##f, "%s", (s))

/* ---- init ---- */
EXPORT amdsmi_status_t amdsmi_init(uint64_t flags) {
    (void)flags;
    ENTER();
    if (!cur.loaded || cur.no_driver) RETURN(ST_DRIVER_NOT_LOADED);
    if (cur.init_error) RETURN(cur.init_error);
    init_count++;
    RETURN(ST_SUCCESS);
}

EXPORT amdsmi_status_t amdsmi_shut_down(void) {
    ENTER();
    if (init_count == 0) RETURN(ST_NOT_INIT);
    init_count--;
    RETURN(ST_SUCCESS);
}

/* ---- discovery ---- */
EXPORT amdsmi_status_t amdsmi_get_socket_handles(uint32_t *count, void **handles) {
    int i;
    ENTER();
    REQUIRE_INIT();
    if (!count) RETURN(ST_INVAL);
    if (handles == NULL) {
        *count = (uint32_t)cur.nsockets;
        RETURN(ST_SUCCESS);
    }
    for (i = 0; i < cur.nsockets && (uint32_t)i < *count; i++) handles[i] = &socket_handles[i];
    *count = (uint32_t)i;
    RETURN(ST_SUCCESS);
}

EXPORT amdsmi_status_t amdsmi_get_processor_handles(void *socket, uint32_t *count,
                                                    void **handles) {
    char *c = (char *)socket;
    long s;
    int i;
    uint32_t n = 0;
    ENTER();
    REQUIRE_INIT();
    if (!count || c < socket_handles || c >= socket_handles + MAX_PROCESSORS) RETURN(ST_INVAL);
    s = c - socket_handles;
    if (s >= cur.nsockets) RETURN(ST_NOT_FOUND);
    for (i = 0; i < cur.n; i++) {
        if (cur.p[i].socket != cur.socket_ids[s]) continue;
        if (handles != NULL) {
            if (n >= *count) break;
            handles[n] = &processor_handles[i];
        }
        n++;
    }
    *count = n;
    RETURN(ST_SUCCESS);
}

EXPORT amdsmi_status_t amdsmi_get_processor_type(void *h, uint32_t *type) {
    PROCESSOR(h, d);
    (void)d;
    if (!type) RETURN(ST_INVAL);
    *type = 1; /* AMDSMI_PROCESSOR_TYPE_AMD_GPU */
    RETURN(ST_SUCCESS);
}

/* ---- identity ---- */
EXPORT amdsmi_status_t amdsmi_get_gpu_device_uuid(void *h, uint32_t *len, char *uuid) {
    PROCESSOR(h, d);
    UNSUPPORTED(d, U_UUID);
    if (!len || !uuid) RETURN(ST_INVAL);
    if (*len < strlen(d->uuid) + 1) RETURN(ST_INSUFFICIENT_SIZE);
    copy_str(uuid, *len, d->uuid);
    *len = (uint32_t)strlen(d->uuid);
    RETURN(ST_SUCCESS);
}

EXPORT amdsmi_status_t amdsmi_get_gpu_device_bdf(void *h, void *bdf) {
    unsigned int domain = 0, bus = 0, dev = 0, fn = 0;
    PROCESSOR(h, d);
    UNSUPPORTED(d, U_BDF);
    if (!bdf) RETURN(ST_INVAL);
    sscanf(d->bdf, "%x:%x:%x.%x", &domain, &bus, &dev, &fn);
    /* the union's as_uint: function (3 bits), device (5), bus (8), domain (48) */
    PUT64(bdf, amdsmi_bdf_t, as_uint,
          (uint64_t)(fn & 7) | ((uint64_t)(dev & 31) << 3) | ((uint64_t)(bus & 255) << 8) |
              ((uint64_t)domain << 16));
    RETURN(ST_SUCCESS);
}

EXPORT amdsmi_status_t amdsmi_get_gpu_asic_info(void *h, void *info) {
    PROCESSOR(h, d);
    UNSUPPORTED(d, U_ASIC);
    if (!info) RETURN(ST_INVAL);
    memset(info, 0, SIZEOF_amdsmi_asic_info_t);
    PUTSTR(info, amdsmi_asic_info_t, market_name, d->name);
    PUT32(info, amdsmi_asic_info_t, vendor_id, 0x1002);
    PUTSTR(info, amdsmi_asic_info_t, vendor_name, "Advanced Micro Devices Inc. [AMD/ATI]");
    PUT32(info, amdsmi_asic_info_t, subvendor_id, 0x1002);
    PUT64(info, amdsmi_asic_info_t, device_id, d->device_id);
    PUT32(info, amdsmi_asic_info_t, rev_id, 0);
    PUTSTR(info, amdsmi_asic_info_t, asic_serial, d->asic_serial);
    PUT32(info, amdsmi_asic_info_t, oam_id, (uint32_t)(d->socket % 1000));
    PUT32(info, amdsmi_asic_info_t, num_of_compute_units,
          strcmp(d->compute_partition, "CPX") == 0 ? 38 : 304);
    PUT64(info, amdsmi_asic_info_t, target_graphics_version, 0x942);
    PUT32(info, amdsmi_asic_info_t, subsystem_id, 0x74a1);
    RETURN(ST_SUCCESS);
}

EXPORT amdsmi_status_t amdsmi_get_gpu_enumeration_info(void *h, void *info) {
    PROCESSOR(h, d);
    UNSUPPORTED(d, U_ENUMERATION);
    if (!info) RETURN(ST_INVAL);
    memset(info, 0, SIZEOF_amdsmi_enumeration_info_t);
    PUT32(info, amdsmi_enumeration_info_t, drm_render, 128 + d->hip_id);
    PUT32(info, amdsmi_enumeration_info_t, drm_card, d->hip_id);
    PUT32(info, amdsmi_enumeration_info_t, hsa_id, d->node_id);
    PUT32(info, amdsmi_enumeration_info_t, hip_id, d->hip_id);
    PUTSTR(info, amdsmi_enumeration_info_t, hip_uuid, d->hip_uuid);
    RETURN(ST_SUCCESS);
}

EXPORT amdsmi_status_t amdsmi_get_gpu_kfd_info(void *h, void *info) {
    PROCESSOR(h, d);
    UNSUPPORTED(d, U_KFD);
    if (!info) RETURN(ST_INVAL);
    memset(info, 0, SIZEOF_amdsmi_kfd_info_t);
    PUT64(info, amdsmi_kfd_info_t, kfd_id, 10000 + d->node_id);
    PUT32(info, amdsmi_kfd_info_t, node_id, d->node_id);
    PUT32(info, amdsmi_kfd_info_t, current_partition_id, d->partition_id);
    RETURN(ST_SUCCESS);
}

EXPORT amdsmi_status_t amdsmi_get_gpu_compute_partition(void *h, char *buf, uint32_t len) {
    PROCESSOR(h, d);
    UNSUPPORTED(d, U_PARTITION);
    if (!buf || len == 0) RETURN(ST_INVAL);
    copy_str(buf, len, d->compute_partition);
    RETURN(ST_SUCCESS);
}

EXPORT amdsmi_status_t amdsmi_get_gpu_memory_partition(void *h, char *buf, uint32_t len) {
    PROCESSOR(h, d);
    UNSUPPORTED(d, U_PARTITION);
    if (!buf || len == 0) RETURN(ST_INVAL);
    copy_str(buf, len, d->memory_partition);
    RETURN(ST_SUCCESS);
}

EXPORT amdsmi_status_t amdsmi_get_gpu_driver_info(void *h, void *info) {
    PROCESSOR(h, d);
    UNSUPPORTED(d, U_DRIVER);
    if (!info) RETURN(ST_INVAL);
    memset(info, 0, SIZEOF_amdsmi_driver_info_t);
    PUTSTR(info, amdsmi_driver_info_t, driver_version, cur.driver);
    PUTSTR(info, amdsmi_driver_info_t, driver_date, "2025/01/01 00:00");
    PUTSTR(info, amdsmi_driver_info_t, driver_name, "amdgpu");
    RETURN(ST_SUCCESS);
}

/* ---- load ---- */
EXPORT amdsmi_status_t amdsmi_get_gpu_memory_total(void *h, uint32_t type, uint64_t *total) {
    PROCESSOR(h, d);
    UNSUPPORTED(d, U_MEMORY);
    if (!total) RETURN(ST_INVAL);
    if (type != AMDSMI_MEM_TYPE_VRAM) RETURN(ST_NOT_SUPPORTED);
    *total = d->vram_total;
    RETURN(ST_SUCCESS);
}

EXPORT amdsmi_status_t amdsmi_get_gpu_memory_usage(void *h, uint32_t type, uint64_t *used) {
    PROCESSOR(h, d);
    UNSUPPORTED(d, U_MEMORY);
    if (!used) RETURN(ST_INVAL);
    if (type != AMDSMI_MEM_TYPE_VRAM) RETURN(ST_NOT_SUPPORTED);
    *used = d->vram_used;
    RETURN(ST_SUCCESS);
}

EXPORT amdsmi_status_t amdsmi_get_gpu_activity(void *h, void *usage) {
    PROCESSOR(h, d);
    UNSUPPORTED(d, U_ACTIVITY);
    if (!usage) RETURN(ST_INVAL);
    memset(usage, 0, SIZEOF_amdsmi_engine_usage_t);
    PUT32(usage, amdsmi_engine_usage_t, gfx_activity, d->gfx);
    PUT32(usage, amdsmi_engine_usage_t, umc_activity, d->umc);
    PUT32(usage, amdsmi_engine_usage_t, mm_activity, 0xFFFF); /* N/A on Instinct */
    RETURN(ST_SUCCESS);
}

EXPORT amdsmi_status_t amdsmi_get_temp_metric(void *h, uint32_t sensor, uint32_t metric,
                                              int64_t *value) {
    PROCESSOR(h, d);
    if (!value) RETURN(ST_INVAL);
    if (metric != AMDSMI_TEMP_CURRENT) RETURN(ST_NOT_SUPPORTED);
    if (sensor == AMDSMI_TEMPERATURE_TYPE_HOTSPOT) {
        UNSUPPORTED(d, U_TEMP_HOTSPOT);
        *value = d->temp_hotspot;
    } else if (sensor == AMDSMI_TEMPERATURE_TYPE_EDGE) {
        UNSUPPORTED(d, U_TEMP_EDGE);
        *value = d->temp_edge;
    } else {
        RETURN(ST_NOT_SUPPORTED);
    }
    RETURN(ST_SUCCESS);
}

EXPORT amdsmi_status_t amdsmi_get_power_info(void *h, void *info) {
    PROCESSOR(h, d);
    UNSUPPORTED(d, U_POWER);
    if (!info) RETURN(ST_INVAL);
    memset(info, 0, SIZEOF_amdsmi_power_info_t);
    PUT64(info, amdsmi_power_info_t, socket_power, d->power_w);
    PUT32(info, amdsmi_power_info_t, current_socket_power, d->power_w);
    PUT32(info, amdsmi_power_info_t, average_socket_power, 0xFFFF); /* N/A on MI300 */
    PUT64(info, amdsmi_power_info_t, gfx_voltage, 0xFFFF);
    PUT64(info, amdsmi_power_info_t, soc_voltage, 0xFFFF);
    PUT64(info, amdsmi_power_info_t, mem_voltage, 0xFFFF);
    PUT32(info, amdsmi_power_info_t, power_limit, d->power_cap_w);
    RETURN(ST_SUCCESS);
}

EXPORT amdsmi_status_t amdsmi_get_power_cap_info(void *h, uint32_t sensor, void *info) {
    PROCESSOR(h, d);
    UNSUPPORTED(d, U_POWER_CAP);
    if (!info || sensor != 0) RETURN(ST_INVAL);
    memset(info, 0, SIZEOF_amdsmi_power_cap_info_t);
    /* microwatts, as AMD's library reports them */
    PUT64(info, amdsmi_power_cap_info_t, power_cap, (uint64_t)d->power_cap_w * 1000000u);
    PUT64(info, amdsmi_power_cap_info_t, default_power_cap, (uint64_t)d->power_cap_w * 1000000u);
    PUT64(info, amdsmi_power_cap_info_t, min_power_cap, 0);
    PUT64(info, amdsmi_power_cap_info_t, max_power_cap, (uint64_t)d->power_cap_w * 1000000u);
    RETURN(ST_SUCCESS);
}

EXPORT amdsmi_status_t amdsmi_get_gpu_process_list(void *h, uint32_t *max, void *list) {
    int i;
    PROCESSOR(h, d);
    UNSUPPORTED(d, U_PROCESSES);
    if (!max) RETURN(ST_INVAL);
    if (list == NULL || *max < (uint32_t)d->nproc) {
        int fill = list == NULL ? 0 : (int)*max;
        for (i = 0; i < fill && i < d->nproc; i++) {
            char *e = (char *)list + (size_t)i * SIZEOF_amdsmi_proc_info_t;
            memset(e, 0, SIZEOF_amdsmi_proc_info_t);
            PUT32(e, amdsmi_proc_info_t, pid, d->procs[i].pid);
        }
        *max = (uint32_t)d->nproc;
        RETURN(list == NULL ? ST_SUCCESS : ST_OUT_OF_RESOURCES);
    }
    for (i = 0; i < d->nproc; i++) {
        char *e = (char *)list + (size_t)i * SIZEOF_amdsmi_proc_info_t;
        memset(e, 0, SIZEOF_amdsmi_proc_info_t);
        PUTSTR(e, amdsmi_proc_info_t, name, d->procs[i].name);
        PUT32(e, amdsmi_proc_info_t, pid, d->procs[i].pid);
        PUT64(e, amdsmi_proc_info_t, mem, d->procs[i].vram);
        PUT64(e, amdsmi_proc_info_t, memory_usage__vram_mem, d->procs[i].vram);
        PUT32(e, amdsmi_proc_info_t, cu_occupancy, 0xFFFFFFFFu);
    }
    *max = (uint32_t)d->nproc;
    RETURN(ST_SUCCESS);
}
