# cython: language_level=3
"""Busy polling: keep a CPU from halting while a reply or a request is about to arrive.

Two tools, both without the GIL. The broker uses the spinner thread below
(broker/busypoll.py); a client that asks for it (``Client(busy_poll=...)``)
uses ``poll_readable`` on its socket while it waits for a reply.

The spinner: a lowest-priority spinning thread that keeps this process's CPU awake for a short while after activity.

On a virtual machine a CPU with nothing to run halts (HLT), and waking it
again, for the next request of a client or for the end of an fdatasync,
costs a trip through the hypervisor: tens of microseconds, as much as the
broker's own work on a small transaction. This thread runs under
``SCHED_IDLE``, the scheduler class below every ordinary thread, and spins
(the x86 ``pause`` instruction in a loop, no system calls) until the
deadline that ``arm`` keeps pushing forward, then sleeps on a condition
variable until armed again. So a CPU of this process stays busy, and
wakeable without a halt, for ``window`` nanoseconds after the last
request or reply; any real work preempts the spinner at once, because a
``SCHED_IDLE`` thread runs only on a CPU nothing else wants.

The same idea as Erlang's scheduler busy-wait (RabbitMQ's default) and
Linux's guest halt-polling. The cost is CPU time that would otherwise be
idle: up to ``window`` per request of a lone client, shown as process CPU.

No Python runs in the thread and it never takes the GIL. ``arm`` is one
clock read and one atomic store, plus a condition-variable signal when
the spinner was asleep.
"""

from libc.stdint cimport int64_t


cdef extern from *:
    """
    #include <errno.h>
    #include <poll.h>
    #include <pthread.h>
    #include <sched.h>
    #include <stdatomic.h>
    #include <stdint.h>
    #include <sys/resource.h>
    #include <sys/syscall.h>
    #include <time.h>
    #include <unistd.h>

    static _Atomic int64_t txmq_bp_deadline = 0;   /* monotonic ns: spin until then */
    static _Atomic int txmq_bp_sleeping = 0;
    static _Atomic int64_t txmq_bp_tid = 0;        /* the spinner's kernel thread id, 0 before it runs */
    static _Atomic int txmq_bp_policy_ok = -1;     /* -1 unknown yet, 1 SCHED_IDLE or nice 19, 0 neither */
    static pid_t txmq_bp_pid = 0;                   /* the process that started it (a fork child starts its own) */
    static pthread_mutex_t txmq_bp_mu = PTHREAD_MUTEX_INITIALIZER;
    static pthread_cond_t txmq_bp_cv = PTHREAD_COND_INITIALIZER;

    static inline int64_t txmq_bp_now(void) {
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
    }

    static inline void txmq_bp_relax(void) {
    #if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
    #elif defined(__aarch64__)
        __asm__ __volatile__("yield");
    #endif
    }

    static void *txmq_bp_main(void *arg) {
        (void)arg;
        atomic_store(&txmq_bp_tid, (int64_t)syscall(SYS_gettid));
        struct sched_param p = {0};
        int ok = sched_setscheduler(0, SCHED_IDLE, &p) == 0;
        if (!ok)  /* no SCHED_IDLE (a seccomp filter, an old kernel): the lowest nice value of this thread */
            ok = setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 19) == 0;
        atomic_store(&txmq_bp_policy_ok, ok);
        if (!ok)
            return NULL;  /* spinning at normal priority would take CPU from real work: never spin */
        for (;;) {
            while (txmq_bp_now() < atomic_load_explicit(&txmq_bp_deadline, memory_order_relaxed)) {
                for (int i = 0; i < 32; i++)
                    txmq_bp_relax();
            }
            pthread_mutex_lock(&txmq_bp_mu);
            atomic_store(&txmq_bp_sleeping, 1);
            while (txmq_bp_now() >= atomic_load(&txmq_bp_deadline))
                pthread_cond_wait(&txmq_bp_cv, &txmq_bp_mu);
            atomic_store(&txmq_bp_sleeping, 0);
            pthread_mutex_unlock(&txmq_bp_mu);
        }
    }

    /* 0 started (or already running in this process), else an errno. */
    static int txmq_bp_start(void) {
        pid_t pid = getpid();
        if (txmq_bp_pid == pid)
            return 0;
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 64 * 1024);
        atomic_store(&txmq_bp_tid, 0);
        atomic_store(&txmq_bp_policy_ok, -1);
        int err = pthread_create(&t, &attr, txmq_bp_main, NULL);
        pthread_attr_destroy(&attr);
        if (err == 0) {
            txmq_bp_pid = pid;
    #ifdef __linux__
            pthread_setname_np(t, "txmq-busypoll");
    #endif
        }
        return err;
    }

    static inline void txmq_bp_arm(int64_t window_ns) {
        atomic_store_explicit(&txmq_bp_deadline, txmq_bp_now() + window_ns, memory_order_relaxed);
        if (atomic_load_explicit(&txmq_bp_sleeping, memory_order_relaxed)) {
            pthread_mutex_lock(&txmq_bp_mu);
            pthread_cond_signal(&txmq_bp_cv);
            pthread_mutex_unlock(&txmq_bp_mu);
        }
    }

    /* 1 once fd is readable (or has an error), 0 after max_ns without. Spins on poll() with a zero timeout. */
    static int txmq_bp_poll(int fd, int64_t max_ns) {
        struct pollfd p;
        p.fd = fd;
        p.events = POLLIN;
        int64_t end = txmq_bp_now() + max_ns;
        do {
            p.revents = 0;
            int n = poll(&p, 1, 0);
            if (n > 0)
                return 1;
            if (n < 0 && errno != EINTR)
                return 1;  /* a bad descriptor: let the event loop find out */
            txmq_bp_relax();
        } while (txmq_bp_now() < end);
        return 0;
    }

    static void txmq_bp_halt(void) {
        atomic_store(&txmq_bp_deadline, 0);
        pthread_mutex_lock(&txmq_bp_mu);
        pthread_cond_signal(&txmq_bp_cv);
        pthread_mutex_unlock(&txmq_bp_mu);
    }
    """
    int txmq_bp_start() nogil
    void txmq_bp_arm(int64_t window_ns) nogil
    void txmq_bp_halt() nogil
    int txmq_bp_poll(int fd, int64_t max_ns) nogil
    int64_t txmq_bp_tid
    int txmq_bp_policy_ok
    int txmq_bp_sleeping


def start() -> int:
    """Start the spinner thread of this process (once; it sleeps until armed). Returns 0 or an errno."""
    return txmq_bp_start()


def arm(int64_t window_ns) -> None:
    """Spin for window_ns from now (replacing an earlier deadline); wakes the spinner if it sleeps."""
    txmq_bp_arm(window_ns)


def poll_readable(int fd, int64_t max_ns) -> bool:
    """Spin (GIL released) until fd is readable or max_ns passed; True if it became readable.

    For a client waiting for a reply on its one busy connection: the
    calling thread stays on its CPU, so the reply is seen without a wake-up
    (on a virtual machine, without the halted CPU's trip through the
    hypervisor). Nothing else on the event loop runs meanwhile, which is why
    the client does it only while one connection of the process has
    requests in flight.
    """
    cdef int r
    with nogil:
        r = txmq_bp_poll(fd, max_ns)
    return r == 1


def halt() -> None:
    """Stop spinning now (the thread stays, asleep, for the next arm)."""
    txmq_bp_halt()


def status() -> tuple:
    """(kernel thread id or 0, 1 if it runs at SCHED_IDLE or nice 19 / 0 if it could not / -1 not yet, asleep)."""
    return (txmq_bp_tid, txmq_bp_policy_ok, bool(txmq_bp_sleeping))
