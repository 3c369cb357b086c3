// A small metrics registry rendered in the Prometheus text exposition format 0.0.4 (what
// `GET /metrics` answers; DESIGN.md section 9): counters, gauges and fixed-bucket histograms,
// each a named family with label names, whose series are created on first use of a set of
// label values.
//
//   metrics::Registry registry;
//   MAINSTAY_ASSIGN_OR_RETURN(auto* steps, registry.AddCounter("mainstay_steps_total", "Steps.", {"job"}));
//   MAINSTAY_ASSIGN_OR_RETURN(auto series, steps->WithLabels({"job-1"}));
//   series->Increment();
//   std::string text = registry.Render();
//
// Ownership: the registry owns its families (pointers stay valid for its lifetime); a family
// hands out shared_ptrs to its series, so a series removed from the family (Remove) stays
// safe to record into, it is just no longer rendered. Collectors are not owned: whoever adds
// one removes it before what it captures goes away.
// Thread safety: everything is thread-safe. Recording into a counter or gauge is one atomic
// operation; a histogram takes a per-series mutex so a scrape sees count, sum and buckets of
// the same observations. Render runs the collectors first (under a mutex of their own, which
// RemoveCollector also takes: after it returns the collector never runs again), then reads
// every series; a collector must not call Render or RemoveCollector.
// Errors: INVALID_ARGUMENT for a malformed metric or label name, bad histogram bounds or the
// wrong number of label values; ALREADY_EXISTS when a name is registered again with another
// type, label names or bounds (the same definition again returns the same family; the first
// help text stays).
#ifndef MAINSTAY_SERVER_METRICS_REGISTRY_H_
#define MAINSTAY_SERVER_METRICS_REGISTRY_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace mainstay::metrics {

enum class MetricType { kCounter, kGauge, kHistogram };

// A value that only goes up (restarts at 0 with the process).
class Counter {
 public:
  // Negative and NaN amounts are ignored: a counter never goes down.
  void Increment(double amount = 1.0);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// A value that is set (or moved) to whatever it is now.
class Gauge {
 public:
  void Set(double value) { value_.store(value, std::memory_order_relaxed); }
  void Add(double amount);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// Observations counted into fixed buckets (upper bounds, strictly increasing; +Inf implied).
class Histogram {
 public:
  struct Snapshot {
    std::vector<uint64_t> cumulative;  // one per bound, then +Inf (== count)
    double sum = 0.0;
    uint64_t count = 0;
  };

  explicit Histogram(std::vector<double> bounds);
  void Observe(double value);  // NaN is ignored
  Snapshot Read() const;
  const std::vector<double>& bounds() const { return bounds_; }

 private:
  const std::vector<double> bounds_;
  mutable absl::Mutex mu_;
  std::vector<uint64_t> counts_ ABSL_GUARDED_BY(mu_);  // per bucket, not cumulative; last: +Inf
  double sum_ ABSL_GUARDED_BY(mu_) = 0.0;
  uint64_t count_ ABSL_GUARDED_BY(mu_) = 0;
};

namespace internal {
// Text-format pieces, shared by the families' renderers and the tests.
std::string FormatValue(double value);                   // 1, 0.25, +Inf, -Inf, NaN
std::string EscapeLabelValue(const std::string& value);  // \ " and newline escaped
std::string EscapeHelp(const std::string& help);         // \ and newline escaped
void AppendSeries(std::string& out, const std::string& name, const std::string& labels, const Counter& c);
void AppendSeries(std::string& out, const std::string& name, const std::string& labels, const Gauge& g);
void AppendSeries(std::string& out, const std::string& name, const std::string& labels, const Histogram& h);
}  // namespace internal

// What every family has; Registry keeps them by name.
class FamilyBase {
 public:
  FamilyBase(std::string name, std::string help, MetricType type, std::vector<std::string> label_names)
      : name_(std::move(name)), help_(std::move(help)), type_(type), label_names_(std::move(label_names)) {}
  virtual ~FamilyBase() = default;

  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  MetricType type() const { return type_; }
  const std::vector<std::string>& label_names() const { return label_names_; }
  // Appends HELP, TYPE and every series; nothing when the family has no series.
  void Render(std::string& out) const;

 protected:
  // Appends the sample lines of every series, sorted by label values.
  virtual void RenderSeries(std::string& out) const = 0;
  virtual bool empty() const = 0;
  // `a="x",b="y"` for these label values (escaped), empty without labels.
  std::string LabelPairs(const std::vector<std::string>& values) const;

 private:
  const std::string name_, help_;
  const MetricType type_;
  const std::vector<std::string> label_names_;
};

template <typename Metric>
class Family final : public FamilyBase {
 public:
  using Make = std::function<std::shared_ptr<Metric>()>;
  Family(std::string name, std::string help, MetricType type, std::vector<std::string> label_names, Make make)
      : FamilyBase(std::move(name), std::move(help), type, std::move(label_names)), make_(std::move(make)) {}

  // The series of these label values (in label_names() order), created at 0 on first use.
  // INVALID_ARGUMENT when the number of values differs from the number of label names.
  absl::StatusOr<std::shared_ptr<Metric>> WithLabels(const std::vector<std::string>& values);
  // Stops rendering that series (e.g. of a job that is gone). No-op when absent.
  void Remove(const std::vector<std::string>& values) {
    absl::MutexLock lock(&mu_);
    series_.erase(values);
  }

 private:
  void RenderSeries(std::string& out) const override;
  bool empty() const override {
    absl::MutexLock lock(&mu_);
    return series_.empty();
  }

  const Make make_;
  mutable absl::Mutex mu_;
  std::map<std::vector<std::string>, std::shared_ptr<Metric>> series_ ABSL_GUARDED_BY(mu_);
};

class Registry {
 public:
  using CollectorId = int64_t;

  Registry() = default;
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // A family without labels gets its one series at once, so it renders 0 from the start.
  absl::StatusOr<Family<Counter>*> AddCounter(const std::string& name, const std::string& help,
                                              std::vector<std::string> label_names = {});
  absl::StatusOr<Family<Gauge>*> AddGauge(const std::string& name, const std::string& help,
                                          std::vector<std::string> label_names = {});
  absl::StatusOr<Family<Histogram>*> AddHistogram(const std::string& name, const std::string& help,
                                                  std::vector<std::string> label_names, std::vector<double> bounds);

  // `collect` runs at the start of every Render: for gauges cheaper to compute on demand
  // (memory held, lease state) than to keep current.
  CollectorId AddCollector(std::function<void()> collect);
  // Waits for a running call of that collector to end; no call afterwards.
  void RemoveCollector(CollectorId id);

  // Every family with at least one series, by name, in text format 0.0.4.
  std::string Render() const;

 private:
  template <typename Metric>
  absl::StatusOr<Family<Metric>*> Add(const std::string& name, const std::string& help, MetricType type,
                                      std::vector<std::string> label_names, std::vector<double> bounds,
                                      typename Family<Metric>::Make make);

  mutable absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<FamilyBase>> families_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::vector<double>> bounds_ ABSL_GUARDED_BY(mu_);  // of histogram families
  mutable absl::Mutex collect_mu_;                                          // held while collectors run
  std::map<CollectorId, std::function<void()>> collectors_ ABSL_GUARDED_BY(collect_mu_);
  CollectorId next_collector_ ABSL_GUARDED_BY(collect_mu_) = 1;
};

// ---- template definitions

template <typename Metric>
absl::StatusOr<std::shared_ptr<Metric>> Family<Metric>::WithLabels(const std::vector<std::string>& values) {
  if (values.size() != label_names().size()) {
    return absl::InvalidArgumentError("metric " + name() + ": " + std::to_string(values.size()) + " label values for " +
                                      std::to_string(label_names().size()) + " label names");
  }
  absl::MutexLock lock(&mu_);
  std::shared_ptr<Metric>& series = series_[values];
  if (series == nullptr) series = make_();
  return series;
}

template <typename Metric>
void Family<Metric>::RenderSeries(std::string& out) const {
  std::vector<std::pair<std::vector<std::string>, std::shared_ptr<Metric>>> series;
  {
    absl::MutexLock lock(&mu_);
    series.assign(series_.begin(), series_.end());
  }
  for (const auto& [values, metric] : series) internal::AppendSeries(out, name(), LabelPairs(values), *metric);
}

}  // namespace mainstay::metrics

#endif  // MAINSTAY_SERVER_METRICS_REGISTRY_H_
