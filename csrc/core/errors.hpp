// Errors the core throws. Each message says what was asked, what was there, and what to do next.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

namespace gpumem {

// A request the pool could not satisfy even after releasing its cache and running the OOM callbacks.
class OutOfMemoryError : public std::runtime_error {
 public:
  OutOfMemoryError(const std::string& message, std::size_t requested_bytes, std::size_t allocated_bytes,
                   std::size_t reserved_bytes, std::size_t cap_bytes, std::size_t largest_free_block)
      : std::runtime_error(message),
        requested(requested_bytes), allocated(allocated_bytes), reserved(reserved_bytes), cap(cap_bytes),
        largest_free(largest_free_block) {}
  std::size_t requested, allocated, reserved, cap, largest_free;
};

// A call that is wrong whatever the state of memory: bad sizes, double or foreign frees, bad config.
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// An upstream (CUDA driver/runtime) failure that is not running out of memory.
class UpstreamError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The invariant checker found the pool's structures inconsistent: always a gpumem bug.
class InvariantViolation : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

}  // namespace gpumem
