/*
 * The front of dist/txmq-linux-<arch> (docs/binary.md): a small launcher with a compressed directory
 * tree appended, PyInstaller's one-directory bundle of txmq (an interpreter and every dependency).
 *
 * On its first start the launcher unpacks that tree once into a cache directory named after the
 * version and the hash of the tree's manifest, CACHE/txmq-<version>-<hash>, and on every start it execs
 * CACHE/txmq-<version>-<hash>/txmq with the same arguments. It runs only a tree it can show it unpacked:
 *
 * - CACHE and every directory on the way to it (symbolic links resolved one by one, each link owned by
 *   this user or root) belong to this user or root and are closed to writes by others: an ancestor may be
 *   writable by others only with the sticky bit (/tmp), CACHE itself never. The walk opens each
 *   directory with O_NOFOLLOW relative to the one before and checks what it opened (fstat), and the tree
 *   is then addressed by the resolved path, which no other user can change.
 * - The tree is unpacked into a private sibling (.tmp-<name>-<pid>, mode 0700), every file is read back
 *   and checked against the SHA-256 the executable's manifest gives for it, and only then is the sibling
 *   renamed to its final name: a directory under that name is complete and verified. Concurrent first
 *   starts each unpack their own copy and the first rename wins (the others remove theirs). A failed
 *   unpack (a full disk) removes its sibling before exiting and says how much space it needs, and where.
 * - A later start checks the tree against the manifest carried in the executable (not a file in the
 *   cache): every entry present, of its type and size (a link: its target), through no symbolic link,
 *   owned by this user or root and not writable by others. A tree that fails (a cleaner removed a file,
 *   another owner, a mode open to others) is never run: a fresh copy is unpacked and swapped in.
 *
 * CACHE is $TXMQ_CACHE_DIR (refused in one line, naming the directory and the reason, when it fails
 * the rules above), else $XDG_CACHE_HOME/txmq, else $HOME/.cache/txmq; where that cannot be created or
 * written, or fails the rules (a note says which), $TMPDIR/txmq-<uid> (or /tmp/txmq-<uid>).
 *
 * Layout of the file: [this launcher][payload: one gzip stream][manifest][trailer, TRAILER_SIZE bytes].
 * The payload is a sequence of records, each: type (1 byte: 'D' directory, 'F' file, 'L' symlink,
 * 'E' end), mode (u32 LE), path length (u32 LE), data length (u64 LE), path, data (file contents or
 * the link's target). The manifest is text, one line per record in the same order:
 * "<type> <mode, octal> <data length> <SHA-256 of the data, hex, or - for a directory> <path>\n".
 * The trailer: magic "TXMQEXE2", payload offset, payload length, manifest length (u64 LE each), the
 * manifest's SHA-256 (32 bytes), the cache directory's name (NUL-padded to NAME_SIZE bytes), which ends
 * in the first 16 hex digits of that SHA-256.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#define MAGIC "TXMQEXE2"
#define NAME_SIZE 96
#define TRAILER_SIZE (8 + 8 + 8 + 8 + 32 + NAME_SIZE)
#define MAX_MANIFEST (64u << 20)
#define MAX_LINKS 40
#define MAX_DEPTH 1024

static const char *prog = "txmq";
static char cleanup_dir[PATH_MAX]; /* the private unpack directory a failing start removes before it exits */

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st; (void)ftw;
    if (flag == FTW_DP) rmdir(path); else unlink(path);
    return 0;
}

/* Removes a tree without following symbolic links (only under a directory checked to be closed to others). */
static void rm_tree(const char *path) { nftw(path, rm_entry, 16, FTW_DEPTH | FTW_PHYS); }

/* One line on stderr and exit 1, after removing this start's private unpack directory (if any). */
static void die(const char *fmt, ...) {
    char msg[3 * PATH_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap); /* first: the message may name the directory removed below */
    va_end(ap);
    if (cleanup_dir[0]) {
        rm_tree(cleanup_dir);
        cleanup_dir[0] = 0;
    }
    fprintf(stderr, "%s: %s\n", prog, msg);
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

/* SHA-256 (FIPS 180-4): the hash of the manifest and of every file it lists. */
typedef struct {
    uint32_t h[8];
    uint64_t bytes;
    unsigned char buf[64];
    size_t n;
} sha256_ctx;

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha256_blocks(uint32_t *h, const unsigned char *p, size_t blocks) {
    for (; blocks; blocks--, p += 64) {
        uint32_t w[64];
        for (int i = 0; i < 16; i++)
            w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
        for (int i = 16; i < 64; i++) {
            uint32_t s0 = ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
            uint32_t s1 = ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16] + s0 + w[i - 7] + s1;
        }
        uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
        for (int i = 0; i < 64; i++) {
            uint32_t t1 = k + (ROR(e, 6) ^ ROR(e, 11) ^ ROR(e, 25)) + ((e & f) ^ (~e & g)) + K256[i] + w[i];
            uint32_t t2 = (ROR(a, 2) ^ ROR(a, 13) ^ ROR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            k = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
        }
        h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += k;
    }
}

#if defined(__x86_64__) && !defined(TXMQ_PORTABLE_SHA256)
#include <cpuid.h>
#include <immintrin.h>
/* The same compression with the SHA extensions (x86-64 CPUs since about 2017), chosen at run time: the
 * portable code above hashes about 200 MB/s, these instructions several times that (a cold start reads
 * the whole unpacked tree back). Four rounds a step: W[j] for j >= 4 from the four words groups before. */
__attribute__((target("sha,sse4.1,ssse3"))) static void sha256_blocks_ni(uint32_t *h, const unsigned char *p, size_t blocks) {
    const __m128i mask = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i t = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&h[0]), 0xB1);  /* CDAB */
    __m128i s1 = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&h[4]), 0x1B); /* EFGH */
    __m128i s0 = _mm_alignr_epi8(t, s1, 8);                                         /* ABEF */
    s1 = _mm_blend_epi16(s1, t, 0xF0);                                              /* CDGH */
    for (; blocks; blocks--, p += 64) {
        __m128i abef = s0, cdgh = s1, w[4];
        for (int j = 0; j < 16; j++) {
            __m128i x;
            if (j < 4)
                x = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * j)), mask);
            else
                x = _mm_sha256msg2_epu32(_mm_add_epi32(_mm_sha256msg1_epu32(w[j & 3], w[(j + 1) & 3]),
                                                       _mm_alignr_epi8(w[(j + 3) & 3], w[(j + 2) & 3], 4)), w[(j + 3) & 3]);
            w[j & 3] = x;
            __m128i m = _mm_add_epi32(x, _mm_loadu_si128((const __m128i *)&K256[4 * j]));
            s1 = _mm_sha256rnds2_epu32(s1, s0, m);
            s0 = _mm_sha256rnds2_epu32(s0, s1, _mm_shuffle_epi32(m, 0x0E));
        }
        s0 = _mm_add_epi32(s0, abef);
        s1 = _mm_add_epi32(s1, cdgh);
    }
    t = _mm_shuffle_epi32(s0, 0x1B);  /* FEBA */
    s1 = _mm_shuffle_epi32(s1, 0xB1); /* DCHG */
    _mm_storeu_si128((__m128i *)&h[0], _mm_blend_epi16(t, s1, 0xF0)); /* DCBA */
    _mm_storeu_si128((__m128i *)&h[4], _mm_alignr_epi8(s1, t, 8));    /* HGFE */
}

static void (*sha256_compress)(uint32_t *, const unsigned char *, size_t);

static void sha256_pick(void) {
    unsigned a, b, c, d;
    int ni = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_SSE4_1) && (c & bit_SSSE3) && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & bit_SHA);
    sha256_compress = ni ? sha256_blocks_ni : sha256_blocks;
}
#else
#define sha256_compress sha256_blocks
static void sha256_pick(void) {}
#endif

static void sha256_init(sha256_ctx *c) {
    static const uint32_t iv[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(c->h, iv, sizeof iv);
    c->bytes = 0;
    c->n = 0;
}

static void sha256_update(sha256_ctx *c, const void *data, size_t len) {
    const unsigned char *p = data;
    c->bytes += len;
    if (c->n) {
        size_t take = 64 - c->n < len ? 64 - c->n : len;
        memcpy(c->buf + c->n, p, take);
        c->n += take; p += take; len -= take;
        if (c->n < 64) return;
        sha256_compress(c->h, c->buf, 1);
        c->n = 0;
    }
    sha256_compress(c->h, p, len / 64);
    p += len - len % 64;
    c->n = len % 64;
    memcpy(c->buf, p, c->n);
}

static void sha256_final(sha256_ctx *c, unsigned char out[32]) {
    uint64_t bits = c->bytes * 8;
    unsigned char pad[72] = {0x80};
    size_t padlen = (c->n < 56 ? 56 : 120) - c->n;
    for (int i = 0; i < 8; i++) pad[padlen + i] = (unsigned char)(bits >> (56 - 8 * i));
    sha256_update(c, pad, padlen + 8);
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 4; j++) out[4 * i + j] = (unsigned char)(c->h[i] >> (24 - 8 * j));
}

/* The manifest carried in the executable: what the unpacked tree holds, in the payload's order. */
struct entry {
    char type;
    unsigned mode;
    uint64_t size;
    unsigned char hash[32];
    const char *path;
};
static struct entry *ents;
static size_t nents;
static uint64_t need_bytes, largest_file; /* the space the tree takes (rounded up to 4 KiB blocks), its largest file */

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
    die("cannot find this executable (%s): /proc is not mounted and it is not on PATH", argv0);
    return NULL;
}

/* A path from the payload stays inside the tree: relative, no "." or "..", no empty components. */
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

static int unhex(const char *s, unsigned char *out) {
    for (int i = 0; i < 64; i++) {
        int c = s[i], v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (v < 0) return -1;
        if (i % 2) out[i / 2] |= (unsigned char)v; else out[i / 2] = (unsigned char)(v << 4);
    }
    return 0;
}

static void load_manifest(const char *exe, int fd, uint64_t off, uint64_t len, const unsigned char *want, const char *name) {
    if (len == 0 || len > MAX_MANIFEST) die("%s is damaged (bad manifest length): download it again", exe);
    char *buf = malloc(len + 1);
    if (!buf) die("out of memory reading %s", exe);
    for (uint64_t done = 0; done < len;) {
        ssize_t n = pread(fd, buf + done, (size_t)(len - done), (off_t)(off + done));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) die("cannot read %s: %s", exe, n < 0 ? strerror(errno) : "it ends early");
        done += (uint64_t)n;
    }
    buf[len] = 0;
    sha256_ctx c;
    unsigned char got[32];
    sha256_init(&c);
    sha256_update(&c, buf, len);
    sha256_final(&c, got);
    char hex[17];
    for (int i = 0; i < 8; i++) snprintf(hex + 2 * i, 3, "%02x", got[i]);
    size_t nl = strlen(name);
    if (memcmp(got, want, 32) != 0 || nl < 16 || strcmp(name + nl - 16, hex) != 0)
        die("%s is damaged (its manifest does not match its hash): download it again", exe);
    size_t lines = 0;
    for (uint64_t i = 0; i < len; i++) lines += buf[i] == '\n';
    if (buf[len - 1] != '\n' || !(ents = calloc(lines, sizeof *ents))) die("%s is damaged (bad manifest): download it again", exe);
    for (char *p = buf; *p; nents++) {
        char *end = strchr(p, '\n'), *q;
        *end = 0;
        struct entry *e = &ents[nents];
        e->type = p[0];
        if (p[1] != ' ') goto bad;
        e->mode = (unsigned)strtoul(p + 2, &q, 8);
        if (*q != ' ') goto bad;
        e->size = strtoull(q + 1, &q, 10);
        if (*q != ' ') goto bad;
        q++;
        if (e->type == 'D') {
            if (q[0] != '-' || q[1] != ' ') goto bad;
            q += 2;
        } else {
            if ((e->type != 'F' && e->type != 'L') || unhex(q, e->hash) != 0 || q[64] != ' ') goto bad;
            q += 65;
        }
        if (!safe_rel(q)) goto bad;
        e->path = q;
        if (e->type == 'F') {
            need_bytes += (e->size + 4095) / 4096 * 4096;
            if (e->size > largest_file) largest_file = e->size;
        } else if (e->type == 'D') {
            need_bytes += 4096;
        }
        p = end + 1;
    }
    return;
bad:
    die("%s is damaged (bad manifest line %zu): download it again", exe, nents + 1);
}

/* Trust rules for directories (see the top of this file). */
enum { USABLE = 0, UNTRUSTED = 1, UNUSABLE = 2 };

static int check_dir(const struct stat *st, const char *path, int is_base, char *why, size_t wsz) {
    uid_t me = geteuid();
    if (!*path) path = "/";
    if (st->st_uid != me && st->st_uid != 0) {
        snprintf(why, wsz, "%s is owned by uid %u, not by this user (uid %u) or root", path, (unsigned)st->st_uid, (unsigned)me);
        return UNTRUSTED;
    }
    if ((st->st_mode & 022) && (is_base || !(st->st_mode & S_ISVTX))) {
        snprintf(why, wsz, "%s is writable by %s (mode %04o)%s", path, st->st_mode & 002 ? "others" : "its group",
                 (unsigned)(st->st_mode & 07777), is_base ? "" : " without the sticky bit");
        return UNTRUSTED;
    }
    return USABLE;
}

/* Opens the directory `path` (made absolute from the working directory), creating missing components
 * with mode 0700, resolving symbolic links one by one and checking every directory on the way (check_dir).
 * Returns an O_PATH descriptor of it and its resolved path in canon, or -1 with the reason in why and its
 * kind (UNTRUSTED: another user could change it; UNUSABLE: it cannot be created or opened) in *kind. */
static int open_trusted(const char *path, char *canon, size_t csize, char *why, size_t wsz, int *kind) {
    static char rest[2 * PATH_MAX], next[2 * PATH_MAX];
    static int fds[MAX_DEPTH];
    static size_t clen[MAX_DEPTH];
    int depth = 0, links = 0, r;
    struct stat st;
    *kind = UNUSABLE;
    if (path[0] == '/') {
        snprintf(rest, sizeof rest, "%s", path);
    } else {
        char cwd[PATH_MAX];
        if (!getcwd(cwd, sizeof cwd)) {
            snprintf(why, wsz, "cannot resolve %s: %s", path, strerror(errno));
            return -1;
        }
        snprintf(rest, sizeof rest, "%s/%s", cwd, path);
    }
    canon[0] = 0;
    clen[0] = 0;
    fds[0] = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (fds[0] < 0 || fstat(fds[0], &st) != 0) {
        snprintf(why, wsz, "cannot open /: %s", strerror(errno));
        return -1;
    }
    if ((r = check_dir(&st, canon, 0, why, wsz)) != USABLE) goto fail;
    for (char *p = rest; *p;) {
        while (*p == '/') p++;
        if (!*p) break;
        char *e = strchrnul(p, '/');
        size_t len = (size_t)(e - p);
        char comp[NAME_MAX + 1];
        if (len > NAME_MAX || clen[depth] + len + 2 > csize) {
            snprintf(why, wsz, "%s: %s", path, strerror(ENAMETOOLONG));
            r = UNUSABLE;
            goto fail;
        }
        memcpy(comp, p, len);
        comp[len] = 0;
        p = e;
        if (strcmp(comp, ".") == 0) continue;
        if (strcmp(comp, "..") == 0) {
            if (depth > 0) close(fds[depth--]);
            canon[clen[depth]] = 0;
            continue;
        }
        snprintf(canon + clen[depth], csize - clen[depth], "/%s", comp);
        if (fstatat(fds[depth], comp, &st, AT_SYMLINK_NOFOLLOW) != 0) {
            if (errno != ENOENT || (mkdirat(fds[depth], comp, 0700) != 0 && errno != EEXIST) ||
                fstatat(fds[depth], comp, &st, AT_SYMLINK_NOFOLLOW) != 0) {
                snprintf(why, wsz, "cannot create %s: %s", canon, strerror(errno));
                r = UNUSABLE;
                goto fail;
            }
        }
        if (S_ISLNK(st.st_mode)) {
            if (st.st_uid != geteuid() && st.st_uid != 0) {
                snprintf(why, wsz, "%s is a symbolic link owned by uid %u, not by this user (uid %u) or root", canon,
                         (unsigned)st.st_uid, (unsigned)geteuid());
                r = UNTRUSTED;
                goto fail;
            }
            char target[PATH_MAX];
            ssize_t n = ++links > MAX_LINKS ? (errno = ELOOP, -1) : readlinkat(fds[depth], comp, target, sizeof target - 1);
            if (n <= 0) {
                snprintf(why, wsz, "cannot resolve %s: %s", canon, n < 0 ? strerror(errno) : "empty link");
                r = UNUSABLE;
                goto fail;
            }
            target[n] = 0;
            if (snprintf(next, sizeof next, "%s/%s", target, p) >= (int)sizeof next) {
                snprintf(why, wsz, "%s: %s", path, strerror(ENAMETOOLONG));
                r = UNUSABLE;
                goto fail;
            }
            memcpy(rest, next, sizeof rest);
            p = rest;
            if (target[0] == '/')
                while (depth > 0) close(fds[depth--]);
            canon[clen[depth]] = 0;
            continue;
        }
        int fd = S_ISDIR(st.st_mode) ? openat(fds[depth], comp, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC) : (errno = ENOTDIR, -1);
        if (fd < 0 || fstat(fd, &st) != 0) {
            snprintf(why, wsz, "cannot use %s: %s", canon, strerror(errno));
            if (fd >= 0) close(fd);
            r = UNUSABLE;
            goto fail;
        }
        if (depth + 1 >= MAX_DEPTH) {
            close(fd);
            snprintf(why, wsz, "%s: %s", path, strerror(ENAMETOOLONG));
            r = UNUSABLE;
            goto fail;
        }
        fds[++depth] = fd;
        clen[depth] = strlen(canon);
        if ((r = check_dir(&st, canon, 0, why, wsz)) != USABLE) goto fail;
    }
    if (fstat(fds[depth], &st) != 0 || (r = check_dir(&st, canon, 1, why, wsz)) != USABLE) goto fail;
    int fd = fds[depth];
    for (int d = 0; d < depth; d++) close(fds[d]);
    if (!canon[0]) snprintf(canon, csize, "/");
    return fd;
fail:
    for (; depth >= 0; depth--) close(fds[depth]);
    *kind = r;
    return -1;
}

/* An entry of the tree as this start may run it: this user's or root's, not writable by others. */
static int owned_closed(const struct stat *st) {
    return (st->st_uid == geteuid() || st->st_uid == 0) && (S_ISLNK(st->st_mode) || !(st->st_mode & 022));
}

static int link_matches(int dirfd, const struct entry *e) {
    char target[PATH_MAX];
    if (e->size >= sizeof target) return 0;
    ssize_t n = readlinkat(dirfd, e->path, target, sizeof target);
    if (n < 0 || (uint64_t)n != e->size) return 0;
    sha256_ctx c;
    unsigned char got[32];
    sha256_init(&c);
    sha256_update(&c, target, (size_t)n);
    sha256_final(&c, got);
    return memcmp(got, e->hash, 32) == 0;
}

/* The unpacked tree base/name if this start may run it: a directory of this user's (or root's) closed to
 * others, holding every entry of the executable's manifest as it says (type, size, link target, the
 * owner's execute bit), each owned by this user or root and not writable by others; directories are
 * checked before what they hold, so no path below goes through a symbolic link. Its fd, or -1. */
static int tree_fd(int basefd, const char *name) {
    int fd = openat(basefd, name, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return -1;
    struct stat st;
    if (fstat(fd, &st) != 0 || !owned_closed(&st)) goto bad;
    for (size_t i = 0; i < nents; i++) {
        const struct entry *e = &ents[i];
        if (fstatat(fd, e->path, &st, AT_SYMLINK_NOFOLLOW) != 0 || !owned_closed(&st)) goto bad;
        if (e->type == 'D' && !S_ISDIR(st.st_mode)) goto bad;
        if (e->type == 'F' && (!S_ISREG(st.st_mode) || (uint64_t)st.st_size != e->size || !(st.st_mode & 0100) != !(e->mode & 0100))) goto bad;
        if (e->type == 'L' && (!S_ISLNK(st.st_mode) || !link_matches(fd, e))) goto bad;
    }
    return fd;
bad:
    close(fd);
    return -1;
}

static void read_exact(gzFile gz, void *buf, size_t n, const char *exe) {
    unsigned char *p = buf;
    while (n) {
        unsigned chunk = n > (1u << 30) ? (1u << 30) : (unsigned)n;
        int got = gzread(gz, p, chunk);
        if (got <= 0) die("%s is damaged or truncated (its packed files end early): download it again", exe);
        p += got;
        n -= (size_t)got;
    }
}

static double megabytes(uint64_t bytes) { return (double)((bytes + 999999) / 1000000); }

/* A write into the private unpack directory failed: remove the directory, then say why in one line (and for
 * a full disk or a quota, how much space the tree needs in base and how much is free there now). */
static void unpack_failed(const char *base, const char *what, int err) {
    rm_tree(cleanup_dir);
    cleanup_dir[0] = 0;
    if (err == ENOSPC || err == EDQUOT) {
        struct statvfs sv;
        if (statvfs(base, &sv) == 0) {
            uint64_t avail = (uint64_t)(geteuid() == 0 ? sv.f_bfree : sv.f_bavail) * sv.f_frsize;
            die("cannot unpack into %s: %s: it needs %.0f MB there, %.0f MB are free; free some space or set TXMQ_CACHE_DIR "
                "to a directory with room", base, strerror(err), megabytes(need_bytes), (double)(avail / 1000000));
        }
        die("cannot unpack into %s: %s: it needs %.0f MB there; free some space or set TXMQ_CACHE_DIR to a directory with room",
            base, strerror(err), megabytes(need_bytes));
    }
    if (err == EFBIG)
        die("cannot unpack into %s: %s: its largest file is %.0f MB and it needs %.0f MB in all (is a file size limit, "
            "ulimit -f, set?)", base, strerror(err), megabytes(largest_file), megabytes(need_bytes));
    die("cannot unpack into %s: cannot write %s: %s", base, what, strerror(err));
}

static int write_all(int out, const unsigned char *p, size_t n) {
    while (n) {
        ssize_t w = write(out, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return -1;
        if (w == 0) {
            errno = ENOSPC;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Every file and link of the private directory dfd against the manifest's SHA-256. */
static void verify(int dfd, const char *dir, const char *exe, unsigned char *buf, size_t bufsize) {
    for (size_t i = 0; i < nents; i++) {
        const struct entry *e = &ents[i];
        if (e->type == 'L') {
            if (!link_matches(dfd, e)) die("the unpacked link %s/%s does not match %s's manifest", dir, e->path, exe);
            continue;
        }
        if (e->type != 'F') continue;
        int in = openat(dfd, e->path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
        struct stat st;
        if (in < 0 || fstat(in, &st) != 0 || !S_ISREG(st.st_mode)) die("cannot read back %s/%s: %s", dir, e->path, strerror(errno));
        sha256_ctx c;
        unsigned char got[32];
        sha256_init(&c);
        uint64_t total = 0;
        for (;;) {
            ssize_t n = read(in, buf, bufsize);
            if (n < 0 && errno == EINTR) continue;
            if (n < 0) die("cannot read back %s/%s: %s", dir, e->path, strerror(errno));
            if (n == 0) break;
            sha256_update(&c, buf, (size_t)n);
            total += (uint64_t)n;
        }
        close(in);
        sha256_final(&c, got);
        if (total != e->size || memcmp(got, e->hash, 32) != 0)
            die("the unpacked file %s/%s does not match the SHA-256 in %s's manifest (a disk error?)", dir, e->path, exe);
    }
}

/* Unpacks the payload into base/tmpname (created here, mode 0700) and verifies it. Returns -1 with errno
 * set when base does not let this user create it (read-only, not this user's); exits on other failures,
 * after removing the directory. */
static int unpack(const char *exe, int fd, uint64_t offset, int basefd, const char *base, const char *tmpname) {
    if (mkdirat(basefd, tmpname, 0700) != 0) {
        if (errno == EACCES || errno == EPERM || errno == EROFS) return -1;
        unpack_failed(base, tmpname, errno);
    }
    snprintf(cleanup_dir, sizeof cleanup_dir, "%s/%s", base, tmpname);
    int dfd = openat(basefd, tmpname, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dfd < 0) die("cannot open %s: %s", cleanup_dir, strerror(errno));
    if (lseek(fd, (off_t)offset, SEEK_SET) < 0) die("cannot read %s: %s", exe, strerror(errno));
    gzFile gz = gzdopen(dup(fd), "rb");
    if (!gz) die("cannot read %s: out of memory", exe);
    gzbuffer(gz, 1 << 17);
    static unsigned char buf[1 << 18];
    char rel[PATH_MAX], target[PATH_MAX];
    for (size_t i = 0;; i++) {
        unsigned char hdr[17];
        read_exact(gz, hdr, sizeof hdr, exe);
        char type = (char)hdr[0];
        uint32_t mode = le32(hdr + 1), plen = le32(hdr + 5);
        uint64_t size = le64(hdr + 9);
        if (type == 'E') {
            if (i != nents) die("%s is damaged (its packed files end before its manifest): download it again", exe);
            /* the end of the gzip stream: gzread checks its CRC there */
            if (gzread(gz, buf, 1) != 0) die("%s is damaged (its packed files fail their checksum): download it again", exe);
            break;
        }
        if (plen == 0 || plen >= sizeof rel) die("%s is damaged (a packed path is too long): download it again", exe);
        read_exact(gz, rel, plen, exe);
        rel[plen] = 0;
        const struct entry *e = i < nents ? &ents[i] : NULL;
        if (!e || e->type != type || e->mode != mode || e->size != size || strcmp(e->path, rel) != 0)
            die("%s is damaged (its packed files do not match its manifest at %s): download it again", exe, rel);
        if (type == 'D') {
            if (mkdirat(dfd, rel, (mode & 0777) | 0700) != 0) unpack_failed(base, rel, errno);
        } else if (type == 'L') {
            if (size >= sizeof target) die("%s is damaged (a link target is too long)", exe);
            read_exact(gz, target, (size_t)size, exe);
            target[size] = 0;
            if (symlinkat(target, dfd, rel) != 0) unpack_failed(base, rel, errno);
        } else if (type == 'F') {
            int out = openat(dfd, rel, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, (mode & 0777) | 0600);
            if (out < 0) unpack_failed(base, rel, errno);
            for (uint64_t left = size; left;) {
                size_t n = left > sizeof buf ? sizeof buf : (size_t)left;
                read_exact(gz, buf, n, exe);
                if (write_all(out, buf, n) != 0) {
                    int err = errno;
                    close(out); /* an open file keeps its blocks: the free space said below counts them back */
                    unpack_failed(base, rel, err);
                }
                left -= n;
            }
            if (close(out) != 0) unpack_failed(base, rel, errno);
        } else {
            die("%s is damaged (unknown record in its packed files): download it again", exe);
        }
    }
    gzclose(gz);
    verify(dfd, cleanup_dir, exe, buf, sizeof buf);
    close(dfd);
    return 0;
}

/* Remove the private unpack directories of starts that are gone (killed while unpacking): those whose
 * process is gone and that are over a minute old (a process of another PID namespace sharing the cache
 * may have that pid), and any over an hour old (an unpack takes seconds; the pid may have been reused). */
static void remove_stale(int basefd, const char *base) {
    int dfd = openat(basefd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *d = dfd >= 0 ? fdopendir(dfd) : NULL;
    if (!d) {
        if (dfd >= 0) close(dfd);
        return;
    }
    struct dirent *e;
    char path[PATH_MAX];
    time_t now = time(NULL);
    while ((e = readdir(d))) {
        if (strncmp(e->d_name, ".tmp-", 5) != 0 && strncmp(e->d_name, ".old-", 5) != 0) continue;
        struct stat st;
        if (fstatat(dfd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || st.st_uid != geteuid()) continue;
        const char *dash = strrchr(e->d_name, '-');
        long pid = dash ? strtol(dash + 1, NULL, 10) : 0;
        int gone = pid <= 0 || (kill((pid_t)pid, 0) != 0 && errno == ESRCH);
        double age = difftime(now, st.st_mtime);
        if (((gone && age > 60) || age > 3600) && snprintf(path, sizeof path, "%s/%s", base, e->d_name) < (int)sizeof path) rm_tree(path);
    }
    closedir(d);
}

/* Puts the verified private copy in place as base/name, unless another start did first with a tree as good. */
static void publish(int basefd, const char *base, const char *tmpname, const char *name) {
    if (renameat(basefd, tmpname, basefd, name) == 0) {
        cleanup_dir[0] = 0;
        return;
    }
    int err = errno, t;
    if (err != EEXIST && err != ENOTEMPTY && err != ENOTDIR) die("cannot move the unpacked files to %s/%s: %s", base, name, strerror(err));
    if ((t = tree_fd(basefd, name)) >= 0) { /* another start unpacked it first */
        close(t);
        rm_tree(cleanup_dir);
        cleanup_dir[0] = 0;
        return;
    }
    /* a damaged copy, or one this start may not run, under the final name: move it aside, put ours in its place */
    char old[NAME_SIZE + 32], path[PATH_MAX];
    snprintf(old, sizeof old, ".old-%s-%ld", name, (long)getpid());
    snprintf(path, sizeof path, "%s/%s", base, old);
    rm_tree(path);
    if (renameat(basefd, name, basefd, old) == 0) rm_tree(path);
    if (renameat(basefd, tmpname, basefd, name) != 0) {
        err = errno;
        if ((t = tree_fd(basefd, name)) < 0) die("cannot replace %s/%s: %s", base, name, strerror(err));
        close(t); /* another start replaced it first */
        rm_tree(cleanup_dir);
    }
    cleanup_dir[0] = 0;
}

int main(int argc, char **argv) {
    (void)argc;
    sha256_pick();
    const char *exe = self_path(argv[0]);
    const char *slash = strrchr(exe, '/');
    prog = slash ? slash + 1 : exe;
    int fd = open(exe, O_RDONLY | O_CLOEXEC);
    if (fd < 0) die("cannot open %s: %s", exe, strerror(errno));
    unsigned char tr[TRAILER_SIZE];
    off_t end = lseek(fd, 0, SEEK_END);
    if (end < TRAILER_SIZE || pread(fd, tr, TRAILER_SIZE, end - TRAILER_SIZE) != TRAILER_SIZE || memcmp(tr, MAGIC, 8) != 0)
        die("%s has no packed files at its end (truncated download?)", exe);
    uint64_t offset = le64(tr + 8), length = le64(tr + 16), mlen = le64(tr + 24);
    if (offset > (uint64_t)end || length > (uint64_t)end || mlen > (uint64_t)end || offset + length + mlen + TRAILER_SIZE != (uint64_t)end)
        die("%s is truncated or has bytes appended: download it again", exe);
    char name[NAME_SIZE + 1];
    memcpy(name, tr + 64, NAME_SIZE);
    name[NAME_SIZE] = 0;
    if (!safe_rel(name) || strchr(name, '/')) die("%s is damaged (bad cache name)", exe);
    load_manifest(exe, fd, offset + length, mlen, tr + 32, name);

    char cand[3][PATH_MAX];
    int ncand = 0, explicit = 0;
    const char *v;
    if ((v = getenv("TXMQ_CACHE_DIR")) && *v) {
        explicit = 1;
        snprintf(cand[ncand++], PATH_MAX, "%s", v);
    } else {
        if ((v = getenv("XDG_CACHE_HOME")) && *v == '/') snprintf(cand[ncand++], PATH_MAX, "%s/txmq", v);
        else if ((v = getenv("HOME")) && *v == '/') snprintf(cand[ncand++], PATH_MAX, "%s/.cache/txmq", v);
        const char *tmpdir = getenv("TMPDIR");
        if (!tmpdir || *tmpdir != '/') tmpdir = "/tmp";
        snprintf(cand[ncand++], PATH_MAX, "%s/txmq-%u", tmpdir, (unsigned)geteuid());
    }
    for (int i = 0; i < ncand; i++) {
        char base[PATH_MAX], why[2 * PATH_MAX + 128];
        int kind, last = i == ncand - 1;
        if (strlen(cand[i]) > PATH_MAX - 512) die("the cache directory's path is too long: %s", cand[i]);
        int basefd = open_trusted(cand[i], base, sizeof base, why, sizeof why, &kind);
        if (basefd < 0) {
            if (explicit) die("TXMQ_CACHE_DIR=%s cannot hold the unpacked files: %s", cand[i], why);
            if (last) die("no cache directory to unpack into: %s; set TXMQ_CACHE_DIR to a directory of this user's", why);
            if (kind == UNTRUSTED) fprintf(stderr, "%s: not using the cache directory %s: %s; trying %s\n", prog, cand[i], why, cand[i + 1]);
            continue;
        }
        int t = tree_fd(basefd, name);
        if (t < 0) {
            char tmpname[NAME_SIZE + 32], path[PATH_MAX];
            remove_stale(basefd, base);
            snprintf(tmpname, sizeof tmpname, ".tmp-%s-%ld", name, (long)getpid());
            snprintf(path, sizeof path, "%s/%s", base, tmpname);
            rm_tree(path); /* a leftover of an earlier process with this pid (pid 1 in a container) */
            signal(SIGXFSZ, SIG_IGN); /* a file size limit: write fails with EFBIG and the copy is removed */
            if (unpack(exe, fd, offset, basefd, base, tmpname) != 0) {
                int err = errno;
                close(basefd);
                if (explicit) die("TXMQ_CACHE_DIR=%s cannot hold the unpacked files: cannot create files in %s: %s", cand[i], base, strerror(err));
                if (last) die("no cache directory to unpack into: cannot create files in %s: %s; set TXMQ_CACHE_DIR", base, strerror(err));
                continue;
            }
            publish(basefd, base, tmpname, name);
            if ((t = tree_fd(basefd, name)) < 0) die("the unpacked files in %s/%s changed while this start ran: run it again", base, name);
        }
        close(t);
        close(basefd);
        close(fd);
        char target[PATH_MAX];
        snprintf(target, sizeof target, "%s%s%s/txmq", base, strcmp(base, "/") ? "/" : "", name);
        /* The bundle's bootloader finds its files from /proc/self/exe; without /proc, from argv[0]: name it then. */
        if (access("/proc/self/exe", F_OK) != 0) argv[0] = target;
        signal(SIGXFSZ, SIG_DFL);
        execv(target, argv);
        die("cannot run %s: %s", target, strerror(errno));
    }
    return 1;
}
