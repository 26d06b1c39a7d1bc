#include "loom/layouts/activations.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <tuple>

#include "loom/checkpoint/safetensors.h"
#include "loom/core/error.h"
#include "loom/cp/ring_attention.h"

namespace loom::layouts {
namespace fs = std::filesystem;

int64_t row_start(const ActivationGeometry& g, int64_t call, int64_t rows) {
  const int64_t batch = call / g.microbatches;
  const int64_t micro = call % g.microbatches;
  return batch * g.local_batch * g.dp_degree + g.dp_rank * g.local_batch + micro * rows;
}

std::optional<Segments> sequence_segments(const ActivationGeometry& g, int64_t local_len, bool& replicated) {
  // The context-parallel piece of each row: chunks i and 2c-1-i, early one first.
  Segments cp_piece;
  if (g.cp_degree == 1) {
    cp_piece = {{0, g.seq_len}};
  } else {
    const int64_t chunk = g.seq_len / (2 * g.cp_degree);
    for (int64_t c : cp::chunk_ids(g.cp_rank, g.cp_degree)) cp_piece.emplace_back(c * chunk, chunk);
  }
  const int64_t piece_len = g.seq_len / g.cp_degree;
  replicated = false;
  if (local_len == piece_len) {
    replicated = g.tp_degree > 1;
    return cp_piece;
  }
  if (g.tp_degree == 1 || local_len * g.tp_degree != piece_len) return std::nullopt;
  // Sequence parallel: positions [tp_rank L, (tp_rank + 1) L) of the context-parallel piece.
  int64_t skip = g.tp_rank * local_len, want = local_len;
  Segments out;
  for (const auto& [start, len] : cp_piece) {
    if (skip >= len) {
      skip -= len;
      continue;
    }
    const int64_t take = std::min(len - skip, want);
    out.emplace_back(start + skip, take);
    want -= take;
    skip = 0;
    if (want == 0) break;
  }
  return out;
}

bool recorded_module(const std::string& name) {
  std::vector<std::string> parts;
  for (size_t begin = 0;;) {
    const size_t dot = name.find('.', begin);
    parts.push_back(name.substr(begin, dot == std::string::npos ? std::string::npos : dot - begin));
    if (dot == std::string::npos) break;
    begin = dot + 1;
  }
  if (name.empty()) return false;
  if (parts.size() == 1) return parts[0] != "layers" && parts[0] != "output";
  if (parts[0] != "layers") return false;
  if (parts.size() == 2) return true;
  return parts.size() == 3 && parts[2].find("norm") == std::string::npos;
}

ActivationRecorder::ActivationRecorder(const std::vector<std::shared_ptr<nn::Module>>& parts,
                                       ActivationGeometry geometry)
    : geometry_(geometry),
      pieces_(std::make_shared<std::vector<ActivationPiece>>()),
      unplaced_(std::make_shared<std::vector<std::string>>()),
      calls_(std::make_shared<std::map<std::string, int64_t>>()) {
  for (const auto& part : parts) {
    int64_t index = -1;
    for (const auto& [name, module] : part->named_modules()) {
      ++index;
      if (!recorded_module(name)) continue;
      auto hook = [g = geometry_, name = name, pieces = pieces_, unplaced = unplaced_, calls = calls_,
                   at = index](nn::Module&, torch::Tensor, torch::Tensor out) {
        // Only a forward that builds the graph: not validation, not activation checkpointing's
        // first pass (its recompute in backward records the same values).
        if (!torch::GradMode::is_enabled() || !out.defined() || out.dim() < 3 || !out.requires_grad()) return out;
        const int64_t call = (*calls)[name]++;
        bool replicated = false;
        const std::optional<Segments> segments = sequence_segments(g, out.size(1), replicated);
        if (!segments) {
          if (std::find(unplaced->begin(), unplaced->end(), name) == unplaced->end()) unplaced->push_back(name);
          return out;
        }
        if (replicated && g.tp_rank != 0) return out;
        const int64_t row = row_start(g, call, out.size(0));
        pieces->push_back({name, "output", at, row, *segments, out.detach().to(torch::kFloat32).cpu().clone()});
        // The rank's loss is the mean over its own tokens: 1 / (dp x cp) of the global mean's gradient.
        const double scale = 1.0 / static_cast<double>(g.dp_degree * g.cp_degree);
        out.register_hook([name, at, row, segments = *segments, pieces, scale](const torch::Tensor& grad) {
          pieces->push_back({name, "grad", at, row, segments, grad.detach().to(torch::kFloat32).cpu() * scale});
        });
        return out;
      };
      handles_.push_back(module->add_forward_post_hook(hook, nn::HookKind::kStateOnly));
    }
  }
}

ActivationRecorder::~ActivationRecorder() { remove_hooks(); }

void ActivationRecorder::remove_hooks() {
  for (auto& h : handles_) h.remove();
  handles_.clear();
}

void ActivationRecorder::write(const fs::path& file) const {
  checkpoint::NamedTensors tensors;
  nlohmann::json meta = nlohmann::json::array();
  for (const ActivationPiece& p : *pieces_) {
    nlohmann::json segments = nlohmann::json::array();
    for (const auto& [start, len] : p.segments) segments.push_back({start, len});
    meta.push_back({{"module", p.module}, {"kind", p.kind}, {"order", p.order}, {"row", p.row},
                    {"segments", segments}});
    tensors.emplace_back(std::to_string(tensors.size()), p.data.contiguous());
  }
  fs::create_directories(file.parent_path());
  checkpoint::save_safetensors(file, tensors, {{"pieces", meta.dump()}, {"unplaced", nlohmann::json(*unplaced_).dump()}});
}

std::vector<ActivationPiece> read_pieces(const fs::path& dir) {
  std::vector<ActivationPiece> out;
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("rank-", 0) == 0 && entry.path().extension() == ".safetensors") files.push_back(entry.path());
  }
  LOOM_REQUIRE(!files.empty(), "no recorded activations (rank-*.safetensors) in ", dir);
  std::sort(files.begin(), files.end());
  for (const fs::path& path : files) {
    const checkpoint::SafetensorsFile file(path);
    const auto it = file.metadata().find("pieces");
    LOOM_REQUIRE(it != file.metadata().end(), path, " lacks its pieces' metadata");
    const nlohmann::json meta = nlohmann::json::parse(it->second);
    for (size_t i = 0; i < meta.size(); ++i) {
      ActivationPiece p;
      p.module = meta[i].at("module").get<std::string>();
      p.kind = meta[i].at("kind").get<std::string>();
      p.order = meta[i].at("order").get<int64_t>();
      p.row = meta[i].at("row").get<int64_t>();
      for (const auto& s : meta[i].at("segments")) p.segments.emplace_back(s.at(0).get<int64_t>(), s.at(1).get<int64_t>());
      p.data = file.tensor(std::to_string(i));
      out.push_back(std::move(p));
    }
  }
  return out;
}

namespace {

// Where a module's forward finishes: the embedding, then the blocks by number (inside a block its
// children in registration order, `order`, then the block itself), then what follows the blocks.
// From the names, not from when the hooks fired: activation checkpointing records a block's
// children in its backward, and a pipeline's stages are separate processes.
std::tuple<int, int64_t, int, int64_t> forward_position(const std::string& module, int64_t order) {
  if (module.rfind("layers.", 0) == 0) {
    const std::string rest = module.substr(7);
    int64_t layer = -1;
    try {
      layer = std::stoll(rest.substr(0, rest.find('.')));
    } catch (const std::exception&) {
    }
    const bool block = rest.find('.') == std::string::npos;
    return {1, layer, block ? 1 : 0, order};
  }
  return {module == "tok_embeddings" ? 0 : 2, 0, 0, order};
}

}  // namespace

StepActivations assemble(const std::vector<ActivationPiece>& pieces, int64_t rows, int64_t seq_len,
                         std::vector<std::string>* incomplete) {
  std::map<std::pair<std::string, std::string>, std::vector<const ActivationPiece*>> by_tensor;
  std::map<std::string, int64_t> first_order;
  for (const ActivationPiece& p : pieces) {
    by_tensor[{p.kind, p.module}].push_back(&p);
    if (p.kind == "output") {
      auto [it, fresh] = first_order.emplace(p.module, p.order);
      if (!fresh) it->second = std::min(it->second, p.order);
    }
  }
  StepActivations out;
  std::set<std::string> left_out;
  for (const auto& [key, list] : by_tensor) {
    const auto& [kind, module] = key;
    std::vector<int64_t> shape = {rows, seq_len};
    const auto trailing = list.front()->data.sizes().slice(2);
    shape.insert(shape.end(), trailing.begin(), trailing.end());
    torch::Tensor whole = torch::zeros(shape, torch::kFloat32);
    torch::Tensor covered = torch::zeros({rows, seq_len}, torch::kBool);
    bool fits = true;
    for (const ActivationPiece* p : list) {
      const torch::Tensor& d = p->data;
      if (d.dim() != static_cast<int64_t>(shape.size()) || d.sizes().slice(2) != trailing || p->row < 0 ||
          p->row + d.size(0) > rows) {
        fits = false;
        break;
      }
      int64_t offset = 0;
      for (const auto& [start, len] : p->segments) {
        if (start < 0 || start + len > seq_len || offset + len > d.size(1)) {
          fits = false;
          break;
        }
        whole.narrow(0, p->row, d.size(0)).narrow(1, start, len).copy_(d.narrow(1, offset, len));
        covered.narrow(0, p->row, d.size(0)).narrow(1, start, len).fill_(true);
        offset += len;
      }
      if (!fits) break;
    }
    if (!fits || !covered.all().item<bool>()) {
      left_out.insert(module);
      continue;
    }
    (kind == "output" ? out.outputs : out.grads)[module] = whole;
  }
  for (const std::string& m : left_out) {
    out.outputs.erase(m);
    out.grads.erase(m);
    if (incomplete) incomplete->push_back(m);
  }
  std::vector<std::string> modules;
  for (const auto& [m, o] : out.outputs) modules.push_back(m);
  std::sort(modules.begin(), modules.end(), [&](const std::string& a, const std::string& b) {
    return forward_position(a, first_order.at(a)) < forward_position(b, first_order.at(b));
  });
  out.order = modules;
  return out;
}

}  // namespace loom::layouts
