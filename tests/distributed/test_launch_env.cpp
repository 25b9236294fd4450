#include <gtest/gtest.h>

#include <cstdlib>
#include <stdexcept>

#include "error_of.h"
#include "hyperparallel/launch_env.h"

namespace hp {
namespace {

class LaunchEnvTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* name :
         {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HP_TIMEOUT_S",
          "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT"}) {
      unsetenv(name);
    }
  }
  static void set_valid() {
    setenv("RANK", "1", 1);
    setenv("WORLD_SIZE", "4", 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", "29500", 1);
  }
  static std::string error_of() {
    return testing::error_of<c10::ValueError>([] { LaunchEnv::from_environment(); });
  }
};

TEST_F(LaunchEnvTest, ReadsTorchrunVariables) {
  set_valid();
  setenv("LOCAL_RANK", "0", 1);
  LaunchEnv env = LaunchEnv::from_environment();
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 0);
  EXPECT_EQ(env.master_addr, "127.0.0.1");
  EXPECT_EQ(env.master_port, 29500);
}

TEST_F(LaunchEnvTest, LocalRankDefaultsToRank) {
  set_valid();
  EXPECT_EQ(LaunchEnv::from_environment().local_rank, 1);
}

TEST_F(LaunchEnvTest, MissingVariableIsNamed) {
  set_valid();
  unsetenv("MASTER_PORT");
  std::string error = error_of();
  EXPECT_NE(error.find("MASTER_PORT is not set"), std::string::npos) << error;
  EXPECT_NE(error.find("hp-run"), std::string::npos) << "the error should say how to launch";
}

TEST_F(LaunchEnvTest, InvalidValuesAreNamed) {
  set_valid();
  setenv("RANK", "4", 1);  // not < WORLD_SIZE
  EXPECT_NE(error_of().find("RANK='4'"), std::string::npos) << error_of();
  set_valid();
  setenv("WORLD_SIZE", "two", 1);
  EXPECT_NE(error_of().find("WORLD_SIZE='two'"), std::string::npos) << error_of();
  set_valid();
  setenv("MASTER_PORT", "70000", 1);
  EXPECT_NE(error_of().find("MASTER_PORT='70000'"), std::string::npos) << error_of();
}

TEST_F(LaunchEnvTest, TimeoutAndTorchrunVariables) {
  set_valid();
  LaunchEnv plain = LaunchEnv::from_environment();
  EXPECT_FALSE(plain.timeout.has_value());
  EXPECT_FALSE(plain.agent_store);
  EXPECT_EQ(plain.restart_count, 0);

  setenv("HP_TIMEOUT_S", "2.5", 1);
  setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
  setenv("TORCHELASTIC_RESTART_COUNT", "3", 1);
  LaunchEnv env = LaunchEnv::from_environment();
  ASSERT_TRUE(env.timeout.has_value());
  EXPECT_EQ(env.timeout->count(), 2500);
  EXPECT_TRUE(env.agent_store);
  EXPECT_EQ(env.restart_count, 3);
  setenv("TORCHELASTIC_USE_AGENT_STORE", "False", 1);
  EXPECT_FALSE(LaunchEnv::from_environment().agent_store);

  for (const char* bad : {"0", "-1", "ten", "5s", "nan"}) {
    setenv("HP_TIMEOUT_S", bad, 1);
    EXPECT_NE(error_of().find(std::string("HP_TIMEOUT_S='") + bad +
                              "' is not a positive number of seconds"),
              std::string::npos)
        << error_of();
  }
  setenv("HP_TIMEOUT_S", "10", 1);
  setenv("TORCHELASTIC_USE_AGENT_STORE", "yes", 1);
  EXPECT_NE(error_of().find("TORCHELASTIC_USE_AGENT_STORE='yes'"), std::string::npos) << error_of();
}

}  // namespace
}  // namespace hp
