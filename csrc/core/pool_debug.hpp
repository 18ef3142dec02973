// The validate-every-op check of debug builds, for the pool's own .cpp files. Configured with
// cmake -DGPUMEM_VALIDATE_EVERY_OP=ON, every public method of Pool that changes it states
// GPUMEM_VALIDATE_ON_RETURN() right after taking its lock: when the method leaves that scope, by
// returning or by throwing, the invariant checker runs with the lock still held. A violation after a
// normal return throws InvariantViolation from the call that caused it; after a throw (where a second
// exception would terminate anyway) it prints the violation and aborts. Otherwise the macro is nothing.
#pragma once

#include "pool.hpp"

#ifndef GPUMEM_VALIDATE_EVERY_OP
#define GPUMEM_VALIDATE_EVERY_OP 0
#endif

namespace gpumem {

class Pool::ValidateOnReturn {
 public:
  explicit ValidateOnReturn(const Pool& pool);
  ~ValidateOnReturn() noexcept(false);
  ValidateOnReturn(const ValidateOnReturn&) = delete;
  ValidateOnReturn& operator=(const ValidateOnReturn&) = delete;

 private:
  const Pool& pool_;
  int exceptions_;  // std::uncaught_exceptions() on entry: more on exit means the method is throwing
};

}  // namespace gpumem

#if GPUMEM_VALIDATE_EVERY_OP
#define GPUMEM_VALIDATE_ON_RETURN() ::gpumem::Pool::ValidateOnReturn gpumem_validate_on_return_(*this)
#else
#define GPUMEM_VALIDATE_ON_RETURN() static_cast<void>(0)
#endif
