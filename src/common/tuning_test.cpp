#include "common/tuning.h"

#include <gtest/gtest.h>

#include <set>

namespace pdb {

// Every switch is read into its own field, and only when set.
TEST(Tuning, EverySwitchIsParsedIntoItsField) {
  std::set<std::string> names;
  for (const auto& s : tuning_switches()) {
    EXPECT_TRUE(names.insert(s.env).second) << s.env << " listed twice";
    unsetenv(s.env);
  }
  const Tuning none = Tuning::from_env();
  for (const auto& s : tuning_switches()) EXPECT_EQ(none.*s.field, "") << s.env;
  for (const auto& s : tuning_switches()) {
    setenv(s.env, s.env, 1);
    const Tuning t = Tuning::from_env();
    for (const auto& o : tuning_switches()) EXPECT_EQ(t.*o.field, o.field == s.field ? std::string(s.env) : std::string()) << s.env << " set, " << o.env << " read";
    unsetenv(s.env);
  }
}

}  // namespace pdb
