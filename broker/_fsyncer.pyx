# cython: language_level=3
"""The group-commit fsync in a C thread that never takes the GIL.

A Python fsync thread needs the GIL twice per cycle: to take the job and
after ``fdatasync`` returns. While the event loop is busy it gets it only
when the loop blocks or the switch interval forces a hand-over, so under
load a 300 us fdatasync became a 1-3 ms cycle (measured: 32 producers,
sync flush, ``flush_seconds_avg`` 1.2 ms while strace showed fdatasync
p50 at 321 us), and every send waited for that cycle. Here the loop hands
over the descriptors (``submit``), this thread runs ``fdatasync`` on each
(and ``fsync`` on the directory when it changed) and then writes to an
eventfd; the loop, reading the eventfd, takes the result (``collect``)
and does the bookkeeping itself. One job at a time; each instance has its
own thread (a test process runs many brokers).
"""

from libc.errno cimport EBUSY, EPIPE


cdef extern from *:
    """
    #include <errno.h>
    #include <pthread.h>
    #include <stdint.h>
    #include <stdlib.h>
    #include <string.h>
    #include <sys/eventfd.h>
    #include <unistd.h>

    #define TXMQ_FS_MAXFDS 64

    typedef struct {
        pthread_mutex_t mu;
        pthread_cond_t cv;
        pthread_t thread;
        int efd;
        int fds[TXMQ_FS_MAXFDS];
        int nfds;
        int dir_fd;
        int state;    /* 0 idle, 1 a job handed over (or running), 2 done, its result not collected */
        int result;   /* errno of the job done, 0 when every fsync succeeded */
        int stop;
        int joined;
    } txmq_fs_t;

    static void *txmq_fs_main(void *arg) {
        txmq_fs_t *s = (txmq_fs_t *)arg;
        int fds[TXMQ_FS_MAXFDS];
        for (;;) {
            pthread_mutex_lock(&s->mu);
            while (s->state != 1 && !s->stop)
                pthread_cond_wait(&s->cv, &s->mu);
            if (s->state != 1) {  /* stopping, nothing handed over */
                pthread_mutex_unlock(&s->mu);
                return NULL;
            }
            int n = s->nfds, dir_fd = s->dir_fd;
            memcpy(fds, s->fds, sizeof(int) * (size_t)n);
            pthread_mutex_unlock(&s->mu);
            int err = 0;
            for (int i = 0; i < n && !err; i++)
                if (fdatasync(fds[i]) != 0)
                    err = errno ? errno : EIO;
            if (!err && dir_fd >= 0 && fsync(dir_fd) != 0)
                err = errno ? errno : EIO;
            pthread_mutex_lock(&s->mu);
            s->result = err;
            s->state = 2;
            pthread_mutex_unlock(&s->mu);
            uint64_t one = 1;
            ssize_t w;
            do {
                w = write(s->efd, &one, sizeof one);
            } while (w < 0 && errno == EINTR);
        }
    }

    /* NULL and *err set on failure. */
    static txmq_fs_t *txmq_fs_new(int *err) {
        txmq_fs_t *s = (txmq_fs_t *)calloc(1, sizeof(txmq_fs_t));
        if (s == NULL) {
            *err = ENOMEM;
            return NULL;
        }
        s->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (s->efd < 0) {
            *err = errno;
            free(s);
            return NULL;
        }
        pthread_mutex_init(&s->mu, NULL);
        pthread_cond_init(&s->cv, NULL);
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, 64 * 1024);
        int e = pthread_create(&s->thread, &attr, txmq_fs_main, s);
        pthread_attr_destroy(&attr);
        if (e != 0) {
            close(s->efd);
            pthread_mutex_destroy(&s->mu);
            pthread_cond_destroy(&s->cv);
            free(s);
            *err = e;
            return NULL;
        }
    #ifdef __linux__
        pthread_setname_np(s->thread, "txmq-fdatasync");
    #endif
        return s;
    }

    /* 0 handed over; EBUSY a job is not collected yet; E2BIG too many descriptors; EPIPE halted. */
    static int txmq_fs_submit(txmq_fs_t *s, const int *fds, int n, int dir_fd) {
        if (n > TXMQ_FS_MAXFDS)
            return E2BIG;
        pthread_mutex_lock(&s->mu);
        if (s->stop) {
            pthread_mutex_unlock(&s->mu);
            return EPIPE;
        }
        if (s->state != 0) {
            pthread_mutex_unlock(&s->mu);
            return EBUSY;
        }
        memcpy(s->fds, fds, sizeof(int) * (size_t)n);
        s->nfds = n;
        s->dir_fd = dir_fd;
        s->state = 1;
        pthread_cond_signal(&s->cv);
        pthread_mutex_unlock(&s->mu);
        return 0;
    }

    /* -1 nothing done to collect (idle or running), else the done job's errno (0 ok); the fsyncer is idle again. */
    static int txmq_fs_collect(txmq_fs_t *s) {
        uint64_t v;
        while (read(s->efd, &v, sizeof v) < 0 && errno == EINTR) {
        }
        pthread_mutex_lock(&s->mu);
        int r = -1;
        if (s->state == 2) {
            r = s->result;
            s->state = 0;
        }
        pthread_mutex_unlock(&s->mu);
        return r;
    }

    static int txmq_fs_state(txmq_fs_t *s) {
        pthread_mutex_lock(&s->mu);
        int r = s->state;
        pthread_mutex_unlock(&s->mu);
        return r;
    }

    /* Stop the thread after the job handed over, if any; its result stays collectable. */
    static void txmq_fs_halt(txmq_fs_t *s) {
        pthread_mutex_lock(&s->mu);
        s->stop = 1;
        pthread_cond_signal(&s->cv);
        pthread_mutex_unlock(&s->mu);
        if (!s->joined) {
            pthread_join(s->thread, NULL);
            s->joined = 1;
        }
    }

    static void txmq_fs_free(txmq_fs_t *s) {
        txmq_fs_halt(s);
        close(s->efd);
        pthread_mutex_destroy(&s->mu);
        pthread_cond_destroy(&s->cv);
        free(s);
    }
    """
    ctypedef struct txmq_fs_t:
        int efd
    enum: TXMQ_FS_MAXFDS
    txmq_fs_t *txmq_fs_new(int *err)
    int txmq_fs_submit(txmq_fs_t *s, const int *fds, int n, int dir_fd) nogil
    int txmq_fs_collect(txmq_fs_t *s) nogil
    int txmq_fs_state(txmq_fs_t *s) nogil
    void txmq_fs_halt(txmq_fs_t *s) nogil
    void txmq_fs_free(txmq_fs_t *s) nogil


MAX_FDS = TXMQ_FS_MAXFDS


cdef class Fsyncer:
    """fdatasync of a few descriptors in a thread of its own; completion is signalled on ``fileno()``."""

    cdef txmq_fs_t *s

    def __cinit__(self):
        cdef int err = 0
        self.s = txmq_fs_new(&err)
        if self.s == NULL:
            raise OSError(err, "cannot start the fsync thread")

    def fileno(self) -> int:
        """An eventfd, readable once a job is done (register it with the event loop's add_reader)."""
        if self.s == NULL:
            raise ValueError("fsyncer closed")
        return self.s.efd

    def submit(self, fds, int dir_fd=-1) -> None:
        """Start fdatasync of each of fds, then fsync of dir_fd (unless -1). One job at a time."""
        if self.s == NULL:
            raise ValueError("fsyncer closed")
        cdef int buf[TXMQ_FS_MAXFDS]
        cdef int n = len(fds)
        cdef int i
        if n > TXMQ_FS_MAXFDS:
            raise ValueError(f"{n} descriptors in one job, at most {TXMQ_FS_MAXFDS}")
        for i in range(n):
            buf[i] = fds[i]
        cdef int r = txmq_fs_submit(self.s, buf, n, dir_fd)
        if r == EBUSY:
            raise RuntimeError("a job is still running or not collected")
        if r != 0:
            raise OSError(r, "fsync thread stopped" if r == EPIPE else "cannot hand over the fsync")

    def collect(self):
        """None while no job is done (idle, or running); else the done job's errno, 0 when it succeeded."""
        if self.s == NULL:
            return None
        cdef int r
        with nogil:
            r = txmq_fs_collect(self.s)
        return None if r < 0 else r

    @property
    def running(self) -> bool:
        """A job is handed over and not yet done."""
        return self.s != NULL and txmq_fs_state(self.s) == 1

    def halt(self) -> None:
        """Stop the thread once the job handed over (if any) is done; its result stays collectable."""
        if self.s != NULL:
            with nogil:
                txmq_fs_halt(self.s)

    def close(self) -> None:
        """Halt, then free: the eventfd is closed (remove it from the loop first)."""
        if self.s != NULL:
            with nogil:
                txmq_fs_free(self.s)
            self.s = NULL

    def __dealloc__(self):
        if self.s != NULL:
            with nogil:
                txmq_fs_free(self.s)
            self.s = NULL
