/* token-data.h - the files train-gpt's --data and --val-data read, as a stream of tokens:
 *
 *   bytes   any file, each byte a token (vocabulary 256): the default;
 *   uint16  nanoGPT's prepare.py output (np.uint16 .tofile): little-endian 16-bit tokens,
 *           nothing else, the vocabulary given (--vocab);
 *   llmc    llm.c's .bin (dev/data/data_common.py write_datafile): 256 little-endian int32,
 *           [0] the magic, [1] the version, [2] the token count, then the tokens: magic
 *           20240520 version 1 is GPT-2's (uint16, vocabulary 50257), 20240801 version 7
 *           Llama 3's (uint32, vocabulary 128256). The header has no vocabulary: that is
 *           the tokenizer's, unless one is given (e.g. llm.c's padded 50304).
 *
 * auto takes llmc when the file starts with one of its magics, else uint16 when a
 * vocabulary is given, else bytes. Every token is checked against the vocabulary when the
 * file is parsed, so that training never indexes past the embedding.
 * Pure functions of a buffer: the tests parse files they make without training. */
#ifndef RTP_TOKEN_DATA_H
#define RTP_TOKEN_DATA_H

#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

enum token_format { TOKEN_AUTO, TOKEN_BYTES, TOKEN_UINT16, TOKEN_LLMC, TOKEN_FORMAT_COUNT };

#define TOKEN_LLMC_HEADER 1024 /* 256 int32 */
#define TOKEN_LLMC_GPT2 20240520
#define TOKEN_LLMC_LLAMA3 20240801
#define TOKEN_LLMC_EVAL 20240522 /* llm.c's multiple-choice evaluation files */
#define TOKEN_GPT2_VOCAB 50257
#define TOKEN_LLAMA3_VOCAB 128256

/* n tokens of width bytes each (1, 2 or 4, little-endian) at p, each below vocab. */
struct token_span {
  const uint8_t *p;
  size_t n;
  int width;
  int vocab;
  const char *kind; /* what the tokens are, for messages: "bytes", "llm.c GPT-2 tokens", ... */
};

static inline const char *token_format_name(enum token_format f) {
  static const char *const names[TOKEN_FORMAT_COUNT] = {"auto", "bytes", "uint16", "llmc"};
  return (unsigned)f < TOKEN_FORMAT_COUNT ? names[f] : "?";
}

/* false, leaving *f, if name is none of token_format_name's. */
static inline bool token_format_parse(const char *name, enum token_format *f) {
  for (int i = 0; i < TOKEN_FORMAT_COUNT && name; i++)
    if (strcmp(name, token_format_name((enum token_format)i)) == 0) {
      *f = (enum token_format)i;
      return true;
    }
  return false;
}

static inline uint32_t token_le32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Writes the reason a file is refused into err (len bytes); -1. */
static inline int token_error(char *err, size_t len, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static inline int token_error(char *err, size_t len, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, len, fmt, ap);
  va_end(ap);
  return -1;
}

/* Token i of s (i < s->n). */
static inline int32_t token_at(const struct token_span *s, size_t i) {
  const uint8_t *p = s->p + i * (size_t)s->width;
  if (s->width == 1) return p[0];
  if (s->width == 2) return (int32_t)(p[0] | p[1] << 8);
  return (int32_t)token_le32(p); /* below vocab, checked by token_span_parse */
}

/* Tokens [first, first + n) of s. */
static inline struct token_span token_span_slice(struct token_span s, size_t first, size_t n) {
  s.p += first * (size_t)s.width;
  s.n = n;
  return s;
}

/* The first token at or past vocab: an error naming its index and byte offset in the file
 * (the tokens start at byte `base`). */
static inline int token_check_range(const struct token_span *s, size_t base, char *err,
                                    size_t len) {
  for (size_t i = 0; i < s->n; i++) {
    uint32_t t = s->width == 4 ? token_le32(s->p + i * 4) : (uint32_t)token_at(s, i);
    if (t < (uint32_t)s->vocab) continue;
    return token_error(err, len,
                       "token %" PRIu32
                       " at token index %zu (byte offset %zu) is not below "
                       "the vocabulary size %d",
                       t, i, base + i * (size_t)s->width, s->vocab);
  }
  return 0;
}

/* Refuses a file whose first int32 is not a magic of llm.c's token files. */
static inline int token_bad_magic(const uint8_t *buf, size_t size, char *err, size_t len) {
  if (size < 4)
    return token_error(err, len, "not an llm.c token file: %zu bytes, too short for a magic",
                       size);
  uint32_t magic = token_le32(buf);
  if (magic == TOKEN_LLMC_EVAL)
    return token_error(err, len,
                       "magic %d is llm.c's evaluation file (HellaSwag, MMLU), not a token "
                       "stream",
                       TOKEN_LLMC_EVAL);
  return token_error(err, len,
                     "not an llm.c token file: its first int32 is %" PRIu32
                     ", llm.c's magic is %d (GPT-2, uint16) or %d (Llama 3, uint32)",
                     magic, TOKEN_LLMC_GPT2, TOKEN_LLMC_LLAMA3);
}

/* llm.c's header at buf (size bytes): the width and default vocabulary its magic and
 * version name, and its token count, which must be what follows the header exactly. */
static inline int token_parse_llmc(const uint8_t *buf, size_t size, struct token_span *s,
                                   char *err, size_t len) {
  uint32_t magic = size >= 4 ? token_le32(buf) : 0;
  bool gpt2 = magic == TOKEN_LLMC_GPT2;
  if (!gpt2 && magic != TOKEN_LLMC_LLAMA3) return token_bad_magic(buf, size, err, len);
  if (size < TOKEN_LLMC_HEADER)
    return token_error(err, len,
                       "truncated llm.c header: the file has %zu bytes, the header is %d "
                       "(256 int32)",
                       size, TOKEN_LLMC_HEADER);
  uint32_t version = token_le32(buf + 4), want = gpt2 ? 1 : 7;
  if (version != want)
    return token_error(
        err, len, "llm.c header: version %" PRIu32 " with magic %" PRIu32 ", expected %" PRIu32,
        version, magic, want);
  int32_t count = (int32_t)token_le32(buf + 8);
  int width = gpt2 ? 2 : 4;
  size_t bytes = size - TOKEN_LLMC_HEADER, have = bytes / (size_t)width;
  if (count < 0 || (size_t)count * (size_t)width != bytes)
    return token_error(err, len,
                       "llm.c header: the token count is %" PRId32
                       " (%s), the file holds %zu bytes after the header (%zu tokens of %d "
                       "bytes)",
                       count,
                       count < 0              ? "negative"
                       : (size_t)count > have ? "larger than the file"
                                              : "not all the file holds",
                       bytes, have, width);
  *s = (struct token_span){buf + TOKEN_LLMC_HEADER, (size_t)count, width,
                           gpt2 ? TOKEN_GPT2_VOCAB : TOKEN_LLAMA3_VOCAB,
                           gpt2 ? "llm.c GPT-2 tokens" : "llm.c Llama 3 tokens"};
  return 0;
}

/* The format auto stands for (see the top). */
static inline enum token_format token_format_detect(const uint8_t *buf, size_t size,
                                                    int vocab) {
  uint32_t magic = size >= 4 ? token_le32(buf) : 0;
  if (magic == TOKEN_LLMC_GPT2 || magic == TOKEN_LLMC_LLAMA3 || magic == TOKEN_LLMC_EVAL)
    return TOKEN_LLMC;
  return vocab > 0 ? TOKEN_UINT16 : TOKEN_BYTES;
}

/*
 * The tokens of a file's size bytes at buf, in format f, into *s (pointing into buf).
 * vocab > 0 is the vocabulary the tokens must be below (the caller keeps it within what
 * the format holds: 256 for bytes, 65536 for uint16); 0 takes the format's (bytes 256,
 * llm.c the tokenizer's its magic names); uint16 needs one. 0, or -1 with the reason in
 * err (a token out of range is named by its token index and its byte offset in the file).
 */
static inline int token_span_parse(const uint8_t *buf, size_t size, enum token_format f,
                                   int vocab, struct token_span *s, char *err, size_t len) {
  if (f == TOKEN_AUTO) f = token_format_detect(buf, size, vocab);
  size_t base = 0;
  if (f == TOKEN_BYTES) {
    *s = (struct token_span){buf, size, 1, 256, "bytes"};
  } else if (f == TOKEN_UINT16) {
    if (vocab <= 0) return token_error(err, len, "uint16 tokens need a vocabulary size");
    if (size % 2)
      return token_error(err, len, "%zu bytes, an odd count: uint16 tokens are 2 bytes each",
                         size);
    *s = (struct token_span){buf, size / 2, 2, vocab, "uint16 tokens"};
  } else {
    if (token_parse_llmc(buf, size, s, err, len)) return -1;
    base = TOKEN_LLMC_HEADER;
  }
  if (vocab > 0) s->vocab = vocab;
  return token_check_range(s, base, err, len);
}

#endif
