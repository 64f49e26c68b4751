/* free-port.h - a port for rank 0 of ranks started on this machine, that no other process
 * using this header can be handed until this one exits.
 *
 * Checking that a port is free and binding it later leaves a window in which another job
 * can take it: ctest runs several multi-rank tests side by side, and two of them once chose
 * the same port, so that each rank met the other test's rank 0. So the choice is also
 * reserved: a lock on byte `port` of one file in the temporary directory, held by the
 * open file (inherited by forked ranks) until the process exits. Ports are drawn below
 * Linux's ephemeral range (32768 on), which the kernel hands to outgoing connections.
 * Shared by rtp-run, the benchmarks and the tests. */
#ifndef RTP_FREE_PORT_H
#define RTP_FREE_PORT_H

/* Needs _GNU_SOURCE (F_OFD_SETLK), defined before the first system header. */
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

static inline bool free_port_bindable(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a;
  memset(&a, 0, sizeof(a));
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons((uint16_t)port);
  bool ok = fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0;
  if (fd >= 0) close(fd);
  return ok;
}

/* The reservation file, opened once per process (a forked child opens its own, so that
 * its reservations are not its parent's); -1 where it cannot be opened, and then ports
 * are only checked, not reserved. */
static inline int free_port_lock_fd(void) {
  static int fd = -1;
  static pid_t owner = 0;
  if (owner == getpid()) return fd;
  owner = getpid();
  const char *dir = getenv("TMPDIR");
  char path[4096];
  snprintf(path, sizeof(path), "%s/rtp-ports.lock", dir && *dir ? dir : "/tmp");
  fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
  if (fd >= 0) fchmod(fd, 0666); /* another user's jobs reserve in the same file */
  return fd;
}

static inline bool free_port_reserve(int port) {
  int fd = free_port_lock_fd();
  if (fd < 0) return true;
  struct flock l;
  memset(&l, 0, sizeof(l));
  l.l_type = F_WRLCK;
  l.l_whence = SEEK_SET;
  l.l_start = port;
  l.l_len = 1;
  return fcntl(fd, F_OFD_SETLK, &l) == 0;
}

/* A free, reserved port in [20000, 32000); 0 if none of 1000 random tries is. Random, so
 * that processes that do not use this header rarely pick the same. */
static inline int free_port(void) {
  int urandom = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  int port = 0;
  for (int i = 0; i < 1000 && !port; i++) {
    unsigned r = 0;
    if (urandom < 0 || read(urandom, &r, sizeof(r)) != (ssize_t)sizeof(r)) r = (unsigned)rand();
    int p = 20000 + (int)(r % 12000);
    if (free_port_bindable(p) && free_port_reserve(p)) port = p;
  }
  if (urandom >= 0) close(urandom);
  return port;
}

#endif
