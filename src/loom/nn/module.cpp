#include "loom/nn/module.h"

#include <sstream>

#include "loom/core/error.h"

namespace loom::nn {
namespace {
// A leaf tensor carries the slot's trainability; integer tensors can never require grad.
torch::Tensor with_requires_grad(torch::Tensor tensor, bool requires_grad) {
  if (tensor.defined() && tensor.is_leaf() && tensor.requires_grad() != requires_grad &&
      (!requires_grad || tensor.is_floating_point() || tensor.is_complex())) {
    tensor.requires_grad_(requires_grad);
  }
  return tensor;
}

std::string join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}
}  // namespace

void HookHandle::remove() {
  if (auto table = table_.lock()) {
    if (is_pre_) {
      table->pre.erase(id_);
    } else {
      table->post.erase(id_);
    }
    table->state_only.erase(id_);
  }
  table_.reset();
}

Module::Module(std::string type_name)
    : type_name_(std::move(type_name)), hooks_(std::make_shared<detail::HookTable>()) {}

void Module::check_new_name(const std::string& name) const {
  TORCH_CHECK(!name.empty() && name.find('.') == std::string::npos,
              "module member name '", name, "' must be non-empty and contain no '.'");
  auto taken = [&](const auto& list) {
    return std::any_of(list.begin(), list.end(), [&](const auto& e) { return e->name == name; });
  };
  const bool child_taken = std::any_of(children_.begin(), children_.end(),
                                       [&](const auto& c) { return c.first == name; });
  TORCH_CHECK(!taken(parameters_) && !taken(buffers_) && !child_taken, type_name_,
              " already has a member named '", name, "'");
}

ParameterSlot* Module::register_parameter(const std::string& name, torch::Tensor tensor,
                                          bool requires_grad) {
  check_new_name(name);
  auto slot = std::make_unique<ParameterSlot>();
  slot->name = name;
  slot->requires_grad = requires_grad;
  slot->tensor = with_requires_grad(std::move(tensor), requires_grad);
  slot->owner = this;
  parameters_.push_back(std::move(slot));
  return parameters_.back().get();
}

BufferSlot* Module::register_buffer(const std::string& name, torch::Tensor tensor,
                                    bool persistent) {
  check_new_name(name);
  auto slot = std::make_unique<BufferSlot>();
  slot->name = name;
  slot->tensor = std::move(tensor);
  slot->persistent = persistent;
  slot->owner = this;
  buffers_.push_back(std::move(slot));
  return buffers_.back().get();
}

void Module::add_child(const std::string& name, std::shared_ptr<Module> module) {
  TORCH_CHECK(module != nullptr, "register_module('", name, "') got a null module");
  check_new_name(name);
  children_.emplace_back(name, std::move(module));
}

std::shared_ptr<Module> Module::remove_module(const std::string& name) {
  for (auto it = children_.begin(); it != children_.end(); ++it) {
    if (it->first == name) {
      auto module = std::move(it->second);
      children_.erase(it);
      return module;
    }
  }
  fail(type_name_, " has no child module '", name, "'");
}

template <typename Fn>
void Module::visit(const std::string& prefix, Fn&& fn) {
  fn(prefix, *this);
  for (auto& [name, child] : children_) child->visit(join(prefix, name), fn);
}

std::vector<NamedParameter> Module::named_parameters(bool recurse) {
  std::vector<NamedParameter> out;
  auto collect = [&](const std::string& prefix, Module& m) {
    for (auto& slot : m.parameters_) out.push_back({join(prefix, slot->name), slot.get()});
  };
  if (recurse) {
    visit("", collect);
  } else {
    collect("", *this);
  }
  return out;
}

std::vector<NamedBuffer> Module::named_buffers(bool recurse) {
  std::vector<NamedBuffer> out;
  auto collect = [&](const std::string& prefix, Module& m) {
    for (auto& slot : m.buffers_) out.push_back({join(prefix, slot->name), slot.get()});
  };
  if (recurse) {
    visit("", collect);
  } else {
    collect("", *this);
  }
  return out;
}

std::vector<std::pair<std::string, Module*>> Module::named_modules() {
  std::vector<std::pair<std::string, Module*>> out;
  visit("", [&](const std::string& prefix, Module& m) { out.emplace_back(prefix, &m); });
  return out;
}

std::vector<std::pair<std::string, std::shared_ptr<Module>>> Module::named_children() const {
  return children_;
}

std::vector<torch::Tensor> Module::parameters(bool recurse) {
  std::vector<torch::Tensor> out;
  for (const auto& p : named_parameters(recurse)) out.push_back(p.slot->tensor);
  return out;
}

int64_t Module::num_parameters(bool recurse) {
  int64_t n = 0;
  for (const auto& p : named_parameters(recurse)) n += p.slot->tensor.numel();
  return n;
}

namespace {
std::vector<std::string> split_path(const std::string& path) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (!path.empty()) {
    const size_t dot = path.find('.', start);
    parts.push_back(path.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return parts;
}
}  // namespace

Module* Module::find_submodule(const std::string& path) {
  Module* m = this;
  for (const std::string& part : split_path(path)) {
    const auto it = std::find_if(m->children_.begin(), m->children_.end(),
                                 [&](const auto& c) { return c.first == part; });
    if (it == m->children_.end()) return nullptr;
    m = it->second.get();
  }
  return m;
}

Module& Module::submodule(const std::string& path) {
  Module* m = find_submodule(path);
  LOOM_REQUIRE(m != nullptr, "no submodule '", path, "' in ", type_name_);
  return *m;
}

std::pair<Module*, std::string> Module::resolve(const std::string& path) {
  const size_t dot = path.rfind('.');
  if (dot == std::string::npos) return {this, path};
  return {&submodule(path.substr(0, dot)), path.substr(dot + 1)};
}

ParameterSlot& Module::parameter_slot(const std::string& path) {
  auto [owner, name] = resolve(path);
  for (auto& slot : owner->parameters_) {
    if (slot->name == name) return *slot;
  }
  fail("no parameter '", path, "' in ", type_name_);
}

BufferSlot& Module::buffer_slot(const std::string& path) {
  auto [owner, name] = resolve(path);
  for (auto& slot : owner->buffers_) {
    if (slot->name == name) return *slot;
  }
  fail("no buffer '", path, "' in ", type_name_);
}

void Module::set_parameter(const std::string& path, torch::Tensor tensor) {
  ParameterSlot& slot = parameter_slot(path);
  slot.tensor = with_requires_grad(std::move(tensor), slot.requires_grad);
}

void Module::set_buffer(const std::string& path, torch::Tensor tensor) {
  buffer_slot(path).tensor = std::move(tensor);
}

std::vector<std::pair<std::string, torch::Tensor>> Module::state_dict() {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& p : named_parameters()) out.emplace_back(p.name, p.slot->tensor.detach());
  for (const auto& b : named_buffers()) {
    if (b.slot->persistent) out.emplace_back(b.name, b.slot->tensor.detach());
  }
  return out;
}

void Module::to(c10::ScalarType dtype) {
  torch::NoGradGuard no_grad;
  visit("", [&](const std::string&, Module& m) {
    for (auto& slot : m.parameters_) {
      if (slot->tensor.defined() && slot->tensor.is_floating_point()) {
        slot->tensor = with_requires_grad(slot->tensor.to(dtype), slot->requires_grad);
      }
    }
    for (auto& slot : m.buffers_) {
      if (slot->tensor.defined() && slot->tensor.is_floating_point()) {
        slot->tensor = slot->tensor.to(dtype);
      }
    }
  });
}

void Module::to(c10::Device device) {
  torch::NoGradGuard no_grad;
  visit("", [&](const std::string&, Module& m) {
    for (auto& slot : m.parameters_) {
      if (slot->tensor.defined()) {
        slot->tensor = with_requires_grad(slot->tensor.to(device), slot->requires_grad);
      }
    }
    for (auto& slot : m.buffers_) {
      if (slot->tensor.defined()) slot->tensor = slot->tensor.to(device);
    }
  });
}

void Module::to_empty(c10::Device device) {
  torch::NoGradGuard no_grad;
  visit("", [&](const std::string&, Module& m) {
    for (auto& slot : m.parameters_) {
      if (!slot->tensor.defined()) continue;
      slot->tensor = with_requires_grad(
          torch::empty(slot->tensor.sizes(), slot->tensor.options().device(device)),
          slot->requires_grad);
    }
    for (auto& slot : m.buffers_) {
      if (!slot->tensor.defined()) continue;
      slot->tensor = torch::empty(slot->tensor.sizes(), slot->tensor.options().device(device));
    }
  });
}

void Module::zero_grad(bool set_to_none) {
  for (const auto& p : named_parameters()) {
    torch::Tensor& t = p.slot->tensor;
    if (!t.defined()) continue;
    torch::Tensor grad = t.mutable_grad();
    if (!grad.defined()) continue;
    if (set_to_none) {
      t.mutable_grad() = torch::Tensor();
    } else {
      grad.detach_();
      grad.zero_();
    }
  }
}

void Module::train(bool on) {
  visit("", [&](const std::string&, Module& m) { m.training_ = on; });
}

HookHandle Module::add_forward_pre_hook(ForwardPreHook hook, HookKind kind) {
  TORCH_CHECK(hook != nullptr, "add_forward_pre_hook got an empty function");
  const int64_t id = hooks_->next_id++;
  hooks_->pre.emplace(id, std::move(hook));
  if (kind == HookKind::kStateOnly) hooks_->state_only.insert(id);
  return HookHandle(hooks_, id, /*is_pre=*/true);
}

void Module::set_forward_override(ForwardOverride around) { hooks_->around = std::move(around); }

HookHandle Module::add_forward_post_hook(ForwardPostHook hook, HookKind kind) {
  TORCH_CHECK(hook != nullptr, "add_forward_post_hook got an empty function");
  const int64_t id = hooks_->next_id++;
  hooks_->post.emplace(id, std::move(hook));
  if (kind == HookKind::kStateOnly) hooks_->state_only.insert(id);
  return HookHandle(hooks_, id, /*is_pre=*/false);
}

torch::Tensor Module::run_between_hooks(torch::Tensor input, const ForwardFn& use) {
  LOOM_REQUIRE(!has_transforming_hooks(), type_name_, ": run_between_hooks with a hook that may change the "
               "forward's values (an around-hook or a kTransform pre/post hook); call the module's forward instead");
  if (!has_forward_hooks()) return use(input);
  input = run_pre_hooks(std::move(input));
  return run_post_hooks(input, use(input));
}

torch::Tensor Module::run_pre_hooks(torch::Tensor input) {
  // Copy the table so a hook may remove itself (or others) while running.
  const auto hooks = hooks_->pre;
  for (const auto& [id, hook] : hooks) input = hook(*this, std::move(input));
  return input;
}

torch::Tensor Module::run_post_hooks(const torch::Tensor& input, torch::Tensor output) {
  const auto hooks = hooks_->post;
  for (const auto& [id, hook] : hooks) output = hook(*this, input, std::move(output));
  return output;
}

std::string Module::describe() {
  std::ostringstream os;
  visit("", [&](const std::string& prefix, Module& m) {
    const int64_t depth =
        prefix.empty() ? 0 : 1 + std::count(prefix.begin(), prefix.end(), '.');
    const std::string indent(static_cast<size_t>(2 * depth), ' ');
    os << indent << (prefix.empty() ? std::string("(root)") : prefix) << ": " << m.type_name_;
    for (const auto& slot : m.parameters_) {
      os << " " << slot->name << slot->tensor.sizes() << (slot->requires_grad ? "" : "(frozen)");
    }
    os << "\n";
  });
  return os.str();
}

}  // namespace loom::nn
