#include "cli/table.h"

#include <algorithm>

#include "absl/strings/str_format.h"

namespace mainstay::cli {

void Table::Print(std::ostream& out) const {
  std::vector<size_t> width(header_.size(), 0);
  auto widen = [&](const std::vector<std::string>& row) {
    for (size_t i = 0; i < row.size() && i < width.size(); ++i) width[i] = std::max(width[i], row[i].size());
  };
  widen(header_);
  for (const auto& row : rows_) widen(row);
  auto print = [&](const std::vector<std::string>& row) {
    std::string line;
    for (size_t i = 0; i < width.size(); ++i) {
      const std::string& cell = i < row.size() ? row[i] : "";
      line += cell;
      if (i + 1 < width.size()) line += std::string(width[i] - cell.size() + 2, ' ');
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out << line << '\n';
  };
  print(header_);
  for (const auto& row : rows_) print(row);
}

std::string HumanCount(int64_t n) {
  if (n < 10000) return absl::StrFormat("%d", n);
  if (n < 1'000'000) return absl::StrFormat("%.1fK", n / 1e3);
  if (n < 1'000'000'000) return absl::StrFormat("%.2fM", n / 1e6);
  return absl::StrFormat("%.2fG", n / 1e9);
}

}  // namespace mainstay::cli
