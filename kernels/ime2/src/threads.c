/*
 * threads.c - npu_ime2_gemm_mt: the GEMM with its N tiles split over a persistent per-process pool
 * of worker threads, and that pool's control API (npu_ime2_pool_*, issue 15).
 *
 * Split. With T slices, slice i gets the contiguous tile range [i * tiles / T, (i + 1) * tiles / T)
 * (whole 32-column tiles; only the last range can end in the partial tail tile), where
 * T = min(threads, tiles), and on a configured pool T = min(threads, configured workers, tiles).
 * Slice i runs on worker i. A tile range is a contiguous slice of packed B, and a path's result for
 * a column depends only on that column's tile, so each worker runs the ordinary single-threaded path
 * (npu_ime2_run_path, AUTO resolved on the worker's own core) on its slice, into its own [M, cols]
 * slice of one scratch buffer; C is filled from the scratch only when every slice succeeded. The
 * result is bit-identical to npu_ime2_gemm. vllm_npu.ime2.fence.plan_slices is the same split.
 *
 * Who computes. Every slice runs on a pool worker; the calling thread checks the arguments, hands
 * out the slices, waits until they are done (spin_until: looking for up to 50 us, yielding the CPU
 * between looks, then sleeping on a condition variable) and copies them into C (an empty C: worker 0 makes
 * npu_ime2_gemm's path check on its core). The only exception is an unconfigured pool with T == 1
 * (threads == 1, one tile, or an empty C), which is npu_ime2_gemm in the caller. On the SpacemiT
 * K3 the Python fence (vllm_npu.ime2.fence) registers the workers alone in /proc/set_ai_thread and
 * configures one per A100 core, so the IME2 code runs on the A100 cores while the calling (vLLM)
 * thread, and every VLEN-256 op it runs, stays on the X100 cores. The whole op (npu_ime2_hp_gemm_on,
 * dispatch.c) uses the same workers once the pool is configured: npu_ime2_pool_configured() says
 * how many, and npu_ime2_pool_path_status() makes its path check on worker 0.
 *
 * Pool lifetime. Workers are created when first needed (a GEMM with T > 1 on an unconfigured
 * pool, npu_ime2_pool_start, npu_ime2_pool_configure), in the process that uses them, and then
 * reused: never per call. An unconfigured pool grows to the largest T asked for. A worker that
 * has no slice looks for one for up to 50 us (spin_until), then sleeps on a condition variable:
 * GEMMs that follow each other closely (a model's layers; benchmark loops) find their workers
 * awake, where a condition-variable wake-up costs tens of microseconds in a VM and a woken worker
 * may land on a busy CPU (issue 12: two threads took 0.7-1.6x one thread's time on a 2-core VM,
 * now about 0.57x). Workers block the asynchronous signals (they stay
 * with the application's threads) but not the synchronous ones (SIGILL, SIGSEGV, SIGBUS, SIGFPE,
 * SIGTRAP, SIGSYS), which must reach the thread that caused them: the QEMU test driver emulates the
 * .hp instructions in a SIGILL handler, on whichever thread executes them.
 *
 * Fork. A child of fork() has none of the workers. A pthread_atfork handler (holding both pool
 * locks across the fork, so the child's copy is consistent) makes the child's pool empty and
 * unconfigured, with a threads-created count of 0; a pid check catches a child created without
 * the handlers. The child's first GEMM creates its own workers, unpinned (a fenced pool must be
 * fenced again in the child: the Python fence does that).
 *
 * Exit and unload. A destructor (process exit, dlclose) stops and joins the idle workers, so no
 * worker outlives the library's code. If a GEMM of another thread is still running at that moment
 * the destructor leaves the workers alone rather than wait: exit_group ends them.
 *
 * Concurrency. One GEMM at a time uses the pool: concurrent npu_ime2_gemm_mt calls from several
 * threads (and npu_ime2_pool_configure/start/shutdown) wait for each other on `pool.call`.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/syscall.h>
#endif

#include "internal.h"

typedef struct {
    const uint8_t *a, *b; /* b: the slice's first tile */
    int64_t m, k, n_cols; /* n_cols == 0: only check that `path` can run on the worker's core */
    float *out;           /* [M, n_cols] slice of the scratch */
    int path;
    npu_ime2_status status;
} slice_job;

typedef struct {
    pthread_t thread;
    int started;    /* the worker has published its tid and waits for work */
    int64_t tid;    /* kernel thread id (gettid), -1 where there is none */
    int cpu;        /* CPU it was pinned to by npu_ime2_pool_configure, -1: not pinned */
    int last_cpu;   /* CPU its last slice ended on, -1 before the first */
    int last_vlenb; /* vlenb it read after its last slice, -1 before the first */
    int64_t slices; /* slices run (path checks included) */
    slice_job *job; /* the slice assigned to it, NULL when idle */
} pool_worker;

/* Lock order: `call` before `lock`. `call` is held for a whole GEMM / start / configure /
 * shutdown; `lock` guards every other field and is held only briefly. */
static struct {
    pthread_mutex_t call;
    pthread_mutex_t lock;
    pthread_cond_t wake; /* workers: a slice was assigned, or `stopping` */
    pthread_cond_t idle; /* the caller: `pending` reached 0, or a new worker started */
    pool_worker w[NPU_IME2_MAX_THREADS];
    int size;        /* workers alive: w[0 .. size - 1] */
    int configured;  /* 0, or the pinned workers w[0 .. configured - 1] every GEMM runs on */
    int pending;     /* slices of the current GEMM not finished yet */
    int stopping;    /* workers exit when idle */
    int64_t created; /* threads created in this process */
    pid_t owner;     /* the process the workers belong to */
} pool = {.call = PTHREAD_MUTEX_INITIALIZER,
          .lock = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER,
          .idle = PTHREAD_COND_INITIALIZER};

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static int64_t current_tid(void)
{
#if defined(__linux__) && defined(SYS_gettid)
    return (int64_t)syscall(SYS_gettid);
#else
    return -1;
#endif
}

static int current_cpu(void)
{
#ifdef __linux__
    return sched_getcpu();
#else
    return -1;
#endif
}

/* ---- workers ---------------------------------------------------------------------------------- */

static void finish_slice(pool_worker *self, int cpu, int vlenb)
{
    __atomic_store_n(&self->job, NULL, __ATOMIC_RELAXED);
    self->slices++;
    self->last_cpu = cpu;
    self->last_vlenb = vlenb;
    if (__atomic_sub_fetch(&pool.pending, 1, __ATOMIC_RELEASE) == 0)
        pthread_cond_broadcast(&pool.idle);
}

/* Spin for up to SPIN_NS nanoseconds (`pool.lock` not held) while `done(arg)` is false, yielding
 * the CPU between looks: a GEMM handed out or finished within that time is seen without a
 * condition-variable sleep and wake-up, which costs tens of microseconds in a VM. Returns
 * whether done() became true; the caller then re-checks under the lock either way. */
#define SPIN_NS 50000
static int spin_until(int (*done)(const void *), const void *arg)
{
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        for (int i = 0; i < 64; i++)
            if (done(arg))
                return 1;
        clock_gettime(CLOCK_MONOTONIC, &t);
        if ((t.tv_sec - t0.tv_sec) * 1000000000L + (t.tv_nsec - t0.tv_nsec) > SPIN_NS)
            return 0;
        sched_yield();
    }
}

static int has_job(const void *w)
{
    return __atomic_load_n(&((const pool_worker *)w)->job, __ATOMIC_ACQUIRE) != NULL ||
           __atomic_load_n(&pool.stopping, __ATOMIC_RELAXED);
}

static int none_pending(const void *unused)
{
    (void)unused;
    return __atomic_load_n(&pool.pending, __ATOMIC_ACQUIRE) == 0;
}

static void *worker_main(void *arg)
{
    pool_worker *self = (pool_worker *)arg;
    pthread_mutex_lock(&pool.lock);
    self->tid = current_tid();
    self->started = 1;
    pthread_cond_broadcast(&pool.idle);
    for (;;) {
        if (!self->job && !pool.stopping) {
            pthread_mutex_unlock(&pool.lock);
            spin_until(has_job, self);
            pthread_mutex_lock(&pool.lock);
        }
        while (!self->job && !pool.stopping)
            pthread_cond_wait(&pool.wake, &pool.lock);
        slice_job *job = self->job;
        if (!job)
            break; /* stopping, and no slice left */
        pthread_mutex_unlock(&pool.lock);
        job->status = job->n_cols == 0 ? npu_ime2_path_status(job->path)
                                       : npu_ime2_run_path(job->path, job->a, job->b, job->m, job->k, job->n_cols,
                                                           job->out);
        const int cpu = current_cpu(), vlenb = npu_ime2_vlenb(); /* after the slice: V already in use */
        pthread_mutex_lock(&pool.lock);
        finish_slice(self, cpu, vlenb);
    }
    pthread_mutex_unlock(&pool.lock);
    return NULL;
}

/* Every signal except the synchronous ones, which must reach the thread that raised them. */
static void asynchronous_signals(sigset_t *set)
{
    sigfillset(set);
    static const int sync_signals[] = {SIGILL, SIGSEGV, SIGBUS, SIGFPE, SIGTRAP, SIGSYS};
    for (size_t i = 0; i < sizeof sync_signals / sizeof sync_signals[0]; i++)
        sigdelset(set, sync_signals[i]);
}

/* ---- fork ------------------------------------------------------------------------------------- */

/* Drops every worker record without joining (in a forked child the threads do not exist). */
static void forget_workers(void)
{
    memset(pool.w, 0, sizeof pool.w);
    pool.size = pool.configured = pool.pending = pool.stopping = 0;
    pool.created = 0;
    pool.owner = 0;
}

static void atfork_prepare(void)
{
    pthread_mutex_lock(&pool.call);
    pthread_mutex_lock(&pool.lock);
}

static void atfork_parent(void)
{
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&pool.call);
}

static void atfork_child(void)
{
    forget_workers();
    /* The parent's workers may have been waiting on these: fresh ones for the child. */
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.idle, NULL);
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&pool.call);
}

static void register_atfork(void) { pthread_atfork(atfork_prepare, atfork_parent, atfork_child); }

/* `call` held: a pool inherited from another process (fork without the handlers) is empty here. */
static void forget_if_forked(void)
{
    pthread_mutex_lock(&pool.lock);
    if (pool.size > 0 && pool.owner != getpid())
        forget_workers();
    pthread_mutex_unlock(&pool.lock);
}

/* ---- growing, pinning, stopping (`call` held) ------------------------------------------------- */

/* Starts workers until there are `n` (1 .. NPU_IME2_MAX_THREADS). Returns 0, or the error of
 * pthread_create (the workers started before it stay). */
static int grow(int n)
{
    pthread_once(&atfork_once, register_atfork);
    sigset_t blocked, saved;
    asynchronous_signals(&blocked);
    pthread_sigmask(SIG_BLOCK, &blocked, &saved); /* a new thread inherits the creator's mask */
    int err = 0;
    pthread_mutex_lock(&pool.lock);
    if (pool.size == 0)
        pool.owner = getpid();
    while (pool.size < n) {
        pool_worker *w = &pool.w[pool.size];
        memset(w, 0, sizeof *w);
        w->cpu = w->last_cpu = w->last_vlenb = -1;
        err = pthread_create(&w->thread, NULL, worker_main, w);
        if (err)
            break;
        pool.created++;
        while (!w->started)
            pthread_cond_wait(&pool.idle, &pool.lock);
        pool.size++;
    }
    pthread_mutex_unlock(&pool.lock);
    pthread_sigmask(SIG_SETMASK, &saved, NULL);
    return err;
}

/* Pins worker `i` to `cpu`. Returns 0, or the error of pthread_setaffinity_np. */
static int pin(int i, int cpu)
{
#ifdef __linux__
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    const int err = pthread_setaffinity_np(pool.w[i].thread, sizeof set, &set);
    if (err)
        return err;
    pthread_mutex_lock(&pool.lock);
    pool.w[i].cpu = cpu;
    pthread_mutex_unlock(&pool.lock);
    return 0;
#else
    (void)i;
    (void)cpu;
    return ENOSYS;
#endif
}

/* Stops and joins every worker; the pool is then empty and unconfigured. */
static void stop_workers(void)
{
    pthread_mutex_lock(&pool.lock);
    const int n = pool.size;
    __atomic_store_n(&pool.stopping, 1, __ATOMIC_RELAXED);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    for (int i = 0; i < n; i++)
        pthread_join(pool.w[i].thread, NULL);
    pthread_mutex_lock(&pool.lock);
    memset(pool.w, 0, sizeof pool.w);
    pool.size = pool.configured = pool.pending = pool.stopping = 0;
    pthread_mutex_unlock(&pool.lock);
}

__attribute__((destructor)) static void pool_fini(void)
{
    if (pthread_mutex_trylock(&pool.call) != 0)
        return; /* a GEMM of another thread is running: do not wait for it at exit */
    if (pool.size > 0 && pool.owner == getpid())
        stop_workers();
    pthread_mutex_unlock(&pool.call);
}

/* ---- the GEMM --------------------------------------------------------------------------------- */

/* Slices of a GEMM: min(threads, tiles), and at most the configured workers when configured. */
static int slice_count(int threads, int configured, int64_t tiles)
{
    int t = threads;
    if (configured > 0 && configured < t)
        t = configured;
    return tiles < t ? (int)tiles : t;
}

/* Hands slice i to worker i (i < t) and waits until all are done. */
static void run_round(slice_job *jobs, int t)
{
    pthread_mutex_lock(&pool.lock);
    __atomic_store_n(&pool.pending, t, __ATOMIC_RELAXED);
    for (int i = 0; i < t; i++)
        __atomic_store_n(&pool.w[i].job, &jobs[i], __ATOMIC_RELEASE);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    spin_until(none_pending, NULL);
    pthread_mutex_lock(&pool.lock);
    while (pool.pending > 0)
        pthread_cond_wait(&pool.idle, &pool.lock);
    pthread_mutex_unlock(&pool.lock);
}

/* The GEMM on t pool workers (`call` held, workers w[0 .. t-1] alive), C written only on success. */
static npu_ime2_status pool_gemm(int path, const uint8_t *a, const uint8_t *b, size_t tile_bytes, int64_t m,
                                 int64_t k, int64_t n, float *c, int t)
{
    const int64_t tiles = ceil_div(n, TILE_N);
    slice_job jobs[NPU_IME2_MAX_THREADS];
    int64_t col0s[NPU_IME2_MAX_THREADS];
    float *scratch = malloc((size_t)m * (size_t)n * sizeof(float)); /* fits: checked by the caller */
    if (!scratch)
        return NPU_IME2_ERR_NO_MEMORY;
    for (int i = 0; i < t; i++) {
        const int64_t t0 = tiles * i / t, t1 = tiles * (i + 1) / t;
        const int64_t col0 = t0 * TILE_N, col1 = t1 * TILE_N < n ? t1 * TILE_N : n;
        col0s[i] = col0;
        jobs[i] = (slice_job){.a = a, .b = b + (size_t)t0 * tile_bytes, .m = m, .k = k, .n_cols = col1 - col0,
                              .out = scratch + (size_t)m * (size_t)col0, .path = path, .status = NPU_IME2_OK};
    }
    run_round(jobs, t);
    npu_ime2_status st = NPU_IME2_OK;
    for (int i = 0; i < t && st == NPU_IME2_OK; i++)
        st = jobs[i].status;
    if (st == NPU_IME2_OK) /* C is written only when every slice succeeded */
        for (int i = 0; i < t; i++)
            for (int64_t r = 0; r < m; r++)
                memcpy(c + r * n + col0s[i], jobs[i].out + r * jobs[i].n_cols, (size_t)jobs[i].n_cols * sizeof(float));
    free(scratch);
    return st;
}

/* npu_ime2_gemm's path check for an empty C, made by worker 0 on its own core (`call` held). */
static npu_ime2_status pool_check_path(int path)
{
    slice_job job = {.path = path, .status = NPU_IME2_OK};
    run_round(&job, 1);
    return job.status;
}

npu_ime2_status npu_ime2_gemm_mt(const void *a_packed, size_t a_bytes, const void *b_packed, size_t b_bytes,
                                 int64_t m, int64_t k, int64_t n, float *c, size_t c_bytes, int path, int threads)
{
    if (threads < 1 || threads > NPU_IME2_MAX_THREADS)
        return NPU_IME2_ERR_BAD_SHAPE;
    size_t b_need; /* the checks of npu_ime2_gemm, once, before any worker is involved */
    npu_ime2_status st = npu_ime2_gemm_check(a_packed, a_bytes, b_packed, b_bytes, m, k, n, c, c_bytes, path, &b_need);
    if (st != NPU_IME2_OK)
        return st;
    const int64_t tiles = n > 0 ? ceil_div(n, TILE_N) : 1;
    pthread_mutex_lock(&pool.call);
    forget_if_forked();
    int t = m > 0 && n > 0 ? slice_count(threads, pool.configured, tiles) : 1;
    if (pool.configured == 0 && t > 1 && grow(t) != 0)
        t = pool.size < t ? pool.size : t; /* fewer threads could be started: use those */
    if (pool.configured == 0 && t <= 1) {
        pthread_mutex_unlock(&pool.call); /* exactly npu_ime2_gemm, in the calling thread */
        return npu_ime2_gemm(a_packed, a_bytes, b_packed, b_bytes, m, k, n, c, c_bytes, path);
    }
    if (m == 0 || n == 0)
        st = pool_check_path(path);
    else
        st = pool_gemm(path, (const uint8_t *)a_packed, (const uint8_t *)b_packed, b_need / (size_t)tiles, m, k, n,
                       c, t);
    pthread_mutex_unlock(&pool.call);
    return st;
}

/* ---- for the whole op (dispatch.c, internal.h) ----------------------------------------------- */

int npu_ime2_pool_configured(void)
{
    pthread_mutex_lock(&pool.lock);
    const int n = pool.owner == getpid() ? pool.configured : 0; /* a forked child has no workers */
    pthread_mutex_unlock(&pool.lock);
    return n;
}

npu_ime2_status npu_ime2_pool_path_status(int path)
{
    pthread_mutex_lock(&pool.call);
    forget_if_forked();
    const npu_ime2_status st = pool.configured > 0 ? pool_check_path(path) : npu_ime2_path_status(path);
    pthread_mutex_unlock(&pool.call);
    return st;
}

/* ---- the pool's control API (npu_ime2.h, "thread pinning (issue 15)") ------------------------ */

/* Index of the first bad entry of cpus[0 .. n-1] (out of range, or a repeat), or -1. */
static int first_bad_cpu(const int *cpus, int n)
{
    for (int i = 0; i < n; i++) {
        if (cpus[i] < 0 || cpus[i] > NPU_IME2_POOL_MAX_CPU)
            return i;
        for (int j = 0; j < i; j++)
            if (cpus[j] == cpus[i])
                return i;
    }
    return -1;
}

int npu_ime2_pool_start(int n)
{
    if (n < 1 || n > NPU_IME2_MAX_THREADS)
        return EINVAL;
    pthread_mutex_lock(&pool.call);
    forget_if_forked();
    const int err = grow(n);
    pthread_mutex_unlock(&pool.call);
    return err;
}

int npu_ime2_pool_configure(const int *cpus, int n, int *failed_index)
{
    int ignored;
    int *bad = failed_index ? failed_index : &ignored;
    *bad = -1;
    if (n < 0 || n > NPU_IME2_MAX_THREADS || (n > 0 && !cpus))
        return EINVAL;
    if ((*bad = first_bad_cpu(cpus, n)) >= 0)
        return EINVAL;
    pthread_mutex_lock(&pool.call);
    forget_if_forked();
    if (n == 0) {
        stop_workers(); /* a pinned thread cannot always be unpinned (K3): fresh workers instead */
        pthread_mutex_unlock(&pool.call);
        return 0;
    }
    pool.configured = 0; /* unconfigured until every pin succeeded */
    int err = grow(n);
    if (err)
        *bad = pool.size;
    for (int i = 0; i < n && !err; i++)
        if ((err = pin(i, cpus[i])) != 0)
            *bad = i;
    if (!err)
        pool.configured = n;
    pthread_mutex_unlock(&pool.call);
    return err;
}

void npu_ime2_pool_shutdown(void)
{
    pthread_mutex_lock(&pool.call);
    forget_if_forked();
    stop_workers();
    pthread_mutex_unlock(&pool.call);
}

int npu_ime2_pool_get_info(npu_ime2_pool_info *out)
{
    if (!out)
        return EINVAL;
    pthread_mutex_lock(&pool.lock);
    const int ours = pool.owner == getpid();
    *out = (npu_ime2_pool_info){.size = ours ? pool.size : 0, .configured = ours ? pool.configured : 0,
                                .created = ours ? pool.created : 0};
    pthread_mutex_unlock(&pool.lock);
    return 0;
}

int npu_ime2_pool_get_worker(int i, npu_ime2_pool_worker_info *out)
{
    if (!out)
        return EINVAL;
    int err = EINVAL;
    pthread_mutex_lock(&pool.lock);
    if (pool.owner == getpid() && i >= 0 && i < pool.size) {
        const pool_worker *w = &pool.w[i];
        *out = (npu_ime2_pool_worker_info){.tid = w->tid, .cpu = w->cpu, .last_cpu = w->last_cpu,
                                           .last_vlenb = w->last_vlenb, .slices = w->slices};
        err = 0;
    }
    pthread_mutex_unlock(&pool.lock);
    return err;
}
