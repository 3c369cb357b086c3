// server/metrics/registry.h: the Prometheus text exposition format 0.0.4 byte for byte
// (HELP/TYPE lines, escaping, histogram buckets, +Inf, number formatting), the registry's
// validation and idempotent registration, collectors, and recording from many threads.
// Where Debian's `promtool` is installed, a rendered registry also passes its linter.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "server/metrics/registry.h"
#include "tests/testing/status_matchers.h"

namespace mainstay::metrics {
namespace {

using ::mainstay::testing::IsOk;
using ::mainstay::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::Not;

TEST(MetricsFormatTest, ValuesUseTheShortestRoundTripTextAndPrometheusSpecials) {
  EXPECT_EQ(internal::FormatValue(0.0), "0");
  EXPECT_EQ(internal::FormatValue(2.0), "2");
  EXPECT_EQ(internal::FormatValue(-3.0), "-3");
  EXPECT_EQ(internal::FormatValue(0.25), "0.25");
  EXPECT_EQ(internal::FormatValue(0.001), "0.001");
  EXPECT_EQ(internal::FormatValue(1e21), "1e+21");
  EXPECT_EQ(internal::FormatValue(123456789012.0), "123456789012");
  EXPECT_EQ(internal::FormatValue(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(internal::FormatValue(-std::numeric_limits<double>::infinity()), "-Inf");
  EXPECT_EQ(internal::FormatValue(std::nan("")), "NaN");
  EXPECT_EQ(std::stod(internal::FormatValue(0.1 + 0.2)), 0.1 + 0.2);
}

TEST(MetricsFormatTest, LabelValuesEscapeBackslashQuoteAndNewlineAndHelpEscapesBackslashAndNewline) {
  EXPECT_EQ(internal::EscapeLabelValue("a\\b\"c\nd"), "a\\\\b\\\"c\\nd");
  EXPECT_EQ(internal::EscapeHelp("a\\b\"c\nd"), "a\\\\b\"c\\nd");  // quotes stay in HELP
}

TEST(MetricsRenderTest, CounterAndGaugeRenderHelpTypeAndSortedSeries) {
  Registry r;
  MAINSTAY_ASSERT_OK_AND_ASSIGN(auto* steps, r.AddCounter("x_steps_total", "Steps\ndone \\ here.", {"job", "kind"}));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(auto* held, r.AddGauge("a_held_bytes", "Bytes."));
  (*steps->WithLabels({"j2", "k"}))->Increment(2);
  (*steps->WithLabels({"j\"1\n", "k"}))->Increment();
  (*held->WithLabels({}))->Set(1.5);
  EXPECT_EQ(r.Render(),
            "# HELP a_held_bytes Bytes.\n"
            "# TYPE a_held_bytes gauge\n"
            "a_held_bytes 1.5\n"
            "# HELP x_steps_total Steps\\ndone \\\\ here.\n"
            "# TYPE x_steps_total counter\n"
            "x_steps_total{job=\"j\\\"1\\n\",kind=\"k\"} 1\n"  // sorted by the raw values: '"' < '2'
            "x_steps_total{job=\"j2\",kind=\"k\"} 2\n");
}

TEST(MetricsRenderTest, HistogramRendersCumulativeBucketsWithInfSumAndCount) {
  Registry r;
  MAINSTAY_ASSERT_OK_AND_ASSIGN(auto* h, r.AddHistogram("t_seconds", "Time.", {"phase"}, {0.5, 1, 2.5}));
  std::shared_ptr<Histogram> s = *h->WithLabels({"update"});
  for (double v : {0.125, 0.5, 0.75, 1.0, 3.0, 100.0}) s->Observe(v);  // a value equal to a bound is in it (le)
  s->Observe(std::nan(""));                                            // ignored
  EXPECT_EQ(r.Render(),
            "# HELP t_seconds Time.\n"
            "# TYPE t_seconds histogram\n"
            "t_seconds_bucket{phase=\"update\",le=\"0.5\"} 2\n"
            "t_seconds_bucket{phase=\"update\",le=\"1\"} 4\n"
            "t_seconds_bucket{phase=\"update\",le=\"2.5\"} 4\n"
            "t_seconds_bucket{phase=\"update\",le=\"+Inf\"} 6\n"
            "t_seconds_sum{phase=\"update\"} 105.375\n"
            "t_seconds_count{phase=\"update\"} 6\n");
}

TEST(MetricsRenderTest, UnlabelledHistogramHasOnlyLeLabelAndStartsAtZero) {
  Registry r;
  ASSERT_THAT(r.AddHistogram("s_seconds", "S.", {}, {1, std::numeric_limits<double>::infinity()}).status(), IsOk());
  EXPECT_EQ(r.Render(),
            "# HELP s_seconds S.\n"
            "# TYPE s_seconds histogram\n"
            "s_seconds_bucket{le=\"1\"} 0\n"
            "s_seconds_bucket{le=\"+Inf\"} 0\n"
            "s_seconds_sum 0\n"
            "s_seconds_count 0\n");
}

TEST(MetricsRenderTest, LabelledFamilyWithoutSeriesRendersNothingAndRemovedSeriesVanish) {
  Registry r;
  MAINSTAY_ASSERT_OK_AND_ASSIGN(auto* g, r.AddGauge("norm", "N.", {"job"}));
  EXPECT_EQ(r.Render(), "");
  std::shared_ptr<Gauge> kept = *g->WithLabels({"a"});
  kept->Set(4);
  EXPECT_THAT(r.Render(), HasSubstr("norm{job=\"a\"} 4\n"));
  g->Remove({"a"});
  EXPECT_EQ(r.Render(), "");
  kept->Set(5);                                      // still safe to record into
  EXPECT_EQ((*g->WithLabels({"a"}))->value(), 0.0);  // a new series
}

TEST(MetricsRenderTest, CounterIgnoresNegativeAndNanAmountsAndGaugeMovesBothWays) {
  Counter c;
  c.Increment(2.5);
  c.Increment(-1);
  c.Increment(std::nan(""));
  EXPECT_EQ(c.value(), 2.5);
  Gauge g;
  g.Add(3);
  g.Add(-5);
  EXPECT_EQ(g.value(), -2.0);
}

TEST(MetricsRegistryTest, MalformedNamesLabelsAndBoundsAreInvalidArgument) {
  Registry r;
  EXPECT_THAT(r.AddCounter("", "h").status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(r.AddCounter("9lives", "h").status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(r.AddCounter("a-b", "h").status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(r.AddCounter("ns:ok_total", "h").status(), IsOk());  // colons are allowed in names
  EXPECT_THAT(r.AddCounter("c", "h", {"a:b"}).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(r.AddCounter("c", "h", {"__x"}).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(r.AddCounter("c", "h", {"x", "x"}).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(r.AddHistogram("h", "h", {"le"}, {1}).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(r.AddHistogram("h", "h", {}, {}).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(r.AddHistogram("h", "h", {}, {1, 1}).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(r.AddHistogram("h", "h", {}, {2, 1}).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(r.AddHistogram("h", "h", {}, {std::nan("")}).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(auto* c, r.AddCounter("c", "h", {"job"}));
  EXPECT_THAT(c->WithLabels({}).status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("label")));
  EXPECT_THAT(c->WithLabels({"a", "b"}).status(), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(MetricsRegistryTest, SameDefinitionReturnsTheSameFamilyAndAnotherOneIsAlreadyExists) {
  Registry r;
  MAINSTAY_ASSERT_OK_AND_ASSIGN(auto* first, r.AddCounter("c_total", "h", {"job"}));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(auto* again, r.AddCounter("c_total", "other help", {"job"}));
  EXPECT_EQ(first, again);
  EXPECT_THAT(r.AddGauge("c_total", "h", {"job"}).status(), StatusIs(absl::StatusCode::kAlreadyExists));
  EXPECT_THAT(r.AddCounter("c_total", "h", {"node"}).status(), StatusIs(absl::StatusCode::kAlreadyExists));
  ASSERT_THAT(r.AddHistogram("h_seconds", "h", {}, {1, 2}).status(), IsOk());
  EXPECT_THAT(r.AddHistogram("h_seconds", "h", {}, {1, 2}).status(), IsOk());
  EXPECT_THAT(r.AddHistogram("h_seconds", "h", {}, {1, 3}).status(), StatusIs(absl::StatusCode::kAlreadyExists));
}

TEST(MetricsRegistryTest, CollectorsRunBeforeEachRenderUntilRemoved) {
  Registry r;
  MAINSTAY_ASSERT_OK_AND_ASSIGN(auto* g, r.AddGauge("held", "h"));
  std::shared_ptr<Gauge> held = *g->WithLabels({});
  int calls = 0;
  const Registry::CollectorId id = r.AddCollector([&] { held->Set(++calls); });
  EXPECT_THAT(r.Render(), HasSubstr("held 1\n"));
  EXPECT_THAT(r.Render(), HasSubstr("held 2\n"));
  r.RemoveCollector(id);
  EXPECT_THAT(r.Render(), HasSubstr("held 2\n"));
  EXPECT_EQ(calls, 2);
}

TEST(MetricsRegistryTest, ConcurrentRecordingAndRenderingLoseNoIncrement) {
  Registry r;
  MAINSTAY_ASSERT_OK_AND_ASSIGN(auto* c, r.AddCounter("n_total", "h", {"t"}));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(auto* h, r.AddHistogram("v_seconds", "h", {}, {0.5}));
  constexpr int kThreads = 4, kPerThread = 20000;
  std::vector<std::thread> threads;
  std::atomic<bool> done{false};
  std::thread renderer([&] {
    while (!done) {
      const std::string text = r.Render();
      ASSERT_THAT(text, Not(HasSubstr("NaN")));
    }
  });
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        (*c->WithLabels({t % 2 == 0 ? "even" : "odd"}))->Increment();
        (*h->WithLabels({}))->Observe(i % 2 == 0 ? 0.25 : 1.0);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  done = true;
  renderer.join();
  const std::string text = r.Render();
  EXPECT_THAT(text, HasSubstr("n_total{t=\"even\"} 40000\n"));
  EXPECT_THAT(text, HasSubstr("n_total{t=\"odd\"} 40000\n"));
  EXPECT_THAT(text, HasSubstr("v_seconds_bucket{le=\"0.5\"} 40000\n"));
  EXPECT_THAT(text, HasSubstr("v_seconds_count 80000\n"));
  EXPECT_THAT(text, HasSubstr("v_seconds_sum 50000\n"));
}

// Runs `promtool check metrics` on `text`; returns its exit code and output.
std::pair<int, std::string> Promtool(const std::string& text) {
  char path[] = "/tmp/mainstay-metrics-XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) return {-1, "mkstemp failed"};
  (void)!write(fd, text.data(), text.size());
  close(fd);
  const std::string command = std::string("promtool check metrics < ") + path + " 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  std::string out;
  char buffer[512];
  while (pipe != nullptr && fgets(buffer, sizeof(buffer), pipe) != nullptr) out += buffer;
  const int status = pipe == nullptr ? -1 : pclose(pipe);
  unlink(path);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

TEST(MetricsRenderTest, RenderedTextPassesPromtoolLint) {
  if (access("/usr/bin/promtool", X_OK) != 0) GTEST_SKIP() << "promtool is not installed (Debian package prometheus)";
  Registry r;
  (*(*r.AddCounter("mainstay_test_steps_total", "Steps \"done\".\nSecond line.", {"job"}))->WithLabels({"a\"b\\c\nd"}))
      ->Increment(3);
  (*(*r.AddGauge("mainstay_test_held_bytes", "Bytes held."))->WithLabels({}))->Set(1e21);
  std::shared_ptr<Histogram> h =
      *(*r.AddHistogram("mainstay_test_phase_seconds", "Phase time.", {"phase"}, {0.001, 0.5, 10}))->WithLabels({"q"});
  h->Observe(0.2);
  h->Observe(20);
  const auto [code, output] = Promtool(r.Render());
  EXPECT_EQ(code, 0) << output << "\n" << r.Render();
}

}  // namespace
}  // namespace mainstay::metrics
