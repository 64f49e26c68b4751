/* rtp-status.c - status codes, error messages and logging. */
#include "rtp-impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static _Thread_local char last_error[512];
static rtp_log_cb log_cb;
static void *log_user;

const char *rtp_strerror(int status) {
  switch (status) {
#define RTP_XX(name, code, text) \
  case code:                     \
    return text;
    RTP_STATUS_MAP(RTP_XX)
#undef RTP_XX
  }
  return "unknown status";
}

const char *rtp_last_error(void) {
  return last_error;
}

int rtp__verror(int status, const char *fmt, va_list ap) {
  vsnprintf(last_error, sizeof(last_error), fmt, ap);
  return status;
}

int rtp__error(int status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  rtp__verror(status, fmt, ap);
  va_end(ap);
  return status;
}

void rtp_log_set(rtp_log_cb cb, void *user) {
  log_cb = cb;
  log_user = user;
}

void rtp__log(int level, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  if (log_cb) {
    log_cb(level, msg, log_user);
    return;
  }
  static const char *const tags[] = {"error", "warn", "info"};
  fprintf(stderr, "rtp %s: %s\n", tags[level < 0 ? 0 : level > 2 ? 2 : level], msg);
}

_Noreturn void rtp__abort(const char *file, int line, const char *what) {
  fprintf(stderr, "rtp: internal error at %s:%d: %s\n", file, line, what);
  abort();
}
