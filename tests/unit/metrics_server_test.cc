// server/metrics/metrics_server.h on 127.0.0.1:0: GET /metrics answers the registry's text
// with the 0.0.4 content type, other paths 404, a taken port is UNAVAILABLE, bad options are
// INVALID_ARGUMENT, and Shutdown stops serving.
#include "server/metrics/metrics_server.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <httplib.h>

#include <memory>
#include <string>

#include "server/metrics/registry.h"
#include "tests/testing/status_matchers.h"

namespace mainstay::metrics {
namespace {

using ::mainstay::testing::IsOk;
using ::mainstay::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::Pair;
using ::testing::StartsWith;

std::unique_ptr<MetricsServer> StartOrDie(const Registry& registry, const std::string& address = "127.0.0.1:0") {
  absl::StatusOr<std::unique_ptr<MetricsServer>> server = MetricsServer::Start({address, &registry});
  EXPECT_THAT(server.status(), IsOk());
  return server.ok() ? *std::move(server) : nullptr;
}

TEST(MetricsServerTest, GetMetricsAnswersTheRegistryTextWithTheExpositionContentType) {
  Registry registry;
  (*(*registry.AddCounter("mainstay_test_total", "Test.", {"job"}))->WithLabels({"j"}))->Increment(7);
  std::unique_ptr<MetricsServer> server = StartOrDie(registry);
  ASSERT_NE(server, nullptr);
  ASSERT_GT(server->port(), 0);
  httplib::Client client("127.0.0.1", server->port());
  client.set_connection_timeout(10);
  client.set_read_timeout(30);
  httplib::Result result = client.Get("/metrics");
  ASSERT_TRUE(result) << httplib::to_string(result.error());
  EXPECT_EQ(result->status, 200);
  EXPECT_THAT(result->get_header_value("Content-Type"), StartsWith("text/plain; version=0.0.4"));
  EXPECT_EQ(result->body, registry.Render());
  EXPECT_THAT(result->body, HasSubstr("mainstay_test_total{job=\"j\"} 7\n"));
}

TEST(MetricsServerTest, OtherPathsAreNotFound) {
  Registry registry;
  std::unique_ptr<MetricsServer> server = StartOrDie(registry);
  ASSERT_NE(server, nullptr);
  httplib::Client client("127.0.0.1", server->port());
  client.set_connection_timeout(10);
  for (const char* path : {"/", "/metricsx", "/metrics/x", "/health"}) {
    httplib::Result result = client.Get(path);
    ASSERT_TRUE(result) << path;
    EXPECT_EQ(result->status, 404) << path;
  }
}

TEST(MetricsServerTest, ATakenPortIsUnavailable) {
  Registry registry;
  std::unique_ptr<MetricsServer> first = StartOrDie(registry);
  ASSERT_NE(first, nullptr);
  EXPECT_THAT(MetricsServer::Start({"127.0.0.1:" + std::to_string(first->port()), &registry}).status(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("cannot listen")));
}

TEST(MetricsServerTest, BadOptionsAreInvalidArgument) {
  Registry registry;
  EXPECT_THAT(MetricsServer::Start({"127.0.0.1:0", nullptr}).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  for (const char* address : {"", "9464", ":9464", "host:", "host:x", "host:70000", "host:-1"}) {
    EXPECT_THAT(MetricsServer::Start({address, &registry}).status(), StatusIs(absl::StatusCode::kInvalidArgument))
        << address;
  }
}

TEST(MetricsServerTest, SplitHostPortTakesBracketedIpv6) {
  EXPECT_THAT(*SplitHostPort("0.0.0.0:9464"), Pair("0.0.0.0", 9464));
  EXPECT_THAT(*SplitHostPort("[::]:0"), Pair("::", 0));
  EXPECT_THAT(*SplitHostPort("[::1]:9464"), Pair("::1", 9464));
}

TEST(MetricsServerTest, ShutdownStopsServingAndIsIdempotent) {
  Registry registry;
  std::unique_ptr<MetricsServer> server = StartOrDie(registry);
  ASSERT_NE(server, nullptr);
  const int port = server->port();
  server->Shutdown();
  server->Shutdown();
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(5);
  EXPECT_FALSE(client.Get("/metrics"));
}

}  // namespace
}  // namespace mainstay::metrics
