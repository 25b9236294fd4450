#pragma once
// The metrics file of a training run: JSON Lines, one object per logged step.

#include <cstdint>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace hp::trainer {

struct MetricsRecord {
  int64_t step = 0;
  double loss = 0;       // training loss of the step, mean over the ranks
  double grad_norm = 0;  // before clipping
  // The loss or the norm was not finite, so the step made no update (written as null).
  bool skipped = false;
  // The MoE layers' load-balancing loss of the step (coefficient applied, summed over the
  // layers, mean over the ranks): logged by runs with one (--experts, --balance-loss > 0).
  std::optional<double> balance_loss;
  double tokens_per_s = 0;
  double elapsed_s = 0;                   // since this process started training
  std::optional<double> validation_loss;  // on the steps that evaluate
};

// The records of a metrics file with step <= `last_step`, in order; none when there is no
// file. Throws std::runtime_error naming the file and line when a line does not parse.
std::vector<MetricsRecord> read_metrics(const std::string& path, int64_t last_step);

// Appends records to a metrics file, each line flushed as it is written. Starts the file
// over with `kept` (a resumed run drops what the interrupted one logged after its
// checkpoint), replacing it atomically.
class MetricsLog {
 public:
  MetricsLog(const std::string& path, const std::vector<MetricsRecord>& kept);
  void append(const MetricsRecord& record);

 private:
  std::string path_;
  std::ofstream out_;
};

}  // namespace hp::trainer
