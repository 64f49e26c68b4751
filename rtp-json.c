/*
 * rtp-json.c - the strict JSON reader of rtp-json.h.
 *
 * The tree is one array of values in document order: an array's or object's first child
 * directly follows it and each child links to its next sibling, so a parse is one pass
 * with no per-value allocation. Strings, keys included, are decoded into one buffer the
 * size of the text (a string never decodes longer than it is written, quotes included),
 * which never moves, so the pointers handed out stay valid until the document is freed.
 */
#include "rtp-json.h"

#include "rtp-impl.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define JS_MAX_DEPTH 64 /* recursion: the parser descends once per level */
#define JS_NONE UINT32_MAX

/* A number that is not an INT: why not (for the message of rtp__json_int). */
enum { JS_FRACTION = 1, JS_BIG = 2 };

struct rtp__json_value {
  uint8_t kind;
  uint8_t flags; /* JS_FRACTION, JS_BIG */
  uint32_t n;    /* members, elements, or bytes of a string */
  uint32_t next; /* the next sibling's index; 0 for none (the root is no one's sibling) */
  uint32_t key;  /* an object member's key: its offset in str; JS_NONE otherwise */
  union {
    int64_t i;    /* INT, BOOL */
    uint32_t str; /* STRING: offset in str */
  } u;
};

struct rtp__json {
  char *file;
  struct rtp__json_value *v;
  size_t n, cap;
  char *str; /* decoded strings, each NUL-terminated */
  size_t str_n;
};

struct js_parser {
  const unsigned char *s;
  size_t n, pos;
  int max_depth;
  size_t max_values;
  struct rtp__json *doc;
  struct rtp__json_fault *fault;
  const char **keys; /* scratch for finding duplicate keys */
  size_t keys_cap;
};

/* ---- parsing -------------------------------------------------------------------------- */

static int js_fail_at(const struct js_parser *p, size_t at, const char *fmt, ...)
    RTP_PRINTF(3, 4);

static int js_fail_at(const struct js_parser *p, size_t at, const char *fmt, ...) {
  char what[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof(what), fmt, ap);
  va_end(ap);
  size_t line = 1, col = 1;
  for (size_t i = 0; i < at && i < p->n; i++) {
    col = p->s[i] == '\n' ? 1 : col + 1;
    line += p->s[i] == '\n';
  }
  return rtp__error(RTP_EFORMAT, "%s: bad JSON at byte %zu of %zu (line %zu, column %zu): %s",
                    p->doc->file, at, p->n, line, col, what);
}

#define js_fail(p, ...) js_fail_at(p, (p)->pos, __VA_ARGS__)

static void js_ws(struct js_parser *p) {
  while (p->pos < p->n) {
    unsigned char c = p->s[p->pos];
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
    p->pos++;
  }
}

/* The byte at pos, for messages: 'c', or its code when it does not print. */
static const char *js_found(const struct js_parser *p, char *buf, size_t size) {
  if (p->pos >= p->n) return "the end";
  unsigned char c = p->s[p->pos];
  if (c >= 0x20 && c < 0x7f) {
    snprintf(buf, size, "'%c'", c);
  } else {
    snprintf(buf, size, "byte 0x%02x", c);
  }
  return buf;
}

static int js_new(struct js_parser *p, enum rtp__json_kind kind, uint32_t *out) {
  struct rtp__json *d = p->doc;
  if (d->n >= p->max_values) return js_fail(p, "more than %zu values", p->max_values);
  if (d->n == d->cap) {
    size_t cap = d->cap ? d->cap * 2 : 64;
    if (cap > p->max_values) cap = p->max_values;
    struct rtp__json_value *v = realloc(d->v, cap * sizeof(*v));
    if (!v)
      return rtp__error(RTP_ENOMEM, "%s: out of memory for %zu JSON values", d->file, cap);
    d->v = v;
    d->cap = cap;
  }
  *out = (uint32_t)d->n;
  d->v[d->n++] = (struct rtp__json_value){.kind = (uint8_t)kind, .key = JS_NONE};
  return RTP_OK;
}

/* Length of the valid UTF-8 sequence at s (at most avail bytes), 0 if invalid: overlong
 * forms and encoded surrogates are refused, as RFC 3629 says. */
static size_t js_utf8_len(const unsigned char *s, size_t avail) {
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

bool rtp__json_utf8_valid(const char *s, size_t n) {
  for (size_t i = 0; i < n;) {
    size_t len = js_utf8_len((const unsigned char *)s + i, n - i);
    if (!len) return false;
    i += len;
  }
  return true;
}

static int js_hex4(struct js_parser *p, uint32_t *out) {
  if (p->n - p->pos < 4) return js_fail(p, "truncated \\u escape");
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) {
    unsigned char c = p->s[p->pos];
    v <<= 4;
    if (c >= '0' && c <= '9') {
      v |= (uint32_t)(c - '0');
    } else if (c >= 'a' && c <= 'f') {
      v |= (uint32_t)(c - 'a' + 10);
    } else if (c >= 'A' && c <= 'F') {
      v |= (uint32_t)(c - 'A' + 10);
    } else {
      return js_fail(p, "bad hex digit in \\u escape");
    }
    p->pos++;
  }
  *out = v;
  return RTP_OK;
}

/* The code point of a \u escape whose 'u' is at pos - 1, surrogate pairs joined. */
static int js_escape_u(struct js_parser *p, uint32_t *cp) {
  size_t at = p->pos - 2;
  int rc = js_hex4(p, cp);
  if (rc) return rc;
  if (*cp >= 0xDC00 && *cp <= 0xDFFF)
    return js_fail_at(p, at, "lone low surrogate \\u%04x", *cp);
  if (*cp >= 0xD800 && *cp <= 0xDBFF) {
    uint32_t lo = 0;
    if (p->n - p->pos < 2 || p->s[p->pos] != '\\' || p->s[p->pos + 1] != 'u')
      return js_fail_at(p, at, "high surrogate \\u%04x not followed by a low one", *cp);
    p->pos += 2;
    if ((rc = js_hex4(p, &lo))) return rc;
    if (lo < 0xDC00 || lo > 0xDFFF)
      return js_fail_at(p, at, "high surrogate \\u%04x not followed by a low one", *cp);
    *cp = 0x10000 + ((*cp - 0xD800) << 10) + (lo - 0xDC00);
  }
  if (*cp == 0) return js_fail_at(p, at, "NUL character (\\u0000) in string");
  return RTP_OK;
}

static size_t js_put_utf8(char *o, uint32_t cp) {
  if (cp < 0x80) {
    o[0] = (char)cp;
    return 1;
  }
  if (cp < 0x800) {
    o[0] = (char)(0xC0 | (cp >> 6));
    o[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
  }
  if (cp < 0x10000) {
    o[0] = (char)(0xE0 | (cp >> 12));
    o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
    o[2] = (char)(0x80 | (cp & 0x3F));
    return 3;
  }
  o[0] = (char)(0xF0 | (cp >> 18));
  o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
  o[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
  o[3] = (char)(0x80 | (cp & 0x3F));
  return 4;
}

/* The string at pos (its opening quote), decoded into doc->str: *off and *len. */
static int js_string(struct js_parser *p, uint32_t *off, uint32_t *len) {
  struct rtp__json *d = p->doc;
  char *o = d->str + d->str_n;
  size_t start = d->str_n, k = 0;
  p->pos++;
  for (;;) {
    if (p->pos >= p->n) return js_fail(p, "unterminated string");
    unsigned char c = p->s[p->pos];
    if (c == '"') break;
    if (c < 0x20) return js_fail(p, "control character (byte 0x%02x) in string", c);
    if (c != '\\') {
      size_t n = js_utf8_len(p->s + p->pos, p->n - p->pos);
      if (!n) return js_fail(p, "invalid UTF-8 in string");
      memcpy(o + k, p->s + p->pos, n);
      k += n;
      p->pos += n;
      continue;
    }
    if (p->n - p->pos < 2) return js_fail(p, "unterminated string");
    c = p->s[p->pos + 1];
    p->pos += 2;
    static const char from[] = "\"\\/bfnrt", to[] = "\"\\/\b\f\n\r\t";
    const char *e = c ? strchr(from, c) : NULL;
    if (e) {
      o[k++] = to[e - from];
    } else if (c == 'u') {
      uint32_t cp = 0;
      int rc = js_escape_u(p, &cp);
      if (rc) return rc;
      k += js_put_utf8(o + k, cp); /* at most 4 bytes from at least 6 */
    } else {
      p->pos -= 2;
      return js_fail(p, "bad escape '\\%c' in string", c >= 0x20 && c < 0x7f ? c : '?');
    }
  }
  p->pos++;
  o[k] = '\0';
  d->str_n += k + 1;
  *off = (uint32_t)start;
  *len = (uint32_t)k;
  return RTP_OK;
}

static bool js_digit(const struct js_parser *p) {
  return p->pos < p->n && p->s[p->pos] >= '0' && p->s[p->pos] <= '9';
}

/* -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)? into an INT where it is one. */
static int js_number(struct js_parser *p, uint32_t idx) {
  bool neg = p->s[p->pos] == '-';
  p->pos += neg;
  if (!js_digit(p)) return js_fail(p, "expected a digit%s", neg ? " after '-'" : "");
  if (p->s[p->pos] == '0' && p->pos + 1 < p->n && p->s[p->pos + 1] >= '0' &&
      p->s[p->pos + 1] <= '9')
    return js_fail(p, "number with a leading zero");
  uint64_t mag = 0, limit = neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
  int flags = 0;
  for (; js_digit(p); p->pos++) {
    uint64_t digit = p->s[p->pos] - '0';
    if (mag > (limit - digit) / 10) flags |= JS_BIG;
    if (!(flags & JS_BIG)) mag = mag * 10 + digit;
  }
  if (p->pos < p->n && p->s[p->pos] == '.') {
    p->pos++;
    if (!js_digit(p)) return js_fail(p, "expected a digit after '.'");
    while (js_digit(p)) p->pos++;
    flags |= JS_FRACTION;
  }
  if (p->pos < p->n && (p->s[p->pos] == 'e' || p->s[p->pos] == 'E')) {
    p->pos++;
    if (p->pos < p->n && (p->s[p->pos] == '+' || p->s[p->pos] == '-')) p->pos++;
    if (!js_digit(p)) return js_fail(p, "expected a digit in the exponent");
    while (js_digit(p)) p->pos++;
    flags |= JS_FRACTION;
  }
  struct rtp__json_value *v = &p->doc->v[idx];
  if (flags) {
    v->kind = RTP__JSON_NUMBER;
    v->flags = (uint8_t)flags;
  } else {
    v->u.i = !neg ? (int64_t)mag : mag > (uint64_t)INT64_MAX ? INT64_MIN : -(int64_t)mag;
  }
  return RTP_OK;
}

static int js_literal(struct js_parser *p, uint32_t idx) {
  static const char *const words[] = {"null", "false", "true"};
  for (int w = 0; w < 3; w++) {
    size_t len = strlen(words[w]), have = p->n - p->pos;
    if (memcmp(p->s + p->pos, words[w], have < len ? have : len) != 0) continue;
    if (have < len) return js_fail_at(p, p->n, "unexpected end of input");
    p->pos += len;
    p->doc->v[idx].kind = w ? RTP__JSON_BOOL : RTP__JSON_NULL;
    p->doc->v[idx].u.i = w == 2;
    return RTP_OK;
  }
  char found[16];
  return js_fail(p,
                 "expected a value (an object, array, string, integer, number, true, false "
                 "or null), found %s",
                 js_found(p, found, sizeof(found)));
}

static int js_cmp_key(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* No key twice in the object idx (which starts at byte at): sorted, so that a header with
 * many tensors costs n log n. */
static int js_unique_keys(struct js_parser *p, uint32_t idx, size_t at, int depth,
                          const char *self) {
  const struct rtp__json *d = p->doc;
  size_t n = d->v[idx].n;
  if (n < 2) return RTP_OK;
  if (n > p->keys_cap) {
    const char **k = realloc(p->keys, n * sizeof(*k));
    if (!k) return rtp__error(RTP_ENOMEM, "%s: out of memory", d->file);
    p->keys = k;
    p->keys_cap = n;
  }
  size_t i = 0;
  for (uint32_t c = idx + 1; i < n; c = d->v[c].next) p->keys[i++] = d->str + d->v[c].key;
  qsort(p->keys, n, sizeof(*p->keys), js_cmp_key);
  for (i = 1; i < n; i++)
    if (strcmp(p->keys[i - 1], p->keys[i]) == 0) break;
  if (i == n) return RTP_OK;
  if (p->fault) {
    p->fault->duplicate = true;
    p->fault->depth = depth;
    snprintf(p->fault->key, sizeof(p->fault->key), "%s", p->keys[i]);
    snprintf(p->fault->parent, sizeof(p->fault->parent), "%s", self ? self : "");
  }
  return js_fail_at(p, at, "duplicate key '%.100s' in the object that starts here", p->keys[i]);
}

static int js_value(struct js_parser *p, int depth, const char *self, uint32_t *out);

/* An array or object at pos; self is its own key (NULL if it has none). */
static int js_container(struct js_parser *p, int depth, const char *self, uint32_t idx) {
  bool object = p->s[p->pos] == '{';
  char close = object ? '}' : ']', found[16];
  size_t at = p->pos;
  if (depth > p->max_depth) return js_fail(p, "nesting deeper than %d", p->max_depth);
  p->pos++;
  js_ws(p);
  uint32_t prev = 0;
  if (p->pos < p->n && p->s[p->pos] == (unsigned char)close) {
    p->pos++;
    return RTP_OK;
  }
  for (;;) {
    uint32_t key = JS_NONE, child, len;
    js_ws(p);
    if (object) {
      if (p->pos >= p->n) return js_fail(p, "unexpected end of input");
      if (p->s[p->pos] != '"')
        return js_fail(p, "expected '\"' to start a key, found %s",
                       js_found(p, found, sizeof(found)));
      int rc = js_string(p, &key, &len);
      if (rc) return rc;
      js_ws(p);
      if (p->pos >= p->n) return js_fail(p, "unexpected end of input");
      if (p->s[p->pos] != ':')
        return js_fail(p, "expected ':' after a key, found %s",
                       js_found(p, found, sizeof(found)));
      p->pos++;
    }
    int rc = js_value(p, depth + 1, object ? p->doc->str + key : NULL, &child);
    if (rc) return rc;
    struct rtp__json_value *v = p->doc->v;
    v[child].key = key;
    if (prev) v[prev].next = child;
    prev = child;
    v[idx].n++;
    js_ws(p);
    if (p->pos >= p->n) return js_fail(p, "unexpected end of input");
    unsigned char c = p->s[p->pos++];
    if (c == (unsigned char)close) break;
    if (c != ',') {
      p->pos--;
      return js_fail(p, "expected ',' or '%c' in %s, found %s", close,
                     object ? "object" : "array", js_found(p, found, sizeof(found)));
    }
  }
  return object ? js_unique_keys(p, idx, at, depth, self) : RTP_OK;
}

static int js_value(struct js_parser *p, int depth, const char *self, uint32_t *out) {
  js_ws(p);
  if (p->pos >= p->n) return js_fail(p, "unexpected end of input");
  unsigned char c = p->s[p->pos];
  enum rtp__json_kind kind = c == '{'   ? RTP__JSON_OBJECT
                             : c == '[' ? RTP__JSON_ARRAY
                             : c == '"' ? RTP__JSON_STRING
                                        : RTP__JSON_INT; /* or what js_literal finds */
  int rc = js_new(p, kind, out);
  if (rc) return rc;
  if (kind == RTP__JSON_OBJECT || kind == RTP__JSON_ARRAY)
    return js_container(p, depth, self, *out);
  if (kind == RTP__JSON_STRING) {
    uint32_t off, len;
    rc = js_string(p, &off, &len);
    p->doc->v[*out].u.str = off;
    p->doc->v[*out].n = len;
    return rc;
  }
  if (c == '-' || (c >= '0' && c <= '9')) return js_number(p, *out);
  return js_literal(p, *out);
}

static char *js_strdup(const char *s) {
  size_t n = strlen(s) + 1;
  char *r = malloc(n);
  if (r) memcpy(r, s, n);
  return r;
}

int rtp__json_parse(const char *file, const char *text, size_t n,
                    const struct rtp__json_limits *lim, struct rtp__json **out,
                    struct rtp__json_fault *fault) {
  if (!out) return rtp__error(RTP_EINVAL, "rtp__json_parse: out is NULL");
  *out = NULL;
  if (fault) memset(fault, 0, sizeof(*fault));
  if (!file) file = "(JSON)";
  if (!text && n) return rtp__error(RTP_EINVAL, "%s: no text", file);
  struct rtp__json_limits l = lim ? *lim : (struct rtp__json_limits){0};
  if (!l.max_bytes || l.max_bytes > RTP__JSON_MAX_BYTES) l.max_bytes = RTP__JSON_MAX_BYTES;
  if (l.max_depth <= 0 || l.max_depth > JS_MAX_DEPTH) l.max_depth = JS_MAX_DEPTH;
  if (n > l.max_bytes)
    return rtp__error(RTP_EFORMAT, "%s: %zu bytes of JSON, more than the limit of %zu", file, n,
                      l.max_bytes);
  /* No text of n bytes holds more values: "[0,0]" takes 5 bytes for 3. */
  if (!l.max_values || l.max_values > n / 2 + 1) l.max_values = n / 2 + 1;
  struct rtp__json *d = calloc(1, sizeof(*d));
  if (d) d->file = js_strdup(file);
  if (d && d->file) d->str = malloc(n + 1);
  if (!d || !d->file || !d->str) {
    rtp__json_free(d);
    return rtp__error(RTP_ENOMEM, "%s: out of memory to parse %zu bytes of JSON", file, n);
  }
  struct js_parser p = {
      (const unsigned char *)text, n, 0, l.max_depth, l.max_values, d, fault, NULL, 0};
  uint32_t root;
  int rc = js_value(&p, 1, NULL, &root);
  if (!rc) {
    js_ws(&p);
    if (p.pos != n) rc = js_fail(&p, "trailing bytes after the top-level value");
  }
  free(p.keys);
  if (rc) {
    rtp__json_free(d);
    return rc;
  }
  *out = d;
  return RTP_OK;
}

void rtp__json_free(struct rtp__json *doc) {
  if (!doc) return;
  free(doc->file);
  free(doc->v);
  free(doc->str);
  free(doc);
}

/* ---- walking ------------------------------------------------------------------------ */

const struct rtp__json_value *rtp__json_root(const struct rtp__json *doc) {
  return doc && doc->n ? &doc->v[0] : NULL;
}

enum rtp__json_kind rtp__json_kind(const struct rtp__json_value *v) {
  return v ? (enum rtp__json_kind)v->kind : RTP__JSON_NULL;
}

size_t rtp__json_count(const struct rtp__json_value *v) {
  return v && (v->kind == RTP__JSON_ARRAY || v->kind == RTP__JSON_OBJECT) ? v->n : 0;
}

const struct rtp__json_value *rtp__json_child(const struct rtp__json *doc,
                                              const struct rtp__json_value *v) {
  (void)doc; /* a child follows its parent in the one array of values */
  return rtp__json_count(v) ? v + 1 : NULL;
}

const struct rtp__json_value *rtp__json_next(const struct rtp__json *doc,
                                             const struct rtp__json_value *v) {
  return v && v->next ? &doc->v[v->next] : NULL;
}

const char *rtp__json_key(const struct rtp__json *doc, const struct rtp__json_value *v) {
  return v && v->key != JS_NONE ? doc->str + v->key : NULL;
}

const struct rtp__json_value *rtp__json_get(const struct rtp__json *doc,
                                            const struct rtp__json_value *obj,
                                            const char *key) {
  if (!obj || obj->kind != RTP__JSON_OBJECT || !key) return NULL;
  for (const struct rtp__json_value *m = rtp__json_child(doc, obj); m;
       m = rtp__json_next(doc, m))
    if (strcmp(doc->str + m->key, key) == 0) return m;
  return NULL;
}

const char *rtp__json_str(const struct rtp__json *doc, const struct rtp__json_value *v) {
  return v && v->kind == RTP__JSON_STRING ? doc->str + v->u.str : NULL;
}

int64_t rtp__json_int_value(const struct rtp__json_value *v) {
  return v && v->kind == RTP__JSON_INT ? v->u.i : 0;
}

const char *rtp__json_kind_name(const struct rtp__json_value *v) {
  switch (rtp__json_kind(v)) {
    case RTP__JSON_BOOL:
      return v->u.i ? "true" : "false";
    case RTP__JSON_INT:
      return "an integer";
    case RTP__JSON_NUMBER:
      return "a number";
    case RTP__JSON_STRING:
      return "a string";
    case RTP__JSON_ARRAY:
      return "an array";
    case RTP__JSON_OBJECT:
      return "an object";
    default:
      return v ? "null" : "nothing";
  }
}

/* ---- checked access ------------------------------------------------------------------- */

/* "FILE: WHERE: what", or "FILE: what" where WHERE is empty. */
static int js_vbad(const struct rtp__json *doc, const char *where, va_list ap, const char *fmt,
                   ...) RTP_PRINTF(4, 5);

static int js_vbad(const struct rtp__json *doc, const char *where, va_list ap, const char *fmt,
                   ...) {
  char place[256], what[256];
  vsnprintf(place, sizeof(place), where, ap);
  va_list wp;
  va_start(wp, fmt);
  vsnprintf(what, sizeof(what), fmt, wp);
  va_end(wp);
  return rtp__error(RTP_EFORMAT, "%s: %s%s%s", doc->file, place, *place ? ": " : "", what);
}

static const char *js_expected(enum rtp__json_kind kind) {
  switch (kind) {
    case RTP__JSON_OBJECT:
      return "'{' (an object)";
    case RTP__JSON_ARRAY:
      return "'[' (an array)";
    case RTP__JSON_STRING:
      return "a string";
    case RTP__JSON_INT:
      return "an integer";
    case RTP__JSON_NUMBER:
      return "a number";
    case RTP__JSON_BOOL:
      return "true or false";
    default:
      return "null";
  }
}

static int js_vexpect(const struct rtp__json *doc, const struct rtp__json_value *v,
                      enum rtp__json_kind kind, const char *where, va_list ap) {
  if (v && v->kind == kind) return RTP_OK;
  if (kind == RTP__JSON_INT && v && v->kind == RTP__JSON_NUMBER)
    return js_vbad(doc, where, ap, "%s",
                   v->flags & JS_FRACTION
                       ? "expected an integer, found a number with a fraction or exponent"
                       : "integer too large (beyond 64 bits)");
  return js_vbad(doc, where, ap, "expected %s, found %s", js_expected(kind),
                 rtp__json_kind_name(v));
}

int rtp__json_expect(const struct rtp__json *doc, const struct rtp__json_value *v,
                     enum rtp__json_kind kind, const char *where, ...) {
  va_list ap;
  va_start(ap, where);
  int rc = js_vexpect(doc, v, kind, where, ap);
  va_end(ap);
  return rc;
}

int rtp__json_int(const struct rtp__json *doc, const struct rtp__json_value *v, int64_t min,
                  int64_t max, int64_t *out, const char *where, ...) {
  va_list ap;
  va_start(ap, where);
  int rc = js_vexpect(doc, v, RTP__JSON_INT, where, ap);
  va_end(ap);
  if (rc) return rc;
  if (v->u.i >= min && v->u.i <= max) {
    *out = v->u.i;
    return RTP_OK;
  }
  va_start(ap, where);
  if (v->u.i < 0 && min >= 0) {
    rc = js_vbad(doc, where, ap, "negative number %" PRId64, v->u.i);
  } else {
    rc = js_vbad(doc, where, ap, "%" PRId64 " is out of range [%" PRId64 ", %" PRId64 "]",
                 v->u.i, min, max);
  }
  va_end(ap);
  return rc;
}

int rtp__json_string(const struct rtp__json *doc, const struct rtp__json_value *v,
                     size_t max_len, const char **out, const char *where, ...) {
  va_list ap;
  va_start(ap, where);
  int rc = js_vexpect(doc, v, RTP__JSON_STRING, where, ap);
  va_end(ap);
  if (rc) return rc;
  if (v->n > max_len) {
    va_start(ap, where);
    rc = js_vbad(doc, where, ap, "a string of %" PRIu32 " bytes, at most %zu allowed", v->n,
                 max_len);
    va_end(ap);
    return rc;
  }
  *out = doc->str + v->u.str;
  return RTP_OK;
}

int rtp__json_member(const struct rtp__json *doc, const struct rtp__json_value *obj,
                     const char *key, enum rtp__json_kind kind,
                     const struct rtp__json_value **out, const char *where, ...) {
  va_list ap;
  va_start(ap, where);
  *out = rtp__json_get(doc, obj, key);
  int rc;
  if (!*out) {
    rc = js_vbad(doc, where, ap, "missing %s", key);
  } else {
    char place[256];
    va_list cp;
    va_copy(cp, ap);
    vsnprintf(place, sizeof(place), where, cp);
    va_end(cp);
    rc = rtp__json_expect(doc, *out, kind, "%s%s%s", place, *place ? ": " : "", key);
  }
  va_end(ap);
  return rc;
}

int rtp__json_only(const struct rtp__json *doc, const struct rtp__json_value *obj,
                   const char *const *keys, const char *where, ...) {
  for (const struct rtp__json_value *m = rtp__json_child(doc, obj); m;
       m = rtp__json_next(doc, m)) {
    const char *k = rtp__json_key(doc, m);
    int i = 0;
    while (keys[i] && strcmp(keys[i], k) != 0) i++;
    if (keys[i]) continue;
    va_list ap;
    va_start(ap, where);
    int rc = js_vbad(doc, where, ap, "unknown key '%.100s'", k);
    va_end(ap);
    return rc;
  }
  return RTP_OK;
}
