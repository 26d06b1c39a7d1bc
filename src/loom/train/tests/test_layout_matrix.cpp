// The layout matrix (issue 45): every pair of the parallelisms Loom composes -- FSDP, HSDP, TP with
// sequence parallel, async TP, CP, PP with 1F1B, Interleaved1F1B, ZBVZeroBubble and DualPipeV, EP
// -- that the compatibility table accepts, plus the triples TorchTitan's recipes use (FSDP x TP x
// PP, FSDP x CP x TP, EP x FSDP x PP), each trained against one process on the same data, seed
// and global batch, comparing every step's loss AND gradient norm with clipping engaged
// (layout_runs.h: training.max_norm below the tiny models' norms; the harness checks that the
// reference clipped on at least half its steps). A wrong norm reduction -- the PP x TP bug this
// matrix was made for, where the losses agreed for four steps -- fails at step 1.
//
// Each cell also carries one feature that must compose with both of its parallelisms: gradient
// accumulation, full or selective activation checkpointing, LoRA, Float8 (emulated on the CPU),
// AdamW8bit or Muon, or none. The features are dealt to the cells greedily so that every
// (parallelism, feature) combination the table accepts is met by at least one cell (a covering
// design: one run per pair instead of one per pair and feature); TrainerLayoutMatrix.Plan checks
// the cover and prints the matrix with every refused combination and the table's reason.
//
// Models: the dense pairs alternate Llama 3 and Qwen3, the EP pairs Qwen3-MoE and DeepSeek-V3
// (all "tiny" flavors). An EP pair whose partner gives the experts no ranks to spread over (ep
// must divide dp_shard x cp x tp) takes FSDP 2 as its carrier, as TorchTitan's EP needs.
//
// Tolerances: per-step loss and gradient norm within 1e-5 relative (the layouts sum in another
// order: measured differences are printed, typically 1e-7). Float8 is compared with one process
// accumulating micro-batches of the layout's rows (its weight-gradient scales are per
// micro-batch), within 5e-4: float8 rounding is a step function of the weights, which turns the
// layouts' 1e-7 differences into up to ~1e-4 once clipping engages (test_trainer_float8.cpp).
// AdamW8bit's block-wise 8-bit moments are a step function too: within 1e-4.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <sstream>

#include "loom/core/build_paths.h"
#include "loom/parallel/optimizer_registry.h"
#include "loom/train/config.h"
#include "loom/train/layout_check.h"
#include "loom/train/tests/layout_runs.h"

namespace {
using loom::testing::Layout;

constexpr int kSteps = 6;
constexpr int kGlobalBatch = 8;

// One parallelism of the matrix at degree 2. `group`: parallelisms of one group are alternatives
// (FSDP or HSDP; TP or async TP; one PP schedule), never paired.
struct Dim {
  std::string name;
  std::string group;
  std::map<std::string, int> degrees;  // "dp_shard", "dp_replicate", "tp", "cp", "pp", "ep"
  std::string flags;                   // anything besides the degrees
};

const std::vector<Dim>& dims() {
  const std::string pp = " --parallelism.pipeline_parallel_microbatch_size=1 --parallelism.pipeline_parallel_schedule=";
  static const std::vector<Dim> d = {
      {"fsdp2", "dp", {{"dp_shard", 2}}, ""},
      {"hsdp2x2", "dp", {{"dp_replicate", 2}, {"dp_shard", 2}}, ""},
      {"tp2", "tp", {{"tp", 2}}, ""},
      {"asynctp2", "tp", {{"tp", 2}}, " --parallelism.enable_async_tensor_parallel=true"},
      {"cp2", "cp", {{"cp", 2}}, ""},
      {"pp2_1F1B", "pp", {{"pp", 2}}, pp + "1F1B"},
      {"pp2_Interleaved1F1B", "pp", {{"pp", 2}}, pp + "Interleaved1F1B"},
      {"pp2_ZBVZeroBubble", "pp", {{"pp", 2}}, pp + "ZBVZeroBubble"},
      {"pp2_DualPipeV", "pp", {{"pp", 2}}, pp + "DualPipeV"},
      {"ep2", "ep", {{"ep", 2}}, ""},
  };
  return d;
}

// A feature every cell may carry. `reference`: what its single-process reference adds.
struct Feature {
  std::string name;
  std::string flags;
  double tolerance;
};

const std::vector<Feature>& features() {
  static const std::vector<Feature> f = {
      {"plain", "", 1e-5},
      {"accumulate", "", 1e-5},  // the layout's rows as two micro-batches (global batch kept)
      {"ac_full", " --activation_checkpoint.mode=full", 1e-5},
      {"ac_selective", " --activation_checkpoint.mode=selective --activation_checkpoint.selective_ac_option=op", 1e-5},
      // The adapters' gradient norm starts at ~0.012 (B starts at zero): clip at 0.011; at lr 3e-2
      // the adapters lower the loss within the 6 steps (at 1e-3 they do not yet).
      {"lora",
       " --lora.rank=4 --lora.alpha=8 --lora.target_modules=q_proj,v_proj,o_proj,down_proj --optimizer.lr=3e-2"
       " --training.max_norm=0.011",
       1e-5},
      {"float8", " --float8.enable=true", 5e-4},
      {"adamw8bit", " --optimizer.name=AdamW8bit --optimizer.block_size=256", 1e-4},
      {"muon", " --optimizer.name=Muon", 1e-5},
  };
  return f;
}

struct Cell {
  Layout layout;
  std::string model_flags;      // family + feature: what the reference shares
  std::string reference_flags;  // the reference's alone (Float8's micro-batches)
  double tolerance = 1e-5;
  std::vector<std::string> dims;
  std::string feature;
};

// Why a cell cannot run: the table's (or the model's, or the optimizer's) one-line refusal, as
// `loom train` would print it before any process group; empty when it runs.
std::string refusal(const std::string& flags, int world_size) {
  std::vector<std::string> overrides;
  std::istringstream in(flags);
  for (std::string word; in >> word;) overrides.push_back(word);
  try {
    const auto config = loom::train::load_job_config(loom::testing::source_path("configs/llama3_debug.toml"), overrides);
    const auto& spec = loom::models::get_spec(config.model.name);
    // The tokenizer's vocabulary (2048); the file need not exist when tests are listed.
    const auto args = spec.build_args({config.model.flavor, 2048, config.training.seq_len, config.model.n_layers});
    loom::train::check_layout(config, world_size, 0, spec, [&]() -> const loom::models::ModelArgs& { return *args; });
    const auto& optimizer = loom::parallel::optimizer_spec(config.optimizer.name);
    if (optimizer.check_layout) {
      loom::parallel::OptimizerLayout layout;
      layout.tensor_parallel_degree = config.parallelism.tensor_parallel_degree;
      optimizer.check_layout(loom::parallel::OptimizerRequest{}, layout);
    }
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

// The cell of `chosen` dims with `feature` on `family`: its flags, ranks and batch.
// `global_batch`: rows per optimizer step, for the cell and its reference (16 where a schedule
// needs more micro-batches than 8 rows give the cell's data-parallel ranks).
Cell make_cell(std::vector<const Dim*> chosen, const Feature& feature, const std::string& family,
               int global_batch = kGlobalBatch) {
  std::map<std::string, int> degrees{{"dp_shard", 1}, {"dp_replicate", 1}, {"tp", 1}, {"cp", 1}, {"pp", 1}, {"ep", 1}};
  std::string extra;
  for (const Dim* d : chosen) {
    for (const auto& [k, v] : d->degrees) degrees[k] = v;
    extra += d->flags;
  }
  std::vector<std::string> names;
  for (const Dim* d : chosen) names.push_back(d->name);
  // EP spreads the experts over ranks of dp_shard x cp x tp; with none, FSDP 2 carries it.
  if (degrees["ep"] > 1 && degrees["dp_shard"] * degrees["cp"] * degrees["tp"] < degrees["ep"]) {
    degrees["dp_shard"] = 2;
    names.insert(names.begin(), "fsdp2");
  }
  const int nproc = degrees["dp_shard"] * degrees["dp_replicate"] * degrees["tp"] * degrees["cp"] * degrees["pp"];
  const int dp = degrees["dp_shard"] * degrees["dp_replicate"];
  const bool accumulate = feature.name == "accumulate";
  const int local_batch = global_batch / dp / (accumulate ? 2 : 1);
  std::string flags = " --parallelism.data_parallel_shard_degree=" + std::to_string(degrees["dp_shard"]) +
                      " --parallelism.data_parallel_replicate_degree=" + std::to_string(degrees["dp_replicate"]) +
                      " --parallelism.tensor_parallel_degree=" + std::to_string(degrees["tp"]) +
                      " --parallelism.context_parallel_degree=" + std::to_string(degrees["cp"]) +
                      " --parallelism.pipeline_parallel_degree=" + std::to_string(degrees["pp"]) +
                      " --parallelism.expert_parallel_degree=" + std::to_string(degrees["ep"]) + extra;
  if (accumulate) flags += " --training.global_batch_size=" + std::to_string(global_batch);
  Cell cell;
  std::string name;
  for (const auto& n : names) name += (name.empty() ? "" : "_x_") + n;
  name += "__" + feature.name + "__" + family;
  cell.dims = names;
  cell.feature = feature.name;
  cell.model_flags = "--model.name=" + family;
  if (global_batch != kGlobalBatch) {
    // 16 rows average the gradient over more tokens: the tiny models' norms are ~0.35-0.39.
    cell.model_flags += " --training.global_batch_size=" + std::to_string(global_batch) + " --training.max_norm=0.34";
    name += "_gb" + std::to_string(global_batch);
  }
  cell.model_flags += feature.flags;
  // Shapes that are no float8 GEMM stay in high precision: the tiny MoE routers (64 -> 8 experts)
  // and DeepSeek-V3's tiny MLA down-projection wkv_a (64 -> kv_lora 32 + rope 8).
  if (feature.name == "float8" && (family == "deepseek_v3" || family == "qwen3_moe" || family == "gpt_oss")) {
    cell.model_flags += " --float8.filter_fqns=output,router,wkv_a";
  }
  // DeepSeek-V3's attention is MLA: its query and key/value up-projections stand for q_proj/v_proj.
  if (feature.name == "lora" && family == "deepseek_v3") {
    cell.model_flags += " --lora.target_modules=q_b_proj,kv_b_proj,o_proj,down_proj";
  }
  cell.tolerance = feature.tolerance;
  if (feature.name == "float8") {
    // One process accumulating micro-batches of the rows one rank's forward sees at once.
    const int rows = degrees["pp"] > 1 ? 1 : local_batch;
    if (rows < global_batch) {
      cell.reference_flags = " --training.local_batch_size=" + std::to_string(rows) +
                             " --training.global_batch_size=" + std::to_string(global_batch);
    }
  }
  cell.layout = Layout{nullptr, nproc, local_batch, flags};
  static std::vector<std::unique_ptr<std::string>> names_kept;  // Layout holds a const char*
  names_kept.push_back(std::make_unique<std::string>(name));
  cell.layout.name = names_kept.back()->c_str();
  return cell;
}

// The flags a cell's run is checked with, as layout_train_args and the cell give them.
std::string layout_flags_for_check(const Cell& c) {
  return " --model.flavor=tiny --training.seq_len=64 --validation.enable=false --training.local_batch_size=" +
         std::to_string(c.layout.local_batch) + " " + c.model_flags + " " + c.layout.flags;
}

// Every cell that runs and every refused (pair, feature), by the covering rule in the header.
struct Matrix {
  std::vector<Cell> cells;
  std::vector<std::pair<std::string, std::string>> refused;  // cell name, the one-line reason
  std::set<std::pair<std::string, std::string>> accepted;    // (dim, feature) some cell could run
  std::set<std::pair<std::string, std::string>> covered;     // (dim, feature) a chosen cell runs
  std::set<std::set<std::string>> unrunnable;                // combinations refused with every feature
};

const Matrix& matrix() {
  static const Matrix m = [] {
    Matrix out;
    const auto& d = dims();
    std::vector<std::vector<const Dim*>> combos;
    for (size_t i = 0; i < d.size(); ++i) {
      for (size_t j = i + 1; j < d.size(); ++j) {
        if (d[i].group != d[j].group) combos.push_back({&d[i], &d[j]});
      }
    }
    auto by_name = [&](const std::string& n) {
      return &*std::find_if(d.begin(), d.end(), [&](const Dim& x) { return x.name == n; });
    };
    combos.push_back({by_name("fsdp2"), by_name("tp2"), by_name("pp2_Interleaved1F1B")});
    combos.push_back({by_name("fsdp2"), by_name("cp2"), by_name("tp2")});
    combos.push_back({by_name("ep2"), by_name("fsdp2"), by_name("pp2_1F1B")});
    std::map<std::string, int> used;
    int dense = 0, moe = 0;
    for (const auto& combo : combos) {
      const bool has_ep = std::any_of(combo.begin(), combo.end(), [](const Dim* x) { return x->group == "ep"; });
      static const char* kMoeFamilies[] = {"qwen3_moe", "deepseek_v3", "gpt_oss"};
      const std::string family = has_ep ? kMoeFamilies[moe++ % 3]
                                        : (dense++ % 2 == 0 ? "llama3" : "qwen3");
      // Each feature this combination accepts, with the (dim, feature) pairs it would newly cover.
      const Cell* best = nullptr;
      std::vector<Cell> candidates;
      for (const Feature& f : features()) {
        Cell c = make_cell(combo, f, family);
        std::string why = refusal(layout_flags_for_check(c), c.layout.nproc);
        if (why.find("micro-batch") != std::string::npos) {
          c = make_cell(combo, f, family, 2 * kGlobalBatch);
          why = refusal(layout_flags_for_check(c), c.layout.nproc);
        }
        if (!why.empty()) {
          out.refused.emplace_back(c.layout.name, why);
          continue;
        }
        for (const auto& dn : c.dims) out.accepted.insert({dn, f.name});
        candidates.push_back(std::move(c));
      }
      if (candidates.empty()) {
        std::set<std::string> names;
        for (const Dim* x : combo) names.insert(x->name);
        out.unrunnable.insert(names);
        continue;
      }
      int best_new = -1;
      for (const Cell& c : candidates) {
        int fresh = 0;
        for (const auto& dn : c.dims) fresh += out.covered.count({dn, c.feature}) ? 0 : 1;
        // More new combinations first; then the feature used least so far; then "plain".
        if (fresh > best_new || (fresh == best_new && used[c.feature] < used[best->feature])) {
          best = &c;
          best_new = fresh;
        }
      }
      for (const auto& dn : best->dims) out.covered.insert({dn, best->feature});
      ++used[best->feature];
      out.cells.push_back(*best);
    }
    // Combinations no pair's cell met: one more cell each, on the first combination that accepts it.
    for (const auto& combination : std::set<std::pair<std::string, std::string>>(out.accepted)) {
      const std::string dn = combination.first, fname = combination.second;
      if (out.covered.count({dn, fname})) continue;
      const Feature& f = *std::find_if(features().begin(), features().end(), [&](const Feature& x) { return x.name == fname; });
      for (const auto& combo : combos) {
        if (std::none_of(combo.begin(), combo.end(), [&](const Dim* x) { return x->name == dn; })) continue;
        const bool has_ep = std::any_of(combo.begin(), combo.end(), [](const Dim* x) { return x->group == "ep"; });
        Cell c = make_cell(combo, f, has_ep ? "qwen3_moe" : "llama3");
        if (refusal(layout_flags_for_check(c), c.layout.nproc).find("micro-batch") != std::string::npos) {
          c = make_cell(combo, f, has_ep ? "qwen3_moe" : "llama3", 2 * kGlobalBatch);
        }
        if (!refusal(layout_flags_for_check(c), c.layout.nproc).empty()) continue;
        for (const auto& n : c.dims) out.covered.insert({n, fname});
        out.cells.push_back(std::move(c));
        break;
      }
    }
    return out;
  }();
  return m;
}

void PrintTo(const Cell& c, std::ostream* os) { *os << c.layout.name << " on " << c.layout.nproc << " ranks"; }

}  // namespace

class TrainerLayoutMatrix : public ::testing::TestWithParam<Cell> {};

TEST_P(TrainerLayoutMatrix, TrainsLikeTheSingleProcess) {
  const Cell& c = GetParam();
  loom::testing::expect_layout_matches_single_process(c.layout, c.model_flags, kSteps, {c.tolerance, -1, c.tolerance},
                                                      nullptr, c.reference_flags);
}

INSTANTIATE_TEST_SUITE_P(Pairs, TrainerLayoutMatrix, ::testing::ValuesIn(matrix().cells),
                         [](const ::testing::TestParamInfo<Cell>& info) { return std::string(info.param.layout.name); });

// The matrix itself: every pair of parallelisms of different groups has a cell or a refusal from
// the table, every (parallelism, feature) the table accepts is run by some cell, and the three
// triples are there. Prints the cells and the refusals (the closing note of issue 45 lists them).
TEST(TrainerLayoutMatrixPlan, CoversEveryAcceptedPairAndFeature) {
  const Matrix& m = matrix();
  std::printf("%zu cells:\n", m.cells.size());
  for (const Cell& c : m.cells) std::printf("  %-60s %d ranks, local batch %d, tolerance %.0e\n", c.layout.name, c.layout.nproc, c.layout.local_batch, c.tolerance);
  std::printf("%zu refused (pair x feature):\n", m.refused.size());
  for (const auto& [name, why] : m.refused) std::printf("  %-60s %s\n", name.c_str(), why.c_str());
  for (const auto& combination : m.accepted) {
    EXPECT_TRUE(m.covered.count(combination)) << combination.first << " x " << combination.second << " is accepted but no cell runs it";
  }
  // Every pair of different groups is run (with some feature) or refused with every feature.
  const auto& d = dims();
  for (size_t i = 0; i < d.size(); ++i) {
    for (size_t j = i + 1; j < d.size(); ++j) {
      if (d[i].group == d[j].group) continue;
      const bool run = std::any_of(m.cells.begin(), m.cells.end(), [&](const Cell& c) {
        return std::count(c.dims.begin(), c.dims.end(), d[i].name) && std::count(c.dims.begin(), c.dims.end(), d[j].name);
      });
      EXPECT_TRUE(run || m.unrunnable.count({d[i].name, d[j].name}))
          << d[i].name << " x " << d[j].name << " has no cell and was not refused";
      if (!run) std::printf("refused with every feature: %s x %s\n", d[i].name.c_str(), d[j].name.c_str());
    }
  }
  // Every parallelism meets every feature except what the table refuses (printed above).
  for (const Dim& dim : d) {
    int met = 0;
    for (const Feature& f : features()) met += m.covered.count({dim.name, f.name}) ? 1 : 0;
    EXPECT_GE(met, 4) << dim.name << " meets only " << met << " features";
  }
  EXPECT_GE(m.cells.size(), 37u);
}
