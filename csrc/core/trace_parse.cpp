// Reading an allocation trace (trace.hpp: the format) into a Trace: plain text or gzip, one operation a
// line, every malformed line refused as "<path>:<line>: <what is wrong>". Replay is trace_replay.cpp.
#include "trace.hpp"

#if GPUMEM_WITH_ZLIB
#include <zlib.h>
#else
// Without zlib, read plain text through the same calls (gzip traces are refused by their magic).
#include <cstdio>
using gzFile = FILE*;
static gzFile gzopen(const char* path, const char* mode) { return std::fopen(path, mode); }
static char* gzgets(gzFile f, char* buf, int len) { return std::fgets(buf, len, f); }
static int gzclose(gzFile f) { return std::fclose(f); }
#define Z_OK 0
#define Z_STREAM_END 1
static const char* gzerror(gzFile f, int* err) { *err = std::ferror(f) ? -1 : Z_OK; return "read error"; }
#endif

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

namespace gpumem {

namespace {

[[noreturn]] void malformed(const std::string& path, std::size_t line, const std::string& what) {
  throw InvalidArgument(path + ":" + std::to_string(line) + ": " + what);
}

// Parses an unsigned decimal field; false on anything else (signs, junk, overflow).
bool parse_u64(const char*& p, std::uint64_t* out) {
  while (*p == ' ' || *p == '\t') ++p;
  if (*p < '0' || *p > '9') return false;
  std::uint64_t v = 0;
  while (*p >= '0' && *p <= '9') {
    std::uint64_t next = v * 10 + static_cast<std::uint64_t>(*p - '0');
    if (next / 10 != v) return false;
    v = next;
    ++p;
  }
  if (*p && *p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') return false;
  *out = v;
  return true;
}

bool at_end(const char* p) {
  while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') ++p;
  return *p == 0;
}

}  // namespace

Trace load_trace(const std::string& path) {
  gzFile file = gzopen(path.c_str(), "rb");  // reads plain text too
  if (!file) throw InvalidArgument(path + ": cannot open: " + std::strerror(errno));
  Trace trace;
  trace.path = path;
  std::unordered_map<std::uint64_t, std::uint32_t> slots;  // id -> slot
  std::vector<std::uint8_t> freed;
  std::vector<char> buf(1 << 16);
  std::size_t line = 0;
  try {
    while (gzgets(file, buf.data(), static_cast<int>(buf.size()))) {
      ++line;
      const char* s = buf.data();
      if (line == 1 && static_cast<unsigned char>(s[0]) == 0x1f && static_cast<unsigned char>(s[1]) == 0x8b)
        malformed(path, line, "gzip data, but this build has no zlib: decompress the trace first");
      if (std::strlen(s) == buf.size() - 1 && s[buf.size() - 2] != '\n')
        malformed(path, line, "line longer than " + std::to_string(buf.size()) + " characters");
      if (*s == '#') {
        // "# key value key value ...": keep the two fields the replay reports.
        std::vector<std::string> words;
        for (const char* w = s + 1; *w;) {
          while (*w == ' ' || *w == '\t' || *w == '\n' || *w == '\r') ++w;
          const char* e = w;
          while (*e && *e != ' ' && *e != '\t' && *e != '\n' && *e != '\r') ++e;
          if (e > w) words.emplace_back(w, e);
          w = e;
        }
        for (std::size_t k = 0; k + 1 < words.size(); k += 2) {
          if (words[k] == "workload") trace.workload = words[k + 1];
          if (words[k] == "peak_live_bytes") trace.header_peak_live = std::strtoull(words[k + 1].c_str(), nullptr, 10);
        }
        continue;
      }
      if (at_end(s)) continue;
      char kind = *s;
      const char* p = s + 1;
      std::uint64_t id;
      if ((kind != 'a' && kind != 'f') || (*p != ' ' && *p != '\t'))
        malformed(path, line, "expected 'a <id> <bytes> <stream>' or 'f <id>', got '" +
                                  std::string(s, strcspn(s, "\r\n")) + "'");
      if (!parse_u64(p, &id)) malformed(path, line, "the id is not a non-negative integer");
      if (kind == 'a') {
        std::uint64_t bytes, stream;
        if (!parse_u64(p, &bytes)) malformed(path, line, "the size is not a non-negative integer");
        if (!parse_u64(p, &stream)) malformed(path, line, "the stream is not a non-negative integer");
        if (!at_end(p)) malformed(path, line, "unexpected text after the stream");
        if (bytes > kMaxRequest) malformed(path, line, "allocation of " + std::to_string(bytes) + " bytes is absurd");
        auto [it, inserted] = slots.emplace(id, static_cast<std::uint32_t>(slots.size()));
        if (!inserted) malformed(path, line, "id " + std::to_string(id) + " allocated twice");
        freed.push_back(0);
        trace.ops.push_back(TraceOp{it->second, true, bytes, static_cast<StreamId>(stream)});
        trace.allocations++;
      } else {
        if (!at_end(p)) malformed(path, line, "unexpected text after the id");
        auto it = slots.find(id);
        if (it == slots.end()) malformed(path, line, "free of id " + std::to_string(id) + " that was never allocated");
        if (freed[it->second]) malformed(path, line, "id " + std::to_string(id) + " freed twice");
        freed[it->second] = 1;
        trace.ops.push_back(TraceOp{it->second, false, 0, 0});
      }
    }
    int err = 0;
    const char* message = gzerror(file, &err);
    if (err != Z_OK && err != Z_STREAM_END) malformed(path, line + 1, std::string("cannot decompress: ") + message);
  } catch (...) {
    gzclose(file);
    throw;
  }
  gzclose(file);
  if (trace.ops.empty()) throw InvalidArgument(path + ": no allocations in the trace");
  return trace;
}

}  // namespace gpumem
