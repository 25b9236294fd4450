#pragma once
// The loss curve of a training run, drawn from its metrics records as an SVG picture.

#include <optional>
#include <string>
#include <vector>

#include "trainer/metrics_log.h"

namespace hp::trainer {

// The training and validation loss over the steps: one path per curve, and the baseline
// (e.g. the unigram loss) as a dashed line when given.
std::string loss_curve_svg(const std::vector<MetricsRecord>& records, const std::string& title,
                           std::optional<double> baseline);

}  // namespace hp::trainer
