// test-token-data.cpp - the files train-gpt's --data reads (examples/train-gpt/
// token-data.h): llm.c's .bin (GPT-2 and Llama 3), nanoGPT's uint16 and bytes, what auto
// takes, and every malformed file refused with its reason, tokens out of range by their
// index and byte offset.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "token-data.h"

namespace {

void put32(std::vector<uint8_t> *b, uint32_t v) {
  for (int i = 0; i < 4; i++) b->push_back((uint8_t)(v >> (8 * i)));
}

// llm.c's write_datafile: 256 int32 (magic, version, count, zeros), then the tokens.
std::vector<uint8_t> llmc(uint32_t magic, uint32_t version, int32_t count,
                          const std::vector<uint32_t> &tokens, int width) {
  std::vector<uint8_t> b;
  put32(&b, magic);
  put32(&b, version);
  put32(&b, (uint32_t)count);
  b.resize(TOKEN_LLMC_HEADER);
  for (uint32_t t : tokens)
    for (int i = 0; i < width; i++) b.push_back((uint8_t)(t >> (8 * i)));
  return b;
}

std::vector<uint8_t> gpt2(const std::vector<uint32_t> &tokens) {
  return llmc(TOKEN_LLMC_GPT2, 1, (int32_t)tokens.size(), tokens, 2);
}

// The file parsed, kept with the span that points into it.
struct Parsed {
  std::vector<uint8_t> file;
  int rc;
  token_span s;
  std::string err;
};

Parsed parse(std::vector<uint8_t> b, token_format f, int vocab = 0) {
  Parsed p{std::move(b), -1, {}, ""};
  char err[256] = "";
  p.rc = token_span_parse(p.file.data(), p.file.size(), f, vocab, &p.s, err, sizeof(err));
  p.err = err;
  return p;
}

std::vector<int32_t> all(const token_span &s) {
  std::vector<int32_t> v;
  for (size_t i = 0; i < s.n; i++) v.push_back(token_at(&s, i));
  return v;
}

TEST(TokenData, Gpt2FileHasItsTokensAndGpt2sVocabulary) {
  for (token_format f : {TOKEN_AUTO, TOKEN_LLMC}) {
    Parsed p = parse(gpt2({50256, 0, 1, 65535 % 50257, 464}), f);
    ASSERT_EQ(p.rc, 0) << p.err;
    EXPECT_EQ(p.s.width, 2);
    EXPECT_EQ(p.s.vocab, 50257);
    EXPECT_STREQ(p.s.kind, "llm.c GPT-2 tokens");
    EXPECT_EQ(all(p.s), (std::vector<int32_t>{50256, 0, 1, 15278, 464}));
  }
  Parsed padded = parse(gpt2({50300}), TOKEN_AUTO, 50304);  // llm.c's padded vocabulary
  ASSERT_EQ(padded.rc, 0) << padded.err;
  EXPECT_EQ(padded.s.vocab, 50304);
}

TEST(TokenData, Llama3FileHasUint32Tokens) {
  Parsed p = parse(llmc(TOKEN_LLMC_LLAMA3, 7, 3, {128000, 70000, 5}, 4), TOKEN_AUTO);
  ASSERT_EQ(p.rc, 0) << p.err;
  EXPECT_EQ(p.s.width, 4);
  EXPECT_EQ(p.s.vocab, 128256);
  EXPECT_EQ(all(p.s), (std::vector<int32_t>{128000, 70000, 5}));
}

TEST(TokenData, AutoIsBytesWithoutAVocabularyAndUint16WithOne) {
  std::vector<uint8_t> b = {'h', 'i', 0x01, 0x02};
  Parsed bytes = parse(b, TOKEN_AUTO);
  ASSERT_EQ(bytes.rc, 0) << bytes.err;
  EXPECT_EQ(bytes.s.vocab, 256);
  EXPECT_EQ(all(bytes.s), (std::vector<int32_t>{'h', 'i', 1, 2}));
  Parsed u16 = parse(b, TOKEN_AUTO, 65536);
  ASSERT_EQ(u16.rc, 0) << u16.err;
  EXPECT_STREQ(u16.s.kind, "uint16 tokens");
  EXPECT_EQ(all(u16.s), (std::vector<int32_t>{'h' | 'i' << 8, 0x0201}));
  Parsed forced = parse(gpt2({1, 2}), TOKEN_BYTES);  // bytes, even after llm.c's magic
  ASSERT_EQ(forced.rc, 0) << forced.err;
  EXPECT_EQ(forced.s.n, 1024u + 4u);
}

TEST(TokenData, SliceIsARangeOfTokens) {
  Parsed p = parse(gpt2({10, 11, 12, 13, 14}), TOKEN_AUTO);
  ASSERT_EQ(p.rc, 0) << p.err;
  token_span s = token_span_slice(p.s, 3, 2);
  EXPECT_EQ(all(s), (std::vector<int32_t>{13, 14}));
}

// Each malformed file gets its reason; none parses.
TEST(TokenData, MalformedFilesAreRefusedWithTheirReason) {
  std::vector<uint8_t> full = gpt2({1, 2, 3});
  std::vector<uint8_t> truncated(full.begin(), full.begin() + 100);
  std::vector<uint8_t> cut(full.begin(), full.end() - 1);
  struct Case {
    const char *name;
    std::vector<uint8_t> file;
    token_format f;
    int vocab;
    std::string message;
  };
  const Case cases[] = {
      {"truncated header", truncated, TOKEN_AUTO, 0,
       "truncated llm.c header: the file has 100 bytes, the header is 1024 (256 int32)"},
      {"wrong magic",
       {'a', 'b', 'c', 'd', 'e'},
       TOKEN_LLMC,
       0,
       "not an llm.c token file: its first int32 is 1684234849, llm.c's magic is 20240520"},
      {"too short for a magic", {'a'}, TOKEN_LLMC, 0, "1 bytes, too short for a magic"},
      {"evaluation file", llmc(TOKEN_LLMC_EVAL, 1, 0, {}, 2), TOKEN_AUTO, 0,
       "magic 20240522 is llm.c's evaluation file"},
      {"wrong version", llmc(TOKEN_LLMC_GPT2, 2, 1, {7}, 2), TOKEN_AUTO, 0,
       "version 2 with magic 20240520, expected 1"},
      {"count larger than the file", llmc(TOKEN_LLMC_GPT2, 1, 4, {1, 2, 3}, 2), TOKEN_AUTO, 0,
       "the token count is 4 (larger than the file), the file holds 6 bytes after the header "
       "(3 tokens of 2 bytes)"},
      {"count smaller than the file", llmc(TOKEN_LLMC_GPT2, 1, 2, {1, 2, 3}, 2), TOKEN_AUTO, 0,
       "the token count is 2 (not all the file holds)"},
      {"negative count", llmc(TOKEN_LLMC_GPT2, 1, -1, {}, 2), TOKEN_AUTO, 0,
       "the token count is -1 (negative)"},
      {"half a token", cut, TOKEN_AUTO, 0, "the token count is 3 (larger than the file)"},
      {"odd uint16 file",
       {1, 2, 3},
       TOKEN_UINT16,
       300,
       "3 bytes, an odd count: uint16 tokens are 2 bytes each"},
      {"uint16 without a vocabulary",
       {1, 2},
       TOKEN_UINT16,
       0,
       "uint16 tokens need a vocabulary size"},
  };
  for (const Case &c : cases) {
    Parsed p = parse(c.file, c.f, c.vocab);
    EXPECT_EQ(p.rc, -1) << c.name;
    EXPECT_NE(p.err.find(c.message), std::string::npos)
        << c.name << ": expected '" << c.message << "' in: " << p.err;
  }
}

// A token at or past the vocabulary is named by its index among the tokens and its byte
// offset in the file (past llm.c's header of 1024 bytes).
TEST(TokenData, TokensOutOfRangeNameTheirIndexAndOffset) {
  Parsed p = parse(gpt2({1, 2, 3, 4, 5, 299, 300, 9}), TOKEN_AUTO, 300);
  EXPECT_EQ(p.rc, -1);
  EXPECT_NE(p.err.find("token 300 at token index 6 (byte offset 1036) is not below the "
                       "vocabulary size 300"),
            std::string::npos)
      << p.err;
  Parsed gpt = parse(gpt2({50257}), TOKEN_AUTO);
  EXPECT_NE(gpt.err.find("token 50257 at token index 0 (byte offset 1024)"), std::string::npos)
      << gpt.err;
  Parsed u16 = parse({1, 0, 0x2c, 0x01}, TOKEN_UINT16, 300);  // 1, then 300
  EXPECT_NE(u16.err.find("token 300 at token index 1 (byte offset 2)"), std::string::npos)
      << u16.err;
  Parsed huge = parse(llmc(TOKEN_LLMC_LLAMA3, 7, 2, {5, 0xffffffffu}, 4), TOKEN_AUTO);
  EXPECT_NE(huge.err.find("token 4294967295 at token index 1 (byte offset 1028)"),
            std::string::npos)
      << huge.err;
}

TEST(TokenData, FormatNamesRoundTrip) {
  for (int i = 0; i < TOKEN_FORMAT_COUNT; i++) {
    token_format f = TOKEN_AUTO;
    ASSERT_TRUE(token_format_parse(token_format_name((token_format)i), &f));
    EXPECT_EQ(f, (token_format)i);
  }
  token_format f = TOKEN_BYTES;
  EXPECT_FALSE(token_format_parse("u16", &f));
  EXPECT_EQ(f, TOKEN_BYTES);
}

}  // namespace
