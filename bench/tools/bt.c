/* bt: the timed inner loops of the hoardfs benchmark suite.
 *
 * Each mode does one measurement and prints one line "key=value ..." on stdout, with
 * the time measured inside the process (CLOCK_MONOTONIC), so process start-up and the
 * Python driver do not count.
 *
 *   bt seq FILE BS                 read FILE sequentially with BS-byte read(2)s
 *   bt pread FILE SIZE N           open once, pread SIZE bytes at offset 0, N times
 *   bt pages DIR NFILES ROUNDS     xCachefs micro-benchmark: ROUNDS rounds, each opening
 *                                  DIR/fNNNN for every file and reading one 4 KiB page
 *                                  (round r reads page r*13 mod pages-per-file)
 *   bt stat PATH N                 stat(2) PATH N times (follows symlinks)
 *   bt walk DIR                    lstat every entry below DIR (nftw, FTW_PHYS)
 *   bt readall DIR                 read every byte of every regular file below DIR
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void die(const char *what, const char *arg) {
    fprintf(stderr, "bt: %s %s: %s\n", what, arg, strerror(errno));
    exit(1);
}

static char *buf;
static size_t bufsz = 1 << 20;
static long long total_bytes, total_files, total_entries;

static int walk_cb(const char *p, const struct stat *st, int flag, struct FTW *f) {
    (void)p; (void)st; (void)flag; (void)f;
    total_entries++;
    return 0;
}

static int readall_cb(const char *p, const struct stat *st, int flag, struct FTW *f) {
    (void)f;
    if (flag != FTW_F || !S_ISREG(st->st_mode)) return 0;
    int fd = open(p, O_RDONLY);
    if (fd < 0) die("open", p);
    ssize_t n;
    while ((n = read(fd, buf, bufsz)) > 0) total_bytes += n;
    if (n < 0) die("read", p);
    close(fd);
    total_files++;
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: bt seq|pread|pages|stat|walk|readall ARGS\n");
        return 2;
    }
    const char *mode = argv[1];
    buf = aligned_alloc(4096, bufsz);
    memset(buf, 0, bufsz);
    if (!strcmp(mode, "seq") && argc == 4) {
        size_t bs = strtoull(argv[3], 0, 0);
        if (bs > bufsz) { free(buf); bufsz = bs; buf = aligned_alloc(4096, bs); }
        double t0 = now();
        int fd = open(argv[2], O_RDONLY);
        if (fd < 0) die("open", argv[2]);
        ssize_t n;
        while ((n = read(fd, buf, bs)) > 0) total_bytes += n;
        if (n < 0) die("read", argv[2]);
        close(fd);
        double dt = now() - t0;
        printf("seconds=%.6f bytes=%lld mib_s=%.1f\n", dt, total_bytes, total_bytes / dt / 1048576.0);
    } else if (!strcmp(mode, "pread") && argc == 5) {
        size_t sz = strtoull(argv[3], 0, 0);
        long n = strtol(argv[4], 0, 0);
        int fd = open(argv[2], O_RDONLY);
        if (fd < 0) die("open", argv[2]);
        if (pread(fd, buf, sz, 0) < 0) die("pread", argv[2]); /* first call not timed */
        double t0 = now();
        for (long i = 0; i < n; i++)
            if (pread(fd, buf, sz, 0) != (ssize_t)sz) die("pread", argv[2]);
        double dt = now() - t0;
        close(fd);
        printf("seconds=%.6f ns_per_call=%.1f\n", dt, dt / n * 1e9);
    } else if (!strcmp(mode, "pages") && argc == 5) {
        int nfiles = atoi(argv[3]), rounds = atoi(argv[4]);
        char p[4096];
        double t0 = now();
        for (int r = 0; r < rounds; r++) {
            for (int i = 0; i < nfiles; i++) {
                snprintf(p, sizeof p, "%s/f%04d", argv[2], i);
                int fd = open(p, O_RDONLY);
                if (fd < 0) die("open", p);
                struct stat st;
                if (fstat(fd, &st) < 0) die("fstat", p);
                off_t pages = st.st_size / 4096;
                off_t off = pages ? ((off_t)r * 13 % pages) * 4096 : 0;
                if (pread(fd, buf, 4096, off) < 0) die("pread", p);
                close(fd);
            }
        }
        double dt = now() - t0;
        printf("seconds=%.6f us_per_page=%.2f\n", dt, dt / ((double)nfiles * rounds) * 1e6);
    } else if (!strcmp(mode, "stat") && argc == 4) {
        long n = strtol(argv[3], 0, 0);
        struct stat st;
        double t0 = now();
        for (long i = 0; i < n; i++)
            if (stat(argv[2], &st) < 0) die("stat", argv[2]);
        double dt = now() - t0;
        printf("seconds=%.6f ns_per_call=%.1f\n", dt, dt / n * 1e9);
    } else if (!strcmp(mode, "walk")) {
        double t0 = now();
        if (nftw(argv[2], walk_cb, 64, FTW_PHYS) < 0) die("nftw", argv[2]);
        double dt = now() - t0;
        printf("seconds=%.6f entries=%lld\n", dt, total_entries);
    } else if (!strcmp(mode, "readall")) {
        double t0 = now();
        if (nftw(argv[2], readall_cb, 64, FTW_PHYS) < 0) die("nftw", argv[2]);
        double dt = now() - t0;
        printf("seconds=%.6f files=%lld bytes=%lld\n", dt, total_files, total_bytes);
    } else {
        fprintf(stderr, "bt: bad arguments\n");
        return 2;
    }
    return 0;
}
