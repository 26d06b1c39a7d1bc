#include "loom/elastic/generation.h"

#include <c10/util/StringUtil.h>

#include <algorithm>
#include <map>

#include "loom/core/error.h"

namespace loom::elastic {

int64_t world_rank(const BaseLayout& base, int64_t replicas, int64_t pp_index, int64_t dp_index,
                   int64_t cp_index, int64_t tp_index) {
  return ((pp_index * replicas + dp_index) * base.cp + cp_index) * base.tp + tp_index;
}

int64_t model_parallel_index(const BaseLayout& base, int64_t replicas, int64_t rank) {
  const int64_t tp_index = rank % base.tp;
  const int64_t cp_index = (rank / base.tp) % base.cp;
  const int64_t pp_index = rank / (base.tp * base.cp * replicas);
  return (pp_index * base.cp + cp_index) * base.tp + tp_index;
}

int64_t data_parallel_index(const BaseLayout& base, int64_t replicas, int64_t rank) {
  return (rank / (base.tp * base.cp)) % replicas;
}

std::string GenerationLayout::describe() const {
  std::string out = c10::str(trainers.size(), " rank(s) training (dp_replicate ", dp_replicate,
                             " x dp_shard ", dp_shard, ", ", local_batch_size, " row(s) per micro-batch)");
  if (!spares.empty()) out += c10::str(", ", spares.size(), " waiting");
  return out;
}

GenerationLayout plan_generation(const BaseLayout& base, const GenerationLayout& previous,
                                 const std::vector<int64_t>& members) {
  const int64_t mp = base.model_parallel();
  // The replicas that come through whole, each as its members in model-parallel order.
  std::vector<std::vector<int64_t>> replicas;
  std::vector<int64_t> loose;  // members of no whole replica, in member order
  std::vector<bool> placed(members.size(), false);
  if (!previous.trainers.empty()) {
    const int64_t old_replicas = previous.replicas();
    std::map<int64_t, std::vector<int64_t>> by_replica;  // data-parallel index -> [mp index] member
    for (int64_t rank = 0; rank < static_cast<int64_t>(previous.trainers.size()); ++rank) {
      auto& slots = by_replica[data_parallel_index(base, old_replicas, rank)];
      slots.resize(static_cast<size_t>(mp), -1);
      slots[static_cast<size_t>(model_parallel_index(base, old_replicas, rank))] =
          previous.trainers[static_cast<size_t>(rank)];
    }
    for (auto& [index, slots] : by_replica) {
      bool whole = true;
      for (int64_t id : slots) {
        whole = whole && std::find(members.begin(), members.end(), id) != members.end();
      }
      if (!whole) continue;
      replicas.push_back(slots);
      for (int64_t id : slots) {
        placed[static_cast<size_t>(std::find(members.begin(), members.end(), id) - members.begin())] = true;
      }
    }
  }
  for (size_t i = 0; i < members.size(); ++i) {
    if (!placed[i]) loose.push_back(members[i]);
  }
  for (size_t i = 0; i + static_cast<size_t>(mp) <= loose.size(); i += static_cast<size_t>(mp)) {
    replicas.emplace_back(loose.begin() + static_cast<std::ptrdiff_t>(i),
                          loose.begin() + static_cast<std::ptrdiff_t>(i + static_cast<size_t>(mp)));
  }
  const size_t in_new = loose.size() / static_cast<size_t>(mp) * static_cast<size_t>(mp);
  GenerationLayout out;
  out.spares.assign(loose.begin() + static_cast<std::ptrdiff_t>(in_new), loose.end());
  // As many replicas as divide the global batch (the first generation has them all).
  int64_t count = std::min<int64_t>(static_cast<int64_t>(replicas.size()), base.replicas());
  while (count > 0 && base.global_batch_size % count != 0) --count;
  for (size_t i = static_cast<size_t>(std::max<int64_t>(count, 0)); i < replicas.size(); ++i) {
    out.spares.insert(out.spares.end(), replicas[i].begin(), replicas[i].end());
  }
  if (count <= 0) {
    out.spares.clear();
    out.spares = members;
    return out;
  }
  replicas.resize(static_cast<size_t>(count));
  out.dp_replicate = count % base.dp_replicate == 0 ? base.dp_replicate : 1;
  out.dp_shard = count / out.dp_replicate;
  if (count == base.replicas()) {
    out.dp_replicate = base.dp_replicate;
    out.dp_shard = base.dp_shard;
  }
  // The same global batch: rows per replica, in the largest micro-batch that divides them and is
  // no larger than the configured one.
  const int64_t rows = base.global_batch_size / count;
  out.local_batch_size = std::min(base.local_batch_size, rows);
  while (rows % out.local_batch_size != 0) --out.local_batch_size;
  // World ranks in mesh order.
  out.trainers.assign(static_cast<size_t>(count * mp), -1);
  for (int64_t d = 0; d < count; ++d) {
    for (int64_t q = 0; q < mp; ++q) {
      const int64_t tp_index = q % base.tp;
      const int64_t cp_index = (q / base.tp) % base.cp;
      const int64_t pp_index = q / (base.tp * base.cp);
      out.trainers[static_cast<size_t>(world_rank(base, count, pp_index, d, cp_index, tp_index))] =
          replicas[static_cast<size_t>(d)][static_cast<size_t>(q)];
    }
  }
  return out;
}

}  // namespace loom::elastic
