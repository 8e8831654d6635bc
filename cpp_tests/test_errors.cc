#include <gtest/gtest.h>

#include "cpp/config.h"
#include "cpp/errors.h"
#include "cpp/op_state.h"
#include "cpp/timeouts.h"

namespace freescale {

TEST(Errors, CodesHaveNamesAndPrefixMessages) {
  CommError e(ErrorCode::kPeerDied, "rank 3 died");
  EXPECT_EQ(e.code(), ErrorCode::kPeerDied);
  EXPECT_STREQ(error_code_name(e.code()), "PEER_DIED");
  EXPECT_EQ(std::string(e.what()), "[PEER_DIED] rank 3 died");
}

TEST(Errors, HierarchyIsCatchableAsError) {
  try {
    throw InvalidArgument("input_split_sizes has 3 entries");
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  }
  EXPECT_THROW(throw SystemError("shm_open", ENOENT), Error);
}

TEST(Errors, CommCodesAreTheCollectiveFailures) {
  EXPECT_TRUE(is_comm_code(ErrorCode::kTimeout));
  EXPECT_TRUE(is_comm_code(ErrorCode::kPeerDied));
  EXPECT_TRUE(is_comm_code(ErrorCode::kPeerAborted));
  EXPECT_TRUE(is_comm_code(ErrorCode::kSizeMismatch));
  EXPECT_FALSE(is_comm_code(ErrorCode::kInvalidArgument));
  EXPECT_FALSE(is_comm_code(ErrorCode::kInternal));
}

TEST(Errors, SystemErrorCarriesErrno) {
  SystemError e("ftruncate", ENOSPC);
  EXPECT_EQ(e.code(), ErrorCode::kSystem);
  EXPECT_NE(std::string(e.what()).find("ftruncate failed"), std::string::npos);
  EXPECT_NE(std::string(e.what()).find("errno"), std::string::npos);
}

TEST(Config, BadEnvironmentNamesTheVariable) {
  setenv("FREESCALE_CHUNK_BYTES", "lots", 1);
  try {
    Config::from_env();
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("FREESCALE_CHUNK_BYTES"), std::string::npos);
  }
  setenv("FREESCALE_CHUNK_BYTES", "512K", 1);  // not the default
  setenv("FREESCALE_TIMEOUT_S", "2.5", 1);
  Config c = Config::from_env();
  EXPECT_EQ(c.chunk_bytes, 512u * 1024u);
  EXPECT_EQ(c.timeout_ms, 2500u);
  setenv("FREESCALE_TIMEOUT_S", "-1", 1);
  EXPECT_THROW(Config::from_env(), InvalidArgument);
  for (const char* lax : {"+5", " 5", "0x10", "5 "}) {  // refused as the size knobs refuse them (strtod took the first three)
    setenv("FREESCALE_TIMEOUT_S", lax, 1);
    EXPECT_THROW(Config::from_env(), InvalidArgument) << "'" << lax << "'";
  }
  setenv("FREESCALE_TIMEOUT_S", "1e3", 1);
  EXPECT_EQ(Config::from_env().timeout_ms, 1000000u);
  unsetenv("FREESCALE_CHUNK_BYTES");
  unsetenv("FREESCALE_TIMEOUT_S");
}

// Issue 22 item 10: each of these was accepted (as 1 GiB, 2^64 - 1 and 64 TiB).
TEST(Config, OverflowingNegativeAndHugeSizesAreRefusedNamingTheVariable) {
  for (const char* raw : {"17179869185G", " -1", "\t-5M", "18446744073709551616", "+7", "65536G"}) {
    setenv("FREESCALE_ARENA_BYTES", raw, 1);
    try {
      Config c = Config::from_env();
      ADD_FAILURE() << "FREESCALE_ARENA_BYTES='" << raw << "' accepted as " << c.arena_bytes;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("FREESCALE_ARENA_BYTES"), std::string::npos) << e.what();
    }
  }
  setenv("FREESCALE_ARENA_BYTES", "64G", 1);
  EXPECT_EQ(Config::from_env().arena_bytes, 64ull << 30);
  unsetenv("FREESCALE_ARENA_BYTES");
}

// Issue 22 item 5: seconds * 1000 cast to uint64 was UB past ~1.8e16 s, and a deadline of
// now + that many milliseconds overflowed the clock (an immediate TIMEOUT).
TEST(Config, TimeoutsBeyondACenturyMeanNoTimeout) {
  setenv("FREESCALE_TIMEOUT_S", "1e30", 1);
  Config c = Config::from_env();
  unsetenv("FREESCALE_TIMEOUT_S");
  EXPECT_EQ(capped_timeout_ms(c.timeout_ms), kForeverTimeout);
  EXPECT_EQ(capped_timeout_ms(~0ull), kForeverTimeout);
  EXPECT_GT(Clock::now() + capped_timeout_ms(~0ull), Clock::now() + std::chrono::hours(24 * 365 * 99));
  EXPECT_EQ(timeout_from_seconds(1e10).count(), -1);
  EXPECT_EQ(timeout_from_seconds(2.5).count(), 2500000);
}

TEST(Config, ArenaMustHoldTwoChunks) {
  Config c;
  c.chunk_bytes = 1 << 20;
  c.arena_bytes = 1 << 20;
  EXPECT_THROW(c.validate(), InvalidArgument);
  c.transport = "carrier-pigeon";
  c.arena_bytes = 4 << 20;
  EXPECT_THROW(c.validate(), InvalidArgument);
}

}  // namespace freescale
