// A plain-text table with aligned columns, for mainstayctl's human-readable output.
#ifndef MAINSTAY_CLI_TABLE_H_
#define MAINSTAY_CLI_TABLE_H_

#include <ostream>
#include <string>
#include <vector>

namespace mainstay::cli {

class Table {
 public:
  explicit Table(std::vector<std::string> header) : header_(std::move(header)) {}
  void AddRow(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  // Columns are left-aligned, separated by two spaces; numbers are not special-cased.
  void Print(std::ostream& out) const;

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

// 1234567 -> "1.23M", 8030261248 -> "8.03G"; below 10^4 the plain number.
std::string HumanCount(int64_t n);

}  // namespace mainstay::cli

#endif  // MAINSTAY_CLI_TABLE_H_
