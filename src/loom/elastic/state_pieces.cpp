#include "loom/elastic/state_pieces.h"

#include <c10/util/StringUtil.h>

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "loom/checkpoint/group.h"
#include "loom/checkpoint/region.h"

namespace loom::elastic {

namespace {

nlohmann::json region_json(const checkpoint::Region& r) {
  return {{"box_offsets", r.box_offsets}, {"box_sizes", r.box_sizes}, {"begin", r.begin}, {"end", r.end}};
}

checkpoint::Region region_of(const nlohmann::json& j) {
  checkpoint::Region r;
  r.box_offsets = j.at("box_offsets").get<std::vector<int64_t>>();
  r.box_sizes = j.at("box_sizes").get<std::vector<int64_t>>();
  r.begin = j.at("begin").get<int64_t>();
  r.end = j.at("end").get<int64_t>();
  return r;
}

// A chunk's elements as host bytes (a copy when the chunk is elsewhere or strided).
torch::Tensor chunk_bytes(const torch::Tensor& data) {
  torch::Tensor host = data.detach().reshape({-1}).to(torch::kCPU).contiguous();
  return host.view(torch::kUInt8);
}

}  // namespace

nlohmann::json describe_pieces(const checkpoint::ShardedStateDict& state) {
  nlohmann::json meta = nlohmann::json::array();
  int64_t offset = 0;
  for (const auto& [name, t] : state.tensors()) {
    nlohmann::json chunks = nlohmann::json::array();
    const int64_t element = static_cast<int64_t>(c10::elementSize(t.dtype));
    for (const auto& c : t.chunks) {
      nlohmann::json j = region_json(c.region());
      j["offset"] = offset;
      chunks.push_back(std::move(j));
      offset += c.data.numel() * element;
    }
    meta.push_back({{"name", name},
                    {"shape", t.shape},
                    {"dtype", static_cast<int>(t.dtype)},
                    {"element", element},
                    {"chunks", std::move(chunks)}});
  }
  return meta;
}

int64_t pieces_bytes(const nlohmann::json& meta) {
  int64_t total = 0;
  for (const auto& t : meta) {
    const int64_t element = t.at("element").get<int64_t>();
    for (const auto& c : t.at("chunks")) total += (c.at("end").get<int64_t>() - c.at("begin").get<int64_t>()) * element;
  }
  return total;
}

void copy_pieces(const checkpoint::ShardedStateDict& state, const nlohmann::json& meta, torch::Tensor& bytes) {
  size_t index = 0;
  for (const auto& [name, t] : state.tensors()) {
    const auto& m = meta.at(index++);
    LOOM_REQUIRE(m.at("name").get<std::string>() == name, "elastic: state changed shape between steps (",
                 name, ")");
    for (size_t i = 0; i < t.chunks.size(); ++i) {
      const torch::Tensor src = chunk_bytes(t.chunks[i].data);
      const int64_t offset = m.at("chunks").at(i).at("offset").get<int64_t>();
      bytes.narrow(0, offset, src.numel()).copy_(src);
    }
  }
}

PieceSet take_pieces(const checkpoint::ShardedStateDict& state, int64_t generation, int64_t rank,
                     int64_t step) {
  PieceSet set;
  set.generation = generation;
  set.rank = rank;
  set.step = step;
  set.meta = describe_pieces(state);
  set.json = state.json();
  set.rank_json = state.rank_json();
  set.bytes = torch::empty({pieces_bytes(set.meta)}, torch::kUInt8);
  copy_pieces(state, set.meta, set.bytes);
  return set;
}

ShardReplicator::ShardReplicator(std::shared_ptr<distributed::Comm> group, int64_t generation,
                                 std::vector<int64_t> world_ranks)
    : group_(std::move(group)), generation_(generation), world_ranks_(std::move(world_ranks)) {
  LOOM_REQUIRE(group_ && group_->size() >= 2, "elastic: a neighbour copy needs a ring of 2 or more ranks");
}

void ShardReplicator::replicate(const checkpoint::ShardedStateDict& state, int64_t step, PieceSet& replica) {
  const int size = group_->size();
  const int me = group_->rank();
  const int prev = (me + size - 1) % size;
  if (!send_.defined()) {
    // The pieces' layout is fixed for a membership: exchanged once.
    meta_ = describe_pieces(state);
    const auto metas = checkpoint::comm_group(group_)->all_gather(meta_.dump());
    prev_meta_ = nlohmann::json::parse(metas.at(static_cast<size_t>(prev)));
    send_ = torch::empty({pieces_bytes(meta_)}, torch::kUInt8);
    receive_ = torch::empty({pieces_bytes(prev_meta_)}, torch::kUInt8);
  }
  copy_pieces(state, meta_, send_);
  distributed::RingStep ring = distributed::ring_step(*group_, send_, receive_, tag_);
  ring.wait();
  // Complete: it replaces the previous copy (swap the buffers, so neither is reallocated).
  replica.generation = generation_;
  replica.rank = world_ranks_.at(static_cast<size_t>(prev));
  replica.step = step;
  replica.meta = prev_meta_;
  replica.json = state.json();
  replica.rank_json = nlohmann::json::object();
  if (!replica.bytes.defined() || replica.bytes.numel() != receive_.numel()) {
    replica.bytes = receive_.clone();
  } else {
    std::swap(replica.bytes, receive_);
  }
}

int64_t restore_state(const std::shared_ptr<distributed::Comm>& world, const std::vector<const PieceSet*>& held,
                      checkpoint::ShardedStateDict& target) {
  // 1. What every member holds.
  nlohmann::json mine = nlohmann::json::array();
  for (const PieceSet* s : held) {
    if (!s || !s->valid()) continue;
    mine.push_back({{"generation", s->generation}, {"rank", s->rank}, {"step", s->step}, {"meta", s->meta},
                    {"json", s->json}});
  }
  const auto gathered = checkpoint::comm_group(world)->all_gather(mine.dump());
  struct Held {
    int member;       // new rank
    size_t index;     // in that member's list
    int64_t old_rank;
    int64_t step;
    const nlohmann::json* meta;
    const nlohmann::json* json;
  };
  std::vector<nlohmann::json> lists;
  for (const auto& g : gathered) lists.push_back(nlohmann::json::parse(g));
  int64_t newest = -1;
  for (const auto& l : lists) {
    for (const auto& s : l) newest = std::max(newest, s.at("generation").get<int64_t>());
  }
  LOOM_REQUIRE(newest >= 0, "elastic: no member holds any training state to continue from");
  std::vector<Held> sets;
  for (size_t m = 0; m < lists.size(); ++m) {
    for (size_t i = 0; i < lists[m].size(); ++i) {
      const auto& s = lists[m][i];
      if (s.at("generation").get<int64_t>() != newest) continue;
      sets.push_back({static_cast<int>(m), i, s.at("rank").get<int64_t>(), s.at("step").get<int64_t>(),
                      &s.at("meta"), &s.at("json")});
    }
  }
  // The lowest old rank first; a member's own pieces before another's copy of them.
  std::sort(sets.begin(), sets.end(), [](const Held& a, const Held& b) {
    return std::tie(a.old_rank, a.member, a.index) < std::tie(b.old_rank, b.member, b.index);
  });
  // 2. Who provides each region of each tensor.
  struct Source {
    const Held* set;
    checkpoint::Region region;
    int64_t offset;
  };
  std::map<std::string, std::vector<Source>> sources;
  std::set<int64_t> steps_used;
  std::map<std::string, std::set<checkpoint::Region>> seen;
  for (const Held& h : sets) {
    bool used = false;
    for (const auto& t : *h.meta) {
      const std::string name = t.at("name").get<std::string>();
      for (const auto& c : t.at("chunks")) {
        checkpoint::Region r = region_of(c);
        if (!seen[name].insert(r).second) continue;  // a replica's equal copy
        sources[name].push_back({&h, r, c.at("offset").get<int64_t>()});
        used = true;
      }
    }
    if (used) steps_used.insert(h.step);
  }
  if (steps_used.size() > 1) {
    throw StateLost(c10::str("the surviving copies of the training state are of different steps (",
                             *steps_used.begin(), " and ", *steps_used.rbegin(),
                             "): a rank died between applying a step and copying it to its neighbour"));
  }
  const int64_t step = steps_used.empty() ? -1 : *steps_used.begin();
  const int me = world->rank();
  const PieceSet* own_step_set = nullptr;
  for (const PieceSet* s : held) {
    if (s && s->valid() && s->generation == newest) own_step_set = s;
  }
  // 3. Tensor by tensor: the providers write their regions into a zeroed buffer, a sum over the
  // members assembles it (exact: every byte has one writer), and each member reads its own regions.
  for (const auto& [name, t] : target.tensors()) {
    auto it = sources.find(name);
    const int64_t element = static_cast<int64_t>(c10::elementSize(t.dtype));
    int64_t covered = 0;
    if (it != sources.end()) {
      for (const Source& s : it->second) covered += s.region.numel();
    }
    if (covered != t.numel()) {
      throw StateLost(c10::str("no surviving copy holds all of '", name, "' (", covered, " of ", t.numel(),
                               " elements): the ranks that held the rest, and their neighbours' copies, are gone"));
    }
    torch::Tensor full = torch::zeros({t.numel() * element}, torch::kUInt8);
    for (const Source& s : it->second) {
      if (s.set->member != me) continue;
      const PieceSet* mine_set = nullptr;
      size_t k = 0;
      for (const PieceSet* p : held) {
        if (!p || !p->valid()) continue;
        if (k++ == s.set->index) mine_set = p;
      }
      LOOM_REQUIRE(mine_set != nullptr, "elastic: lost track of a held piece set");
      for (const checkpoint::Run& run : checkpoint::runs_of(t.shape, s.region)) {
        full.narrow(0, run.global * element, run.length * element)
            .copy_(mine_set->bytes.narrow(0, s.offset + run.local * element, run.length * element));
      }
    }
    if (world->size() > 1) world->all_reduce(full, distributed::ReduceOp::kSum);
    for (const auto& c : t.chunks) {
      torch::Tensor local = torch::empty({c.data.numel() * element}, torch::kUInt8);
      for (const checkpoint::Run& run : checkpoint::runs_of(t.shape, c.region())) {
        local.narrow(0, run.local * element, run.length * element)
            .copy_(full.narrow(0, run.global * element, run.length * element));
      }
      c.data.copy_(local.view(t.dtype).view(c.data.sizes()));
    }
  }
  // 4. The JSON state of that step (every holder has the same), and this rank's own per-rank part.
  for (const Held& h : sets) {
    if (h.step != step) continue;
    target.json() = *h.json;
    break;
  }
  target.json()["step"] = step;
  if (own_step_set && own_step_set->step == step) target.rank_json() = own_step_set->rank_json;
  return step;
}

}  // namespace loom::elastic
