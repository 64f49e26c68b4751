/* rtp-tcp-wire.c - the tcp transport's wire format: frame headers, the HELLO of the
 * handshake, its HMACs, the job id and the host key, and socket addresses as text. Every
 * integer on the wire is little-endian. docs/transport.md, "Handshake" and "Frames". */
#define _GNU_SOURCE
#include "rtp-tcp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

void rtp__tcp_put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

void rtp__tcp_put64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

uint32_t rtp__tcp_get32(const uint8_t *p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
  return v;
}

uint64_t rtp__tcp_get64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
  return v;
}

void rtp__tcp_hdr_put(uint8_t *p, const struct rc_hdr *h) {
  rtp__tcp_put32(p, RC_FRAME_MAGIC);
  p[4] = RC_VERSION;
  p[5] = h->type;
  p[6] = h->kind;
  p[7] = h->cls;
  rtp__tcp_put64(p + 8, h->seq);
  rtp__tcp_put64(p + 16, h->len);
  rtp__tcp_put64(p + 24, h->total);
  rtp__tcp_put64(p + 32, h->arg);
  rtp__tcp_put64(p + 40, h->addr);
  rtp__tcp_put64(p + 48, h->group);
}

void rtp__tcp_hdr_get(const uint8_t *p, struct rc_hdr *h) {
  h->magic = rtp__tcp_get32(p);
  h->version = p[4];
  h->type = p[5];
  h->kind = p[6];
  h->cls = p[7];
  h->seq = rtp__tcp_get64(p + 8);
  h->len = rtp__tcp_get64(p + 16);
  h->total = rtp__tcp_get64(p + 24);
  h->arg = rtp__tcp_get64(p + 32);
  h->addr = rtp__tcp_get64(p + 40);
  h->group = rtp__tcp_get64(p + 48);
}

void rtp__tcp_hmac(const char *token, const char *label, const uint8_t *data, size_t n,
                   uint8_t out[RC_MAC_SIZE]) {
  size_t ll = strlen(label);
  uint8_t buf[512];
  unsigned int outlen = RC_MAC_SIZE;
  RTP_ASSERT(ll + n <= sizeof(buf));
  memcpy(buf, label, ll);
  if (n) memcpy(buf + ll, data, n);
  RTP_ASSERT(HMAC(EVP_sha256(), token, (int)strlen(token), buf, ll + n, out, &outlen) != NULL);
}

static uint64_t fnv1a(uint64_t h, const void *p, size_t n) {
  for (size_t i = 0; i < n; i++) h = (h ^ ((const uint8_t *)p)[i]) * 0x100000001b3ull;
  return h;
}

/* What two ranks must share for one to write into the other's memory: the boot (same
 * kernel), the network namespace (netns "hosts" of the Ethernet emulation must not
 * bypass their links), the pid namespace (pids mean the same) and the user. 0 when
 * unknown or turned off with RTP_DIRECT_COPY=0. */
uint64_t rtp__tcp_host_key(void) {
  const char *env = getenv("RTP_DIRECT_COPY");
  if (env && !strcmp(env, "0")) return 0;
  char boot[64] = {0};
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  if (!f) return 0;
  size_t n = fread(boot, 1, sizeof(boot) - 1, f);
  fclose(f);
  struct stat net, pid;
  if (n == 0 || stat("/proc/self/ns/net", &net) || stat("/proc/self/ns/pid", &pid)) return 0;
  uid_t uid = getuid();
  uint64_t h = fnv1a(0xcbf29ce484222325ull, boot, n);
  h = fnv1a(h, &net.st_ino, sizeof(net.st_ino));
  h = fnv1a(h, &net.st_dev, sizeof(net.st_dev));
  h = fnv1a(h, &pid.st_ino, sizeof(pid.st_ino));
  h = fnv1a(h, &pid.st_dev, sizeof(pid.st_dev));
  h = fnv1a(h, &uid, sizeof(uid));
  return h ? h : 1;
}

/* HELLO: magic, version u8, flags u8, u16 0, u64 0 (refusing: the reason u32 and what the
 * acceptor has u32), world size u32, rank u32, nonce[32], host key u64, pid u32, zero
 * padding to 80 bytes. Nothing in it derives from the token: a stranger learns nothing
 * of it before the connector's proof (docs/transport.md). */
void rtp__tcp_hello_fill(uint8_t *p, int size, int rank, uint64_t host_key) {
  memset(p, 0, RC_HELLO_SIZE);
  rtp__tcp_put32(p, RC_HELLO_MAGIC);
  p[4] = RC_VERSION;
  p[5] = host_key ? RC_HELLO_DIRECT : 0;
  rtp__tcp_put32(p + 16, (uint32_t)size);
  rtp__tcp_put32(p + 20, (uint32_t)rank);
  RTP_ASSERT(RAND_bytes(p + 24, RC_NONCE_SIZE) == 1);
  rtp__tcp_put64(p + 56, host_key);
  rtp__tcp_put32(p + 64, (uint32_t)getpid());
}

void rtp__tcp_hello_refuse(uint8_t *p, int why, uint32_t have) {
  memset(p, 0, RC_HELLO_SIZE);
  rtp__tcp_put32(p, RC_HELLO_MAGIC);
  p[4] = RC_VERSION;
  p[5] = RC_HELLO_REFUSED;
  rtp__tcp_put32(p + 8, (uint32_t)why);
  rtp__tcp_put32(p + 12, have);
}

const char *rtp__tcp_hello_check(const uint8_t *p, int size, int me, int *rank, int *refusal) {
  *refusal = 0;
  if (rtp__tcp_get32(p) != RC_HELLO_MAGIC) return "not an rtp handshake (bad magic)";
  /* Another version's hello may be laid out otherwise: closed unanswered, as garbage. */
  if (p[4] != RC_VERSION) return "protocol version mismatch";
  if ((p[5] & ~RC_HELLO_DIRECT) || p[6] || p[7] || rtp__tcp_get64(p + 8))
    return "malformed hello";
  if (rtp__tcp_get32(p + 16) != (uint32_t)size) {
    *refusal = RC_REFUSE_SIZE;
    return "different world size";
  }
  uint32_t r = rtp__tcp_get32(p + 20);
  if (r >= (uint32_t)size || (int)r == me) {
    *refusal = RC_REFUSE_RANK;
    return "bad rank";
  }
  *rank = (int)r;
  return NULL;
}

const char *rtp__tcp_hello_refusal(const uint8_t *p, char *buf, size_t n) {
  if (rtp__tcp_get32(p) != RC_HELLO_MAGIC || !(p[5] & RC_HELLO_REFUSED)) return NULL;
  uint32_t have = rtp__tcp_get32(p + 12);
  switch (rtp__tcp_get32(p + 8)) {
    case RC_REFUSE_SIZE:
      snprintf(buf, n, "its world size is %u", have);
      break;
    case RC_REFUSE_RANK:
      snprintf(buf, n, "this rank is out of range or not one that connects to it");
      break;
    case RC_REFUSE_DUPLICATE:
      snprintf(buf, n, "another process already joined as this rank");
      break;
    default:
      snprintf(buf, n, "refused");
  }
  return buf;
}

void rtp__tcp_sa_to_str(const struct sockaddr *sa, char *out, size_t n) {
  char ip[64] = "?";
  if (sa->sa_family == AF_INET) {
    const struct sockaddr_in *s4 = (const struct sockaddr_in *)sa;
    uv_ip4_name(s4, ip, sizeof(ip));
    snprintf(out, n, "%s:%d", ip, ntohs(s4->sin_port));
  } else if (sa->sa_family == AF_INET6) {
    const struct sockaddr_in6 *s6 = (const struct sockaddr_in6 *)sa;
    uv_ip6_name(s6, ip, sizeof(ip));
    snprintf(out, n, "[%s]:%d", ip, ntohs(s6->sin6_port));
  } else {
    snprintf(out, n, "?");
  }
}

int rtp__tcp_parse_ip(const char *s, int port, struct sockaddr_storage *out) {
  memset(out, 0, sizeof(*out));
  if (uv_ip4_addr(s, port, (struct sockaddr_in *)out) == 0) return 0;
  if (uv_ip6_addr(s, port, (struct sockaddr_in6 *)out) == 0) return 0;
  return -1;
}

void rtp__tcp_sa_set_port(struct sockaddr_storage *sa, int port) {
  if (sa->ss_family == AF_INET) ((struct sockaddr_in *)sa)->sin_port = htons((uint16_t)port);
  if (sa->ss_family == AF_INET6) ((struct sockaddr_in6 *)sa)->sin6_port = htons((uint16_t)port);
}

int rtp__tcp_sa_port(const struct sockaddr_storage *sa) {
  if (sa->ss_family == AF_INET) return ntohs(((const struct sockaddr_in *)sa)->sin_port);
  if (sa->ss_family == AF_INET6) return ntohs(((const struct sockaddr_in6 *)sa)->sin6_port);
  return 0;
}

void rtp__tcp_sa_ip(const struct sockaddr_storage *sa, char *out, size_t n) {
  if (sa->ss_family == AF_INET6)
    uv_ip6_name((const struct sockaddr_in6 *)sa, out, n);
  else
    uv_ip4_name((const struct sockaddr_in *)sa, out, n);
}
