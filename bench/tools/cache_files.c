// bench/tools/cache_files.c: what the cache's second file per cached file costs its file
// system, without hoardfs: N small files filled as a cold fill fills them.
//
//   cc -O2 -o cache_files bench/tools/cache_files.c && ./cache_files N DIR MODE
//
// Per file i: DIR/d/i created, 94 bytes written, fstat, sync_file_range(WRITE); after all,
// each fdatasync'ed and closed (the group commit). MODE 1: nothing else; MODE 2: also the
// record file DIR/m/i created and 109 bytes written to it at the fill and again at the
// commit (as hoardfs does today); MODE x: the record in an extended attribute of the data
// file instead. Prints wall and CPU seconds. Use a fresh file system (docs/performance.md,
// session 32): on a journal-less ext4 a run just after removing the last one also pays for
// ext4's scan of recently freed inodes.
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>
// A call that failed ends the run: figures of calls that did nothing would mislead.
static int ok(int r, const char *what) {
  if (r < 0) { perror(what); exit(1); }
  return r;
}
int main(int c, char **v) {
  if (c != 4 || !strchr("12x", v[3][0])) { fprintf(stderr, "usage: %s N DIR 1|2|x\n", v[0]); return 2; }
  int n = atoi(v[1]); char *dir = v[2]; char mode = v[3][0];
  char p[4096], buf[128]; memset(buf, 'x', sizeof buf);
  snprintf(p, sizeof p, "%s/d", dir); mkdir(p, 0700);
  snprintf(p, sizeof p, "%s/m", dir); mkdir(p, 0700);
  int dd = ok(open(dir, O_PATH | O_DIRECTORY), dir);
  struct timespec a, b; clock_gettime(CLOCK_MONOTONIC, &a);
  int *fds = malloc(n * sizeof(int));
  for (int i = 0; i < n; i++) {
    snprintf(p, sizeof p, "d/%d", i);
    int fd = ok(openat(dd, p, O_RDWR | O_CREAT | O_CLOEXEC, 0600), p);
    struct stat st; fstat(fd, &st);
    if (mode == '2') {
      snprintf(p, sizeof p, "m/%d", i);
      int m = ok(openat(dd, p, O_RDWR | O_CREAT | O_CLOEXEC, 0600), p);
      fstat(m, &st); ok(pwrite(m, buf, 109, 0), "pwrite"); fstat(m, &st); close(m);
    } else if (mode == 'x') {
      ok(fsetxattr(fd, "user.hoardfs.record", buf, 109, 0), "fsetxattr");
    }
    ok(pwrite(fd, buf, 94, 0), "pwrite"); fstat(fd, &st);
    ok(sync_file_range(fd, 0, 94, SYNC_FILE_RANGE_WRITE), "sync_file_range");
    fds[i] = fd;
  }
  for (int i = 0; i < n; i++) {
    ok(fdatasync(fds[i]), "fdatasync");
    if (mode == '2') {
      snprintf(p, sizeof p, "m/%d", i);
      int m = ok(openat(dd, p, O_RDWR), p);
      ok(pwrite(m, buf, 109, 0), "pwrite");
      close(m);
    } else if (mode == 'x') {
      ok(fsetxattr(fds[i], "user.hoardfs.record", buf, 109, 0), "fsetxattr");
    }
    close(fds[i]);
  }
  clock_gettime(CLOCK_MONOTONIC, &b);
  struct timespec ru; clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ru);
  printf("mode %c n %d wall %.3f cpu %.3f\n", mode, n, (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9, ru.tv_sec + ru.tv_nsec / 1e9);
}
