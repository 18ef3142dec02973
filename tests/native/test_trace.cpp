// trace_tests: allocation traces (trace.hpp): the parser (trace_parse.cpp) on well-formed traces,
// plain and gzip, and on every kind of malformed line, refused as "<path>:<line>: <what is wrong>";
// replay (trace_replay.cpp) of a small hand-written trace with exact figures, of a trace that runs out
// of memory, and of the recorded traces bundled with gpumem.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "core/errors.hpp"
#include "core/pool.hpp"
#include "core/simulated_device.hpp"
#include "core/trace.hpp"
#include "harness.hpp"

#if GPUMEM_WITH_ZLIB
#include <zlib.h>
#endif

#ifndef GPUMEM_SOURCE_DIR
#define GPUMEM_SOURCE_DIR "."
#endif

using namespace gpumem;

namespace {

// A file in a fresh temporary folder, removed with it.
struct TempTrace {
  std::filesystem::path dir, path;
  explicit TempTrace(const std::string& text, const char* name = "t.trace") {
    const auto stamp = reinterpret_cast<std::uintptr_t>(this) ^ static_cast<std::uintptr_t>(std::rand());
    dir = std::filesystem::temp_directory_path() / ("gpumem-trace-test-" + std::to_string(stamp));
    std::filesystem::create_directories(dir);
    path = dir / name;
    std::ofstream(path, std::ios::binary) << text;
  }
  ~TempTrace() {
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
  }
  std::string str() const { return path.string(); }
};

// load_trace(text) must fail with exactly "<path>:<line>: <what>" (what: a prefix of the rest).
void check_malformed(const std::string& text, int line, const std::string& what) {
  TempTrace t(text);
  const std::string m = gpumem_test::message_of([&] { load_trace(t.str()); });
  const std::string expected = t.str() + ":" + std::to_string(line) + ": " + what;
  if (m.compare(0, expected.size(), expected) != 0)
    throw gpumem_test::TestFailure("trace " + std::string(text.substr(0, 60)) + "...: expected '" + expected +
                                   "...', got '" + m + "'");
  CHECK_THROWS(load_trace(t.str()), InvalidArgument);
}

const char* const kSmall =
    "# workload tiny peak_live_bytes 3072 recorded_on test\n"
    "a 10 1024 0\n"
    "\n"
    "a 7 2048 5\r\n"
    "f 10\n"
    "a\t11\t512\t0\n"
    "f 7\n"
    "# a comment between operations\n"
    "f 11   \n";

}  // namespace

TEST(a_well_formed_trace) {
  TempTrace t(kSmall);
  const Trace trace = load_trace(t.str());
  CHECK_EQ(trace.path, t.str());
  CHECK_EQ(trace.workload, std::string("tiny"));
  CHECK_EQ(trace.header_peak_live, std::uint64_t(3072));
  CHECK_EQ(trace.allocations, std::size_t(3));
  CHECK_EQ(trace.ops.size(), std::size_t(6));
  // Ids become dense slots in order of allocation; frees name their allocation's slot.
  CHECK(trace.ops[0].is_alloc && trace.ops[0].slot == 0 && trace.ops[0].bytes == 1024 && trace.ops[0].stream == 0);
  CHECK(trace.ops[1].is_alloc && trace.ops[1].slot == 1 && trace.ops[1].bytes == 2048 && trace.ops[1].stream == 5);
  CHECK(!trace.ops[2].is_alloc && trace.ops[2].slot == 0);
  CHECK(trace.ops[3].is_alloc && trace.ops[3].slot == 2 && trace.ops[3].bytes == 512);
  CHECK(!trace.ops[4].is_alloc && trace.ops[4].slot == 1);
  CHECK(!trace.ops[5].is_alloc && trace.ops[5].slot == 2);
}

TEST(an_id_is_allocated_once_per_trace) {
  // An id is allocated once per trace: a second allocation of it is refused even after its free.
  check_malformed("a 1 512 0\nf 1\na 1 512 0\n", 3, "id 1 allocated twice");
}

TEST(malformed_lines_are_refused_with_file_and_line) {
  check_malformed("a 1 512 0\nx 2\n", 2, "expected 'a <id> <bytes> <stream>' or 'f <id>', got 'x 2'");
  check_malformed("a1 512 0\n", 1, "expected 'a <id> <bytes> <stream>' or 'f <id>', got 'a1 512 0'");
  check_malformed("a 1 512 0\r\nfree 1\r\n", 2, "expected 'a <id> <bytes> <stream>' or 'f <id>', got 'free 1'");
  check_malformed("a -1 512 0\n", 1, "the id is not a non-negative integer");
  check_malformed("a 99999999999999999999 512 0\n", 1, "the id is not a non-negative integer");  // > 2^64
  check_malformed("a 1 12x 0\n", 1, "the size is not a non-negative integer");
  check_malformed("a 1 512\n", 1, "the stream is not a non-negative integer");
  check_malformed("a 1 512 -3\n", 1, "the stream is not a non-negative integer");
  check_malformed("a 1 512 0 extra\n", 1, "unexpected text after the stream");
  check_malformed("a 1 281474976710657 0\n", 1, "allocation of 281474976710657 bytes is absurd");
  check_malformed("a 1 512 0\nf 1 2\n", 2, "unexpected text after the id");
  check_malformed("a 1 512 0\nf\n", 2, "expected 'a <id> <bytes> <stream>' or 'f <id>', got 'f'");
  check_malformed("a 1 512 0\n\n\nf 2\n", 4, "free of id 2 that was never allocated");
  check_malformed("a 1 512 0\nf 1\n# header\nf 1\n", 4, "id 1 freed twice");
  check_malformed("a 1 512 0\na 1 1024 0\n", 2, "id 1 allocated twice");
  check_malformed("a 1 512 0\n" + std::string(70000, '7') + "\n", 2, "line longer than 65536 characters");
}

TEST(traces_without_operations_or_file_are_refused) {
  {
    TempTrace empty("");
    CHECK_THROWS_WITH(load_trace(empty.str()), InvalidArgument, empty.str() + ": no allocations in the trace");
  }
  {
    TempTrace header_only("# workload nothing\n\n");
    CHECK_THROWS_WITH(load_trace(header_only.str()), InvalidArgument, ": no allocations in the trace");
  }
  CHECK_THROWS_WITH(load_trace("/nonexistent/gpumem.trace"), InvalidArgument,
                    "/nonexistent/gpumem.trace: cannot open: ");
  // The largest size and id there are parse.
  TempTrace big("a 18446744073709551615 281474976710656 18446744073709551615\n");
  const Trace trace = load_trace(big.str());
  CHECK_EQ(trace.ops[0].bytes, std::uint64_t(kMaxRequest));
}

#if GPUMEM_WITH_ZLIB
TEST(gzip_traces_read_as_plain_ones_and_corrupt_ones_are_refused) {
  TempTrace t("", "t.trace.gz");
  {
    gzFile gz = gzopen(t.str().c_str(), "wb");
    CHECK(gz != nullptr);
    gzputs(gz, kSmall);
    gzclose(gz);
  }
  const Trace trace = load_trace(t.str());
  CHECK_EQ(trace.workload, std::string("tiny"));
  CHECK_EQ(trace.ops.size(), std::size_t(6));
  // Corrupt the stream's CRC (its trailer: CRC-32, then the length, 4 bytes each): every line
  // decompresses, and the reader still reports the corruption rather than trusting the data.
  {
    std::fstream f(t.path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-8, std::ios::end);
    const char c = static_cast<char>(f.get() ^ 0xff);
    f.seekp(-8, std::ios::end);
    f.put(c);
  }
  const std::string m = gpumem_test::message_of([&] { load_trace(t.str()); });
  CHECK(m.rfind(t.str() + ":", 0) == 0);
  CHECK(m.find(": cannot decompress: ") != std::string::npos);
}
#endif

TEST(replay_of_a_small_trace_has_exact_figures) {
  TempTrace t(kSmall);
  const Trace trace = load_trace(t.str());
  auto dev = std::make_shared<SimulatedDevice>(UpstreamKind::kPages, 64 * MiB);
  Pool pool(dev);
  std::size_t calls = 0, last_done = 0;
  const ReplayResult r = replay(trace, pool, [&](std::size_t done, std::size_t total) {
    ++calls;
    last_done = done;
    CHECK_EQ(total, trace.ops.size());
  });
  CHECK_EQ(r.allocations, std::uint64_t(3));
  CHECK_EQ(r.frees, std::uint64_t(3));
  CHECK_EQ(r.ooms, std::uint64_t(0));
  CHECK_EQ(r.peak_live, std::uint64_t(3072));  // 1024 + 2048 live at once
  CHECK_EQ(r.peak_reserved, std::uint64_t(4 * MiB));  // a 2 MiB page in each stream's small arena
  CHECK_EQ(r.upstream_calls, std::uint64_t(2));
  CHECK(r.first_oom.empty());
  CHECK_EQ(calls, std::size_t(1));
  CHECK_EQ(last_done, trace.ops.size());
  CHECK_EQ(pool.stats().allocation[kAggregate].current, 0);
  pool.validate();
}

TEST(replay_counts_ooms_and_skips_their_frees) {
  // 5 MiB twice on an 8 MiB device of 2 MiB pages: the second does not fit.
  TempTrace t("a 1 5242880 0\na 2 5242880 0\nf 2\nf 1\na 3 1048576 0\nf 3\n");
  const Trace trace = load_trace(t.str());
  auto dev = std::make_shared<SimulatedDevice>(UpstreamKind::kPages, 8 * MiB);
  PoolOptions two_mib_pages;
  two_mib_pages.large_page_bytes = 2 * MiB;
  Pool pool(dev, two_mib_pages);
  const ReplayResult r = replay(trace, pool);
  CHECK_EQ(r.allocations, std::uint64_t(3));
  CHECK_EQ(r.ooms, std::uint64_t(1));
  CHECK_EQ(r.frees, std::uint64_t(2));  // the failed allocation's free is skipped
  CHECK_EQ(r.peak_live, std::uint64_t(5 * MiB));
  CHECK(r.first_oom.rfind("operation 2: gpumem: out of memory", 0) == 0);
  pool.validate();
  CHECK_EQ(dev->used_bytes(), std::size_t(pool.stats().reserved_bytes[kAggregate].current));
}

TEST(replay_again_makes_the_allocations_the_trace_never_frees_once) {
  // Ids 1 and 3 are never freed (a weight, state made during the first step): they stay live; 2 and
  // 4 are a step's blocks, allocated and freed.
  TempTrace t("a 1 4194304 0\na 2 1048576 0\nf 2\na 3 2097152 0\na 4 3145728 0\nf 4\n");
  const Trace trace = load_trace(t.str());
  auto dev = std::make_shared<SimulatedDevice>(UpstreamKind::kPages, 64 * MiB);
  Pool pool(dev);
  const ReplayResult first = replay(trace, pool);
  CHECK_EQ(first.allocations, std::uint64_t(4));
  CHECK_EQ(first.peak_live, std::uint64_t(9 * MiB));  // 4 + 2 + 3
  CHECK_EQ(pool.stats().allocated_bytes[kAggregate].current, std::int64_t(6 * MiB));
  const ReplayResult again = replay(trace, pool, {}, {}, /*again=*/true);
  CHECK_EQ(again.allocations, std::uint64_t(2));  // 2 and 4 again; 1 and 3 are still live
  CHECK_EQ(again.frees, std::uint64_t(2));
  CHECK_EQ(again.ooms, std::uint64_t(0));
  CHECK_EQ(again.peak_live, std::uint64_t(9 * MiB));  // the kept 6 MiB count as live from the start
  CHECK_EQ(again.upstream_calls, std::uint64_t(0));   // the same steps again: the cache serves them
  CHECK_EQ(pool.stats().allocated_bytes[kAggregate].current, std::int64_t(6 * MiB));  // nothing leaked
  pool.validate();
}

TEST(replay_recorded_traces_consistently) {
#if GPUMEM_WITH_ZLIB
  for (const char* name : {"gpt_varlen", "resnet50"}) {
    std::string path = std::string(GPUMEM_SOURCE_DIR) + "/python/gpumem/traces/" + name + ".trace.gz";
    if (std::FILE* f = std::fopen(path.c_str(), "rb")) std::fclose(f);
    else continue;
    Trace trace = load_trace(path);
    for (UpstreamKind kind : {UpstreamKind::kPages, UpstreamKind::kSegments}) {
      auto dev = std::make_shared<SimulatedDevice>(kind, 80 * GiB);
      Pool pool(dev);
      ReplayResult r = replay(trace, pool);
      CHECK_EQ(r.ooms, std::uint64_t(0));
      std::printf("  replayed %s on %s: %llu allocations\n", name, dev->name().c_str(), (unsigned long long)r.allocations);
      CHECK(r.allocations > 0);
      pool.validate();
      CHECK_EQ(static_cast<std::int64_t>(dev->used_bytes()), pool.stats().reserved_bytes[kAggregate].current);
      CHECK(std::uint64_t(pool.stats().reserved_bytes[kAggregate].peak) == r.peak_reserved);
    }
  }
#endif
}
