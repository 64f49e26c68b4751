/* rtp-json.h - the library's one JSON reader (internal): safetensors headers (rtp-io.c)
 * and checkpoint indexes (rtp-ckpt.c) are both read through it.
 *
 * Parsing is strict RFC 8259 and checks everything before a caller sees a value: UTF-8,
 * escapes (surrogate pairs included), number syntax, nesting depth, the number of values,
 * nothing after the top-level value, and no key twice in one object (compared after
 * decoding escapes). The result is a read-only tree that callers walk and query by key,
 * so they depend on neither the order of keys nor the spacing. Deliberate departures:
 * "\u0000" is refused, since every string is handed on as a C string that a NUL would
 * cut short; numbers with a fraction or an exponent are checked but not converted, since
 * no reader needs one.
 *
 * Every failure returns RTP_EFORMAT (RTP_ENOMEM, RTP_EINVAL) with a message that names
 * the file, the position (parsing) or the place in the tree (the checked accessors), and
 * the fault.
 */
#ifndef RTP_JSON_H
#define RTP_JSON_H

#include "rtp.h"

#ifdef __cplusplus
extern "C" {
#endif

enum rtp__json_kind {
  RTP__JSON_NULL,
  RTP__JSON_BOOL,
  RTP__JSON_INT,    /* an integer in int64 range, without fraction or exponent */
  RTP__JSON_NUMBER, /* any other number: a fraction, an exponent or beyond int64 */
  RTP__JSON_STRING,
  RTP__JSON_ARRAY,
  RTP__JSON_OBJECT,
};

struct rtp__json;       /* a parsed document, read-only */
struct rtp__json_value; /* one value in it; valid until the document is freed */

/* Bounds on what a parse may take; a zero field takes the default. */
struct rtp__json_limits {
  size_t max_bytes;  /* of the text (default and cap: RTP__JSON_MAX_BYTES) */
  int max_depth;     /* arrays and objects inside one another (default and cap: 64) */
  size_t max_values; /* in the tree (default: as many as the text can hold) */
};
#define RTP__JSON_MAX_BYTES ((size_t)1 << 30)

/* A duplicate key, for callers that word it in their own terms (a safetensors header's
 * top-level keys are tensor names). */
struct rtp__json_fault {
  bool duplicate;
  int depth;        /* of the object holding the key twice: 1 is the top-level value */
  char key[128];    /* the key (cut short if longer) */
  char parent[128]; /* the object's own key; "" at the top or in an array */
};

/* Parses text[0, n) into *out (NULL on failure). file names the text in messages; fault
 * may be NULL. */
int rtp__json_parse(const char *file, const char *text, size_t n,
                    const struct rtp__json_limits *lim, struct rtp__json **out,
                    struct rtp__json_fault *fault);
void rtp__json_free(struct rtp__json *doc); /* NULL is fine */

/* ---- walking the tree ---- */
const struct rtp__json_value *rtp__json_root(const struct rtp__json *doc);
enum rtp__json_kind rtp__json_kind(const struct rtp__json_value *v);
/* Members of an object, elements of an array; 0 for anything else. */
size_t rtp__json_count(const struct rtp__json_value *v);
/* The first member or element of v, then each next one in document order; NULL after
 * the last. */
const struct rtp__json_value *rtp__json_child(const struct rtp__json *doc,
                                              const struct rtp__json_value *v);
const struct rtp__json_value *rtp__json_next(const struct rtp__json *doc,
                                             const struct rtp__json_value *v);
/* The key of an object's member, NULL for any other value. */
const char *rtp__json_key(const struct rtp__json *doc, const struct rtp__json_value *v);
/* The member of obj with this key, NULL if there is none or obj is not an object. */
const struct rtp__json_value *rtp__json_get(const struct rtp__json *doc,
                                            const struct rtp__json_value *obj, const char *key);
/* A string's decoded bytes (NUL-terminated, valid UTF-8) or NULL; an INT's value. */
const char *rtp__json_str(const struct rtp__json *doc, const struct rtp__json_value *v);
int64_t rtp__json_int_value(const struct rtp__json_value *v);
/* "an integer", "an object", ...: for messages. */
const char *rtp__json_kind_name(const struct rtp__json_value *v);

/* ---- checked access: RTP_EFORMAT and "FILE: WHERE: fault" unless v is as required ----
 * WHERE is a printf format naming v for the reader of the message (e.g. "tensor 'w':
 * shape[1]"); "" names the top-level value. */
int rtp__json_expect(const struct rtp__json *doc, const struct rtp__json_value *v,
                     enum rtp__json_kind kind, const char *where, ...) RTP_PRINTF(4, 5);
/* An INT within [min, max]. */
int rtp__json_int(const struct rtp__json *doc, const struct rtp__json_value *v, int64_t min,
                  int64_t max, int64_t *out, const char *where, ...) RTP_PRINTF(6, 7);
/* A string of at most max_len bytes. */
int rtp__json_string(const struct rtp__json *doc, const struct rtp__json_value *v,
                     size_t max_len, const char **out, const char *where, ...) RTP_PRINTF(5, 6);
/* The member key of the object obj, of the given kind ("WHERE: missing KEY" if absent). */
int rtp__json_member(const struct rtp__json *doc, const struct rtp__json_value *obj,
                     const char *key, enum rtp__json_kind kind,
                     const struct rtp__json_value **out, const char *where, ...)
    RTP_PRINTF(6, 7);
/* obj has no key other than those of the NULL-terminated list keys. */
int rtp__json_only(const struct rtp__json *doc, const struct rtp__json_value *obj,
                   const char *const *keys, const char *where, ...) RTP_PRINTF(4, 5);

/* Whether s[0, n) is valid UTF-8 (what the writers check before they write a string). */
bool rtp__json_utf8_valid(const char *s, size_t n);

#ifdef __cplusplus
}
#endif

#endif /* RTP_JSON_H */
