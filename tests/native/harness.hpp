// The native unit tests' harness: TEST registers a case, CHECK / CHECK_EQ / CHECK_THROWS fail it with
// file:line. Each test executable is harness_main.cpp plus the test sources of one core header
// (tests/native/CMakeLists.txt); it runs every case, or those whose name holds argv[1], and closes
// with "N passed, M failed" (exit status nonzero when anything failed).
#pragma once

#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace gpumem_test {

struct TestFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

using TestCase = std::pair<const char*, void (*)()>;

inline std::vector<TestCase>& registry() {
  static std::vector<TestCase> cases;
  return cases;
}

struct Registrar {
  Registrar(const char* name, void (*fn)()) { registry().emplace_back(name, fn); }
};

// What `fn` throws, as text; "" when it does not throw.
inline std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace gpumem_test

#define TEST(name)                                                     \
  static void name();                                                  \
  static ::gpumem_test::Registrar registrar_##name(#name, name);       \
  static void name()

#define CHECK(cond)                                                                        \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      std::ostringstream _m;                                                               \
      _m << __FILE__ << ":" << __LINE__ << ": CHECK(" #cond ") failed";                    \
      throw ::gpumem_test::TestFailure(_m.str());                                          \
    }                                                                                      \
  } while (0)

#define CHECK_EQ(a, b)                                                                     \
  do {                                                                                     \
    auto _a = (a);                                                                         \
    auto _b = (b);                                                                         \
    if (!(_a == _b)) {                                                                     \
      std::ostringstream _m;                                                               \
      _m << __FILE__ << ":" << __LINE__ << ": CHECK_EQ(" #a ", " #b ") failed: " << _a     \
         << " != " << _b;                                                                  \
      throw ::gpumem_test::TestFailure(_m.str());                                          \
    }                                                                                      \
  } while (0)

#define CHECK_THROWS(expr, Type)                                                                 \
  do {                                                                                           \
    bool _threw = false;                                                                         \
    try {                                                                                        \
      (void)(expr);                                                                              \
    } catch (const Type&) {                                                                      \
      _threw = true;                                                                             \
    }                                                                                            \
    if (!_threw)                                                                                 \
      throw ::gpumem_test::TestFailure(std::string(__FILE__) + ":" + std::to_string(__LINE__) +  \
                                       ": " #expr " did not throw " #Type);                      \
  } while (0)

// `expr` throws Type whose message contains `text`.
#define CHECK_THROWS_WITH(expr, Type, text)                                                      \
  do {                                                                                           \
    std::string _what;                                                                           \
    bool _threw = false;                                                                         \
    try {                                                                                        \
      (void)(expr);                                                                              \
    } catch (const Type& _e) {                                                                   \
      _threw = true;                                                                             \
      _what = _e.what();                                                                         \
    }                                                                                            \
    if (!_threw || _what.find(text) == std::string::npos)                                        \
      throw ::gpumem_test::TestFailure(std::string(__FILE__) + ":" + std::to_string(__LINE__) +  \
                                       ": " #expr " should throw " #Type " saying '" +           \
                                       std::string(text) + "', " +                               \
                                       (_threw ? "got '" + _what + "'" : "did not throw"));      \
  } while (0)
