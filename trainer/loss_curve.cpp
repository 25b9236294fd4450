#include "trainer/loss_curve.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

namespace hp::trainer {

std::string loss_curve_svg(const std::vector<MetricsRecord>& records, const std::string& title,
                           std::optional<double> baseline) {
  constexpr double kWidth = 720, kHeight = 400, kLeft = 60, kRight = 20, kTop = 40, kBottom = 50;
  double max_step = 1, low = std::numeric_limits<double>::infinity(), high = 0;
  const auto include = [&](double loss) {
    if (!std::isfinite(loss)) return;  // a skipped step's: not drawn
    low = std::min(low, loss);
    high = std::max(high, loss);
  };
  for (const auto& record : records) {
    max_step = std::max(max_step, static_cast<double>(record.step));
    include(record.loss);
    if (record.validation_loss) include(*record.validation_loss);
  }
  if (baseline) include(*baseline);
  if (!(high > low)) {
    low = records.empty() ? 0 : low - 1;
    high = low + 2;
  }
  low = std::floor(low * 2) / 2;
  high = std::ceil(high * 2) / 2;
  const auto x = [&](double step) { return kLeft + (kWidth - kLeft - kRight) * step / max_step; };
  const auto y = [&](double loss) {
    return kTop + (kHeight - kTop - kBottom) * (high - loss) / (high - low);
  };
  std::string svg;
  char buffer[512];
  const auto add = [&](const char* format, auto... values) {
    std::snprintf(buffer, sizeof buffer, format, values...);
    svg += buffer;
  };
  add("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n",
      kWidth, kHeight);
  add("<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n");
  std::string escaped;
  for (char c : title) escaped += c == '<' ? "&lt;" : c == '&' ? "&amp;" : std::string(1, c);
  svg += "<text x=\"" + std::to_string(static_cast<int>(kLeft)) + "\" y=\"24\" font-size=\"14\">" +
         escaped + "</text>\n";
  // Axes, with a grid line every half nat and five step marks.
  for (double loss = low; loss <= high + 1e-9; loss += 0.5) {
    add("<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n", kLeft, y(loss),
        kWidth - kRight, y(loss));
    add("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%.1f</text>\n", kLeft - 6, y(loss) + 4,
        loss);
  }
  for (int mark = 0; mark <= 5; ++mark) {
    const double step = std::round(max_step * mark / 5);
    add("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%.0f</text>\n", x(step),
        kHeight - kBottom + 18, step);
  }
  add("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">step</text>\n",
      (kLeft + kWidth - kRight) / 2, kHeight - 10);
  add("<text x=\"14\" y=\"%.1f\" transform=\"rotate(-90 14 %.1f)\" text-anchor=\"middle\">loss "
      "(nats per byte)</text>\n",
      (kTop + kHeight - kBottom) / 2, (kTop + kHeight - kBottom) / 2);
  if (baseline) {
    add("<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#888\" "
        "stroke-dasharray=\"6 4\"/>\n",
        kLeft, y(*baseline), kWidth - kRight, y(*baseline));
  }
  struct Curve {
    const char* name;
    const char* color;
    bool validation;
  };
  int legend = 0;
  for (const Curve& curve :
       {Curve{"train", "#1f77b4", false}, Curve{"validation", "#d62728", true}}) {
    std::string points;
    for (const auto& record : records) {
      if (curve.validation && !record.validation_loss) continue;
      const double loss = curve.validation ? *record.validation_loss : record.loss;
      if (!std::isfinite(loss)) continue;
      std::snprintf(buffer, sizeof buffer, "%s%.1f %.1f", points.empty() ? "M" : " L",
                    x(static_cast<double>(record.step)), y(loss));
      points += buffer;
    }
    if (points.empty()) continue;
    svg += "<path class=\"" + std::string(curve.name) + "\" d=\"" + points +
           "\" fill=\"none\" stroke=\"" + curve.color + "\" stroke-width=\"1.5\"/>\n";
    add("<text x=\"%.1f\" y=\"%.1f\" fill=\"%s\">%s</text>\n", kWidth - kRight - 150,
        kTop + 16.0 + 16 * legend++, curve.color, curve.name);
  }
  if (baseline) {
    add("<text x=\"%.1f\" y=\"%.1f\" fill=\"#888\">unigram baseline %.3f</text>\n",
        kWidth - kRight - 150, kTop + 16.0 + 16 * legend, *baseline);
  }
  svg += "</svg>\n";
  return svg;
}

}  // namespace hp::trainer
