#include <gtest/gtest.h>

#include "cpp/config.h"
#include "cpp/errors.h"

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
  unsetenv("FREESCALE_CHUNK_BYTES");
  unsetenv("FREESCALE_TIMEOUT_S");
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
