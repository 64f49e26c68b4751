/*
 * rtp-run - starts the ranks of an rtp job (like torchrun).
 *
 *   rtp-run -n 4 -- ./prog args                        4 ranks on this host
 *   rtp-run -n 2 --nnodes 3 --node-rank i --master host:port -- ./prog args
 *                                                      2 ranks on each of 3 hosts
 *
 * Each rank gets RTP_RANK, RTP_WORLD_SIZE, RTP_LOCAL_RANK, RTP_LOCAL_WORLD_SIZE,
 * RTP_MASTER_ADDR, RTP_MASTER_PORT and RTP_TOKEN. On one host the token is fresh random
 * bytes and the port a free one; across hosts the user sets the same RTP_TOKEN on every
 * host (e.g. `export RTP_TOKEN=$(openssl rand -hex 32)` shared through the job script)
 * and names rank 0's host with --master. Every line a rank prints is prefixed with
 * "[rank] ". SIGINT and SIGTERM are forwarded to the ranks. When a rank fails (non-zero
 * exit or a signal), the others are stopped (SIGTERM, then SIGKILL after a grace
 * period) and rtp-run exits non-zero naming the rank at fault: the one that crashed, else
 * the one a failing rank blamed (went silent, or was lost: RTP_RUN_BLAME_FD, a pipe the
 * ranks share), else the one that failed first.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "free-port.h"

#define MAX_LINE 65536
#define GRACE_MS 5000
/* The library's bounds (rtp-comm.h's RTP_COMM_MAX_WORLD, RTP_TIMEOUT_MS's range), checked
 * here so that a bad value is refused before any rank starts. */
#define MAX_WORLD 65536
#define MAX_TIMEOUT_MS 86400000

struct out {
  int fd;   /* read end, -1 when closed */
  FILE *to; /* stdout or stderr */
  char buf[MAX_LINE];
  size_t n;
};

struct rank {
  pid_t pid;
  int rank;
  bool running;
  int status;
  int sent; /* the last signal rtp-run sent it */
  struct out out[2];
};

static volatile sig_atomic_t got_signal;

static void on_signal(int sig) {
  got_signal = sig;
}

#define USAGE                                                                        \
  "usage: rtp-run -n RANKS_PER_NODE [--nnodes K --node-rank I --master HOST:PORT]\n" \
  "               [--timeout-ms MS] -- PROGRAM [ARGS...]\n"

static void usage(void) {
  fprintf(stderr, USAGE "(rtp-run --help says more)\n");
  exit(2);
}

/* Every flag and every variable rtp-run reads or sets, and those the library reads in the
 * ranks (Run.HelpNamesEveryFlagAndVariable finds them in the sources). */
static void help(void) {
  printf(USAGE
         "\n"
         "Starts the ranks of an rtp job on this host, each line they print prefixed with\n"
         "\"[rank] \". SIGINT, SIGTERM and SIGHUP are passed on to the ranks. When a rank\n"
         "fails, the others get SIGTERM, then SIGKILL after %d s, and rtp-run exits with\n"
         "the failing rank's status, naming the rank at fault.\n"
         "\n"
         "Options:\n"
         "  -n, --nproc-per-node N  ranks on this host (default 1)\n"
         "  --nnodes K              hosts in the job (default 1): run rtp-run on each, with\n"
         "                          the same -n, --master and RTP_TOKEN\n"
         "  --node-rank I           this host's index, 0..K-1: it runs ranks I*N .. I*N+N-1\n"
         "  --master HOST:PORT      rank 0's host ([IPv6]:PORT too) and a port free there;\n"
         "                          needed with --nnodes > 1, else 127.0.0.1 and a free port\n"
         "  --timeout-ms MS         RTP_TIMEOUT_MS for the ranks, 1..%d\n"
         "  -h, --help              this text\n"
         "\n"
         "Read by rtp-run:\n"
         "  RTP_TOKEN               the job's secret, the same on every host (needed with\n"
         "                          --nnodes > 1: export RTP_TOKEN=$(openssl rand -hex 32));\n"
         "                          on one host, fresh random bytes when unset\n"
         "\n"
         "Set for each rank:\n"
         "  RTP_RANK, RTP_WORLD_SIZE     its rank, and the number of ranks\n"
         "  RTP_LOCAL_RANK, RTP_LOCAL_WORLD_SIZE\n"
         "                               its index among this host's ranks, and their number\n"
         "  RTP_MASTER_ADDR, RTP_MASTER_PORT\n"
         "                               where rank 0 listens\n"
         "  RTP_TOKEN                    the job's secret\n"
         "  RTP_TIMEOUT_MS               with --timeout-ms (below)\n"
         "  RTP_RUN_BLAME_FD             a pipe on which a failing rank names the peer that\n"
         "                               went silent or was lost\n"
         "\n"
         "Read by the library in each rank (set them for rtp-run, which passes them on):\n"
         "  RTP_BACKEND                  tcp, nccl or local (default: tcp; one rank: local)\n"
         "  RTP_BIND_ADDR, RTP_IFNAME    the address or interface to listen on and announce\n"
         "                               (default: the route to the master)\n"
         "  RTP_TIMEOUT_MS               rendezvous, silence and no-progress limit in ms\n"
         "                               (default 60000)\n"
         "  RTP_DEVICE                   nccl: this rank's CUDA device (default: the local\n"
         "                               rank modulo the device count)\n"
         "  RTP_NCCL_LIBRARY             nccl: the NCCL library to load, a path or a file\n"
         "                               name (default: libnccl.so.2, else the build's)\n"
         "  RTP_SOCKET_BUFFER=BYTES      fixed socket buffers (default: kernel autotuning)\n"
         "  RTP_DIRECT_COPY=0            ranks on one host send through the loopback\n"
         "                               instead of writing into each other's memory\n"
         "  RTP_PROFILE=1                print the time spent in each op at exit\n"
         "  RTP_CUDA_PROFILE=1           cuda: print each op's kernel time when the\n"
         "                               backend is freed\n"
         "  RTP_TRACE=PREFIX             write what each rank ran as a Chrome trace,\n"
         "                               PREFIX.RANK.json\n"
         "\n"
         "Without rtp-run, a rank's number and the world size come from RTP_RANK and\n"
         "RTP_WORLD_SIZE, else SLURM_PROCID and SLURM_NTASKS, else OMPI_COMM_WORLD_RANK and\n"
         "OMPI_COMM_WORLD_SIZE.\n",
         GRACE_MS / 1000, MAX_TIMEOUT_MS);
  exit(0);
}

/* The integer value of flag's argument s in [min, max], or exit 2 saying why: atoi would
 * turn "8x" into 8 and "x" into 0 without a word. */
static int parse_int(const char *flag, const char *s, long min, long max) {
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (!*s || *end || errno || v < min || v > max) {
    fprintf(stderr, "rtp-run: %s wants an integer from %ld to %ld, not '%s'\n", flag, min, max,
            s);
    exit(2);
  }
  return (int)v;
}

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static void make_token(char *out, size_t n) {
  unsigned char b[32];
  int fd = open("/dev/urandom", O_RDONLY);
  if (fd < 0 || read(fd, b, sizeof(b)) != (ssize_t)sizeof(b)) {
    perror("rtp-run: /dev/urandom");
    exit(1);
  }
  close(fd);
  for (size_t i = 0; i < sizeof(b) && 2 * i + 2 < n; i++)
    snprintf(out + 2 * i, 3, "%02x", b[i]);
}

/* Writes the complete lines of o (all of it if flush) with the rank prefix. */
static void emit(struct out *o, int rank, bool flush) {
  size_t start = 0;
  for (size_t i = 0; i < o->n; i++) {
    if (o->buf[i] == '\n') {
      fprintf(o->to, "[%d] %.*s\n", rank, (int)(i - start), o->buf + start);
      start = i + 1;
    }
  }
  if ((flush || (start == 0 && o->n == sizeof(o->buf))) && start < o->n) {
    fprintf(o->to, "[%d] %.*s\n", rank, (int)(o->n - start), o->buf + start);
    start = o->n;
  }
  memmove(o->buf, o->buf + start, o->n - start);
  o->n -= start;
  fflush(o->to);
}

/* The first blame a rank reported, read off the shared pipe. */
struct blame_line {
  int fd;
  char buf[256];
  size_t n;
  int reporter, blamed;
  char why[16];
};

static void read_blame(struct blame_line *b) {
  ssize_t r;
  while (b->fd >= 0 && (r = read(b->fd, b->buf + b->n, sizeof(b->buf) - 1 - b->n)) > 0) {
    b->n += (size_t)r;
    b->buf[b->n] = 0;
    char *nl = strchr(b->buf, '\n');
    if (b->blamed < 0 && nl &&
        sscanf(b->buf, "%d %d %15s", &b->reporter, &b->blamed, b->why) != 3)
      b->blamed = -1;
    if (nl || b->n == sizeof(b->buf) - 1) b->n = 0; /* later lines only follow the first */
  }
}

/* The exit code of a blamed rank that quit by itself with an error (its peers saw it leave,
 * so it failed first: it printed why, and was not lost); 0 otherwise. */
static int quit_with_error(const struct rank *rs, int n, int blamed) {
  for (int l = 0; l < n; l++)
    if (rs[l].rank == blamed && !rs[l].running && !rs[l].sent && WIFEXITED(rs[l].status))
      return WEXITSTATUS(rs[l].status);
  return 0;
}

/* Whether the blamed rank is the job's fault: it did not finish well here (it may run on
 * another node, where it is taken at the reporter's word), and was not lost because
 * rtp-run itself stopped it after another rank's failure. */
static bool at_fault(const struct rank *rs, int n, const struct blame_line *bl) {
  if (bl->blamed < 0) return false;
  for (int l = 0; l < n; l++)
    if (rs[l].rank == bl->blamed)
      return !(WIFEXITED(rs[l].status) && WEXITSTATUS(rs[l].status) == 0 && !rs[l].running) &&
             !(rs[l].sent && strcmp(bl->why, "lost") == 0);
  return true;
}

static void drain(struct out *o, int rank) {
  if (o->fd < 0) return;
  ssize_t r = read(o->fd, o->buf + o->n, sizeof(o->buf) - o->n);
  if (r > 0) {
    o->n += (size_t)r;
    emit(o, rank, false);
  } else if (r == 0 || (errno != EAGAIN && errno != EINTR)) {
    emit(o, rank, true);
    close(o->fd);
    o->fd = -1;
  }
}

static void signal_all(struct rank *rs, int n, int sig) {
  for (int i = 0; i < n; i++)
    if (rs[i].running) {
      kill(-rs[i].pid, sig); /* its process group */
      rs[i].sent = sig;
    }
}

static void describe(const struct rank *r, char *buf, size_t n) {
  if (WIFEXITED(r->status))
    snprintf(buf, n, "exited with status %d", WEXITSTATUS(r->status));
  else if (WIFSIGNALED(r->status))
    snprintf(buf, n, "was killed by signal %d (%s)", WTERMSIG(r->status),
             strsignal(WTERMSIG(r->status)));
  else
    snprintf(buf, n, "stopped");
}

int main(int argc, char **argv) {
  int nproc = 1, nnodes = 1, node_rank = 0, timeout_ms = 0;
  const char *master = NULL;
  int i = 1;
  for (; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--")) {
      i++;
      break;
    } else if ((!strcmp(a, "-n") || !strcmp(a, "--nproc-per-node")) && i + 1 < argc) {
      nproc = parse_int(a, argv[++i], 1, MAX_WORLD);
    } else if (!strcmp(a, "--nnodes") && i + 1 < argc) {
      nnodes = parse_int(a, argv[++i], 1, MAX_WORLD);
    } else if (!strcmp(a, "--node-rank") && i + 1 < argc) {
      node_rank = parse_int(a, argv[++i], 0, MAX_WORLD - 1);
    } else if (!strcmp(a, "--master") && i + 1 < argc) {
      master = argv[++i];
    } else if (!strcmp(a, "--timeout-ms") && i + 1 < argc) {
      timeout_ms = parse_int(a, argv[++i], 1, MAX_TIMEOUT_MS);
    } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
      help();
    } else if (a[0] == '-') {
      fprintf(stderr, "rtp-run: unknown option %s\n", a);
      usage();
    } else {
      break;
    }
  }
  if (i >= argc) usage();
  if ((long)nproc * nnodes > MAX_WORLD) {
    fprintf(stderr, "rtp-run: -n %d x --nnodes %d is more than %d ranks\n", nproc, nnodes,
            MAX_WORLD);
    return 2;
  }
  if (node_rank >= nnodes) {
    fprintf(stderr, "rtp-run: --node-rank %d must be below --nnodes %d\n", node_rank, nnodes);
    return 2;
  }
  char **prog = argv + i;

  char addr[256] = "127.0.0.1", port[16], token[128] = "";
  if (master) {
    const char *colon = strrchr(master, ':');
    if (!colon || colon == master || (size_t)(colon - master) >= sizeof(addr)) {
      fprintf(stderr, "rtp-run: --master wants HOST:PORT, not '%s'\n", master);
      return 2;
    }
    memcpy(addr, master, (size_t)(colon - master));
    addr[colon - master] = 0;
    if (addr[0] == '[' && addr[strlen(addr) - 1] == ']') { /* [ipv6]:port */
      memmove(addr, addr + 1, strlen(addr));
      addr[strlen(addr) - 1] = 0;
    }
    snprintf(port, sizeof(port), "%s", colon + 1);
  } else if (nnodes > 1) {
    fprintf(stderr, "rtp-run: --nnodes > 1 needs --master HOST:PORT (rank 0's host)\n");
    return 2;
  } else {
    int p = free_port();
    if (!p) {
      fprintf(stderr, "rtp-run: no free port in 20000-31999; give one with --master\n");
      return 2;
    }
    snprintf(port, sizeof(port), "%d", p);
  }
  const char *env_token = getenv("RTP_TOKEN");
  if (env_token && *env_token) {
    snprintf(token, sizeof(token), "%s", env_token);
  } else if (nnodes > 1) {
    fprintf(stderr,
            "rtp-run: set the same RTP_TOKEN on every node "
            "(e.g. export RTP_TOKEN=$(openssl rand -hex 32))\n");
    return 2;
  } else {
    make_token(token, sizeof(token));
  }

  struct sigaction sa;
  memset(&sa, 0, sizeof(sa));
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGHUP, &sa, NULL);
  signal(SIGPIPE, SIG_IGN);

  int world = nproc * nnodes;
  struct rank *rs = calloc((size_t)nproc, sizeof(*rs));
  if (!rs) return 1;
  /* The ranks tell us which rank caused their failure (rtp__comm_blame): one line each,
   * "REPORTER BLAMED WHY", on a pipe they share. */
  int blame[2];
  if (pipe(blame) < 0) {
    perror("rtp-run: pipe");
    return 1;
  }
  fcntl(blame[0], F_SETFD, FD_CLOEXEC);
  fcntl(blame[0], F_SETFL, O_NONBLOCK);
  char blame_fd[16];
  snprintf(blame_fd, sizeof(blame_fd), "%d", blame[1]);
  for (int l = 0; l < nproc; l++) {
    struct rank *r = &rs[l];
    r->rank = node_rank * nproc + l;
    int p[2][2];
    if (pipe(p[0]) < 0 || pipe(p[1]) < 0) {
      perror("rtp-run: pipe");
      signal_all(rs, l, SIGKILL);
      return 1;
    }
    /* a signal between fork and exec must kill the child, not run our handler there */
    sigset_t block, old;
    sigemptyset(&block);
    sigaddset(&block, SIGINT);
    sigaddset(&block, SIGTERM);
    sigaddset(&block, SIGHUP);
    sigprocmask(SIG_BLOCK, &block, &old);
    pid_t pid = fork();
    if (pid == 0) {
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
      signal(SIGHUP, SIG_DFL);
      signal(SIGPIPE, SIG_DFL);
      sigprocmask(SIG_SETMASK, &old, NULL);
    } else {
      sigprocmask(SIG_SETMASK, &old, NULL);
    }
    if (pid < 0) {
      perror("rtp-run: fork");
      signal_all(rs, l, SIGKILL);
      return 1;
    }
    if (pid == 0) {
      setpgid(0, 0);
      prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive the launcher */
      dup2(p[0][1], 1);
      dup2(p[1][1], 2);
      close(p[0][0]);
      close(p[0][1]);
      close(p[1][0]);
      close(p[1][1]);
      char v[32];
      snprintf(v, sizeof(v), "%d", r->rank);
      setenv("RTP_RANK", v, 1);
      snprintf(v, sizeof(v), "%d", world);
      setenv("RTP_WORLD_SIZE", v, 1);
      snprintf(v, sizeof(v), "%d", l);
      setenv("RTP_LOCAL_RANK", v, 1);
      snprintf(v, sizeof(v), "%d", nproc);
      setenv("RTP_LOCAL_WORLD_SIZE", v, 1);
      setenv("RTP_RUN_BLAME_FD", blame_fd, 1);
      setenv("RTP_MASTER_ADDR", addr, 1);
      setenv("RTP_MASTER_PORT", port, 1);
      setenv("RTP_TOKEN", token, 1);
      if (timeout_ms > 0) {
        snprintf(v, sizeof(v), "%d", timeout_ms);
        setenv("RTP_TIMEOUT_MS", v, 1);
      }
      execvp(prog[0], prog);
      fprintf(stderr, "rtp-run: cannot run %s: %s\n", prog[0], strerror(errno));
      _exit(127);
    }
    setpgid(pid, pid);
    r->pid = pid;
    r->running = true;
    close(p[0][1]);
    close(p[1][1]);
    r->out[0] = (struct out){.fd = p[0][0], .to = stdout};
    r->out[1] = (struct out){.fd = p[1][0], .to = stderr};
    fcntl(p[0][0], F_SETFL, O_NONBLOCK);
    fcntl(p[1][0], F_SETFL, O_NONBLOCK);
  }

  close(blame[1]);
  struct blame_line bl = {.fd = blame[0], .reporter = -1, .blamed = -1};
  int exit_code = 0, failed_rank = -1, running = nproc, forwarded = 0;
  bool failed_crash = false;
  double stop_at = 0; /* when the others get SIGKILL */
  struct pollfd *pfd = calloc((size_t)nproc * 2 + 1, sizeof(*pfd));
  if (!pfd) return 1;
  for (;;) {
    int np = 0;
    for (int l = 0; l < nproc; l++)
      for (int k = 0; k < 2; k++) {
        pfd[np].fd = rs[l].out[k].fd;
        pfd[np].events = POLLIN;
        pfd[np].revents = 0;
        np++;
      }
    pfd[np].fd = bl.fd;
    pfd[np].events = POLLIN;
    pfd[np].revents = 0;
    poll(pfd, (nfds_t)np + 1, 50);
    if (pfd[np].revents) read_blame(&bl);
    for (int l = 0; l < nproc; l++)
      for (int k = 0; k < 2; k++)
        if (pfd[2 * l + k].revents) drain(&rs[l].out[k], rs[l].rank);

    if (got_signal && got_signal != forwarded) {
      forwarded = got_signal;
      fprintf(stderr, "rtp-run: got signal %d (%s), passing it to the ranks\n", forwarded,
              strsignal(forwarded));
      signal_all(rs, nproc, forwarded);
      if (!exit_code) exit_code = 128 + forwarded;
      if (!stop_at) stop_at = now_ms() + GRACE_MS;
    }
    for (int l = 0; l < nproc; l++) {
      struct rank *r = &rs[l];
      if (!r->running) continue;
      if (waitpid(r->pid, &r->status, WNOHANG) != r->pid) continue;
      r->running = false;
      running--;
      kill(-r->pid, SIGKILL); /* whatever it left behind in its group */
      bool ok = WIFEXITED(r->status) && WEXITSTATUS(r->status) == 0;
      bool ours = WIFSIGNALED(r->status) && r->sent && WTERMSIG(r->status) == r->sent;
      if (!ok && !ours && !forwarded) {
        /* The root cause is the first failure, except that a crash (a signal) beats an
           exit seen before it: ranks that lose a peer exit with an error, and may do so
           before the crashed peer is reaped (a core dump takes time). */
        char why[128];
        describe(r, why, sizeof(why));
        bool crash = WIFSIGNALED(r->status);
        if (failed_rank < 0 || (crash && !failed_crash)) {
          failed_rank = r->rank;
          failed_crash = crash;
          exit_code = WIFEXITED(r->status) ? WEXITSTATUS(r->status) : 128 + WTERMSIG(r->status);
        }
        fprintf(stderr, "rtp-run: rank %d %s%s\n", r->rank, why,
                stop_at ? "" : "; stopping the other ranks");
        if (!stop_at) {
          signal_all(rs, nproc, SIGTERM);
          stop_at = now_ms() + GRACE_MS;
        }
      }
    }
    if (stop_at && now_ms() > stop_at) {
      signal_all(rs, nproc, SIGKILL);
      stop_at = now_ms() + 1e9;
    }
    bool open_fds = false;
    for (int l = 0; l < nproc; l++) open_fds |= rs[l].out[0].fd >= 0 || rs[l].out[1].fd >= 0;
    if (running == 0 && (!open_fds || stop_at)) break;
    if (running == 0) {
      /* children are gone; drain what is left without blocking forever (a grandchild
         may keep a pipe open) */
      if (!stop_at) stop_at = now_ms() + 1000;
    }
  }
  for (int l = 0; l < nproc; l++)
    for (int k = 0; k < 2; k++) {
      drain(&rs[l].out[k], rs[l].rank);
      emit(&rs[l].out[k], rs[l].rank, true);
    }
  read_blame(&bl);
  int quit = failed_rank >= 0 && !failed_crash ? quit_with_error(rs, nproc, bl.blamed) : 0;
  if (quit)
    fprintf(stderr, "rtp-run: job failed: rank %d failed first (exit code %d)\n", bl.blamed,
            quit);
  else if (failed_rank >= 0 && !failed_crash && at_fault(rs, nproc, &bl))
    fprintf(stderr, "rtp-run: job failed: rank %d %s (rank %d noticed; exit code %d)\n",
            bl.blamed, strcmp(bl.why, "silent") == 0 ? "went silent" : "was lost", bl.reporter,
            exit_code);
  else if (failed_rank >= 0)
    fprintf(stderr, "rtp-run: job failed: rank %d %s (exit code %d)\n", failed_rank,
            failed_crash ? "crashed" : "failed first", exit_code);
  if (bl.fd >= 0) close(bl.fd);
  free(pfd);
  free(rs);
  return exit_code;
}
