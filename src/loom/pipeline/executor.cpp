#include "loom/pipeline/executor.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <string>
#include <utility>

#include "loom/core/error.h"

namespace loom::pipeline {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

using Key = std::pair<int, int>;  // (stage, micro-batch)

std::string format_ids(const std::vector<int>& ids) {
  std::string out = "[";
  for (size_t i = 0; i < ids.size(); ++i) out += (i ? ", " : "") + std::to_string(ids[i]);
  return out + "]";
}

struct Pending {
  distributed::WorkHandle work;
  torch::Tensor tensor;  // the buffer (receive) or the data kept alive until sent
};

}  // namespace

PipelineExecutor::PipelineExecutor(Schedule schedule,
                                   std::vector<std::shared_ptr<PipelineStage>> stages,
                                   ExecutorOptions options)
    : schedule_(std::move(schedule)), stages_(std::move(stages)), options_(std::move(options)) {
  LOOM_REQUIRE(options_.comm != nullptr, "the pipeline executor needs the pp group");
  LOOM_REQUIRE(options_.comm->size() == schedule_.num_ranks, "schedule '", schedule_.name,
               "' is for ", schedule_.num_ranks, " pipeline ranks, the pp group has ",
               options_.comm->size());
  rank_ = options_.comm->rank();
  const int m = schedule_.num_microbatches;
  bool crosses_ranks = false;
  for (int s = 0; s + 1 < schedule_.num_stages(); ++s) {
    crosses_ranks = crosses_ranks || schedule_.rank_of(s) != schedule_.rank_of(s + 1);
  }
  LOOM_REQUIRE(!crosses_ranks || schedule_.has_communication(), "schedule '", schedule_.name,
               "' has no SEND/RECV actions: lower it with add_communication (build_schedule does)");
  std::vector<int> expected = schedule_.stages_of(rank_);
  std::vector<int> got;
  for (const auto& s : stages_) {
    LOOM_REQUIRE(s != nullptr, "null pipeline stage");
    LOOM_REQUIRE(s->num_stages() == schedule_.num_stages(), "stage ", s->index(), " believes in ",
                 s->num_stages(), " stages, the schedule has ", schedule_.num_stages());
    got.push_back(s->index());
    s->set_loss_scale(1.0 / static_cast<double>(m));
  }
  std::sort(got.begin(), got.end());
  LOOM_REQUIRE(got == expected, "pipeline rank ", rank_, " holds stages ", format_ids(got),
               " but the schedule gives it ", format_ids(expected));
  LOOM_REQUIRE(options_.activation_shape.size() >= 1, "the executor needs the activation shape");
  split_.assign(static_cast<size_t>(schedule_.num_stages()), std::vector<bool>(m, false));
  const std::vector<Action>& actions = schedule_.ranks[rank_];
  for (size_t i = 0; i < actions.size(); ++i) {
    const Action& a = actions[i];
    if (a.kind == ActionKind::kBackwardInput) split_[a.stage][a.microbatch] = true;
  }
}

bool PipelineExecutor::splits_backward() const {
  for (const auto& row : schedule_.ranks) {
    for (const Action& a : row) {
      if (a.kind == ActionKind::kBackwardInput) return true;
    }
  }
  return false;
}

PipelineStage& PipelineExecutor::stage(int index) {
  for (const auto& s : stages_) {
    if (s->index() == index) return *s;
  }
  fail("pipeline rank ", rank_, " has no stage ", index);
}

int PipelineExecutor::tag(int boundary, int mb, bool gradient) const {
  return (boundary * schedule_.num_microbatches + mb) * 2 + (gradient ? 1 : 0);
}

double PipelineExecutor::step(const std::vector<torch::Tensor>& inputs,
                              const std::vector<torch::Tensor>& labels,
                              const std::vector<nn::TokenLayout>& layouts, bool reduce_grads) {
  const auto step_start = Clock::now();
  times_ = {};
  const int m = schedule_.num_microbatches;
  const int last = schedule_.num_stages() - 1;
  const bool has_first = schedule_.rank_of(0) == rank_;
  const bool has_last = schedule_.rank_of(last) == rank_;
  LOOM_REQUIRE(!has_first || static_cast<int>(inputs.size()) == m, "pipeline step: ",
               inputs.size(), " input micro-batches for a schedule of ", m);
  LOOM_REQUIRE(!has_last || static_cast<int>(labels.size()) == m, "pipeline step: ",
               labels.size(), " label micro-batches for a schedule of ", m);
  distributed::Comm& comm = *options_.comm;
  const auto buffer_options =
      torch::TensorOptions().dtype(options_.activation_dtype).device(options_.device);

  std::map<Key, torch::Tensor> local_inputs;    // activations from a stage on this rank
  std::map<Key, torch::Tensor> local_grads;     // output gradients from a stage on this rank
  std::map<Key, torch::Tensor> to_send_f;       // outputs waiting for their SEND_F
  std::map<Key, torch::Tensor> to_send_b;       // input gradients waiting for their SEND_B
  std::map<Key, Pending> recv_f, recv_b;        // posted receives
  std::vector<Pending> sends;                   // posted sends, waited at the end
  torch::Tensor loss_sum;

  auto take_received = [&](std::map<Key, Pending>& posted, std::map<Key, torch::Tensor>& local,
                           Key key, const char* what) {
    if (auto it = local.find(key); it != local.end()) {
      torch::Tensor t = std::move(it->second);
      local.erase(it);
      return t;
    }
    auto it = posted.find(key);
    LOOM_REQUIRE(it != posted.end(), "pipeline rank ", rank_, ": stage ", key.first,
                 " micro-batch ", key.second, " needs its ", what, " but nothing was received");
    const auto wait_start = Clock::now();
    it->second.work->wait();
    times_.wait += seconds_since(wait_start);
    torch::Tensor t = std::move(it->second.tensor);
    posted.erase(it);
    return t;
  };

  // Posts one SEND/RECV action (the run of consecutive ones is ordered by the caller).
  auto post = [&](const Action& a) {
    const Key key{a.stage, a.microbatch};
    switch (a.kind) {
      case ActionKind::kRecvF: {
        torch::Tensor buf = torch::empty(options_.activation_shape, buffer_options);
        recv_f[key] = {comm.recv_async(buf, schedule_.rank_of(a.stage - 1),
                                       tag(a.stage - 1, a.microbatch, false)),
                       buf};
        break;
      }
      case ActionKind::kRecvB: {
        torch::Tensor buf = torch::empty(options_.activation_shape, buffer_options);
        recv_b[key] = {comm.recv_async(buf, schedule_.rank_of(a.stage + 1),
                                       tag(a.stage, a.microbatch, true)),
                       buf};
        break;
      }
      case ActionKind::kSendF: {
        auto it = to_send_f.find(key);
        LOOM_REQUIRE(it != to_send_f.end(), "pipeline rank ", rank_, ": ", a.str(),
                     " before the forward that produces it");
        torch::Tensor t = it->second.contiguous();
        to_send_f.erase(it);
        sends.push_back({comm.send_async(t, schedule_.rank_of(a.stage + 1),
                                         tag(a.stage, a.microbatch, false)),
                         t});
        break;
      }
      case ActionKind::kSendB: {
        auto it = to_send_b.find(key);
        LOOM_REQUIRE(it != to_send_b.end(), "pipeline rank ", rank_, ": ", a.str(),
                     " before the backward that produces it");
        torch::Tensor t = it->second.contiguous();
        to_send_b.erase(it);
        sends.push_back({comm.send_async(t, schedule_.rank_of(a.stage - 1),
                                         tag(a.stage - 1, a.microbatch, true)),
                         t});
        break;
      }
      default:
        fail("not a communication action: ", a.str());
    }
  };

  // After B or I of (stage, mb): the input gradient goes to the previous stage.
  auto hand_back = [&](int s, int mb, torch::Tensor grad_input) {
    if (s == 0) return;
    if (schedule_.rank_of(s - 1) == rank_) {
      local_grads[{s - 1, mb}] = std::move(grad_input);
    } else {
      to_send_b[{s, mb}] = std::move(grad_input);
    }
  };

  const std::vector<Action>& actions = schedule_.ranks[rank_];
  for (size_t i = 0; i < actions.size();) {
    const Action& a = actions[i];
    if (is_send(a.kind) || is_recv(a.kind)) {
      // One batch: every receive of the run first, then every send.
      size_t end = i;
      while (end < actions.size() && (is_send(actions[end].kind) || is_recv(actions[end].kind))) ++end;
      for (size_t j = i; j < end; ++j) {
        if (is_recv(actions[j].kind)) post(actions[j]);
      }
      for (size_t j = i; j < end; ++j) {
        if (is_send(actions[j].kind)) post(actions[j]);
      }
      // Free what the peers have already taken (a send is done once its data left).
      std::erase_if(sends, [](const Pending& p) { return p.work->isCompleted(); });
      i = end;
      continue;
    }
    const auto compute_start = Clock::now();
    const double waited_before = times_.wait;  // waits for received data are not compute
    PipelineStage& st = stage(a.stage);
    const Key key{a.stage, a.microbatch};
    switch (a.kind) {
      case ActionKind::kForward: {
        torch::Tensor input = st.is_first() ? inputs.at(a.microbatch)
                                            : take_received(recv_f, local_inputs, key, "input");
        torch::Tensor out = st.forward(a.microbatch, input,
                                       st.is_last() ? labels.at(a.microbatch) : torch::Tensor(),
                                       split_[a.stage][a.microbatch],
                                       layouts.empty() ? nn::TokenLayout{} : layouts.at(a.microbatch));
        if (st.is_last()) {
          loss_sum = loss_sum.defined() ? loss_sum + out.to(torch::kFloat64)
                                        : out.to(torch::kFloat64);
        } else if (schedule_.rank_of(a.stage + 1) == rank_) {
          local_inputs[{a.stage + 1, a.microbatch}] = out;
        } else {
          to_send_f[key] = out;
        }
        break;
      }
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput: {
        torch::Tensor grad_output;
        if (!st.is_last()) grad_output = take_received(recv_b, local_grads, key, "output gradient");
        torch::Tensor grad_input = a.kind == ActionKind::kBackward
                                       ? st.backward(a.microbatch, grad_output)
                                       : st.backward_input(a.microbatch, grad_output);
        hand_back(a.stage, a.microbatch, std::move(grad_input));
        break;
      }
      case ActionKind::kBackwardWeight:
        st.backward_weight(a.microbatch);
        break;
      case ActionKind::kUnshard:
        if (options_.unshard) options_.unshard(st);
        break;
      case ActionKind::kReshard:
        if (options_.reshard) options_.reshard(st);
        break;
      case ActionKind::kReduceGrad:
        if (options_.reduce_grad && reduce_grads) options_.reduce_grad(st);
        break;
      default:
        fail("unexpected action ", a.str());
    }
    const double computed = seconds_since(compute_start) - (times_.wait - waited_before);
    times_.compute += computed;
    if (static_cast<size_t>(a.kind) < times_.kind_seconds.size()) {
      times_.kind_seconds[static_cast<size_t>(a.kind)] += computed;
      ++times_.kind_count[static_cast<size_t>(a.kind)];
    }
    ++i;
  }

  const auto wait_start = Clock::now();
  for (Pending& p : sends) p.work->wait();
  times_.wait += seconds_since(wait_start);
  sends.clear();
  LOOM_REQUIRE(recv_f.empty() && recv_b.empty() && to_send_f.empty() && to_send_b.empty() &&
                   local_inputs.empty() && local_grads.empty(),
               "pipeline rank ", rank_, ": schedule '", schedule_.name,
               "' left data unused (received but never consumed, or produced but never sent)");
  for (const auto& s : stages_) {
    LOOM_REQUIRE(s->num_pending() == 0, "pipeline rank ", rank_, ": stage ", s->index(), " has ",
                 s->num_pending(), " micro-batches without a finished backward");
  }

  // The loss lives on the last stage's rank; every pp rank logs it.
  torch::Tensor loss = torch::zeros({1}, torch::kFloat64);
  if (has_last) loss.fill_(loss_sum.item<double>() / static_cast<double>(m));
  if (comm.size() > 1) {
    const auto bcast_start = Clock::now();
    comm.broadcast(loss, schedule_.rank_of(last));
    times_.wait += seconds_since(bcast_start);
  }
  times_.total = seconds_since(step_start);
  return loss.item<double>();
}

}  // namespace loom::pipeline
