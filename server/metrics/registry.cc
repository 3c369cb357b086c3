#include "server/metrics/registry.h"

#include <algorithm>
#include <charconv>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace mainstay::metrics {
namespace {

bool ValidName(const std::string& name, bool allow_colon) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (allow_colon && c == ':') ||
                    (i > 0 && c >= '0' && c <= '9');
    if (!ok) return false;
  }
  return true;
}

const char* TypeName(MetricType type) {
  switch (type) {
    case MetricType::kCounter:
      return "counter";
    case MetricType::kGauge:
      return "gauge";
    case MetricType::kHistogram:
      return "histogram";
  }
  return "untyped";
}

void AppendLine(std::string& out, const std::string& name, const std::string& labels, double value) {
  absl::StrAppend(&out, name);
  if (!labels.empty()) absl::StrAppend(&out, "{", labels, "}");
  absl::StrAppend(&out, " ", internal::FormatValue(value), "\n");
}

}  // namespace

void Counter::Increment(double amount) {
  if (!(amount > 0.0)) return;
  value_.fetch_add(amount, std::memory_order_relaxed);
}

void Gauge::Add(double amount) { value_.fetch_add(amount, std::memory_order_relaxed); }

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::Observe(double value) {
  if (std::isnan(value)) return;
  // First bound >= value: Prometheus buckets are "less than or equal".
  const size_t bucket = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin());
  absl::MutexLock lock(&mu_);
  ++counts_[bucket];
  sum_ += value;
  ++count_;
}

Histogram::Snapshot Histogram::Read() const {
  Snapshot s;
  absl::MutexLock lock(&mu_);
  uint64_t running = 0;
  for (uint64_t c : counts_) {
    running += c;
    s.cumulative.push_back(running);
  }
  s.sum = sum_;
  s.count = count_;
  return s;
}

namespace internal {

std::string FormatValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  char buffer[32];
  // Shortest text that reads back as the same double: integers print without a point.
  const std::to_chars_result r = std::to_chars(buffer, buffer + sizeof(buffer), value);
  return std::string(buffer, r.ptr);
}

std::string EscapeLabelValue(const std::string& value) {
  std::string out;
  out.reserve(value.size());
  for (const char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string EscapeHelp(const std::string& help) {
  std::string out;
  out.reserve(help.size());
  for (const char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

void AppendSeries(std::string& out, const std::string& name, const std::string& labels, const Counter& c) {
  AppendLine(out, name, labels, c.value());
}

void AppendSeries(std::string& out, const std::string& name, const std::string& labels, const Gauge& g) {
  AppendLine(out, name, labels, g.value());
}

void AppendSeries(std::string& out, const std::string& name, const std::string& labels, const Histogram& h) {
  const Histogram::Snapshot s = h.Read();
  const std::string prefix = labels.empty() ? "" : absl::StrCat(labels, ",");
  const std::string bucket = absl::StrCat(name, "_bucket");
  for (size_t i = 0; i < h.bounds().size(); ++i) {
    AppendLine(out, bucket, absl::StrCat(prefix, "le=\"", FormatValue(h.bounds()[i]), "\""),
               static_cast<double>(s.cumulative[i]));
  }
  AppendLine(out, bucket, absl::StrCat(prefix, "le=\"+Inf\""), static_cast<double>(s.count));
  AppendLine(out, absl::StrCat(name, "_sum"), labels, s.sum);
  AppendLine(out, absl::StrCat(name, "_count"), labels, static_cast<double>(s.count));
}

}  // namespace internal

void FamilyBase::Render(std::string& out) const {
  if (empty()) return;
  absl::StrAppend(&out, "# HELP ", name_, " ", internal::EscapeHelp(help_), "\n");
  absl::StrAppend(&out, "# TYPE ", name_, " ", TypeName(type_), "\n");
  RenderSeries(out);
}

std::string FamilyBase::LabelPairs(const std::vector<std::string>& values) const {
  std::vector<std::string> pairs;
  for (size_t i = 0; i < values.size() && i < label_names_.size(); ++i) {
    pairs.push_back(absl::StrCat(label_names_[i], "=\"", internal::EscapeLabelValue(values[i]), "\""));
  }
  return absl::StrJoin(pairs, ",");
}

template <typename Metric>
absl::StatusOr<Family<Metric>*> Registry::Add(const std::string& name, const std::string& help, MetricType type,
                                              std::vector<std::string> label_names, std::vector<double> bounds,
                                              typename Family<Metric>::Make make) {
  if (!ValidName(name, /*allow_colon=*/true)) {
    return absl::InvalidArgumentError(absl::StrCat("metric name '", name, "' is not [a-zA-Z_:][a-zA-Z0-9_:]*"));
  }
  for (size_t i = 0; i < label_names.size(); ++i) {
    const std::string& label = label_names[i];
    if (!ValidName(label, /*allow_colon=*/false) || label.rfind("__", 0) == 0) {
      return absl::InvalidArgumentError(absl::StrCat("metric ", name, ": label name '", label,
                                                     "' is not [a-zA-Z_][a-zA-Z0-9_]* without a leading __"));
    }
    if (type == MetricType::kHistogram && label == "le") {
      return absl::InvalidArgumentError(absl::StrCat("metric ", name, ": 'le' is the histograms' bucket label"));
    }
    if (std::find(label_names.begin(), label_names.begin() + static_cast<std::ptrdiff_t>(i), label) !=
        label_names.begin() + static_cast<std::ptrdiff_t>(i)) {
      return absl::InvalidArgumentError(absl::StrCat("metric ", name, ": label '", label, "' given twice"));
    }
  }
  absl::MutexLock lock(&mu_);
  auto it = families_.find(name);
  if (it != families_.end()) {
    FamilyBase& existing = *it->second;
    const auto b = bounds_.find(name);
    const bool same_bounds = type != MetricType::kHistogram || (b != bounds_.end() && b->second == bounds);
    if (existing.type() != type || existing.label_names() != label_names || !same_bounds) {
      return absl::AlreadyExistsError(
          absl::StrCat("metric ", name, " is already registered with another type, labels or buckets"));
    }
    return static_cast<Family<Metric>*>(&existing);
  }
  const bool unlabelled = label_names.empty();
  auto family = std::make_unique<Family<Metric>>(name, help, type, std::move(label_names), std::move(make));
  Family<Metric>* raw = family.get();
  families_[name] = std::move(family);
  if (type == MetricType::kHistogram) bounds_[name] = std::move(bounds);
  if (unlabelled) (void)raw->WithLabels({});
  return raw;
}

absl::StatusOr<Family<Counter>*> Registry::AddCounter(const std::string& name, const std::string& help,
                                                      std::vector<std::string> label_names) {
  return Add<Counter>(name, help, MetricType::kCounter, std::move(label_names), {},
                      [] { return std::make_shared<Counter>(); });
}

absl::StatusOr<Family<Gauge>*> Registry::AddGauge(const std::string& name, const std::string& help,
                                                  std::vector<std::string> label_names) {
  return Add<Gauge>(name, help, MetricType::kGauge, std::move(label_names), {},
                    [] { return std::make_shared<Gauge>(); });
}

absl::StatusOr<Family<Histogram>*> Registry::AddHistogram(const std::string& name, const std::string& help,
                                                          std::vector<std::string> label_names,
                                                          std::vector<double> bounds) {
  if (!bounds.empty() && std::isinf(bounds.back()) && bounds.back() > 0) bounds.pop_back();  // +Inf is implied
  if (bounds.empty()) return absl::InvalidArgumentError(absl::StrCat("histogram ", name, ": no bucket bounds"));
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (!std::isfinite(bounds[i]) || (i > 0 && !(bounds[i] > bounds[i - 1]))) {
      return absl::InvalidArgumentError(
          absl::StrCat("histogram ", name, ": bucket bounds must be finite and strictly increasing"));
    }
  }
  return Add<Histogram>(name, help, MetricType::kHistogram, std::move(label_names), bounds,
                        [bounds] { return std::make_shared<Histogram>(bounds); });
}

Registry::CollectorId Registry::AddCollector(std::function<void()> collect) {
  absl::MutexLock lock(&collect_mu_);
  const CollectorId id = next_collector_++;
  collectors_[id] = std::move(collect);
  return id;
}

void Registry::RemoveCollector(CollectorId id) {
  absl::MutexLock lock(&collect_mu_);
  collectors_.erase(id);
}

std::string Registry::Render() const {
  {
    absl::MutexLock lock(&collect_mu_);
    for (const auto& [id, collect] : collectors_) collect();
  }
  std::vector<const FamilyBase*> families;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, family] : families_) families.push_back(family.get());
  }
  std::string out;
  for (const FamilyBase* family : families) family->Render(out);
  return out;
}

}  // namespace mainstay::metrics
