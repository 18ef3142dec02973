// fuzz_replay: runs the fuzz harness (fuzz_pool.cpp) without libFuzzer, so any compiler can run it.
//
//   fuzz_replay FILE|DIR...                    replay corpus files (a directory: every file in it)
//   fuzz_replay --random N [--seed S] [--max-len L] [--minutes M]
//                                              N random inputs (or as many as fit in M minutes)
//
// A failing input aborts with the harness's message; the driver names the input first, and random
// inputs are written to ./fuzz-failure-<seed>-<i>.bin so they can be replayed and added to the corpus.
// Closing line: "replayed N inputs, X operations in T s, F faults injected, O OOMs, 0 failures".
#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);
extern "C" std::uint64_t gpumem_fuzz_ops, gpumem_fuzz_faults, gpumem_fuzz_ooms;

namespace fs = std::filesystem;

static std::string g_current;
static void name_failing_input() {
  if (!g_current.empty()) std::fprintf(stderr, "failing input: %s\n", g_current.c_str());
}

static std::vector<std::uint8_t> read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::vector<std::uint8_t>(std::istreambuf_iterator<char>(f), {});
}

int main(int argc, char** argv) {
  std::signal(SIGABRT, [](int) {
    name_failing_input();
    std::signal(SIGABRT, SIG_DFL);
    std::abort();
  });
  std::uint64_t random_inputs = 0, seed = 1;
  std::size_t max_len = 2048;
  double minutes = 0;
  std::vector<fs::path> files;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--random") random_inputs = std::stoull(next());
    else if (a == "--seed") seed = std::stoull(next());
    else if (a == "--max-len") max_len = std::stoull(next());
    else if (a == "--minutes") minutes = std::stod(next());
    else if (a == "-h" || a == "--help") {
      std::printf("usage: fuzz_replay FILE|DIR... | --random N [--seed S] [--max-len L] [--minutes M]\n");
      return 0;
    } else if (fs::is_directory(a)) {
      for (auto& e : fs::directory_iterator(a))
        if (e.is_regular_file()) files.push_back(e.path());
    } else if (fs::exists(a)) {
      files.push_back(a);
    } else {
      std::fprintf(stderr, "fuzz_replay: no such file or directory: %s\n", a.c_str());
      return 2;
    }
  }
  std::sort(files.begin(), files.end());
  const auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  std::uint64_t inputs = 0;
  for (const fs::path& p : files) {
    g_current = p.string();
    std::vector<std::uint8_t> data = read_file(p);
    LLVMFuzzerTestOneInput(data.data(), data.size());
    ++inputs;
  }
  if (random_inputs || minutes > 0) {
    std::mt19937_64 rng(seed);
    for (std::uint64_t i = 0; (random_inputs == 0 || i < random_inputs) && (minutes <= 0 || elapsed() < minutes * 60); ++i) {
      std::vector<std::uint8_t> data(8 + rng() % max_len);
      for (auto& b : data) b = static_cast<std::uint8_t>(rng());
      g_current = "fuzz-failure-" + std::to_string(seed) + "-" + std::to_string(i) + ".bin";
      {
        std::ofstream f(g_current, std::ios::binary);  // kept only if the input fails
        f.write(reinterpret_cast<const char*>(data.data()), data.size());
      }
      LLVMFuzzerTestOneInput(data.data(), data.size());
      std::remove(g_current.c_str());
      ++inputs;
    }
  }
  g_current.clear();
  std::printf("replayed %llu inputs, %llu operations in %.1f s, %llu faults injected, %llu OOMs, 0 failures\n",
              (unsigned long long)inputs, (unsigned long long)gpumem_fuzz_ops, elapsed(),
              (unsigned long long)gpumem_fuzz_faults, (unsigned long long)gpumem_fuzz_ooms);
  return inputs ? 0 : 1;
}
