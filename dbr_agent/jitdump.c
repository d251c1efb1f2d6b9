/*
 * jitdump.c — the marker perf needs to name replacement code (DBR_JITDUMP=1).
 *
 * perf (`perf record -k mono`, then `perf inject --jit`) finds a JIT's code records
 * through a file named jit-PID.dump that the process itself has mapped executable:
 * the mapping's MMAP record names the file, and inject reads its records.  The
 * agent creates that file in /tmp with the format's header and maps its first page;
 * the service appends a JIT_CODE_LOAD record for every region it installs
 * (dbr_service/installation/jitdump.py).  The file stays after the process ends, for inject.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "agent.h"

#define JITDUMP_MAGIC   0x4A695444u   /* "JiTD" */
#define JITDUMP_VERSION 1u
#define EM_X86_64_      62u

struct jitdump_header {
    uint32_t magic, version, total_size, elf_mach, pad1, pid;
    uint64_t timestamp, flags;
};

void dbr_jitdump_open(void)
{
    const char *v = secure_getenv("DBR_JITDUMP");
    struct jitdump_header h;
    struct timespec ts;
    char path[64];
    void *m;
    int fd;

    if (!v || strcmp(v, "1") != 0)
        return;
    snprintf(path, sizeof path, "/tmp/jit-%d.dump", (int)getpid());
    /* never through a link, never over another writer's file */
    fd = open(path, O_CREAT | O_EXCL | O_RDWR | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) {
        dbr_log("jitdump: %s: %s", path, strerror(errno));
        return;
    }
    memset(&h, 0, sizeof h);
    clock_gettime(CLOCK_MONOTONIC, &ts);
    h.magic = JITDUMP_MAGIC;
    h.version = JITDUMP_VERSION;
    h.total_size = sizeof h;
    h.elf_mach = EM_X86_64_;
    h.pid = (uint32_t)getpid();
    h.timestamp = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
    if (write(fd, &h, sizeof h) != (ssize_t)sizeof h) {
        dbr_log("jitdump: writing %s failed", path);
        close(fd);
        unlink(path);
        return;
    }
    /* the marker: an executable mapping of the file, kept for the process's life */
    m = mmap(NULL, (size_t)sysconf(_SC_PAGESIZE), PROT_READ | PROT_EXEC, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED)
        dbr_log("jitdump: mapping %s failed: %s", path, strerror(errno));
    close(fd);
}
