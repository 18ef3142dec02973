// main() of every native unit test executable (harness.hpp): runs the registered cases, or those
// whose name contains argv[1], printing PASS / FAIL per case and "N passed, M failed" last.
#include <cstdio>
#include <exception>
#include <string>

#include "core/pool.hpp"
#include "harness.hpp"

int main(int argc, char** argv) {
  const char* filter = argc > 1 ? argv[1] : nullptr;
  if (gpumem::Pool::validates_every_op()) std::printf("validate() after every pool operation: on\n");
  int passed = 0, failed = 0;
  for (auto& [name, fn] : gpumem_test::registry()) {
    if (filter && std::string(name).find(filter) == std::string::npos) continue;
    try {
      fn();
      ++passed;
      std::printf("PASS %s\n", name);
    } catch (const std::exception& e) {
      ++failed;
      std::printf("FAIL %s: %s\n", name, e.what());
    }
    std::fflush(stdout);
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
