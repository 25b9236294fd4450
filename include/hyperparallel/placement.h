#pragma once
// How one parameter is laid out over the shard dimension of the mesh.

#include <cstdint>
#include <string>

namespace hp {

class Placement {
 public:
  // Split along `dim` (negative counts from the end) into equal chunks; the last
  // ranks may hold padding only.
  static Placement shard(int64_t dim) { return Placement(false, dim); }
  // Every rank holds the whole tensor; its gradient is all-reduced over the data-parallel
  // ranks (shard x replicate).
  static Placement replicate() { return Placement(true, 0); }

  bool is_shard() const { return !replicate_; }
  bool is_replicate() const { return replicate_; }
  int64_t dim() const { return dim_; }  // only meaningful for shard placements
  std::string str() const {
    return is_shard() ? "Shard(" + std::to_string(dim_) + ")" : "Replicate()";
  }
  bool operator==(const Placement&) const = default;

 private:
  Placement(bool replicate, int64_t dim) : replicate_(replicate), dim_(dim) {}
  bool replicate_;
  int64_t dim_;
};

}  // namespace hp
