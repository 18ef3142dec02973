#include "config.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <vector>

namespace gpumem {

namespace {

std::string trim(const std::string& s) {
  auto b = s.find_first_not_of(" \t\n");
  auto e = s.find_last_not_of(" \t\n");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

bool parse_number(const std::string& text, double* out, std::string* rest) {
  const char* begin = text.c_str();
  char* end = nullptr;
  double v = std::strtod(begin, &end);
  if (end == begin || !std::isfinite(v)) return false;
  *out = v;
  *rest = trim(std::string(end));
  return true;
}

// true/false and their spellings 1/0, yes/no, on/off; false when `text` is none of them.
bool parse_flag(const std::string& text, bool* out) {
  const std::string v = lower(text);
  if (v == "1" || v == "true" || v == "yes" || v == "on") *out = true;
  else if (v == "0" || v == "false" || v == "no" || v == "off") *out = false;
  else return false;
  return true;
}

}  // namespace

std::string to_string(ReleasePolicy policy) {
  return policy == ReleasePolicy::kHighWater ? "high_water" : "lazy";
}

std::size_t parse_size(const std::string& text) {
  double v;
  std::string unit;
  if (!parse_number(trim(text), &v, &unit) || v < 0)
    throw InvalidArgument("'" + text + "' is not a size; expected bytes such as 8589934592, 8GiB, 512MiB");
  static const std::pair<const char*, double> units[] = {
      {"", 1},       {"b", 1},         {"kb", 1e3},   {"kib", 1024.0},      {"mb", 1e6},
      {"mib", 1048576.0}, {"gb", 1e9}, {"gib", 1073741824.0}, {"tb", 1e12}, {"tib", 1099511627776.0}};
  for (auto& [name, scale] : units) {
    if (lower(unit) == name) {
      double bytes = v * scale;
      if (bytes > static_cast<double>(kMaxRequest))
        throw InvalidArgument("'" + text + "' is larger than any device");
      return static_cast<std::size_t>(bytes);
    }
  }
  throw InvalidArgument("'" + text + "' has an unknown unit '" + unit +
                        "'; accepted units: B, KB, KiB, MB, MiB, GB, GiB, TB, TiB");
}

Config parse_config(const std::string& text, const std::string& source) {
  Config config;
  std::vector<std::string> items;
  for (std::size_t start = 0;;) {
    std::size_t comma = text.find(',', start);
    items.push_back(text.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  auto bad = [&](const std::string& key, const std::string& value, const std::string& accepted) {
    throw InvalidArgument(source + ": " + key + "='" + value + "' is not valid; accepted: " + accepted);
  };
  // The slacks: a fraction in [0, 1] (NaN and trailing text refused).
  auto fraction = [&](const std::string& key, const std::string& value, const std::string& example) {
    double f = 0;
    std::string rest;
    if (!parse_number(value, &f, &rest) || !rest.empty() || !(f >= 0 && f <= 1))
      bad(key, value, "a fraction in [0, 1] such as " + example);
    return f;
  };
  for (std::string item : items) {
    item = trim(item);
    if (item.empty()) continue;
    auto sep = item.find_first_of(":=");
    if (sep == std::string::npos)
      throw InvalidArgument(source + ": '" + item +
                            "' is not key:value; example: upstream:vmm,cap:0.9,release:high_water");
    std::string key = lower(trim(item.substr(0, sep)));
    std::string value = trim(item.substr(sep + 1));
    if (key == "upstream") {
      std::string v = lower(value);
      if (v != "auto" && v != "vmm" && v != "segments") bad(key, value, "auto, vmm, segments");
      config.upstream = v;
    } else if (key == "cap") {
      double f;
      std::string rest;
      const std::string accepted =
          "a fraction of device memory in (0, 1] (e.g. 0.9) or bytes (e.g. 40GiB, 42949672960), or 0 for none";
      if (value.find('.') != std::string::npos && parse_number(value, &f, &rest) && rest.empty()) {
        if (!(f > 0 && f <= 1)) bad(key, value, accepted);
        config.cap_fraction = f;
        config.cap_bytes = 0;
      } else {
        try {
          config.cap_bytes = parse_size(value);
        } catch (const InvalidArgument&) {
          bad(key, value, accepted);
        }
        config.cap_fraction = 0;
      }
    } else if (key == "release") {
      std::string v = lower(value);
      if (v == "lazy") config.release = ReleasePolicy::kLazy;
      else if (v == "high_water") config.release = ReleasePolicy::kHighWater;
      else bad(key, value, "lazy, high_water");
    } else if (key == "release_slack") {
      config.release_slack = fraction(key, value, "0.005");
    } else if (key == "stitch_slack") {
      config.stitch_slack = fraction(key, value, "0.01");
    } else if (key == "page_size") {
      std::size_t bytes = 0;
      try {
        bytes = parse_size(value);
      } catch (const InvalidArgument&) {
        bad(key, value, "a multiple of 2MiB such as 2MiB, 8MiB, 16MiB");
      }
      if (bytes == 0 || bytes % (2 * MiB) != 0 || bytes > 1 * GiB)
        bad(key, value, "a multiple of 2MiB such as 2MiB, 8MiB, 16MiB (at most 1GiB)");
      config.page_size = bytes;
    } else if (key == "gc_on_oom") {
      if (!parse_flag(value, &config.gc_on_oom)) bad(key, value, "true, false");
    } else if (key == "ipc") {
      if (!parse_flag(value, &config.ipc)) bad(key, value, "true, false");
    } else if (key == "stitch") {
      if (!parse_flag(value, &config.stitch)) bad(key, value, "true, false");
    } else if (key == "ends_by_page") {
      if (!parse_flag(value, &config.ends_by_page)) bad(key, value, "true, false");
    } else if (key == "early_ends_by_page") {
      config.early_ends_by_page = fraction(key, value, "0.1");
    } else if (key == "park_lent") {
      if (!parse_flag(value, &config.park_lent)) bad(key, value, "true, false");
    } else {
      throw InvalidArgument(source + ": unknown key '" + key +
                            "'; accepted keys: upstream, cap, release, release_slack, page_size, gc_on_oom, ipc, stitch, "
                            "stitch_slack, ends_by_page, early_ends_by_page, park_lent");
    }
  }
  return config;
}

}  // namespace gpumem
