// Block-wise 8-bit AdamW (Dettmers et al., "8-bit Optimizers via Block-wise Quantization",
// arXiv:2110.02861; bitsandbytes' AdamW8bit): the same update as optim::AdamW (torch.optim.AdamW:
// bias correction, decoupled weight decay), but both moments are stored in 8 bits.
//
// A quantized parameter's flat elements are cut into blocks of `block_size` consecutive elements,
// counted from its first element. Each block keeps one float32 scale per moment (the block's
// largest |value|, "absmax") and one byte per element: the index of the nearest entry of
// bitsandbytes' dynamic quantization map (create_dynamic_map: an exponent part giving about 7
// decades of range, then linear fractions) of value / absmax. The dynamic map rather than a linear
// absmax grid: the second moment spans orders of magnitude inside a block, and a linear 8-bit grid
// rounds every element below absmax / 255 to zero, whose update then divides by eps alone.
//   exp_avg     int8 codes: code c stands for signed_dynamic_map()[c + 128] (monotone in c)
//   exp_avg_sq  uint8 codes: code c stands for unsigned_dynamic_map()[c]
// Each step, block by block in one loop: dequantize both moments, update them and the parameter
// in float32 with AdamW's formula, requantize them. Blocks are independent, so the result of a
// block depends only on its own elements: an FSDP shard holding whole blocks (the planner's
// element-block granularity) updates bitwise like the unsharded parameter.
//
// Parameters with fewer than kMinQuantizedNumel elements (norm scales, biases) or whose size is not
// a multiple of block_size keep float32 moments (bitsandbytes' min_8bit_size = 4096 rule; the
// block-size rule keeps every block whole, which FSDP's layout needs).
#pragma once
#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "loom/optim/adamw.h"
#include "loom/optim/optimizer.h"

namespace loom::optim {

constexpr int64_t kMinQuantizedNumel = 4096;
constexpr int64_t kDefaultQuantizationBlockSize = 256;

// bitsandbytes' create_dynamic_map(signed, max_exponent_bits = 7, total_bits = 8): 256 sorted
// values in [-1, 1] (signed) or [0, 1] (unsigned), both holding 0 and 1.
const std::array<float, 256>& signed_dynamic_map();
const std::array<float, 256>& unsigned_dynamic_map();

// Index of the entry of the sorted `map` nearest to x (ties: the lower index).
uint8_t nearest_code(const std::array<float, 256>& map, float x);

// One block of n values: absmax = max |x|, codes[i] = nearest_code(map, x[i] / absmax) (every
// code is that of 0 when absmax is 0). Returns absmax.
float quantize_block(const float* x, int64_t n, const std::array<float, 256>& map, uint8_t* codes);
// x[i] = map[codes[i]] * absmax.
void dequantize_block(const uint8_t* codes, int64_t n, float absmax,
                      const std::array<float, 256>& map, float* x);

// Whether a parameter of `numel` elements gets 8-bit moments at this block size (see above).
bool is_block_quantized(int64_t numel, int64_t block_size);

// The moments of one contiguous run of a flat parameter (a whole parameter, or an FSDP shard's
// piece of one): 8-bit codes with one scale per block, or float32.
struct AdamW8bitState {
  bool quantized = false;
  int64_t block_size = 0;
  at::Tensor exp_avg;            // int8 codes or float32, numel elements
  at::Tensor exp_avg_sq;         // uint8 codes or float32
  at::Tensor exp_avg_absmax;     // float32, numel / block_size (quantized only)
  at::Tensor exp_avg_sq_absmax;  // float32, numel / block_size (quantized only)

  // Zero moments for `numel` elements on `options`' device, shaped `shape` (numel elements).
  static AdamW8bitState zeros(c10::IntArrayRef shape, bool quantized, int64_t block_size,
                              const at::TensorOptions& options);
  int64_t nbytes() const;
};

// One contiguous run to update: a 1-D contiguous float32 view of the parameter, its gradient (same
// numel; any shape, made contiguous) and its state.
struct AdamW8bitPiece {
  at::Tensor param;
  at::Tensor grad;
  AdamW8bitState* state = nullptr;
  double weight_decay = 0.0;
};

// One AdamW step of every piece at step count `step` (already incremented): one loop over all
// blocks of all pieces (float32 pieces in runs of block_size elements), parallel over blocks.
void adamw8bit_step(const std::vector<AdamW8bitPiece>& pieces, const AdamWOptions& options,
                    double step, int64_t block_size);

// AdamW8bit on whole parameters (one process, DDP, pipeline stages).
class AdamW8bit : public Optimizer {
 public:
  // Parameters must be contiguous float32 (master weights). Throws loom::Error on duplicates, a bad
  // hyper-parameter or block_size < 1.
  AdamW8bit(std::vector<ParamGroup> groups, AdamWOptions options, int64_t block_size);

  void step() override;
  void zero_grad(bool set_to_none = true) override;
  void set_lr(double lr) override { options_.lr = lr; }
  double lr() const override { return options_.lr; }

  // Per parameter "<p>.step", "<p>.exp_avg", "<p>.exp_avg_sq"; quantized ones also
  // "<p>.exp_avg.absmax" and "<p>.exp_avg_sq.absmax" ([numel / block_size] float32).
  TensorDict state_dict() const override;
  void load_state_dict(const TensorDict& state) override;

  int64_t block_size() const { return block_size_; }
  // Bytes of the moment tensors (codes, scales and float32 moments; not the step counts).
  int64_t state_nbytes() const;
  const AdamW8bitState& state(const std::string& param_name) const;

 private:
  struct Slot {
    std::string name;
    at::Tensor param;
    at::Tensor step;
    AdamW8bitState state;
    double weight_decay = 0.0;
  };
  std::vector<Slot> slots_;
  std::unordered_map<std::string, size_t> index_;
  AdamWOptions options_;
  int64_t block_size_;
};

// The state dict entries of one piece under `prefix` ("<p>"), shaped like `param_shape` (codes or
// moments) and [numel / block_size] (scales).
void add_adamw8bit_state(TensorDict& out, const std::string& prefix, const AdamW8bitState& state,
                         c10::IntArrayRef param_shape);

}  // namespace loom::optim
