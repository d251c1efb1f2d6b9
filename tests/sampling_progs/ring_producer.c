/* ring_producer FD NTHREADS COUNT [SPIN]: synthetic agent-timer producer.
 *
 * Maps the sampler ring memfd FD (struct dbr_ring_header + entries) and pushes COUNT
 * entries from each of NTHREADS threads with the exact protocol of
 * shared/dbr_protocol.h: reserve slot `head` by CAS while head - tail < capacity (else
 * count a drop), fill pc/tid, publish seq = (uint32)(slot + 1) with release ordering.
 * Entry k of thread j has pc = (j + 1) << 32 | k.  SPIN busy-waits that many iterations
 * between pushes.  Prints "thread J TID PUSHED DROPPED" per thread at the end. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "dbr_protocol.h"

static struct dbr_ring_header *ring;
static long count, spin;
static pthread_barrier_t go;

struct result { long tid, pushed, dropped; } results[64];

static int push(uint64_t pc, uint32_t tid)
{
    uint64_t head = __atomic_load_n(&ring->head, __ATOMIC_RELAXED);
    for (;;) {
        uint64_t tail = __atomic_load_n(&ring->tail, __ATOMIC_ACQUIRE);
        if (head - tail >= ring->capacity) {
            __atomic_fetch_add(&ring->dropped, 1, __ATOMIC_RELAXED);
            return -1;
        }
        if (__atomic_compare_exchange_n(&ring->head, &head, head + 1, 0,
                                        __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            break;
    }
    struct dbr_ring_entry *e = (struct dbr_ring_entry *)((char *)(ring + 1) +
        (head & (ring->capacity - 1)) * ring->entry_size);
    e->pc = pc;
    e->tid = tid;
    __atomic_store_n(&e->seq, (uint32_t)(head + 1), __ATOMIC_RELEASE);
    return 0;
}

static void *producer(void *arg)
{
    long j = (long)arg;
    struct result *r = &results[j];
    r->tid = syscall(SYS_gettid);
    pthread_barrier_wait(&go);
    for (long k = 0; k < count; k++) {
        if (push(((uint64_t)(j + 1) << 32) | (uint64_t)k, (uint32_t)r->tid) == 0)
            r->pushed++;
        else
            r->dropped++;
        for (volatile long s = 0; s < spin; s++)
            ;
    }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc < 4)
        return 2;
    int fd = atoi(argv[1]);
    long n = atol(argv[2]);
    count = atol(argv[3]);
    spin = argc > 4 ? atol(argv[4]) : 0;
    struct stat st;
    if (n < 1 || n > 64 || fstat(fd, &st) != 0)
        return 2;
    ring = mmap(NULL, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (ring == MAP_FAILED || ring->magic != DBR_RING_MAGIC)
        return 3;
    pthread_t t[64];
    pthread_barrier_init(&go, NULL, n);
    for (long j = 0; j < n; j++)
        pthread_create(&t[j], NULL, producer, (void *)j);
    for (long j = 0; j < n; j++)
        pthread_join(t[j], NULL);
    for (long j = 0; j < n; j++)
        printf("thread %ld %ld %ld %ld\n", j, results[j].tid, results[j].pushed,
               results[j].dropped);
    return 0;
}
