/*
 * rtp-io.c - safetensors files: a strict reader that never trusts its input and an
 * atomic writer.
 *
 * Layout: 8-byte little-endian header length N, N bytes of UTF-8 JSON
 *   {"__metadata__": {"k": "v", ...},
 *    "name": {"dtype": "F32", "shape": [d0, ...], "data_offsets": [begin, end]}, ...}
 * (padded with spaces), then the data section; offsets are relative to its start.
 */
#define _POSIX_C_SOURCE 200809L
#include "rtp-backend.h"
#include "rtp-json.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "rtp-io.c reads and writes raw data and assumes a little-endian host"
#endif

/* The reference implementation refuses headers above 100 MB; so do we. */
#define ST_MAX_HEADER ((uint64_t)100 << 20)
/* Chunk for copying views through a bounce buffer. */
#define ST_CHUNK ((size_t)1 << 20)

struct st_entry {
  char *name;
  enum rtp_type type;
  int n_dims;               /* as in the file, 0..RTP_MAX_DIMS */
  int64_t ne[RTP_MAX_DIMS]; /* padded with 1 */
  uint64_t begin, end;      /* relative to the data section */
};

struct st_meta {
  char *key;
  char *value;
};

struct rtp_safetensors {
  char *path;
  int fd;
  uint64_t data_start; /* absolute file offset of the data section */
  uint64_t data_size;
  int n;
  struct st_entry *e;
  int n_meta;
  struct st_meta *meta;
};

/* ---- small helpers --------------------------------------------------------------- */

static const char *st_type_name(enum rtp_type type) {
  switch (type) {
    case RTP_TYPE_F32:
      return "F32";
    case RTP_TYPE_I32:
      return "I32";
    default:
      return "?";
  }
}

static size_t st_type_size(enum rtp_type type) {
  return type == RTP_TYPE_F32 || type == RTP_TYPE_I32 ? 4 : 0;
}

static const char *st_errno_str(int err, char *buf, size_t size) {
#if defined(_GNU_SOURCE)
  return strerror_r(err, buf, size); /* the GNU variant, if someone defines it */
#else
  if (strerror_r(err, buf, size) != 0) snprintf(buf, size, "errno %d", err);
  return buf;
#endif
}

static char *st_strdup(const char *s) {
  size_t n = strlen(s) + 1;
  char *r = malloc(n);
  if (r) memcpy(r, s, n);
  return r;
}

/* a * b into *r unless it overflows int64. Both non-negative. */
static bool st_mul_ok(uint64_t a, uint64_t b, uint64_t *r) {
  if (a != 0 && b > (uint64_t)INT64_MAX / a) return false;
  *r = a * b;
  return true;
}

/* "ne={a,b,c,d}" into buf. */
static const char *st_fmt_ne(const int64_t *ne, char *buf, size_t size) {
  snprintf(buf, size, "ne={%" PRId64 ",%" PRId64 ",%" PRId64 ",%" PRId64 "}", ne[0], ne[1],
           ne[2], ne[3]);
  return buf;
}

const char *rtp__file_shape_str(const int64_t *ne, int n_dims, char *buf, size_t size) {
  size_t used = 0;
  used += (size_t)snprintf(buf, size, "[");
  for (int i = n_dims - 1; i >= 0 && used < size; i--) {
    used += (size_t)snprintf(buf + used, size - used, "%" PRId64 "%s", ne[i], i ? ", " : "");
  }
  if (used < size) snprintf(buf + used, size - used, "]");
  return buf;
}

static const char *st_fmt_shape(const struct st_entry *e, char *buf, size_t size) {
  return rtp__file_shape_str(e->ne, e->n_dims, buf, size);
}

/* pread exactly size bytes at off; short reads are a truncated file. */
static int st_pread_fd(int fd, const char *path, void *dst, size_t size, uint64_t off) {
  char *p = dst;
  while (size > 0) {
    size_t chunk = size > ((size_t)1 << 30) ? ((size_t)1 << 30) : size;
    if (off > (uint64_t)INT64_MAX) return rtp__error(RTP_EIO, "%s: offset overflow", path);
    ssize_t r = pread(fd, p, chunk, (off_t)off);
    if (r < 0) {
      if (errno == EINTR) continue;
      char eb[128];
      return rtp__error(RTP_EIO, "%s: read failed at byte %" PRIu64 ": %s", path, off,
                        st_errno_str(errno, eb, sizeof(eb)));
    }
    if (r == 0) {
      return rtp__error(RTP_EIO, "%s: truncated: unexpected end of file at byte %" PRIu64, path,
                        off);
    }
    p += r;
    off += (uint64_t)r;
    size -= (size_t)r;
  }
  return RTP_OK;
}

static int st_pread(const struct rtp_safetensors *st, void *dst, size_t size, uint64_t off) {
  return st_pread_fd(st->fd, st->path, dst, size, off);
}

/* strerror's "File too large" does not say which limit: past RLIMIT_FSIZE, name it. */
static int st_write_failed(const char *path, int err) {
  char eb[128];
  struct rlimit rl;
  st_errno_str(err, eb, sizeof(eb));
  if (err == EFBIG && getrlimit(RLIMIT_FSIZE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
    return rtp__error(RTP_EIO,
                      "%s: write failed: %s (EFBIG: no file may grow past %llu bytes here, "
                      "ulimit -f)",
                      path, eb, (unsigned long long)rl.rlim_cur);
  return rtp__error(RTP_EIO, "%s: write failed: %s", path, eb);
}

static int st_write_all(int fd, const void *src, size_t size, const char *path) {
  const char *p = src;
  while (size > 0) {
    size_t chunk = size > ((size_t)1 << 30) ? ((size_t)1 << 30) : size;
    ssize_t r = write(fd, p, chunk);
    if (r < 0) {
      if (errno == EINTR) continue;
      return st_write_failed(path, errno);
    }
    if (r == 0) return rtp__error(RTP_EIO, "%s: write failed: no progress", path);
    p += r;
    size -= (size_t)r;
  }
  return RTP_OK;
}

/* ---- any file the library reads ---------------------------------------------------- */

static const char *st_file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "a special file";
}

int rtp__file_open(const char *path, uint64_t max_bytes, int *fd, uint64_t *bytes) {
  char eb[128];
  *fd = -1;
  /* O_NONBLOCK: opening a FIFO for reading would wait for a writer; this way the open
   * returns at once and the type check refuses it. Links are followed: the check is of
   * what was opened, and a loop fails the open (ELOOP). */
  int f = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (f < 0)
    return rtp__error(RTP_EIO, "%s: cannot open: %s", path,
                      st_errno_str(errno, eb, sizeof(eb)));
  struct stat sb;
  int rc = RTP_OK, flags;
  if (fstat(f, &sb) != 0) {
    rc = rtp__error(RTP_EIO, "%s: cannot stat: %s", path, st_errno_str(errno, eb, sizeof(eb)));
  } else if (!S_ISREG(sb.st_mode)) {
    rc = rtp__error(RTP_EIO, "%s: is %s, not a regular file", path, st_file_kind(sb.st_mode));
  } else if ((uint64_t)sb.st_size > max_bytes) {
    rc = rtp__error(RTP_EFORMAT, "%s: %" PRIu64 " bytes, more than the %" PRIu64 " allowed",
                    path, (uint64_t)sb.st_size, max_bytes);
  } else if ((flags = fcntl(f, F_GETFL)) < 0 || fcntl(f, F_SETFL, flags & ~O_NONBLOCK) < 0) {
    rc = rtp__error(RTP_EIO, "%s: fcntl: %s", path, st_errno_str(errno, eb, sizeof(eb)));
  }
  if (rc) {
    close(f);
    return rc;
  }
  *fd = f;
  *bytes = (uint64_t)sb.st_size;
  return RTP_OK;
}

int rtp_file_read(const char *path, size_t max_bytes, void **data, size_t *size) {
  if (!path || !data) return rtp__error(RTP_EINVAL, "rtp_file_read: NULL argument");
  *data = NULL;
  if (size) *size = 0;
  int fd;
  uint64_t n;
  int rc = rtp__file_open(path, max_bytes == SIZE_MAX ? UINT64_MAX : max_bytes, &fd, &n);
  if (rc) return rc;
  /* The size was checked before any read, and no more than it is read: a file that
   * grows meanwhile cannot make the buffer grow. */
  char *buf = n < SIZE_MAX ? malloc((size_t)n + 1) : NULL;
  if (!buf) rc = rtp__error(RTP_ENOMEM, "%s: out of memory for %" PRIu64 " bytes", path, n);
  if (!rc) rc = st_pread_fd(fd, path, buf, (size_t)n, 0);
  close(fd);
  if (rc) {
    free(buf);
    return rc;
  }
  buf[n] = '\0';
  *data = buf;
  if (size) *size = (size_t)n;
  return RTP_OK;
}

/* ---- the header, read through rtp-json.c ------------------------------------------ */

/* The header's top-level keys are tensor names and __metadata__: a repeated one is named
 * so, not as a repeated key. */
static int st_duplicate(const struct rtp_safetensors *st, const struct rtp__json_fault *f) {
  if (f->depth == 1 && strcmp(f->key, "__metadata__") == 0)
    return rtp__error(RTP_EFORMAT, "%s: duplicate __metadata__", st->path);
  if (f->depth == 1)
    return rtp__error(RTP_EFORMAT, "%s: duplicate tensor name '%s'", st->path, f->key);
  if (f->depth == 2 && strcmp(f->parent, "__metadata__") == 0)
    return rtp__error(RTP_EFORMAT, "%s: duplicate __metadata__ key '%s'", st->path, f->key);
  if (f->depth == 2 && f->parent[0]) /* else an object in an array: no tensor */
    return rtp__error(RTP_EFORMAT, "%s: tensor '%s': duplicate key '%s'", st->path, f->parent,
                      f->key);
  return RTP_EFORMAT; /* the parser's message stands */
}

/* {"k": "v", ...}: strings only, as in the reference implementation. */
static int st_read_meta(struct rtp_safetensors *st, const struct rtp__json *doc,
                        const struct rtp__json_value *obj) {
  int rc = rtp__json_expect(doc, obj, RTP__JSON_OBJECT, "__metadata__");
  if (rc) return rc;
  st->meta = calloc(rtp__json_count(obj) + 1, sizeof(*st->meta));
  if (!st->meta)
    return rtp__error(RTP_ENOMEM, "%s: out of memory reading the header", st->path);
  for (const struct rtp__json_value *m = rtp__json_child(doc, obj); m;
       m = rtp__json_next(doc, m)) {
    const char *key = rtp__json_key(doc, m), *value = rtp__json_str(doc, m);
    if (!value)
      return rtp__error(RTP_EFORMAT, "%s: __metadata__ values must be strings: '%s' is %s",
                        st->path, key, rtp__json_kind_name(m));
    struct st_meta *e = &st->meta[st->n_meta];
    e->key = st_strdup(key);
    e->value = st_strdup(value);
    if (!e->key || !e->value) {
      free(e->key);
      free(e->value);
      return rtp__error(RTP_ENOMEM, "%s: out of memory reading the header", st->path);
    }
    st->n_meta++;
  }
  return RTP_OK;
}

/* {"dtype": ..., "shape": [...], "data_offsets": [b, e]} for the tensor e->name. */
static int st_read_entry(const struct rtp_safetensors *st, const struct rtp__json *doc,
                         const struct rtp__json_value *obj, struct st_entry *e) {
  static const char *const keys[] = {"dtype", "shape", "data_offsets", NULL};
  const struct rtp__json_value *dtype, *shape, *offs;
  const char *n = e->name;
  int rc = rtp__json_expect(doc, obj, RTP__JSON_OBJECT, "tensor '%s'", n);
  if (!rc) rc = rtp__json_only(doc, obj, keys, "tensor '%s'", n);
  if (!rc) rc = rtp__json_member(doc, obj, "dtype", RTP__JSON_STRING, &dtype, "tensor '%s'", n);
  if (!rc) rc = rtp__json_member(doc, obj, "shape", RTP__JSON_ARRAY, &shape, "tensor '%s'", n);
  if (!rc)
    rc = rtp__json_member(doc, obj, "data_offsets", RTP__JSON_ARRAY, &offs, "tensor '%s'", n);
  if (rc) return rc;
  const char *dt = rtp__json_str(doc, dtype);
  if (strcmp(dt, "F32") == 0) {
    e->type = RTP_TYPE_F32;
  } else if (strcmp(dt, "I32") == 0) {
    e->type = RTP_TYPE_I32;
  } else {
    return rtp__error(RTP_EFORMAT,
                      "%s: tensor '%s': dtype '%s' is not supported (only F32, I32)", st->path,
                      n, dt);
  }
  size_t nd = rtp__json_count(shape);
  if (nd > RTP_MAX_DIMS)
    return rtp__error(RTP_EFORMAT, "%s: tensor '%s': %zu dims, at most %d are supported",
                      st->path, n, nd, RTP_MAX_DIMS);
  e->n_dims = (int)nd;
  for (int d = 0; d < RTP_MAX_DIMS; d++) e->ne[d] = 1;
  int d = (int)nd - 1; /* the file lists the outermost dimension first */
  for (const struct rtp__json_value *v = rtp__json_child(doc, shape); v && !rc;
       v = rtp__json_next(doc, v), d--)
    rc = rtp__json_int(doc, v, 0, INT64_MAX, &e->ne[d], "tensor '%s': shape[%d]", n,
                       (int)nd - 1 - d);
  if (rc) return rc;
  if (rtp__json_count(offs) != 2)
    return rtp__error(RTP_EFORMAT, "%s: tensor '%s': data_offsets has %zu values, not 2",
                      st->path, n, rtp__json_count(offs));
  int64_t be[2];
  const struct rtp__json_value *v = rtp__json_child(doc, offs);
  for (int i = 0; i < 2 && !rc; i++, v = rtp__json_next(doc, v))
    rc = rtp__json_int(doc, v, 0, INT64_MAX, &be[i], "tensor '%s': data_offsets[%d]", n, i);
  e->begin = (uint64_t)be[0];
  e->end = (uint64_t)be[1];
  return rc;
}

static int st_read_header(struct rtp_safetensors *st, const struct rtp__json *doc) {
  const struct rtp__json_value *root = rtp__json_root(doc), *meta;
  int rc = rtp__json_expect(doc, root, RTP__JSON_OBJECT, "header");
  if (rc) return rc;
  meta = rtp__json_get(doc, root, "__metadata__");
  if (meta && (rc = st_read_meta(st, doc, meta))) return rc;
  size_t n = rtp__json_count(root) - (meta != NULL);
  if (n > INT32_MAX) return rtp__error(RTP_EFORMAT, "%s: %zu tensors, too many", st->path, n);
  st->e = calloc(n + 1, sizeof(*st->e));
  if (!st->e) return rtp__error(RTP_ENOMEM, "%s: out of memory reading the header", st->path);
  for (const struct rtp__json_value *m = rtp__json_child(doc, root); m && !rc;
       m = rtp__json_next(doc, m)) {
    if (m == meta) continue;
    struct st_entry *e = &st->e[st->n];
    if (!(e->name = st_strdup(rtp__json_key(doc, m))))
      return rtp__error(RTP_ENOMEM, "%s: out of memory reading the header", st->path);
    st->n++;
    rc = st_read_entry(st, doc, m, e);
  }
  return rc;
}

static int st_parse_header(struct rtp_safetensors *st, const char *hdr, size_t n) {
  /* A tensor's entry takes at least 5 bytes a value, a metadata pair 6: a quarter of the
   * header's bytes bounds the tree (its memory) for any file written as the format says. */
  struct rtp__json_limits lim = {ST_MAX_HEADER, 16, n / 4 + 16};
  struct rtp__json *doc;
  struct rtp__json_fault fault;
  int rc = rtp__json_parse(st->path, hdr, n, &lim, &doc, &fault);
  if (rc) return fault.duplicate ? st_duplicate(st, &fault) : rc;
  rc = st_read_header(st, doc);
  rtp__json_free(doc);
  return rc;
}

/* ---- checks after parsing -------------------------------------------------------- */

static int st_cmp_offs(const void *a, const void *b) {
  const struct st_entry *x = *(const struct st_entry *const *)a;
  const struct st_entry *y = *(const struct st_entry *const *)b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  if (x->end != y->end) return x->end < y->end ? -1 : 1;
  return 0;
}

static int st_validate(struct rtp_safetensors *st) {
  for (int i = 0; i < st->n; i++) {
    struct st_entry *e = &st->e[i];
    char sb[160];
    if (e->begin > e->end || e->end > st->data_size) {
      return rtp__error(RTP_EFORMAT,
                        "%s: tensor '%s': data offsets [%" PRIu64 ",%" PRIu64
                        ") out of range (data section is %" PRIu64 " bytes)",
                        st->path, e->name, e->begin, e->end, st->data_size);
    }
    /* Zero dims are allowed (an empty tensor), but the product of the others must still
     * be representable in bytes, as every size computed from them later must be. */
    uint64_t nel = 1, nz = 1, bytes;
    for (int d = 0; d < RTP_MAX_DIMS; d++) {
      uint64_t dim = (uint64_t)e->ne[d];
      if (!st_mul_ok(nz, dim ? dim : 1, &nz) || !st_mul_ok(nz, st_type_size(e->type), &bytes)) {
        return rtp__error(RTP_EFORMAT, "%s: tensor '%s': shape %s overflows", st->path, e->name,
                          st_fmt_shape(e, sb, sizeof(sb)));
      }
      nel *= dim;
    }
    bytes = nel * st_type_size(e->type);
    if (bytes != e->end - e->begin) {
      return rtp__error(RTP_EFORMAT,
                        "%s: tensor '%s': %s %s is %" PRIu64 " bytes but data offsets [%" PRIu64
                        ",%" PRIu64 ") hold %" PRIu64,
                        st->path, e->name, st_type_name(e->type),
                        st_fmt_shape(e, sb, sizeof(sb)), bytes, e->begin, e->end,
                        e->end - e->begin);
    }
  }
  if (st->n == 0) {
    if (st->data_size != 0) {
      return rtp__error(RTP_EFORMAT, "%s: %" PRIu64 " data bytes but no tensors", st->path,
                        st->data_size);
    }
    return RTP_OK;
  }
  struct st_entry **idx = malloc((size_t)(unsigned)st->n * sizeof(*idx));
  if (!idx) return rtp__error(RTP_ENOMEM, "%s: out of memory", st->path);
  for (int i = 0; i < st->n; i++) idx[i] = &st->e[i];
  int rc = RTP_OK; /* names are unique: the parser refuses a key twice */
  /* The tensors must tile the data section: no overlap, no hole (as the reference
   * implementation requires). */
  qsort(idx, (size_t)(unsigned)st->n, sizeof(*idx), st_cmp_offs);
  uint64_t at = 0;
  const char *prev = NULL;
  for (int i = 0; i < st->n && !rc; i++) {
    const struct st_entry *e = idx[i];
    if (e->begin < at) {
      rc = rtp__error(RTP_EFORMAT,
                      "%s: tensor '%s': data offsets [%" PRIu64 ",%" PRIu64
                      ") overlap tensor '%s'",
                      st->path, e->name, e->begin, e->end, prev);
    } else if (e->begin > at) {
      rc = rtp__error(RTP_EFORMAT,
                      "%s: hole in the data section at [%" PRIu64 ",%" PRIu64
                      ") before tensor '%s'",
                      st->path, at, e->begin, e->name);
    }
    at = e->end;
    prev = e->name;
  }
  if (!rc && at != st->data_size) {
    rc = rtp__error(RTP_EFORMAT,
                    "%s: %" PRIu64
                    " trailing bytes after the last tensor (data section is %" PRIu64
                    " bytes, tensors end at %" PRIu64 ")",
                    st->path, st->data_size - at, st->data_size, at);
  }
  free(idx);
  return rc;
}

/* ---- opening --------------------------------------------------------------------- */

void rtp_safetensors_close(struct rtp_safetensors *st) {
  if (!st) return;
  if (st->fd >= 0) close(st->fd);
  for (int i = 0; i < st->n; i++) free(st->e[i].name);
  for (int i = 0; i < st->n_meta; i++) {
    free(st->meta[i].key);
    free(st->meta[i].value);
  }
  free(st->e);
  free(st->meta);
  free(st->path);
  free(st);
}

int rtp_safetensors_open(const char *path, struct rtp_safetensors **out) {
  return rtp__safetensors_open(path, UINT64_MAX, out);
}

int rtp__safetensors_open(const char *path, uint64_t bytes, struct rtp_safetensors **out) {
  if (!out) return rtp__error(RTP_EINVAL, "rtp_safetensors_open: out is NULL");
  *out = NULL;
  if (!path) return rtp__error(RTP_EINVAL, "rtp_safetensors_open: path is NULL");
  struct rtp_safetensors *st = calloc(1, sizeof(*st));
  if (!st || !(st->path = st_strdup(path))) {
    free(st);
    return rtp__error(RTP_ENOMEM, "%s: out of memory", path);
  }
  int rc = RTP_OK;
  char *hdr = NULL;
  uint64_t fsize;
  if ((rc = rtp__file_open(path, UINT64_MAX, &st->fd, &fsize))) goto fail;
  if (bytes != UINT64_MAX && fsize != bytes) {
    rc = rtp__error(RTP_EFORMAT,
                    "%s: truncated or changed: %" PRIu64 " bytes, expected %" PRIu64, path,
                    fsize, bytes);
    goto fail;
  }
  if (fsize < 8) {
    rc = rtp__error(RTP_EFORMAT,
                    "%s: truncated: %" PRIu64 " bytes, less than the 8-byte header length",
                    path, fsize);
    goto fail;
  }
  unsigned char lb[8];
  if ((rc = st_pread(st, lb, 8, 0))) goto fail;
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | lb[i];
  if (hlen > fsize - 8) {
    rc = rtp__error(RTP_EFORMAT,
                    "%s: header length %" PRIu64 " exceeds file size %" PRIu64 " (truncated?)",
                    path, hlen, fsize);
    goto fail;
  }
  if (hlen > ST_MAX_HEADER) {
    rc = rtp__error(RTP_EFORMAT, "%s: header length %" PRIu64 " exceeds the limit of %" PRIu64,
                    path, hlen, ST_MAX_HEADER);
    goto fail;
  }
  if (hlen < 2) {
    rc = rtp__error(RTP_EFORMAT, "%s: header length %" PRIu64 " is too small for a JSON object",
                    path, hlen);
    goto fail;
  }
  hdr = malloc((size_t)hlen);
  if (!hdr) {
    rc = rtp__error(RTP_ENOMEM, "%s: out of memory for a %" PRIu64 "-byte header", path, hlen);
    goto fail;
  }
  if ((rc = st_pread(st, hdr, (size_t)hlen, 8))) goto fail;
  st->data_start = 8 + hlen;
  st->data_size = fsize - st->data_start;
  if ((rc = st_parse_header(st, hdr, (size_t)hlen))) goto fail;
  if ((rc = st_validate(st))) goto fail;
  free(hdr);
  *out = st;
  return RTP_OK;
fail:
  free(hdr);
  rtp_safetensors_close(st);
  return rc;
}

int rtp_safetensors_count(const struct rtp_safetensors *st) {
  return st ? st->n : 0;
}

int rtp_safetensors_info(const struct rtp_safetensors *st, int i, const char **name,
                         enum rtp_type *type, int *n_dims, int64_t ne[RTP_MAX_DIMS]) {
  if (!st || i < 0 || i >= st->n) {
    return rtp__error(RTP_EINVAL, "rtp_safetensors_info: index %d out of range [0,%d)", i,
                      st ? st->n : 0);
  }
  const struct st_entry *e = &st->e[i];
  if (name) *name = e->name;
  if (type) *type = e->type;
  if (n_dims) *n_dims = e->n_dims;
  if (ne) memcpy(ne, e->ne, sizeof(e->ne));
  return RTP_OK;
}

int rtp_safetensors_find(const struct rtp_safetensors *st, const char *name) {
  if (!st || !name) return -1;
  for (int i = 0; i < st->n; i++) {
    if (strcmp(st->e[i].name, name) == 0) return i;
  }
  return -1;
}

const char *rtp_safetensors_meta(const struct rtp_safetensors *st, const char *key) {
  if (!st || !key) return NULL;
  for (int i = 0; i < st->n_meta; i++) {
    if (strcmp(st->meta[i].key, key) == 0) return st->meta[i].value;
  }
  return NULL;
}

int rtp_safetensors_meta_count(const struct rtp_safetensors *st) {
  return st ? st->n_meta : 0;
}

int rtp_safetensors_meta_at(const struct rtp_safetensors *st, int i, const char **key,
                            const char **value) {
  if (!st || i < 0 || i >= st->n_meta) {
    return rtp__error(RTP_EINVAL, "rtp_safetensors_meta_at: index %d out of range [0,%d)", i,
                      st ? st->n_meta : 0);
  }
  if (key) *key = st->meta[i].key;
  if (value) *value = st->meta[i].value;
  return RTP_OK;
}

/* ---- copying between a packed buffer and a tensor of any strides ------------------- */

static bool st_is_packed(const struct rtp_tensor *t) {
  size_t nb = st_type_size(t->type);
  for (int i = 0; i < RTP_MAX_DIMS; i++) {
    if (t->ne[i] != 1 && t->nb[i] != nb) return false;
    nb *= (size_t)t->ne[i];
  }
  return true;
}

/* n bytes between t's data at p and the host buffer b: through the backend be for device
 * memory, else in place. */
static int st_copy_span(struct rtp_backend *be, char *p, char *b, size_t n, bool to_t) {
  if (be) return to_t ? be->i->set(be, p, b, n) : be->i->get(be, b, p, n);
  if (to_t) {
    memcpy(p, b, n);
  } else {
    memcpy(b, p, n);
  }
  return RTP_OK;
}

/* Rows [r0, r0 + nr) of t (a row is ne[0] elements) to or from the packed buf; t's data
 * may be device memory (be). */
static int st_copy_rows(struct rtp_tensor *t, struct rtp_backend *be, int64_t r0, int64_t nr,
                        char *buf, bool to_t) {
  size_t ts = st_type_size(t->type);
  size_t row = (size_t)t->ne[0] * ts;
  bool packed_row = t->nb[0] == ts || t->ne[0] == 1;
  int rc = RTP_OK;
  for (int64_t r = r0; r < r0 + nr && !rc; r++) {
    int64_t i1 = r % t->ne[1], i2 = (r / t->ne[1]) % t->ne[2], i3 = r / t->ne[1] / t->ne[2];
    char *p = (char *)t->data + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
    char *b = buf + (size_t)(r - r0) * row;
    if (packed_row) {
      rc = st_copy_span(be, p, b, row, to_t);
      continue;
    }
    for (int64_t i0 = 0; i0 < t->ne[0] && !rc; i0++)
      rc = st_copy_span(be, p + i0 * t->nb[0], b + (size_t)i0 * ts, ts, to_t);
  }
  return rc;
}

/* Device tensors go through a host buffer of ST_CHUNK bytes at a time: a packed one in
 * chunks, a view row by row. A view whose elements are not adjacent in a row (a
 * transposed view) would take one device copy per element: refused. */
static int st_device_check(const struct rtp_tensor *t, const char *path, const char *name) {
  if (t->nb[0] == st_type_size(t->type) || t->ne[0] == 1) return RTP_OK;
  return rtp__error(RTP_ENOSYS,
                    "%s: tensor '%s' is a view of %s memory whose rows are not contiguous (a "
                    "transposed view): copy it into a contiguous tensor first (rtp_cont)",
                    path, name, rtp_backend_name(rtp__tensor_backend(t)));
}

static int st_read_device(struct rtp_safetensors *st, struct rtp_tensor *t, uint64_t off,
                          size_t bytes) {
  size_t cap = bytes < ST_CHUNK ? bytes : ST_CHUNK;
  char *buf = malloc(cap);
  if (!buf) return rtp__error(RTP_ENOMEM, "%s: out of memory reading '%s'", st->path, t->name);
  int rc = RTP_OK;
  for (size_t at = 0; at < bytes && !rc; at += cap) {
    size_t n = bytes - at < cap ? bytes - at : cap;
    rc = st_pread(st, buf, n, off + at);
    if (!rc) rc = rtp_tensor_set(t, buf, at, n);
  }
  free(buf);
  return rc;
}

static int st_write_device(int fd, const char *tmp, struct rtp_tensor *t, size_t bytes) {
  size_t cap = bytes < ST_CHUNK ? bytes : ST_CHUNK;
  char *buf = malloc(cap);
  if (!buf) return rtp__error(RTP_ENOMEM, "%s: out of memory writing '%s'", tmp, t->name);
  int rc = RTP_OK;
  for (size_t at = 0; at < bytes && !rc; at += cap) {
    size_t n = bytes - at < cap ? bytes - at : cap;
    rc = rtp_tensor_get(t, buf, at, n);
    if (!rc) rc = st_write_all(fd, buf, n, tmp);
  }
  free(buf);
  return rc;
}

/* ---- reading --------------------------------------------------------------------- */

/* The file offset of element `at` of e. */
static uint64_t st_elem_off(const struct rtp_safetensors *st, const struct st_entry *e,
                            const int64_t *at) {
  uint64_t i = 0;
  for (int d = RTP_MAX_DIMS - 1; d >= 0; d--) i = i * (uint64_t)e->ne[d] + (uint64_t)at[d];
  return st->data_start + e->begin + i * st_type_size(e->type);
}

/* Whether the box of shape ne is one run of the file: whole below its outermost dimension
 * longer than 1. */
static bool st_box_is_run(const struct st_entry *e, const int64_t *ne) {
  int top = RTP_MAX_DIMS - 1;
  while (top > 0 && ne[top] == 1) top--;
  for (int d = 0; d < top; d++)
    if (ne[d] != e->ne[d]) return false;
  return true;
}

/* Reads the box of e that starts at `at` and has t's shape into t (checked by the caller).
 * A box that is one run of the file goes in one read (in chunks for device memory); any
 * other row by row (a row: t->ne[0] elements), ST_CHUNK bytes of rows at a time, rows that
 * follow each other in the file read together. */
static int st_read_box(struct rtp_safetensors *st, const struct st_entry *e, const int64_t *at,
                       struct rtp_tensor *t) {
  size_t row = (size_t)t->ne[0] * st_type_size(t->type);
  int64_t nrows = t->ne[1] * t->ne[2] * t->ne[3];
  uint64_t off = st_elem_off(st, e, at), bytes = (uint64_t)row * (uint64_t)nrows;
  if (bytes == 0) return RTP_OK;
  struct rtp_backend *be = rtp__tensor_backend(t);
  if (be) {
    int rc = st_device_check(t, st->path, e->name);
    if (rc) return rc;
  }
  if (st_is_packed(t) && st_box_is_run(e, t->ne))
    return be ? st_read_device(st, t, off, (size_t)bytes)
              : st_pread(st, t->data, (size_t)bytes, off);

  int64_t chunk = row >= ST_CHUNK ? 1 : (int64_t)(ST_CHUNK / row);
  if (chunk > nrows) chunk = nrows;
  char *buf = malloc((size_t)chunk * row);
  if (!buf) return rtp__error(RTP_ENOMEM, "%s: out of memory reading '%s'", st->path, e->name);
  int rc = RTP_OK;
  for (int64_t r = 0; r < nrows && !rc; r += chunk) {
    int64_t nr = nrows - r < chunk ? nrows - r : chunk;
    uint64_t run_off = 0, run_len = 0;
    size_t run_at = 0;
    for (int64_t k = r; k <= r + nr && !rc; k++) {
      uint64_t o = 0;
      if (k < r + nr) {
        int64_t x[RTP_MAX_DIMS] = {at[0], at[1] + k % t->ne[1],
                                   at[2] + (k / t->ne[1]) % t->ne[2],
                                   at[3] + k / t->ne[1] / t->ne[2]};
        o = st_elem_off(st, e, x);
        if (run_len && o == run_off + run_len) {
          run_len += row;
          continue;
        }
      }
      if (run_len) rc = st_pread(st, buf + run_at, (size_t)run_len, run_off);
      run_off = o;
      run_len = row;
      run_at = (size_t)(k - r) * row;
    }
    if (!rc) rc = st_copy_rows(t, be, r, nr, buf, true);
  }
  free(buf);
  return rc;
}

int rtp_safetensors_read_rows(struct rtp_safetensors *st, const char *name, int64_t first,
                              struct rtp_tensor *t) {
  if (!st || !name || !t) return rtp__error(RTP_EINVAL, "rtp_safetensors_read: NULL argument");
  int i = rtp_safetensors_find(st, name);
  if (i < 0) return rtp__error(RTP_EINVAL, "%s: no tensor '%s'", st->path, name);
  const struct st_entry *e = &st->e[i];
  if (!t->data) {
    return rtp__error(RTP_EINVAL, "%s: tensor '%s': destination has no data", st->path, name);
  }
  int outer = e->n_dims > 0 ? e->n_dims - 1 : 0;
  bool ok = t->type == e->type;
  for (int d = 0; d < RTP_MAX_DIMS; d++) {
    if (t->ne[d] < 0) ok = false;
    if (d != outer && t->ne[d] != e->ne[d]) ok = false;
  }
  int64_t n = t->ne[outer];
  if (!ok || first < 0 || n < 0 || first > e->ne[outer] || n > e->ne[outer] - first) {
    char a[160], b[96], c[96];
    if (first == 0 && ok) {
      return rtp__error(RTP_ESHAPE,
                        "%s: tensor '%s' is %s %s (%s) in the file, destination is %s %s",
                        st->path, name, st_type_name(e->type), st_fmt_shape(e, a, sizeof(a)),
                        st_fmt_ne(e->ne, b, sizeof(b)), st_type_name(t->type),
                        st_fmt_ne(t->ne, c, sizeof(c)));
    }
    return rtp__error(RTP_ESHAPE,
                      "%s: tensor '%s' is %s %s (%s) in the file, destination is %s %s "
                      "for rows [%" PRId64 ",%" PRId64 ") of dim %d",
                      st->path, name, st_type_name(e->type), st_fmt_shape(e, a, sizeof(a)),
                      st_fmt_ne(e->ne, b, sizeof(b)), st_type_name(t->type),
                      st_fmt_ne(t->ne, c, sizeof(c)), first, first + n, outer);
  }
  int64_t at[RTP_MAX_DIMS] = {0};
  at[outer] = first;
  return st_read_box(st, e, at, t);
}

int rtp_safetensors_read(struct rtp_safetensors *st, const char *name, struct rtp_tensor *t) {
  return rtp_safetensors_read_rows(st, name, 0, t);
}

int rtp__safetensors_read_box(struct rtp_safetensors *st, const char *name, const int64_t *at,
                              struct rtp_tensor *t) {
  int i = rtp_safetensors_find(st, name);
  if (i < 0) return rtp__error(RTP_EINVAL, "%s: no tensor '%s'", st->path, name);
  const struct st_entry *e = &st->e[i];
  bool ok = t->data && t->type == e->type;
  for (int d = 0; d < RTP_MAX_DIMS; d++)
    ok = ok && at[d] >= 0 && at[d] <= e->ne[d] && t->ne[d] >= 0 && t->ne[d] <= e->ne[d] - at[d];
  if (!ok) {
    char a[96], b[96], c[96];
    return rtp__error(
        RTP_ESHAPE, "%s: tensor '%s' is %s %s in the file: no box of %s %s at %s in it",
        st->path, name, st_type_name(e->type), st_fmt_ne(e->ne, a, sizeof(a)),
        st_type_name(t->type), st_fmt_ne(t->ne, b, sizeof(b)), st_fmt_ne(at, c, sizeof(c)));
  }
  return st_read_box(st, e, at, t);
}

struct rtp_tensor *rtp_safetensors_load(struct rtp_context *ctx, struct rtp_safetensors *st,
                                        const char *name) {
  if (!ctx || !st || !name) {
    rtp__error(RTP_EINVAL, "rtp_safetensors_load: NULL argument");
    return NULL;
  }
  int i = rtp_safetensors_find(st, name);
  if (i < 0) {
    rtp__error(RTP_EINVAL, "%s: no tensor '%s'", st->path, name);
    return NULL;
  }
  const struct st_entry *e = &st->e[i];
  struct rtp_tensor *t = rtp_tensor_new(ctx, e->type, e->n_dims > 0 ? e->n_dims : 1, e->ne);
  if (!t) {
    char why[256];
    snprintf(why, sizeof(why), "%s", rtp_last_error());
    rtp__error(RTP_ENOMEM, "%s: cannot make tensor '%s' in the context: %s", st->path, name,
               why);
    return NULL;
  }
  rtp_tensor_set_name(t, "%s", name);
  if (rtp_safetensors_read(st, name, t) != RTP_OK) return NULL;
  return t;
}

int rtp_safetensors_check(const struct rtp_safetensors *st, struct rtp_tensor *const *tensors,
                          int n) {
  if (!st || n < 0 || (n > 0 && !tensors))
    return rtp__error(RTP_EINVAL, "rtp_safetensors_check: bad arguments");
  char a[160], b[160];
  for (int i = 0; i < n; i++) {
    const struct rtp_tensor *t = tensors[i];
    if (!t) return rtp__error(RTP_EINVAL, "rtp_safetensors_check: tensor %d is NULL", i);
    int k = rtp_safetensors_find(st, t->name);
    rtp__file_shape_str(t->ne, rtp_tensor_n_dims(t), b, sizeof(b));
    if (k < 0)
      return rtp__error(RTP_ESHAPE, "%s: no tensor '%s' (%s %s expected)", st->path, t->name,
                        st_type_name(t->type), b);
    const struct st_entry *e = &st->e[k];
    if (e->type != t->type || memcmp(e->ne, t->ne, sizeof(e->ne)) != 0)
      return rtp__error(RTP_ESHAPE, "%s: tensor '%s' is %s %s in the file, expected %s %s",
                        st->path, t->name, st_type_name(e->type), st_fmt_shape(e, a, sizeof(a)),
                        st_type_name(t->type), b);
  }
  for (int k = 0; k < st->n; k++) {
    bool listed = false;
    for (int i = 0; i < n && !listed; i++)
      listed = strcmp(st->e[k].name, tensors[i]->name) == 0;
    if (!listed)
      return rtp__error(RTP_ESHAPE,
                        "%s: tensor '%s' (%s %s) is not expected (%d tensors, %d expected)",
                        st->path, st->e[k].name, st_type_name(st->e[k].type),
                        st_fmt_shape(&st->e[k], a, sizeof(a)), st->n, n);
  }
  return RTP_OK;
}

/* ---- the file size limit --------------------------------------------------------- */

/*
 * A write that would pass RLIMIT_FSIZE (ulimit -f) raises SIGXFSZ in the writing thread,
 * and by default the signal kills the process: one file too large would lose the whole
 * run instead of failing one save. Blocked in that thread, the signal stays pending and
 * the write fails with EFBIG, which the writer reports. Only the calling thread's mask
 * changes, and only while it writes, so the process's disposition, other threads and
 * children keep what the program chose; a handler of its own, an ignored signal or one
 * already blocked is left as it is.
 */
bool rtp__fsize_guard_begin(void) {
  struct sigaction sa;
  sigset_t xfsz, old;
  sigemptyset(&xfsz);
  sigaddset(&xfsz, SIGXFSZ);
  if (sigaction(SIGXFSZ, NULL, &sa) || (sa.sa_flags & SA_SIGINFO) || sa.sa_handler != SIG_DFL)
    return false;
  return pthread_sigmask(SIG_BLOCK, &xfsz, &old) == 0 && !sigismember(&old, SIGXFSZ);
}

void rtp__fsize_guard_end(bool blocked) {
  if (!blocked) return;
  int saved = errno;
  sigset_t xfsz;
  sigemptyset(&xfsz);
  sigaddset(&xfsz, SIGXFSZ);
  /* The signal of a write that failed, whose failure the writer has reported: unblocked,
   * it would kill the process after all. */
  struct timespec now = {0, 0};
  while (sigtimedwait(&xfsz, NULL, &now) < 0 && errno == EINTR) {
  }
  pthread_sigmask(SIG_UNBLOCK, &xfsz, NULL);
  errno = saved;
}

/* ---- writing --------------------------------------------------------------------- */

struct st_buf {
  char *p;
  size_t n, cap;
  bool oom;
};

static void sb_putn(struct st_buf *b, const char *s, size_t n) {
  if (b->oom) return;
  if (b->n + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + n + 1) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
      b->oom = true;
      return;
    }
    b->p = p;
    b->cap = cap;
  }
  memcpy(b->p + b->n, s, n);
  b->n += n;
  b->p[b->n] = '\0';
}

static void sb_puts(struct st_buf *b, const char *s) {
  sb_putn(b, s, strlen(s));
}

static void sb_put_u64(struct st_buf *b, uint64_t v) {
  char tmp[24];
  snprintf(tmp, sizeof(tmp), "%" PRIu64, v);
  sb_puts(b, tmp);
}

/* A JSON string; bytes >= 0x80 are passed through (the caller's UTF-8). */
static void sb_put_json(struct st_buf *b, const char *s) {
  sb_putn(b, "\"", 1);
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') {
      char esc[2] = {'\\', (char)c};
      sb_putn(b, esc, 2);
    } else if (c < 0x20) {
      char esc[8];
      snprintf(esc, sizeof(esc), "\\u%04x", c);
      sb_puts(b, esc);
    } else {
      sb_putn(b, (const char *)&c, 1);
    }
  }
  sb_putn(b, "\"", 1);
}

static bool st_valid_utf8(const char *s) {
  return rtp__json_utf8_valid(s, strlen(s));
}

static int st_cmp_str(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Checks every argument of a save. */
static int st_check_save(const char *path, struct rtp_tensor *const *ts, int n,
                         const char *const *meta_kv) {
  if (n < 0 || (n > 0 && !ts)) {
    return rtp__error(RTP_EINVAL, "%s: bad tensor list (n = %d)", path, n);
  }
  uint64_t total = 0;
  for (int i = 0; i < n; i++) {
    const struct rtp_tensor *t = ts[i];
    if (!t) return rtp__error(RTP_EINVAL, "%s: tensor %d is NULL", path, i);
    size_t len = strnlen(t->name, RTP_MAX_NAME);
    if (len == 0 || len == RTP_MAX_NAME) {
      return rtp__error(RTP_EINVAL, "%s: tensor %d has %s name", path, i,
                        len ? "an unterminated" : "no");
    }
    if (!st_valid_utf8(t->name)) {
      return rtp__error(RTP_EINVAL, "%s: tensor %d: name is not valid UTF-8", path, i);
    }
    if (strcmp(t->name, "__metadata__") == 0) {
      return rtp__error(RTP_EINVAL, "%s: tensor %d is named '__metadata__'", path, i);
    }
    if (st_type_size(t->type) == 0) {
      return rtp__error(RTP_EINVAL, "%s: tensor '%s': type %d cannot be saved (only F32, I32)",
                        path, t->name, (int)t->type);
    }
    uint64_t bytes = st_type_size(t->type);
    for (int d = 0; d < RTP_MAX_DIMS; d++) {
      if (t->ne[d] < 0 || !st_mul_ok(bytes, (uint64_t)t->ne[d], &bytes)) {
        return rtp__error(RTP_EINVAL, "%s: tensor '%s': bad shape", path, t->name);
      }
    }
    if (!t->data && bytes > 0) {
      return rtp__error(RTP_EINVAL, "%s: tensor '%s' has no data", path, t->name);
    }
    if (rtp__tensor_backend(t)) {
      int rc = st_device_check(t, path, t->name);
      if (rc) return rc;
    }
    if (total > (uint64_t)INT64_MAX - bytes) {
      return rtp__error(RTP_EINVAL, "%s: tensors too large", path);
    }
    total += bytes;
  }
  int rc = RTP_OK;
  if (n > 1) {
    const char **names = malloc((size_t)n * sizeof(*names));
    if (!names) return rtp__error(RTP_ENOMEM, "%s: out of memory", path);
    for (int i = 0; i < n; i++) names[i] = ts[i]->name;
    qsort(names, (size_t)n, sizeof(*names), st_cmp_str);
    for (int i = 1; i < n && !rc; i++) {
      if (strcmp(names[i - 1], names[i]) == 0) {
        rc = rtp__error(RTP_EINVAL, "%s: duplicate tensor name '%s'", path, names[i]);
      }
    }
    free(names);
  }
  if (rc || !meta_kv) return rc;
  for (int i = 0; meta_kv[i] && !rc; i += 2) {
    if (!meta_kv[i + 1]) {
      return rtp__error(RTP_EINVAL, "%s: metadata key '%s' has no value", path, meta_kv[i]);
    }
    if (!st_valid_utf8(meta_kv[i]) || !st_valid_utf8(meta_kv[i + 1])) {
      return rtp__error(RTP_EINVAL, "%s: metadata pair %d is not valid UTF-8", path, i / 2);
    }
    for (int j = 0; j < i && !rc; j += 2) {
      if (strcmp(meta_kv[i], meta_kv[j]) == 0) {
        rc = rtp__error(RTP_EINVAL, "%s: duplicate metadata key '%s'", path, meta_kv[i]);
      }
    }
  }
  return rc;
}

static int st_n_dims(const struct rtp_tensor *t) {
  int nd = 1;
  for (int d = 1; d < RTP_MAX_DIMS; d++) {
    if (t->ne[d] != 1) nd = d + 1;
  }
  return nd;
}

/* The header JSON padded with spaces so that the data starts 8-byte aligned. */
static int st_build_header(const char *path, struct rtp_tensor *const *ts, int n,
                           const char *const *meta_kv, struct st_buf *b) {
  sb_puts(b, "{");
  bool first = true;
  if (meta_kv && meta_kv[0]) {
    sb_puts(b, "\"__metadata__\":{");
    for (int i = 0; meta_kv[i]; i += 2) {
      if (i) sb_puts(b, ",");
      sb_put_json(b, meta_kv[i]);
      sb_puts(b, ":");
      sb_put_json(b, meta_kv[i + 1]);
    }
    sb_puts(b, "}");
    first = false;
  }
  uint64_t off = 0;
  for (int i = 0; i < n; i++) {
    const struct rtp_tensor *t = ts[i];
    if (!first) sb_puts(b, ",");
    first = false;
    sb_put_json(b, t->name);
    sb_puts(b, ":{\"dtype\":\"");
    sb_puts(b, st_type_name(t->type));
    sb_puts(b, "\",\"shape\":[");
    int nd = st_n_dims(t);
    uint64_t bytes = st_type_size(t->type);
    for (int d = nd - 1; d >= 0; d--) {
      sb_put_u64(b, (uint64_t)t->ne[d]);
      if (d) sb_puts(b, ",");
    }
    for (int d = 0; d < RTP_MAX_DIMS; d++) bytes *= (uint64_t)t->ne[d];
    sb_puts(b, "],\"data_offsets\":[");
    sb_put_u64(b, off);
    sb_puts(b, ",");
    sb_put_u64(b, off + bytes);
    sb_puts(b, "]}");
    off += bytes;
  }
  sb_puts(b, "}");
  while (!b->oom && (8 + b->n) % 8 != 0) sb_puts(b, " ");
  if (b->oom) return rtp__error(RTP_ENOMEM, "%s: out of memory for the header", path);
  if (b->n > ST_MAX_HEADER) {
    return rtp__error(RTP_EINVAL, "%s: header of %zu bytes exceeds the limit", path, b->n);
  }
  return RTP_OK;
}

static int st_write_tensor(int fd, const char *tmp, struct rtp_tensor *t) {
  size_t ts = st_type_size(t->type);
  size_t row = (size_t)t->ne[0] * ts;
  int64_t nrows = t->ne[1] * t->ne[2] * t->ne[3];
  if (row == 0 || nrows == 0) return RTP_OK;
  struct rtp_backend *be = rtp__tensor_backend(t); /* its views checked by st_check_save */
  if (st_is_packed(t))
    return be ? st_write_device(fd, tmp, t, row * (size_t)nrows)
              : st_write_all(fd, t->data, row * (size_t)nrows, tmp);
  int64_t chunk = row >= ST_CHUNK ? 1 : (int64_t)(ST_CHUNK / row);
  if (chunk > nrows) chunk = nrows;
  char *buf = malloc((size_t)chunk * row);
  if (!buf) return rtp__error(RTP_ENOMEM, "%s: out of memory writing '%s'", tmp, t->name);
  int rc = RTP_OK;
  for (int64_t r = 0; r < nrows && !rc; r += chunk) {
    int64_t nr = nrows - r < chunk ? nrows - r : chunk;
    rc = st_copy_rows(t, be, r, nr, buf, false);
    if (!rc) rc = st_write_all(fd, buf, (size_t)nr * row, tmp);
  }
  free(buf);
  return rc;
}

/* fsync of the directory holding path, so that the rename is durable. */
static int st_sync_dir(const char *path) {
  const char *slash = strrchr(path, '/');
  char *dir;
  if (!slash) {
    dir = st_strdup(".");
  } else {
    size_t len = slash == path ? 1 : (size_t)(slash - path);
    dir = malloc(len + 1);
    if (dir) {
      memcpy(dir, path, len);
      dir[len] = '\0';
    }
  }
  if (!dir) return rtp__error(RTP_ENOMEM, "%s: out of memory", path);
  int rc = RTP_OK;
  char eb[128];
  int fd = open(dir, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    rc = rtp__error(RTP_EIO, "%s: cannot open directory %s to sync it: %s", path, dir,
                    st_errno_str(errno, eb, sizeof(eb)));
  } else {
    if (fsync(fd) != 0 && errno != EINVAL && errno != ENOTSUP) {
      rc = rtp__error(RTP_EIO, "%s: fsync of directory %s failed: %s", path, dir,
                      st_errno_str(errno, eb, sizeof(eb)));
    }
    close(fd);
  }
  free(dir);
  return rc;
}

static int st_save(const char *path, struct rtp_tensor *const *tensors, int n,
                   const char *const *meta_kv) {
  static _Atomic unsigned counter;
  int rc = st_check_save(path, tensors, n, meta_kv);
  if (rc) return rc;
  struct st_buf hdr = {0};
  if ((rc = st_build_header(path, tensors, n, meta_kv, &hdr))) {
    free(hdr.p);
    return rc;
  }

  /* The temporary file: next to path (same filesystem, so rename is atomic), created
   * exclusively with the usual permissions (0666 less umask). */
  size_t tlen = strlen(path) + 64;
  char *tmp = malloc(tlen);
  if (!tmp) {
    free(hdr.p);
    return rtp__error(RTP_ENOMEM, "%s: out of memory", path);
  }
  char eb[128];
  int fd = -1;
  for (int attempt = 0; attempt < 100 && fd < 0; attempt++) {
    snprintf(tmp, tlen, "%s.tmp.%ld.%u", path, (long)getpid(), atomic_fetch_add(&counter, 1));
    fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) {
    rc = rtp__error(RTP_EIO, "%s: cannot create temporary file %s: %s", path, tmp,
                    st_errno_str(errno, eb, sizeof(eb)));
    free(tmp);
    free(hdr.p);
    return rc;
  }

  unsigned char lb[8];
  uint64_t hlen = hdr.n;
  for (int i = 0; i < 8; i++) lb[i] = (unsigned char)(hlen >> (8 * i));
  rc = st_write_all(fd, lb, 8, tmp);
  if (!rc) rc = st_write_all(fd, hdr.p, hdr.n, tmp);
  for (int i = 0; i < n && !rc; i++) rc = st_write_tensor(fd, tmp, tensors[i]);
  if (!rc && fsync(fd) != 0) {
    rc = rtp__error(RTP_EIO, "%s: fsync failed: %s", tmp, st_errno_str(errno, eb, sizeof(eb)));
  }
  if (close(fd) != 0 && !rc) {
    rc = rtp__error(RTP_EIO, "%s: close failed: %s", tmp, st_errno_str(errno, eb, sizeof(eb)));
  }
  if (!rc && rename(tmp, path) != 0) {
    rc = rtp__error(RTP_EIO, "%s: cannot rename %s over it: %s", path, tmp,
                    st_errno_str(errno, eb, sizeof(eb)));
  }
  if (rc) {
    unlink(tmp);
  } else {
    rc = st_sync_dir(path);
  }
  free(tmp);
  free(hdr.p);
  return rc;
}

int rtp_safetensors_save(const char *path, struct rtp_tensor *const *tensors, int n,
                         const char *const *meta_kv) {
  if (!path || !*path) return rtp__error(RTP_EINVAL, "rtp_safetensors_save: no path");
  bool blocked = rtp__fsize_guard_begin();
  int rc = st_save(path, tensors, n, meta_kv);
  rtp__fsize_guard_end(blocked);
  return rc;
}
