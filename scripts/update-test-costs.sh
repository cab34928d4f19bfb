#!/usr/bin/env bash
# Writes tests/ctest_costs.txt, the seconds each CTest entry took in BUILD's last runs (CTest's
# own Testing/Temporary/CTestCostData.txt, for the entries `ctest -N` lists now). A build folder
# that has no timings yet starts from these (tests/CMakeLists.txt), so that CTest starts the
# longest entries first on a fresh machine too, as it does once it has timed them itself.
#   scripts/update-test-costs.sh [BUILD]      after a full `ctest` in BUILD (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
data="$build/Testing/Temporary/CTestCostData.txt"
[ -f "$data" ] || { echo "update-test-costs: $data is missing: run ctest in $build first" >&2; exit 2; }
names=$(ctest --test-dir "$build" -N | sed -n 's/^ *Test *#[0-9]*: //p')
{
  echo "# name runs seconds: CTest's cost data, written by scripts/update-test-costs.sh"
  awk -v names="$names" '
    BEGIN { n = split(names, list, "\n"); for (i = 1; i <= n; i++) want[list[i]] = 1 }
    $0 == "---" { exit }
    NF == 3 && ($1 in want) { cost[$1] = $3 }
    END { for (k in cost) printf "%s 1 %.1f\n", k, cost[k] }' "$data" | sort
} > tests/ctest_costs.txt
echo "update-test-costs: $(($(wc -l < tests/ctest_costs.txt) - 1)) entries of $(echo "$names" | wc -l) in tests/ctest_costs.txt"
