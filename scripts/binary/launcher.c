/*
 * The front of dist/txmq-linux-<arch> (docs/binary.md): a small launcher with a compressed directory
 * tree appended, PyInstaller's one-directory bundle of txmq (an interpreter and every dependency).
 *
 * On its first start the launcher unpacks that tree once into a cache directory named after the
 * version and the tree's content hash, CACHE/txmq-<version>-<hash>, and on every start it execs
 * CACHE/txmq-<version>-<hash>/txmq with the same arguments. The tree is unpacked into a private
 * sibling (.tmp-<name>-<pid>) and renamed into place, so a directory under its final name is always
 * complete; concurrent first starts each unpack their own copy and the first rename wins (the others
 * remove theirs). A start checks the unpacked files' sizes against the manifest written with them and
 * unpacks again if something removed or truncated one (a /tmp cleaner, a full disk).
 *
 * CACHE is $TXMQ_CACHE_DIR, else $XDG_CACHE_HOME/txmq, else $HOME/.cache/txmq; where that cannot be
 * created or written, $TMPDIR/txmq-<uid> (or /tmp/txmq-<uid>), which must be a directory owned by this
 * user and closed to others.
 *
 * Layout of the file: [this launcher][payload: one gzip stream][trailer, TRAILER_SIZE bytes].
 * The payload is a sequence of records, each: type (1 byte: 'D' directory, 'F' file, 'L' symlink,
 * 'E' end), mode (u32 LE), path length (u32 LE), data length (u64 LE), path, data (file contents or
 * the link's target). The trailer: magic "TXMQEXE1", payload offset (u64 LE), payload length (u64 LE),
 * the cache directory's name (NUL-padded to NAME_SIZE bytes).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#define MAGIC "TXMQEXE1"
#define NAME_SIZE 96
#define TRAILER_SIZE (8 + 8 + 8 + NAME_SIZE)
#define MANIFEST ".txmq-manifest"

static const char *prog = "txmq";

static void die(const char *fmt, const char *a, const char *b) {
    fprintf(stderr, "%s: ", prog);
    fprintf(stderr, fmt, a, b);
    fputc('\n', stderr);
    exit(1);
}

static uint64_t le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* This executable's path: /proc/self/exe, or argv[0] (searched on PATH) where /proc is not mounted. */
static char *self_path(const char *argv0) {
    static char buf[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
    if (n > 0) {
        buf[n] = 0;
        return buf;
    }
    if (strchr(argv0, '/')) return realpath(argv0, buf) ? buf : (char *)argv0;
    const char *path = getenv("PATH");
    if (!path) path = "/usr/local/bin:/usr/bin:/bin";
    while (*path) {
        const char *end = strchr(path, ':');
        size_t len = end ? (size_t)(end - path) : strlen(path);
        if (len && len + strlen(argv0) + 2 < sizeof buf) {
            memcpy(buf, path, len);
            buf[len] = '/';
            strcpy(buf + len + 1, argv0);
            if (access(buf, X_OK) == 0) return buf;
        }
        path += len + (end ? 1 : 0);
    }
    die("cannot find this executable (%s%s): /proc is not mounted and it is not on PATH", argv0, "");
    return NULL;
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st; (void)ftw;
    if (flag == FTW_DP) rmdir(path); else unlink(path);
    return 0;
}

static void rm_tree(const char *path) { nftw(path, rm_entry, 16, FTW_DEPTH | FTW_PHYS); }

/* mkdir -p with mode 0700 for what it creates; 0 when the directory exists afterwards. */
static int make_dirs(const char *dir) {
    char tmp[PATH_MAX];
    if (snprintf(tmp, sizeof tmp, "%s", dir) >= (int)sizeof tmp) return -1;
    for (char *p = tmp + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(tmp, 0700) != 0 && errno != EEXIST) return -1;
        *p = '/';
    }
    if (mkdir(tmp, 0700) != 0 && errno != EEXIST) return -1;
    struct stat st;
    return stat(tmp, &st) == 0 && S_ISDIR(st.st_mode) ? 0 : -1;
}

/* The shared temporary directory's fallback: ours alone, or refused (another user could plant files in it). */
static int private_dir(const char *dir) {
    if (mkdir(dir, 0700) != 0 && errno != EEXIST) return -1;
    struct stat st;
    if (lstat(dir, &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != geteuid() || (st.st_mode & 022)) {
        errno = EPERM;
        return -1;
    }
    return 0;
}

static int usable_base(const char *base, int private) {
    if (private ? private_dir(base) : make_dirs(base)) return 0;
    return access(base, W_OK | X_OK) == 0;
}

static void cache_base(char *out, size_t size) {
    const char *v;
    int explicit = 0;
    if ((v = getenv("TXMQ_CACHE_DIR")) && *v) {
        snprintf(out, size, "%s", v);
        explicit = 1;
    } else if ((v = getenv("XDG_CACHE_HOME")) && *v == '/') {
        snprintf(out, size, "%s/txmq", v);
    } else if ((v = getenv("HOME")) && *v == '/') {
        snprintf(out, size, "%s/.cache/txmq", v);
    } else {
        out[0] = 0;
    }
    if (strlen(out) > PATH_MAX - 512) die("the cache directory's path is too long: %s%s", out, "");
    if (out[0] && usable_base(out, 0)) return;
    if (explicit) die("TXMQ_CACHE_DIR=%s is not a directory this user can create and write (%s)", out, strerror(errno));
    const char *tmpdir = getenv("TMPDIR");
    if (!tmpdir || *tmpdir != '/') tmpdir = "/tmp";
    snprintf(out, size, "%s/txmq-%u", tmpdir, (unsigned)geteuid());
    if (!usable_base(out, 1))
        die("no cache directory to unpack into: %s is not a private writable directory (%s); set TXMQ_CACHE_DIR", out, strerror(errno));
}

/* Does the unpacked tree still hold every file of its manifest, at its size? */
static int tree_intact(const char *dir) {
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/" MANIFEST, dir);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char line[PATH_MAX + 32];
    int ok = 1, lines = 0;
    while (ok && fgets(line, sizeof line, f)) {
        char *sp = strchr(line, ' ');
        size_t len = strlen(line);
        if (!sp || len < 2 || line[len - 1] != '\n') { ok = 0; break; }
        line[len - 1] = 0;
        unsigned long long want = strtoull(line, NULL, 10);
        struct stat st;
        snprintf(path, sizeof path, "%s/%s", dir, sp + 1);
        ok = lstat(path, &st) == 0 && (S_ISLNK(st.st_mode) || (unsigned long long)st.st_size == want);
        lines++;
    }
    fclose(f);
    return ok && lines > 0;
}

static void read_exact(gzFile gz, void *buf, size_t n, const char *exe) {
    unsigned char *p = buf;
    while (n) {
        unsigned chunk = n > (1u << 30) ? (1u << 30) : (unsigned)n;
        int got = gzread(gz, p, chunk);
        if (got <= 0) die("%s is damaged or truncated (its packed files end early)%s: download it again", exe, "");
        p += got;
        n -= (size_t)got;
    }
}

/* A path from the payload stays inside the tree: relative, no "..", no empty components. */
static int safe_rel(const char *p) {
    if (!*p || *p == '/') return 0;
    for (const char *s = p; *s;) {
        const char *e = strchr(s, '/');
        size_t len = e ? (size_t)(e - s) : strlen(s);
        if (len == 0 || (len == 2 && s[0] == '.' && s[1] == '.') || (len == 1 && s[0] == '.')) return 0;
        s += len + (e ? 1 : 0);
    }
    return 1;
}

static void unpack(const char *exe, int fd, uint64_t offset, const char *dir) {
    if (lseek(fd, (off_t)offset, SEEK_SET) < 0) die("cannot read %s: %s", exe, strerror(errno));
    gzFile gz = gzdopen(dup(fd), "rb");
    if (!gz) die("cannot read %s: %s", exe, "out of memory");
    gzbuffer(gz, 1 << 17);
    char manifest[PATH_MAX];
    snprintf(manifest, sizeof manifest, "%s/" MANIFEST, dir);
    if (mkdir(dir, 0700) != 0) die("cannot create %s: %s", dir, strerror(errno));
    FILE *mf = fopen(manifest, "w");
    if (!mf) die("cannot write %s: %s", manifest, strerror(errno));
    static unsigned char buf[1 << 17];
    char rel[PATH_MAX], path[PATH_MAX], target[PATH_MAX];
    for (;;) {
        unsigned char hdr[17];
        read_exact(gz, hdr, sizeof hdr, exe);
        char type = (char)hdr[0];
        uint32_t mode = le32(hdr + 1), plen = le32(hdr + 5);
        uint64_t size = le64(hdr + 9);
        if (type == 'E') break;
        if (plen == 0 || plen >= sizeof rel) die("%s is damaged (a packed path is too long)%s", exe, "");
        read_exact(gz, rel, plen, exe);
        rel[plen] = 0;
        if (!safe_rel(rel)) die("%s is damaged (packed path %s leaves its directory)", exe, rel);
        if (snprintf(path, sizeof path, "%s/%s", dir, rel) >= (int)sizeof path) die("path too long: %s/%s", dir, rel);
        if (type == 'D') {
            if (mkdir(path, (mode & 07777) | 0700) != 0 && errno != EEXIST) die("cannot create %s: %s", path, strerror(errno));
        } else if (type == 'L') {
            if (size >= sizeof target) die("%s is damaged (a link target is too long)%s", exe, "");
            read_exact(gz, target, (size_t)size, exe);
            target[size] = 0;
            if (symlink(target, path) != 0) die("cannot create %s: %s", path, strerror(errno));
            fprintf(mf, "0 %s\n", rel);
        } else if (type == 'F') {
            int out = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, (mode & 0777) | 0600);
            if (out < 0) die("cannot create %s: %s", path, strerror(errno));
            for (uint64_t left = size; left;) {
                size_t n = left > sizeof buf ? sizeof buf : (size_t)left;
                read_exact(gz, buf, n, exe);
                for (size_t done = 0; done < n;) {
                    ssize_t w = write(out, buf + done, n - done);
                    if (w < 0) {
                        if (errno == EINTR) continue;
                        die("cannot write %s: %s", path, strerror(errno));
                    }
                    done += (size_t)w;
                }
                left -= n;
            }
            if (close(out) != 0) die("cannot write %s: %s", path, strerror(errno));
            fprintf(mf, "%llu %s\n", (unsigned long long)size, rel);
        } else {
            die("%s is damaged (unknown record in its packed files)%s", exe, "");
        }
    }
    gzclose(gz);
    if (fclose(mf) != 0) die("cannot write %s: %s", manifest, strerror(errno));
}

/* Remove the private unpack directories of starts that are gone (killed while unpacking): those whose
 * process is gone and that are over a minute old (a process of another PID namespace sharing the cache
 * may have that pid), and any over an hour old (an unpack takes seconds; the pid may have been reused). */
static void remove_stale(const char *base) {
    DIR *d = opendir(base);
    if (!d) return;
    struct dirent *e;
    char path[PATH_MAX];
    time_t now = time(NULL);
    while ((e = readdir(d))) {
        if (strncmp(e->d_name, ".tmp-", 5) != 0 && strncmp(e->d_name, ".old-", 5) != 0) continue;
        snprintf(path, sizeof path, "%s/%s", base, e->d_name);
        struct stat st;
        if (lstat(path, &st) != 0 || st.st_uid != geteuid()) continue;
        const char *dash = strrchr(e->d_name, '-');
        long pid = dash ? strtol(dash + 1, NULL, 10) : 0;
        int gone = pid <= 0 || (kill((pid_t)pid, 0) != 0 && errno == ESRCH);
        double age = difftime(now, st.st_mtime);
        if ((gone && age > 60) || age > 3600) rm_tree(path);
    }
    closedir(d);
}

int main(int argc, char **argv) {
    (void)argc;
    const char *exe = self_path(argv[0]);
    const char *slash = strrchr(exe, '/');
    prog = slash ? slash + 1 : exe;
    int fd = open(exe, O_RDONLY | O_CLOEXEC);
    if (fd < 0) die("cannot open %s: %s", exe, strerror(errno));
    unsigned char tr[TRAILER_SIZE];
    off_t end = lseek(fd, 0, SEEK_END);
    if (end < TRAILER_SIZE || pread(fd, tr, TRAILER_SIZE, end - TRAILER_SIZE) != TRAILER_SIZE || memcmp(tr, MAGIC, 8) != 0)
        die("%s has no packed files at its end (truncated download?)%s", exe, "");
    uint64_t offset = le64(tr + 8), length = le64(tr + 16);
    if (offset + length + TRAILER_SIZE != (uint64_t)end) die("%s is truncated or has bytes appended: download it again%s", exe, "");
    char name[NAME_SIZE + 1];
    memcpy(name, tr + 24, NAME_SIZE);
    name[NAME_SIZE] = 0;
    if (!safe_rel(name) || strchr(name, '/')) die("%s is damaged (bad cache name)%s", exe, "");

    char base[PATH_MAX], dir[PATH_MAX], target[PATH_MAX], tmp[PATH_MAX];
    cache_base(base, sizeof base);
    snprintf(dir, sizeof dir, "%s/%s", base, name);
    snprintf(target, sizeof target, "%s/txmq", dir);
    if (!tree_intact(dir)) {
        remove_stale(base);
        snprintf(tmp, sizeof tmp, "%s/.tmp-%s-%ld", base, name, (long)getpid());
        rm_tree(tmp); /* a leftover of an earlier process with this pid (pid 1 in a container) */
        unpack(exe, fd, offset, tmp);
        if (rename(tmp, dir) != 0) {
            int err = errno;
            if (err != EEXIST && err != ENOTEMPTY) die("cannot move the unpacked files to %s: %s", dir, strerror(err));
            if (tree_intact(dir)) {
                rm_tree(tmp); /* another start unpacked it first */
            } else {
                /* a damaged copy under the final name: move it aside, then put ours in its place */
                char old[PATH_MAX];
                snprintf(old, sizeof old, "%s/.old-%s-%ld", base, name, (long)getpid());
                rm_tree(old);
                if (rename(dir, old) == 0) rm_tree(old);
                if (rename(tmp, dir) != 0) {
                    err = errno;
                    if (!tree_intact(dir)) die("cannot move the unpacked files to %s: %s", dir, strerror(err));
                    rm_tree(tmp); /* another start replaced it first */
                }
            }
        }
    }
    close(fd);
    /* The bundle's bootloader finds its files from /proc/self/exe; without /proc, from argv[0]: name it then. */
    if (access("/proc/self/exe", F_OK) != 0) argv[0] = target;
    execv(target, argv);
    die("cannot run %s: %s", target, strerror(errno));
    return 1;
}
