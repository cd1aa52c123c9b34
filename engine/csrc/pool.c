/* A persistent thread pool. Its threads (workers 1..n-1) are pinned to the cores
 * the lane was given; worker 0 is the calling thread, which the pool leaves alone.
 *
 * One forward step runs ~6 parallel regions per layer, so waking threads through
 * the kernel for every region would cost more than the work in decode. Workers
 * therefore spin on a generation counter between regions and only fall back to a
 * condition variable after a long idle spin (between steps). Items are handed out
 * one at a time from an atomic counter, so uneven items (a hot expert) balance. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#include "internal.h"

#define SPIN_BEFORE_SLEEP 200000 /* pause iterations (~a few ms) before sleeping */

struct st_pool;

typedef struct {
    struct st_pool *pool;
    int index;
    int core;
    double busy; /* seconds spent draining items; written by this worker only */
    char pad[40]; /* keep each worker's counter on its own cache line */
} worker_arg;

struct st_pool {
    int n_threads;
    pthread_t *threads;
    worker_arg *args;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    _Atomic uint64_t generation;
    _Atomic int64_t next_item;
    _Atomic int n_done;
    _Atomic int stop;
    _Atomic int n_sleeping;
    st_task_fn fn;
    void *ctx;
    int64_t n_items;
    double busy0, total; /* the caller's (worker 0's) busy time; region wall x n_threads */
};

static double mono_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void pin_self(int core) {
    if (core < 0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(core, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set); /* best effort */
}

static void drain_items(st_pool *p, int thread) {
    for (;;) {
        const int64_t i = atomic_fetch_add_explicit(&p->next_item, 1, memory_order_relaxed);
        if (i >= p->n_items) break;
        p->fn(p->ctx, i, thread);
    }
}

static void *worker_main(void *argp) {
    worker_arg *a = argp;
    st_pool *p = a->pool;
    pin_self(a->core);
    uint64_t seen = 0;
    for (;;) {
        uint64_t g;
        int spins = 0;
        while ((g = atomic_load_explicit(&p->generation, memory_order_acquire)) == seen) {
            if (atomic_load_explicit(&p->stop, memory_order_relaxed)) return NULL;
            if (++spins < SPIN_BEFORE_SLEEP) {
                /* yield now and then so an oversubscribed machine still makes progress */
                if (spins % 1024 == 0) sched_yield();
                else CPU_RELAX();
                continue;
            }
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->n_sleeping, 1);
            while (atomic_load(&p->generation) == seen && !atomic_load(&p->stop)) pthread_cond_wait(&p->cv, &p->mu);
            atomic_fetch_sub(&p->n_sleeping, 1);
            pthread_mutex_unlock(&p->mu);
            spins = 0;
        }
        seen = g;
        const double t0 = mono_s();
        drain_items(p, a->index);
        a->busy += mono_s() - t0; /* published by the release below */
        atomic_fetch_add_explicit(&p->n_done, 1, memory_order_acq_rel);
    }
}

st_status st_pool_create(int32_t n_threads, const int32_t *cores, int32_t n_cores, st_pool **out) {
    if (!out) return st_fail(ST_EINVAL, "pool_create: out is NULL");
    *out = NULL;
    if (n_threads < 1 || n_threads > 1024) return st_fail(ST_EINVAL, "pool_create: n_threads=%d out of range", n_threads);
    if (cores && n_cores < 1) return st_fail(ST_EINVAL, "pool_create: empty core list");
    st_pool *p = calloc(1, sizeof *p);
    if (!p) return st_fail(ST_ENOMEM, "pool_create: out of memory");
    p->n_threads = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->threads = calloc((size_t)n_threads, sizeof *p->threads);
    p->args = calloc((size_t)n_threads, sizeof *p->args);
    if (!p->threads || !p->args) {
        st_pool_destroy(p);
        return st_fail(ST_ENOMEM, "pool_create: out of memory");
    }
    for (int i = 1; i < n_threads; i++) {
        p->args[i] = (worker_arg){.pool = p, .index = i, .core = cores ? cores[i % n_cores] : -1};
        if (pthread_create(&p->threads[i], NULL, worker_main, &p->args[i]) != 0) {
            p->n_threads = i; /* destroy joins only the threads that exist */
            st_pool_destroy(p);
            return st_fail(ST_ETHREAD, "pool_create: pthread_create failed for worker %d", i);
        }
    }
    *out = p;
    return ST_OK;
}

void st_pool_destroy(st_pool *p) {
    if (!p) return;
    atomic_store(&p->stop, 1);
    pthread_mutex_lock(&p->mu);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n_threads; i++)
        if (p->threads && p->threads[i]) pthread_join(p->threads[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p->threads);
    free(p->args);
    free(p);
}

int32_t st_pool_threads(const st_pool *p) { return p ? p->n_threads : 0; }

void st_pool_run(st_pool *p, st_task_fn fn, void *ctx, int64_t n_items) {
    if (n_items <= 0) return;
    const double t_start = mono_s();
    if (!p || p->n_threads == 1 || n_items == 1) {
        for (int64_t i = 0; i < n_items; i++) fn(ctx, i, 0);
        if (p) { /* the other workers sat idle through this region */
            const double dt = mono_s() - t_start;
            p->busy0 += dt, p->total += dt * p->n_threads;
        }
        return;
    }
    p->fn = fn;
    p->ctx = ctx;
    p->n_items = n_items;
    atomic_store_explicit(&p->next_item, 0, memory_order_relaxed);
    atomic_store_explicit(&p->n_done, 0, memory_order_relaxed);
    atomic_fetch_add(&p->generation, 1); /* seq_cst: pairs with n_sleeping */
    if (atomic_load(&p->n_sleeping) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    drain_items(p, 0);
    p->busy0 += mono_s() - t_start;
    for (int spins = 1; atomic_load_explicit(&p->n_done, memory_order_acquire) < p->n_threads - 1; spins++) {
        if (spins % 1024 == 0) sched_yield();
        else CPU_RELAX();
    }
    p->total += (mono_s() - t_start) * p->n_threads;
}

void st_pool_times(const st_pool *p, double *busy, double *total) {
    double b = 0.0, t = 0.0;
    if (p) {
        b = p->busy0, t = p->total;
        for (int i = 1; i < p->n_threads; i++) b += p->args[i].busy;
    }
    *busy = b, *total = t;
}

/* ------------------------------------------------------------------ memory read probe */

typedef struct {
    const uint64_t *buf;
    int64_t n_words, per_item;
    uint64_t sums[256]; /* one per item, so the reads cannot be dropped */
} read_ctx;

static void read_task(void *vctx, int64_t item, int thread) {
    (void)thread;
    read_ctx *c = vctx;
    const int64_t a = item * c->per_item, b = a + c->per_item < c->n_words ? a + c->per_item : c->n_words;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0; /* four chains: the loop is bound by memory, not adds */
    int64_t i = a;
    for (; i + 4 <= b; i += 4) s0 += c->buf[i], s1 += c->buf[i + 1], s2 += c->buf[i + 2], s3 += c->buf[i + 3];
    for (; i < b; i++) s0 += c->buf[i];
    c->sums[item] = s0 + s1 + s2 + s3;
}

st_status st_mem_read_gbs(st_pool *pool, int64_t bytes, int32_t passes, double *gb_s) {
    if (!pool || !gb_s) return st_fail(ST_EINVAL, "st_mem_read_gbs: pool and gb_s are required");
    if (bytes < ((int64_t)1 << 20) || bytes > ((int64_t)64 << 30))
        return st_fail(ST_EINVAL, "st_mem_read_gbs: %lld bytes outside [1 MiB, 64 GiB]", (long long)bytes);
    if (passes < 1 || passes > 1000) return st_fail(ST_EINVAL, "st_mem_read_gbs: passes = %d outside [1, 1000]", passes);
    read_ctx *c = calloc(1, sizeof *c);
    const int64_t n_words = bytes / 8;
    uint64_t *buf = malloc((size_t)n_words * 8);
    if (!c || !buf) {
        free(c);
        free(buf);
        return st_fail(ST_ENOMEM, "st_mem_read_gbs: out of memory for %lld bytes", (long long)bytes);
    }
    for (int64_t i = 0; i < n_words; i++) buf[i] = (uint64_t)i; /* touched: every page mapped before timing */
    /* items of a few MiB each, at most 256, handed out by the pool's counter like the step's work */
    int64_t n_items = n_words / (((int64_t)4 << 20) / 8);
    const int nt = st_pool_threads(pool);
    if (n_items < nt) n_items = nt;
    if (n_items > 256) n_items = 256;
    c->buf = buf, c->n_words = n_words, c->per_item = (n_words + n_items - 1) / n_items;
    double best = 0.0;
    for (int32_t p = 0; p < passes; p++) {
        const double t0 = mono_s();
        st_pool_run(pool, read_task, c, n_items);
        const double dt = mono_s() - t0;
        if (dt > 0 && (double)(n_words * 8) / dt > best) best = (double)(n_words * 8) / dt;
    }
    *gb_s = best / 1e9;
    free(buf);
    free(c);
    return ST_OK;
}
