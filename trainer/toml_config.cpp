#include "trainer/toml_config.h"

#include <toml++/toml.h>

#include <charconv>
#include <string>

namespace hp::trainer {
namespace {

std::string line_of(const toml::node& node) {
  return "line " + std::to_string(node.source().begin.line);
}

// A scalar as CLI11 reads it from a command line.
std::string text_of(const toml::node& node, const std::string& key) {
  if (const auto* text = node.as_string()) return text->get();
  if (const auto* integer = node.as_integer()) return std::to_string(integer->get());
  if (const auto* flag = node.as_boolean()) return flag->get() ? "true" : "false";
  if (const auto* number = node.as_floating_point()) {
    char digits[32];
    const auto end = std::to_chars(digits, digits + sizeof digits, number->get()).ptr;
    return std::string(digits, end);  // shortest text that reads back the same double
  }
  throw CLI::ConfigError("--config: '" + key + "' (" + line_of(node) +
                         ") must be a string, number, boolean or an array of them");
}

}  // namespace

std::vector<CLI::ConfigItem> TomlConfig::from_config(std::istream& input) const {
  toml::table table;
  try {
    table = toml::parse(input);
  } catch (const toml::parse_error& error) {
    const auto& at = error.source().begin;
    throw CLI::ConfigError("--config: not valid TOML at line " + std::to_string(at.line) +
                           ", column " + std::to_string(at.column) + ": " +
                           std::string(error.description()));
  }
  std::vector<CLI::ConfigItem> items;
  for (const auto& [key, node] : table) {
    const std::string name(key.str());
    if (name == "config" || app_.get_option_no_throw("--" + name) == nullptr) {
      throw CLI::ConfigError("--config: unknown key '" + name + "' (" + line_of(node) +
                             "); the keys are the long options without '--', e.g. steps = 600");
    }
    CLI::ConfigItem item;
    item.name = name;
    if (const auto* array = node.as_array()) {
      for (const toml::node& element : *array) item.inputs.push_back(text_of(element, name));
    } else {
      item.inputs.push_back(text_of(node, name));
    }
    items.push_back(std::move(item));
  }
  return items;
}

}  // namespace hp::trainer
