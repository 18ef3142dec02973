#include "upstream.hpp"

#include "errors.hpp"

namespace gpumem {

// Default bodies for the calls of the other kind: reaching one is a gpumem bug, so say so loudly.
static void wrong_kind(const Upstream& u, const char* call) {
  throw UpstreamError("upstream '" + u.name() + "' does not support " + call);
}

std::uintptr_t Upstream::allocate_segment(std::size_t) { wrong_kind(*this, "allocate_segment"); return 0; }
void Upstream::free_segment(std::uintptr_t, std::size_t) { wrong_kind(*this, "free_segment"); }
std::uintptr_t Upstream::reserve_address_range(std::size_t) { wrong_kind(*this, "reserve_address_range"); return 0; }
void Upstream::release_address_range(std::uintptr_t, std::size_t) { wrong_kind(*this, "release_address_range"); }
bool Upstream::map(std::uintptr_t, std::size_t, std::size_t) { wrong_kind(*this, "map"); return false; }
void Upstream::unmap(std::uintptr_t, std::size_t, std::size_t) { wrong_kind(*this, "unmap"); }
std::vector<int> Upstream::export_pages(std::uintptr_t, std::size_t, std::size_t) {
  throw UpstreamError("upstream '" + name() + "' cannot export its memory to another process");
}

}  // namespace gpumem
