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

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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
  int cap;
  struct st_entry *e;
  int n_meta;
  int cap_meta;
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

/* The file shape [d0, ..., dk] of an entry. */
static const char *st_fmt_shape(const struct st_entry *e, char *buf, size_t size) {
  size_t used = 0;
  used += (size_t)snprintf(buf, size, "[");
  for (int i = e->n_dims - 1; i >= 0 && used < size; i--) {
    used += (size_t)snprintf(buf + used, size - used, "%" PRId64 "%s", e->ne[i], i ? ", " : "");
  }
  if (used < size) snprintf(buf + used, size - used, "]");
  return buf;
}

/* pread exactly size bytes at off; short reads are a truncated file. */
static int st_pread(const struct rtp_safetensors *st, void *dst, size_t size, uint64_t off) {
  char *p = dst;
  while (size > 0) {
    size_t chunk = size > ((size_t)1 << 30) ? ((size_t)1 << 30) : size;
    if (off > (uint64_t)INT64_MAX) return rtp__error(RTP_EIO, "%s: offset overflow", st->path);
    ssize_t r = pread(st->fd, p, chunk, (off_t)off);
    if (r < 0) {
      if (errno == EINTR) continue;
      char eb[128];
      return rtp__error(RTP_EIO, "%s: read failed at byte %" PRIu64 ": %s", st->path, off,
                        st_errno_str(errno, eb, sizeof(eb)));
    }
    if (r == 0) {
      return rtp__error(RTP_EIO, "%s: truncated: unexpected end of file at byte %" PRIu64,
                        st->path, off);
    }
    p += r;
    off += (uint64_t)r;
    size -= (size_t)r;
  }
  return RTP_OK;
}

static int st_write_all(int fd, const void *src, size_t size, const char *path) {
  const char *p = src;
  while (size > 0) {
    size_t chunk = size > ((size_t)1 << 30) ? ((size_t)1 << 30) : size;
    ssize_t r = write(fd, p, chunk);
    if (r < 0) {
      if (errno == EINTR) continue;
      char eb[128];
      return rtp__error(RTP_EIO, "%s: write failed: %s", path,
                        st_errno_str(errno, eb, sizeof(eb)));
    }
    if (r == 0) return rtp__error(RTP_EIO, "%s: write failed: no progress", path);
    p += r;
    size -= (size_t)r;
  }
  return RTP_OK;
}

/* ---- strict JSON for the header -------------------------------------------------- */

struct jp {
  const char *file;
  const unsigned char *s;
  size_t n;
  size_t pos;
};

static int jp_fail(const struct jp *p, const char *what) {
  return rtp__error(RTP_EFORMAT, "%s: bad header JSON at byte %zu of %zu: %s", p->file, p->pos,
                    p->n, what);
}

static void jp_ws(struct jp *p) {
  while (p->pos < p->n) {
    unsigned char c = p->s[p->pos];
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
    p->pos++;
  }
}

static int jp_expect(struct jp *p, char c) {
  jp_ws(p);
  if (p->pos >= p->n) return jp_fail(p, "unexpected end of header");
  if (p->s[p->pos] != (unsigned char)c) {
    char what[48];
    snprintf(what, sizeof(what), "expected '%c'", c);
    return jp_fail(p, what);
  }
  p->pos++;
  return RTP_OK;
}

/* Peeks the next non-space byte (-1 at the end). */
static int jp_peek(struct jp *p) {
  jp_ws(p);
  return p->pos < p->n ? p->s[p->pos] : -1;
}

/* Length of the valid UTF-8 sequence at s (at most avail bytes), 0 if invalid. */
static size_t jp_utf8_len(const unsigned char *s, size_t avail) {
  unsigned char c = s[0];
  size_t len;
  uint32_t cp, min;
  if (c < 0x80) return 1;
  if ((c & 0xE0) == 0xC0) {
    len = 2, cp = c & 0x1F, min = 0x80;
  } else if ((c & 0xF0) == 0xE0) {
    len = 3, cp = c & 0x0F, min = 0x800;
  } else if ((c & 0xF8) == 0xF0) {
    len = 4, cp = c & 0x07, min = 0x10000;
  } else {
    return 0;
  }
  if (len > avail) return 0;
  for (size_t i = 1; i < len; i++) {
    if ((s[i] & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (s[i] & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return len;
}

static int jp_hex4(struct jp *p, uint32_t *out) {
  if (p->n - p->pos < 4) return jp_fail(p, "truncated \\u escape");
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) {
    unsigned char c = p->s[p->pos + (size_t)i];
    v <<= 4;
    if (c >= '0' && c <= '9') {
      v |= (uint32_t)(c - '0');
    } else if (c >= 'a' && c <= 'f') {
      v |= (uint32_t)(c - 'a' + 10);
    } else if (c >= 'A' && c <= 'F') {
      v |= (uint32_t)(c - 'A' + 10);
    } else {
      return jp_fail(p, "bad hex digit in \\u escape");
    }
  }
  p->pos += 4;
  *out = v;
  return RTP_OK;
}

/* Parses a string into a new NUL-terminated buffer (*out, to free). */
static int jp_string(struct jp *p, char **out) {
  *out = NULL;
  int rc = jp_expect(p, '"');
  if (rc) return rc;
  /* First pass: find the closing quote; the decoded string is never longer. */
  size_t start = p->pos, end = start;
  for (;;) {
    if (end >= p->n) return jp_fail(p, "unterminated string");
    if (p->s[end] == '"') break;
    end += p->s[end] == '\\' ? 2 : 1;
  }
  char *buf = malloc(end - start + 1);
  if (!buf) return rtp__error(RTP_ENOMEM, "%s: out of memory parsing the header", p->file);
  size_t o = 0;
  while (p->s[p->pos] != '"') {
    unsigned char c = p->s[p->pos];
    if (c < 0x20) {
      free(buf);
      return jp_fail(p, "control character in string");
    }
    if (c != '\\') {
      size_t len = jp_utf8_len(p->s + p->pos, end - p->pos);
      if (!len) {
        free(buf);
        return jp_fail(p, "invalid UTF-8 in string");
      }
      memcpy(buf + o, p->s + p->pos, len);
      o += len;
      p->pos += len;
      continue;
    }
    p->pos++; /* the backslash; end guarantees one more byte before the quote */
    c = p->s[p->pos++];
    uint32_t cp;
    switch (c) {
      case '"':
      case '\\':
      case '/':
        buf[o++] = (char)c;
        continue;
      case 'b':
        buf[o++] = '\b';
        continue;
      case 'f':
        buf[o++] = '\f';
        continue;
      case 'n':
        buf[o++] = '\n';
        continue;
      case 'r':
        buf[o++] = '\r';
        continue;
      case 't':
        buf[o++] = '\t';
        continue;
      case 'u':
        break;
      default:
        p->pos--;
        free(buf);
        return jp_fail(p, "bad escape in string");
    }
    if (p->pos + 4 > end || (rc = jp_hex4(p, &cp))) {
      free(buf);
      return rc ? rc : jp_fail(p, "truncated \\u escape");
    }
    if (cp >= 0xDC00 && cp <= 0xDFFF) {
      free(buf);
      return jp_fail(p, "lone low surrogate in \\u escape");
    }
    if (cp >= 0xD800 && cp <= 0xDBFF) {
      uint32_t lo;
      if (p->pos + 6 > end || p->s[p->pos] != '\\' || p->s[p->pos + 1] != 'u') {
        free(buf);
        return jp_fail(p, "high surrogate not followed by a low one");
      }
      p->pos += 2;
      if ((rc = jp_hex4(p, &lo))) {
        free(buf);
        return rc;
      }
      if (lo < 0xDC00 || lo > 0xDFFF) {
        free(buf);
        return jp_fail(p, "high surrogate not followed by a low one");
      }
      cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
    }
    if (cp == 0) {
      free(buf);
      return jp_fail(p, "NUL character in string");
    }
    /* At most 4 bytes from at least 6 escaped ones: stays within the buffer. */
    if (cp < 0x80) {
      buf[o++] = (char)cp;
    } else if (cp < 0x800) {
      buf[o++] = (char)(0xC0 | (cp >> 6));
      buf[o++] = (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      buf[o++] = (char)(0xE0 | (cp >> 12));
      buf[o++] = (char)(0x80 | ((cp >> 6) & 0x3F));
      buf[o++] = (char)(0x80 | (cp & 0x3F));
    } else {
      buf[o++] = (char)(0xF0 | (cp >> 18));
      buf[o++] = (char)(0x80 | ((cp >> 12) & 0x3F));
      buf[o++] = (char)(0x80 | ((cp >> 6) & 0x3F));
      buf[o++] = (char)(0x80 | (cp & 0x3F));
    }
  }
  p->pos++; /* closing quote */
  buf[o] = '\0';
  *out = buf;
  return RTP_OK;
}

/* A non-negative integer without sign, fraction or exponent, at most INT64_MAX. */
static int jp_uint(struct jp *p, uint64_t *out) {
  jp_ws(p);
  if (p->pos >= p->n) return jp_fail(p, "unexpected end of header");
  unsigned char c = p->s[p->pos];
  if (c == '-') return jp_fail(p, "negative number");
  if (c < '0' || c > '9') return jp_fail(p, "expected a non-negative integer");
  if (c == '0' && p->pos + 1 < p->n && p->s[p->pos + 1] >= '0' && p->s[p->pos + 1] <= '9') {
    return jp_fail(p, "number with a leading zero");
  }
  uint64_t v = 0;
  while (p->pos < p->n && p->s[p->pos] >= '0' && p->s[p->pos] <= '9') {
    uint64_t d = p->s[p->pos] - '0';
    if (v > ((uint64_t)INT64_MAX - d) / 10) return jp_fail(p, "integer too large");
    v = v * 10 + d;
    p->pos++;
  }
  if (p->pos < p->n && (p->s[p->pos] == '.' || p->s[p->pos] == 'e' || p->s[p->pos] == 'E')) {
    return jp_fail(p, "expected an integer, not a fraction");
  }
  *out = v;
  return RTP_OK;
}

/* [u, u, ...] with at most max elements stored; *count is the real number. */
static int jp_uint_array(struct jp *p, uint64_t *vals, int max, int *count) {
  int rc = jp_expect(p, '[');
  if (rc) return rc;
  int k = 0;
  if (jp_peek(p) == ']') {
    p->pos++;
    *count = 0;
    return RTP_OK;
  }
  for (;;) {
    uint64_t v = 0;
    if ((rc = jp_uint(p, &v))) return rc;
    if (k < max) vals[k] = v;
    if (k < INT32_MAX) k++;
    int c = jp_peek(p);
    if (c == ',') {
      p->pos++;
    } else if (c == ']') {
      p->pos++;
      break;
    } else {
      return jp_fail(p, "expected ',' or ']' in array");
    }
  }
  *count = k;
  return RTP_OK;
}

static int st_add_meta(struct rtp_safetensors *st, char *key, char *value) {
  for (int i = 0; i < st->n_meta; i++) {
    if (strcmp(st->meta[i].key, key) == 0) {
      rtp__error(RTP_EFORMAT, "%s: duplicate __metadata__ key '%s'", st->path, key);
      free(key);
      free(value);
      return RTP_EFORMAT;
    }
  }
  if (st->n_meta == st->cap_meta) {
    int cap = st->cap_meta ? st->cap_meta * 2 : 8;
    struct st_meta *m = realloc(st->meta, (size_t)cap * sizeof(*m));
    if (!m) {
      free(key);
      free(value);
      return rtp__error(RTP_ENOMEM, "%s: out of memory parsing the header", st->path);
    }
    st->meta = m;
    st->cap_meta = cap;
  }
  st->meta[st->n_meta].key = key;
  st->meta[st->n_meta].value = value;
  st->n_meta++;
  return RTP_OK;
}

/* {"k": "v", ...}: strings only, as in the reference implementation. */
static int st_parse_meta(struct rtp_safetensors *st, struct jp *p) {
  int rc = jp_expect(p, '{');
  if (rc) return rc;
  if (jp_peek(p) == '}') {
    p->pos++;
    return RTP_OK;
  }
  for (;;) {
    char *key = NULL, *value = NULL;
    if ((rc = jp_string(p, &key))) return rc;
    if ((rc = jp_expect(p, ':'))) {
      free(key);
      return rc;
    }
    if (jp_peek(p) != '"') {
      free(key);
      return jp_fail(p, "__metadata__ values must be strings");
    }
    if ((rc = jp_string(p, &value))) {
      free(key);
      return rc;
    }
    if ((rc = st_add_meta(st, key, value))) return rc;
    int c = jp_peek(p);
    if (c == ',') {
      p->pos++;
    } else if (c == '}') {
      p->pos++;
      return RTP_OK;
    } else {
      return jp_fail(p, "expected ',' or '}' in __metadata__");
    }
  }
}

/* {"dtype": ..., "shape": [...], "data_offsets": [b, e]} for the tensor e->name. */
static int st_parse_entry(struct rtp_safetensors *st, struct jp *p, struct st_entry *e) {
  bool have_dtype = false, have_shape = false, have_offsets = false;
  int rc = jp_expect(p, '{');
  if (rc) return rc;
  if (jp_peek(p) != '}') {
    for (;;) {
      char *key = NULL;
      if ((rc = jp_string(p, &key))) return rc;
      if ((rc = jp_expect(p, ':'))) {
        free(key);
        return rc;
      }
      if (strcmp(key, "dtype") == 0 && !have_dtype) {
        char *dt = NULL;
        if (jp_peek(p) != '"') {
          free(key);
          return jp_fail(p, "dtype must be a string");
        }
        if ((rc = jp_string(p, &dt))) {
          free(key);
          return rc;
        }
        if (strcmp(dt, "F32") == 0) {
          e->type = RTP_TYPE_F32;
        } else if (strcmp(dt, "I32") == 0) {
          e->type = RTP_TYPE_I32;
        } else {
          rtp__error(RTP_EFORMAT,
                     "%s: tensor '%s': dtype '%s' is not supported (only F32, I32)", st->path,
                     e->name, dt);
          free(dt);
          free(key);
          return RTP_EFORMAT;
        }
        free(dt);
        have_dtype = true;
      } else if (strcmp(key, "shape") == 0 && !have_shape) {
        uint64_t dims[RTP_MAX_DIMS];
        int nd;
        if ((rc = jp_uint_array(p, dims, RTP_MAX_DIMS, &nd))) {
          free(key);
          return rc;
        }
        if (nd > RTP_MAX_DIMS) {
          free(key);
          return rtp__error(RTP_EFORMAT, "%s: tensor '%s': %d dims, at most %d are supported",
                            st->path, e->name, nd, RTP_MAX_DIMS);
        }
        e->n_dims = nd;
        for (int i = 0; i < RTP_MAX_DIMS; i++) e->ne[i] = 1;
        for (int i = 0; i < nd; i++) e->ne[i] = (int64_t)dims[nd - 1 - i];
        have_shape = true;
      } else if (strcmp(key, "data_offsets") == 0 && !have_offsets) {
        uint64_t offs[2];
        int no;
        if ((rc = jp_uint_array(p, offs, 2, &no))) {
          free(key);
          return rc;
        }
        if (no != 2) {
          free(key);
          return rtp__error(RTP_EFORMAT, "%s: tensor '%s': data_offsets has %d values, not 2",
                            st->path, e->name, no);
        }
        e->begin = offs[0];
        e->end = offs[1];
        have_offsets = true;
      } else {
        bool dup = strcmp(key, "dtype") == 0 || strcmp(key, "shape") == 0 ||
                   strcmp(key, "data_offsets") == 0;
        rtp__error(RTP_EFORMAT, "%s: tensor '%s': %s key '%s'", st->path, e->name,
                   dup ? "duplicate" : "unknown", key);
        free(key);
        return RTP_EFORMAT;
      }
      free(key);
      int c = jp_peek(p);
      if (c == ',') {
        p->pos++;
      } else if (c == '}') {
        break;
      } else {
        return jp_fail(p, "expected ',' or '}' in tensor entry");
      }
    }
  }
  p->pos++; /* '}' */
  if (!have_dtype || !have_shape || !have_offsets) {
    return rtp__error(RTP_EFORMAT, "%s: tensor '%s': missing %s", st->path, e->name,
                      !have_dtype   ? "dtype"
                      : !have_shape ? "shape"
                                    : "data_offsets");
  }
  return RTP_OK;
}

static int st_parse_header(struct rtp_safetensors *st, const char *hdr, size_t n) {
  struct jp p = {st->path, (const unsigned char *)hdr, n, 0};
  bool have_meta = false;
  int rc = jp_expect(&p, '{');
  if (rc) return rc;
  if (jp_peek(&p) == '}') {
    p.pos++;
  } else {
    for (;;) {
      char *key = NULL;
      if ((rc = jp_string(&p, &key))) return rc;
      if ((rc = jp_expect(&p, ':'))) {
        free(key);
        return rc;
      }
      if (strcmp(key, "__metadata__") == 0) {
        free(key);
        if (have_meta) return rtp__error(RTP_EFORMAT, "%s: duplicate __metadata__", st->path);
        have_meta = true;
        if ((rc = st_parse_meta(st, &p))) return rc;
      } else {
        if (st->n == st->cap) {
          int cap = st->cap ? st->cap * 2 : 16;
          struct st_entry *ne = realloc(st->e, (size_t)cap * sizeof(*ne));
          if (!ne) {
            free(key);
            return rtp__error(RTP_ENOMEM, "%s: out of memory parsing the header", st->path);
          }
          st->e = ne;
          st->cap = cap;
        }
        struct st_entry *e = &st->e[st->n++];
        memset(e, 0, sizeof(*e));
        e->name = key;
        if ((rc = st_parse_entry(st, &p, e))) return rc;
      }
      int c = jp_peek(&p);
      if (c == ',') {
        p.pos++;
      } else if (c == '}') {
        p.pos++;
        break;
      } else {
        return jp_fail(&p, "expected ',' or '}' after a tensor");
      }
    }
  }
  jp_ws(&p);
  if (p.pos != p.n) return jp_fail(&p, "trailing bytes after the header object");
  return RTP_OK;
}

/* ---- checks after parsing -------------------------------------------------------- */

static int st_cmp_name(const void *a, const void *b) {
  const struct st_entry *x = *(const struct st_entry *const *)a;
  const struct st_entry *y = *(const struct st_entry *const *)b;
  return strcmp(x->name, y->name);
}

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
  int rc = RTP_OK;
  qsort(idx, (size_t)(unsigned)st->n, sizeof(*idx), st_cmp_name);
  for (int i = 1; i < st->n && !rc; i++) {
    if (strcmp(idx[i - 1]->name, idx[i]->name) == 0) {
      rc = rtp__error(RTP_EFORMAT, "%s: duplicate tensor name '%s'", st->path, idx[i]->name);
    }
  }
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
  if (!out) return rtp__error(RTP_EINVAL, "rtp_safetensors_open: out is NULL");
  *out = NULL;
  if (!path) return rtp__error(RTP_EINVAL, "rtp_safetensors_open: path is NULL");
  struct rtp_safetensors *st = calloc(1, sizeof(*st));
  if (!st || !(st->path = st_strdup(path))) {
    free(st);
    return rtp__error(RTP_ENOMEM, "%s: out of memory", path);
  }
  char eb[128];
  int rc = RTP_OK;
  char *hdr = NULL;
  st->fd = open(path, O_RDONLY | O_CLOEXEC);
  if (st->fd < 0) {
    rc = rtp__error(RTP_EIO, "%s: cannot open: %s", path, st_errno_str(errno, eb, sizeof(eb)));
    goto fail;
  }
  struct stat sb;
  if (fstat(st->fd, &sb) != 0) {
    rc = rtp__error(RTP_EIO, "%s: cannot stat: %s", path, st_errno_str(errno, eb, sizeof(eb)));
    goto fail;
  }
  if (!S_ISREG(sb.st_mode)) {
    rc = rtp__error(RTP_EIO, "%s: not a regular file", path);
    goto fail;
  }
  uint64_t fsize = (uint64_t)sb.st_size;
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

/* Rows [r0, r0 + nr) of t (a row is ne[0] elements) to or from the packed buf. */
static void st_copy_rows(struct rtp_tensor *t, int64_t r0, int64_t nr, char *buf, bool to_t) {
  size_t ts = st_type_size(t->type);
  size_t row = (size_t)t->ne[0] * ts;
  for (int64_t r = r0; r < r0 + nr; r++) {
    int64_t i1 = r % t->ne[1], i2 = (r / t->ne[1]) % t->ne[2], i3 = r / t->ne[1] / t->ne[2];
    char *p = (char *)t->data + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
    char *b = buf + (size_t)(r - r0) * row;
    if (t->nb[0] == ts) {
      if (to_t) {
        memcpy(p, b, row);
      } else {
        memcpy(b, p, row);
      }
      continue;
    }
    for (int64_t i0 = 0; i0 < t->ne[0]; i0++) {
      if (to_t) {
        memcpy(p + i0 * t->nb[0], b + (size_t)i0 * ts, ts);
      } else {
        memcpy(b + (size_t)i0 * ts, p + i0 * t->nb[0], ts);
      }
    }
  }
}

/* Device tensors go through a host buffer of ST_CHUNK bytes at a time; a strided view of
 * device memory would need a device-side gather first, so it is refused. */
static int st_device_check(const struct rtp_tensor *t, const char *path, const char *name) {
  if (st_is_packed(t)) return RTP_OK;
  return rtp__error(RTP_EINVAL,
                    "%s: tensor '%s' is a strided view of %s memory (use a "
                    "contiguous tensor)",
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
  /* Bytes of one step along the outermost dimension; everything fits, as checked at open. */
  uint64_t step = st_type_size(e->type);
  for (int d = 0; d < outer; d++) step *= (uint64_t)e->ne[d];
  uint64_t off = st->data_start + e->begin + (uint64_t)first * step;
  uint64_t bytes = (uint64_t)n * step;
  if (bytes == 0) return RTP_OK;
  if (rtp__tensor_backend(t)) {
    int rc = st_device_check(t, st->path, name);
    return rc ? rc : st_read_device(st, t, off, (size_t)bytes);
  }
  if (st_is_packed(t)) return st_pread(st, t->data, (size_t)bytes, off);

  size_t row = (size_t)t->ne[0] * st_type_size(t->type);
  int64_t nrows = t->ne[1] * t->ne[2] * t->ne[3];
  int64_t chunk = row >= ST_CHUNK ? 1 : (int64_t)(ST_CHUNK / row);
  if (chunk > nrows) chunk = nrows;
  char *buf = malloc((size_t)chunk * row);
  if (!buf) return rtp__error(RTP_ENOMEM, "%s: out of memory reading '%s'", st->path, name);
  int rc = RTP_OK;
  for (int64_t r = 0; r < nrows && !rc; r += chunk) {
    int64_t nr = nrows - r < chunk ? nrows - r : chunk;
    rc = st_pread(st, buf, (size_t)nr * row, off + (uint64_t)r * row);
    if (!rc) st_copy_rows(t, r, nr, buf, true);
  }
  free(buf);
  return rc;
}

int rtp_safetensors_read(struct rtp_safetensors *st, const char *name, struct rtp_tensor *t) {
  return rtp_safetensors_read_rows(st, name, 0, t);
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
  struct rtp_tensor *t = rtp_new_tensor(ctx, e->type, e->n_dims > 0 ? e->n_dims : 1, e->ne);
  if (!t) {
    char why[256];
    snprintf(why, sizeof(why), "%s", rtp_last_error());
    rtp__error(RTP_ENOMEM, "%s: cannot make tensor '%s' in the context: %s", st->path, name,
               why);
    return NULL;
  }
  rtp_set_name(t, "%s", name);
  if (rtp_safetensors_read(st, name, t) != RTP_OK) return NULL;
  return t;
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
  size_t n = strlen(s);
  for (size_t i = 0; i < n;) {
    size_t len = jp_utf8_len((const unsigned char *)s + i, n - i);
    if (!len) return false;
    i += len;
  }
  return true;
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
  if (rtp__tensor_backend(t)) {
    int rc = st_device_check(t, tmp, t->name);
    return rc ? rc : st_write_device(fd, tmp, t, row * (size_t)nrows);
  }
  if (st_is_packed(t)) return st_write_all(fd, t->data, row * (size_t)nrows, tmp);
  int64_t chunk = row >= ST_CHUNK ? 1 : (int64_t)(ST_CHUNK / row);
  if (chunk > nrows) chunk = nrows;
  char *buf = malloc((size_t)chunk * row);
  if (!buf) return rtp__error(RTP_ENOMEM, "%s: out of memory writing '%s'", tmp, t->name);
  int rc = RTP_OK;
  for (int64_t r = 0; r < nrows && !rc; r += chunk) {
    int64_t nr = nrows - r < chunk ? nrows - r : chunk;
    st_copy_rows(t, r, nr, buf, false);
    rc = st_write_all(fd, buf, (size_t)nr * row, tmp);
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

int rtp_safetensors_save(const char *path, struct rtp_tensor *const *tensors, int n,
                         const char *const *meta_kv) {
  static _Atomic unsigned counter;
  if (!path || !*path) return rtp__error(RTP_EINVAL, "rtp_safetensors_save: no path");
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
