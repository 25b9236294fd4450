#include "trainer/metrics_log.h"

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace hp::trainer {
namespace {

// JSON has no inf or NaN: a skipped step's non-finite values are null, read back as NaN.
nlohmann::json number(double value) {
  return std::isfinite(value) ? nlohmann::json(value) : nlohmann::json(nullptr);
}

double number_of(const nlohmann::json& value) {
  return value.is_null() ? std::nan("") : value.get<double>();
}

nlohmann::json to_json(const MetricsRecord& record) {
  nlohmann::json line = {{"step", record.step},
                         {"loss", number(record.loss)},
                         {"grad_norm", number(record.grad_norm)},
                         {"tokens_per_s", record.tokens_per_s},
                         {"elapsed_s", record.elapsed_s}};
  if (record.skipped) line["skipped"] = true;
  if (record.balance_loss) line["balance_loss"] = number(*record.balance_loss);
  if (record.validation_loss) {
    line["validation_loss"] = *record.validation_loss;
    line["validation_perplexity"] = std::exp(*record.validation_loss);
  }
  return line;
}

MetricsRecord from_json(const nlohmann::json& line) {
  MetricsRecord record;
  record.step = line.at("step").get<int64_t>();
  record.loss = number_of(line.at("loss"));
  record.grad_norm = number_of(line.at("grad_norm"));
  record.skipped = line.value("skipped", false);
  record.tokens_per_s = line.at("tokens_per_s").get<double>();
  record.elapsed_s = line.at("elapsed_s").get<double>();
  if (line.contains("balance_loss")) record.balance_loss = number_of(line["balance_loss"]);
  if (line.contains("validation_loss")) {
    record.validation_loss = line["validation_loss"].get<double>();
  }
  return record;
}

}  // namespace

std::vector<MetricsRecord> read_metrics(const std::string& path, int64_t last_step) {
  std::vector<MetricsRecord> records;
  std::ifstream in(path);
  std::string text;
  for (int number = 1; std::getline(in, text); ++number) {
    try {
      MetricsRecord record = from_json(nlohmann::json::parse(text));
      if (record.step <= last_step) records.push_back(record);
    } catch (const nlohmann::json::exception& error) {
      throw std::runtime_error(path + " line " + std::to_string(number) +
                               " is not a metrics record: " + error.what());
    }
  }
  return records;
}

MetricsLog::MetricsLog(const std::string& path, const std::vector<MetricsRecord>& kept)
    : path_(path) {
  const std::string staged = path + ".partial";
  {
    std::ofstream out(staged, std::ios::trunc);
    for (const auto& record : kept) out << to_json(record).dump() << '\n';
    if (!out.flush()) throw std::runtime_error("cannot write " + staged);
  }
  std::filesystem::rename(staged, path);
  out_.open(path, std::ios::app);
  if (!out_) throw std::runtime_error("cannot append to " + path);
}

void MetricsLog::append(const MetricsRecord& record) {
  if (!(out_ << to_json(record).dump() << '\n' << std::flush)) {
    throw std::runtime_error("cannot append to " + path_);
  }
}

}  // namespace hp::trainer
