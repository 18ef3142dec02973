// config_tests: the configuration string (config.hpp): sizes with and without units, every key's
// accepted and refused values, and refusals that name the source, the key and what is accepted.
#include <string>

#include "core/config.hpp"
#include "core/errors.hpp"
#include "harness.hpp"

using namespace gpumem;

TEST(sizes_with_and_without_units) {
  CHECK_EQ(parse_size("512"), std::size_t(512));
  CHECK_EQ(parse_size("0"), std::size_t(0));
  CHECK_EQ(parse_size("64KiB"), std::size_t(64 * KiB));
  CHECK_EQ(parse_size("64kb"), std::size_t(64000));
  CHECK_EQ(parse_size("1.5 GB"), std::size_t(1500000000));
  CHECK_EQ(parse_size(" 8gib "), std::size_t(8 * GiB));
  CHECK_EQ(parse_size("2MiB"), std::size_t(2 * MiB));
  CHECK_EQ(parse_size("1TiB"), std::size_t(1024) * GiB);
  CHECK_EQ(parse_size("7 b"), std::size_t(7));
  CHECK_EQ(parse_size("256TiB"), kMaxRequest);  // exactly the largest request
}

TEST(sizes_that_are_refused) {
  CHECK_THROWS_WITH(parse_size(""), InvalidArgument, "is not a size");
  CHECK_THROWS_WITH(parse_size("-1"), InvalidArgument, "is not a size");
  CHECK_THROWS_WITH(parse_size("GiB"), InvalidArgument, "is not a size");
  CHECK_THROWS_WITH(parse_size("nan"), InvalidArgument, "is not a size");
  CHECK_THROWS_WITH(parse_size("5 parsecs"), InvalidArgument, "unknown unit 'parsecs'");
  CHECK_THROWS_WITH(parse_size("257TiB"), InvalidArgument, "larger than any device");
  CHECK_THROWS_WITH(parse_size("1e30"), InvalidArgument, "larger than any device");
}

TEST(defaults_and_every_key) {
  const Config d = parse_config("");
  CHECK_EQ(d.upstream, std::string("auto"));
  CHECK_EQ(d.cap_bytes, std::size_t(0));
  CHECK_EQ(d.cap_fraction, 0.0);
  CHECK(d.release == ReleasePolicy::kLazy);
  CHECK_EQ(d.page_size, kDefaultPageSize);
  CHECK(!d.gc_on_oom);  // off by default, as PyTorch's allocator
  const Config c = parse_config(" upstream:VMM , cap:0.9,release=high_water,,release_slack:0.01,page_size:16MiB,gc_on_oom:on");
  CHECK_EQ(c.upstream, std::string("vmm"));
  CHECK_EQ(c.cap_fraction, 0.9);
  CHECK_EQ(c.cap_bytes, std::size_t(0));
  CHECK(c.release == ReleasePolicy::kHighWater);
  CHECK_EQ(c.release_slack, 0.01);
  CHECK_EQ(c.page_size, 16 * MiB);
  CHECK(c.gc_on_oom);
  CHECK_EQ(to_string(c.release), std::string("high_water"));
  CHECK_EQ(to_string(ReleasePolicy::kLazy), std::string("lazy"));
}

TEST(the_cap_is_a_fraction_or_bytes_and_the_last_one_wins) {
  const Config bytes = parse_config("cap:0.5,cap:40GiB");
  CHECK_EQ(bytes.cap_bytes, 40 * GiB);
  CHECK_EQ(bytes.cap_fraction, 0.0);
  const Config fraction = parse_config("cap:40GiB,cap:1.0");
  CHECK_EQ(fraction.cap_fraction, 1.0);
  CHECK_EQ(fraction.cap_bytes, std::size_t(0));
  CHECK_EQ(parse_config("cap:0").cap_bytes, std::size_t(0));
  CHECK_EQ(parse_config("cap:42949672960").cap_bytes, 40 * GiB);
  CHECK_THROWS_WITH(parse_config("cap:1.5"), InvalidArgument, "cap='1.5' is not valid; accepted: a fraction");
  CHECK_THROWS_WITH(parse_config("cap:0.0"), InvalidArgument, "cap='0.0' is not valid");
  CHECK_THROWS_WITH(parse_config("cap:lots"), InvalidArgument, "cap='lots' is not valid");
}

TEST(refusals_name_the_source_the_key_and_what_is_accepted) {
  CHECK_THROWS_WITH(parse_config("upstream:cuda"), InvalidArgument,
                    "GPUMEM_CONF: upstream='cuda' is not valid; accepted: auto, vmm, segments");
  CHECK_THROWS_WITH(parse_config("release:eager", "my.conf"), InvalidArgument,
                    "my.conf: release='eager' is not valid; accepted: lazy, high_water");
  CHECK_THROWS_WITH(parse_config("release_slack:2"), InvalidArgument, "release_slack='2' is not valid");
  CHECK_THROWS_WITH(parse_config("release_slack:0.1x"), InvalidArgument, "release_slack='0.1x'");
  CHECK_THROWS_WITH(parse_config("page_size:3MiB"), InvalidArgument, "page_size='3MiB' is not valid");
  CHECK_THROWS_WITH(parse_config("page_size:0"), InvalidArgument, "page_size='0'");
  CHECK_THROWS_WITH(parse_config("page_size:2GiB"), InvalidArgument, "(at most 1GiB)");
  CHECK_THROWS_WITH(parse_config("page_size:big"), InvalidArgument, "a multiple of 2MiB");
  CHECK_THROWS_WITH(parse_config("gc_on_oom:maybe"), InvalidArgument, "accepted: true, false");
  CHECK_THROWS_WITH(parse_config("colour:blue"), InvalidArgument,
                    "GPUMEM_CONF: unknown key 'colour'; accepted keys: upstream, cap, release");
  CHECK_THROWS_WITH(parse_config("upstream"), InvalidArgument, "'upstream' is not key:value");
  CHECK_EQ(parse_config("page_size:1GiB").page_size, 1 * GiB);
  CHECK(parse_config("gc_on_oom:YES").gc_on_oom);
}
