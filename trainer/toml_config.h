#pragma once
// The trainer's --config files, read by a real TOML parser (toml++): malformed TOML is an
// error naming the line and column, and so is a key that is not one of the trainer's long
// options (CLI11's own reader accepts both silently). Writing the resolved configuration
// stays CLI11's.

#include <CLI/CLI.hpp>
#include <istream>
#include <vector>

namespace hp::trainer {

class TomlConfig : public CLI::ConfigTOML {
 public:
  // `app`: whose long options the keys must name; it must outlive this reader.
  explicit TomlConfig(const CLI::App& app) : app_(app) {}

  // Throws CLI::ConfigError for malformed TOML, an unknown key, or a value that is not a
  // string, number, boolean or array of them.
  std::vector<CLI::ConfigItem> from_config(std::istream& input) const override;

 private:
  const CLI::App& app_;
};

}  // namespace hp::trainer
