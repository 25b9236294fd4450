#include "examples/trainer/metrics_log.h"

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace hp::trainer {
namespace {

nlohmann::json to_json(const MetricsRecord& record) {
  nlohmann::json line = {{"step", record.step},
                         {"loss", record.loss},
                         {"grad_norm", record.grad_norm},
                         {"tokens_per_s", record.tokens_per_s},
                         {"elapsed_s", record.elapsed_s}};
  if (record.balance_loss) line["balance_loss"] = *record.balance_loss;
  if (record.validation_loss) {
    line["validation_loss"] = *record.validation_loss;
    line["validation_perplexity"] = std::exp(*record.validation_loss);
  }
  return line;
}

MetricsRecord from_json(const nlohmann::json& line) {
  MetricsRecord record;
  record.step = line.at("step").get<int64_t>();
  record.loss = line.at("loss").get<double>();
  record.grad_norm = line.at("grad_norm").get<double>();
  record.tokens_per_s = line.at("tokens_per_s").get<double>();
  record.elapsed_s = line.at("elapsed_s").get<double>();
  if (line.contains("balance_loss")) record.balance_loss = line["balance_loss"].get<double>();
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
