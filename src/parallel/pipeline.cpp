// Pipeline schedules: each schedule is the order of a rank's forwards and backwards; one
// executor runs any order, with asynchronous point-to-point transfers matched by tags.
#include "hyperparallel/pipeline.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "../trace/trace_recording.h"
#include "hyperparallel/collectives.h"

namespace hp {
namespace {

using Order = std::function<std::vector<PipelineAction>(int64_t, int64_t, int64_t, int64_t)>;

// An activation's shape and dtype travel ahead of it: [ndim, dims..., dtype].
constexpr int64_t kMaxDims = 8;

// What a message carries; with the boundary (the sending stage) and the microbatch, its tag.
enum class Message : int64_t { kShape = 0, kActivation = 1, kGradient = 2 };

int message_tag(Message message, int64_t boundary, int64_t microbatch, int64_t microbatches) {
  const int64_t tag = (boundary * microbatches + microbatch) * 3 + static_cast<int64_t>(message);
  TORCH_CHECK(tag < (int64_t{1} << 31), "pipeline: too many stages x microbatches for tags");
  return static_cast<int>(tag);
}

at::Tensor shape_record(const at::Tensor& activation) {
  if (activation.dim() > kMaxDims) {
    C10_THROW_ERROR(ValueError, "pipeline: activations have at most " + std::to_string(kMaxDims) +
                                    " dims, got " + std::to_string(activation.dim()));
  }
  at::Tensor record = at::zeros({kMaxDims + 2}, at::kLong);
  record[0] = activation.dim();
  for (int64_t d = 0; d < activation.dim(); ++d) record[d + 1] = activation.size(d);
  record[kMaxDims + 1] = static_cast<int64_t>(activation.scalar_type());
  return record;
}

std::vector<at::Tensor> split_batch(const at::Tensor& batch, int64_t microbatches,
                                    const char* what) {
  if (batch.size(0) % microbatches != 0) {
    C10_THROW_ERROR(ValueError, std::string("pipeline: the ") + what + " batch of " +
                                    std::to_string(batch.size(0)) + " is not divisible into " +
                                    std::to_string(microbatches) + " microbatches");
  }
  return batch.chunk(microbatches, 0);
}

std::vector<PipelineAction> gpipe_order(int64_t, int64_t, int64_t, int64_t microbatches) {
  std::vector<PipelineAction> order;
  for (int64_t mb = 0; mb < microbatches; ++mb) order.push_back({PipelineAction::kForward, 0, mb});
  for (int64_t mb = 0; mb < microbatches; ++mb) {
    order.push_back({PipelineAction::kBackward, 0, mb});
  }
  return order;
}

// Megatron-LM's order, which is 1F1B for one chunk: the k-th forward (backward) of a rank
// runs microbatch group k / (S*V) through chunk (k / S) % V (backward: counted from the
// last chunk), S microbatches a group. Warm-up forwards fill the pipeline up to this rank;
// then one forward and one backward alternate; the remaining backwards drain it.
std::vector<PipelineAction> one_f_one_b_order(int64_t rank, int64_t ranks, int64_t chunks,
                                              int64_t microbatches) {
  const int64_t total = microbatches * chunks;
  const auto microbatch = [&](int64_t k) { return k / (ranks * chunks) * ranks + k % ranks; };
  const auto forward = [&](int64_t k) {
    return PipelineAction{PipelineAction::kForward, k / ranks % chunks, microbatch(k)};
  };
  const auto backward = [&](int64_t k) {
    return PipelineAction{PipelineAction::kBackward, chunks - 1 - k / ranks % chunks,
                          microbatch(k)};
  };
  int64_t warmup = chunks == 1 ? ranks - rank - 1 : (ranks - rank - 1) * 2 + (chunks - 1) * ranks;
  // Interleaved with as many microbatches as stages: no steady phase (Megatron-LM's rule).
  if (chunks > 1 && microbatches == ranks) warmup = total;
  warmup = std::min(warmup, total);
  std::vector<PipelineAction> order;
  for (int64_t k = 0; k < warmup; ++k) order.push_back(forward(k));
  for (int64_t k = 0; k < total - warmup; ++k) {
    order.push_back(forward(warmup + k));
    order.push_back(backward(k));
  }
  for (int64_t k = total - warmup; k < total; ++k) order.push_back(backward(k));
  return order;
}

// A trace event of `action` ("pp_recv issue B0.2": the receive of that backward), when
// tracing.
void note(trace::Kind kind, std::string_view op, const PipelineAction& action) {
  if (trace::enabled()) trace::record(kind, op, to_string(action));
}

// One step of a rank's actions: the microbatches' inputs and outputs kept for backward,
// receives posted one action ahead, sends waited for at the end.
class StepRun {
 public:
  StepRun(std::vector<PipelineStage>& chunks, int64_t microbatches,
          const PipelineSchedule::LossFn& loss_fn)
      : chunks_(chunks),
        microbatches_(microbatches),
        loss_fn_(loss_fn),
        group_(*chunks.front().group),
        rank_(group_.rank()),
        ranks_(group_.size()),
        stages_(ranks_ * static_cast<int64_t>(chunks.size())),
        per_chunk_(chunks.size(), std::vector<Microbatch>(microbatches)),
        shapes_(chunks.size()) {}

  void set_batches(const at::Tensor& input, const at::Tensor& target) {
    if (rank_ == 0) {
      if (!input.defined()) {
        C10_THROW_ERROR(ValueError, "pipeline: the first stage (pipeline rank 0) needs the input");
      }
      inputs_ = split_batch(input, microbatches_, "input");
    }
    if (rank_ == ranks_ - 1) {
      if (!target.defined()) {
        C10_THROW_ERROR(ValueError, "pipeline: the last stage (pipeline rank " +
                                        std::to_string(rank_) + ") needs the target");
      }
      targets_ = split_batch(target, microbatches_, "target");
    }
  }

  // Runs `action` once what it receives is here; the receive of `next` (null: none) goes
  // out before it computes.
  void run(const PipelineAction& action, const PipelineAction* next) {
    post_receive(action);
    if (action.kind == PipelineAction::kForward) {
      forward(action, next);
    } else {
      backward(action, next);
    }
  }

  PipelineStepResult finish() {
    for (auto& send : sends_) send.second.wait();
    PipelineStepResult result;
    if (!losses_.empty()) result.loss = at::stack(losses_).sum().detach();
    if (!aux_losses_.empty()) result.aux_loss = at::stack(aux_losses_).sum();
    for (size_t chunk = 0; chunk < chunks_.size(); ++chunk) {
      std::vector<at::Tensor> received, sent;
      for (const Microbatch& mb : per_chunk_[chunk]) {
        if (mb.output_grad.defined()) received.push_back(mb.output_grad);
        if (mb.input_grad.defined()) sent.push_back(mb.input_grad);
      }
      result.output_grads.push_back(received.empty() ? at::Tensor() : at::cat(received));
      result.input_grads.push_back(sent.empty() ? at::Tensor() : at::cat(sent));
    }
    return result;
  }

 private:
  // Posts what `action` will receive, when its size is known already.
  void post_receive(const PipelineAction& action) {
    Microbatch& mb = at(action);
    if (action.kind == PipelineAction::kForward) {
      if (is_first(action.chunk) || mb.received.pending()) return;
      Shape& shape = shapes_[action.chunk];
      if (!shape.known) {
        if (!shape.record.defined()) {
          shape.record = at::empty({kMaxDims + 2}, at::kLong);
          shape.handle = recv(shape.record, previous_rank(), group_,
                              tag(Message::kShape, stage(action.chunk) - 1, 0),
                              transfer(action, "receiving the activations' shape from"));
        }
        return;
      }
      note(trace::Kind::kIssue, "pp_recv", action);
      mb.input = at::empty(
          shape.sizes, at::TensorOptions().dtype(shape.dtype).device(chunks_[action.chunk].device));
      mb.received = recv(mb.input, previous_rank(), group_,
                         tag(Message::kActivation, stage(action.chunk) - 1, action.microbatch),
                         transfer(action, "receiving its input activation from"));
    } else {
      if (is_last(action.chunk) || mb.received.pending() || !mb.output.defined()) return;
      note(trace::Kind::kIssue, "pp_recv", action);
      mb.output_grad = at::empty_like(mb.output);
      mb.received = recv(mb.output_grad, next_rank(), group_,
                         tag(Message::kGradient, stage(action.chunk), action.microbatch),
                         transfer(action, "receiving its output gradient from"));
    }
  }

  struct Microbatch {
    at::Tensor input, output, loss;      // kept from forward for backward
    at::Tensor aux_loss;                 // the chunk's, weighted 1/M; kept when it has a graph
    at::Tensor output_grad, input_grad;  // the boundary gradients of the step
    CommHandle received;                 // the input (forward) or output_grad (backward)
    CommHandle output_sent;              // kept until the gradient for it comes back
  };
  struct Shape {
    bool known = false;
    std::vector<int64_t> sizes;
    c10::ScalarType dtype = at::kFloat;
    at::Tensor record;  // being received
    CommHandle handle;
  };

  int64_t stage(int64_t chunk) const { return chunk * ranks_ + rank_; }
  bool is_first(int64_t chunk) const { return stage(chunk) == 0; }
  bool is_last(int64_t chunk) const { return stage(chunk) == stages_ - 1; }
  int64_t previous_rank() const { return (rank_ + ranks_ - 1) % ranks_; }
  int64_t next_rank() const { return (rank_ + 1) % ranks_; }
  int tag(Message message, int64_t boundary, int64_t microbatch) const {
    return message_tag(message, boundary, microbatch, microbatches_);
  }
  Microbatch& at(const PipelineAction& action) {
    return per_chunk_[action.chunk][action.microbatch];
  }

  // The activation for `action`, received (its shape first, at the step's first one).
  void receive_input(const PipelineAction& action) {
    Shape& shape = shapes_[action.chunk];
    if (!shape.known) {
      post_receive(action);  // the shape record
      note(trace::Kind::kWaitBegin, "pp_recv", action);
      shape.handle.wait();
      note(trace::Kind::kWaitEnd, "pp_recv", action);
      const int64_t dims = shape.record[0].item<int64_t>();
      shape.sizes.resize(dims);
      for (int64_t d = 0; d < dims; ++d) shape.sizes[d] = shape.record[d + 1].item<int64_t>();
      shape.dtype = static_cast<c10::ScalarType>(shape.record[kMaxDims + 1].item<int64_t>());
      shape.known = true;
    }
    post_receive(action);
    wait_received(action);
  }

  void wait_received(const PipelineAction& action) {
    note(trace::Kind::kWaitBegin, "pp_recv", action);
    at(action).received.wait();
    note(trace::Kind::kWaitEnd, "pp_recv", action);
  }

  CommHandle send_to(const at::Tensor& tensor, int64_t dst, int message_tag,
                     const PipelineAction& action, const char* sending) {
    note(trace::Kind::kIssue, "pp_send", action);
    return send(tensor, dst, group_, message_tag, transfer(action, sending));
  }

  // How a failed transfer of `action` is named: its stage, pass and microbatch, what it
  // moves and the peer stage (forward: the previous one when receiving; backward: the
  // previous one when sending), e.g. "pipeline stage 2, backward of microbatch 3:
  // receiving its output gradient from stage 3".
  std::string transfer(const PipelineAction& action, const std::string& moving) const {
    const bool forward = action.kind == PipelineAction::kForward;
    const bool receiving = moving.starts_with("receiving");
    const int64_t own = stage(action.chunk);
    const int64_t peer = forward == receiving ? own - 1 : own + 1;
    return "pipeline stage " + std::to_string(own) + ", " + (forward ? "forward" : "backward") +
           " of microbatch " + std::to_string(action.microbatch) + ": " + moving + " stage " +
           std::to_string(peer);
  }

  void forward(const PipelineAction& action, const PipelineAction* next) {
    Microbatch& mb = at(action);
    const PipelineStage& chunk = chunks_[action.chunk];
    if (is_first(action.chunk)) {
      mb.input = inputs_[action.microbatch];
    } else {
      receive_input(action);
      mb.input.requires_grad_(true);  // its gradient is sent back
    }
    if (next) post_receive(*next);
    note(trace::Kind::kBegin, "pp_forward", action);
    mb.output = chunk.forward(mb.input);
    note(trace::Kind::kEnd, "pp_forward", action);
    if (chunk.aux_loss) take_aux_loss(action, chunk.aux_loss());
    if (is_last(action.chunk)) {
      mb.loss =
          loss_fn_(mb.output, targets_[action.microbatch]) / static_cast<double>(microbatches_);
      losses_.push_back(mb.loss.detach());
      return;
    }
    const at::Tensor activation = mb.output.detach().contiguous();
    Shape& sent_shape = sent_shapes_[action.chunk];
    if (!sent_shape.known) {
      sent_shape.known = true;
      sent_shape.sizes = activation.sizes().vec();
      sent_shape.dtype = activation.scalar_type();
      const at::Tensor record = shape_record(activation);
      sends_.emplace_back(
          record, send_to(record, next_rank(), tag(Message::kShape, stage(action.chunk), 0), action,
                          "sending the activations' shape to"));
    } else if (activation.sizes() != c10::IntArrayRef(sent_shape.sizes) ||
               activation.scalar_type() != sent_shape.dtype) {
      C10_THROW_ERROR(ValueError,
                      "pipeline: stage " + std::to_string(stage(action.chunk)) +
                          " gave microbatch " + std::to_string(action.microbatch) +
                          " an output of shape " + c10::str(activation.sizes()) + " and dtype " +
                          c10::toString(activation.scalar_type()) +
                          ", another than the step's first (" +
                          c10::str(c10::IntArrayRef(sent_shape.sizes)) + ", " +
                          c10::toString(sent_shape.dtype) +
                          "); the microbatches of a step must give outputs of one shape");
    }
    mb.output_sent = send_to(activation, next_rank(),
                             tag(Message::kActivation, stage(action.chunk), action.microbatch),
                             action, "sending its output activation to");
  }

  void take_aux_loss(const PipelineAction& action, const at::Tensor& aux_loss) {
    if (!aux_loss.defined() || aux_loss.numel() != 1) {
      C10_THROW_ERROR(ValueError,
                      "pipeline: stage " + std::to_string(stage(action.chunk)) +
                          "'s aux_loss gave " +
                          (aux_loss.defined() ? "a tensor of shape " + c10::str(aux_loss.sizes())
                                              : std::string("an undefined tensor")) +
                          " after microbatch " + std::to_string(action.microbatch) +
                          "; it must give a scalar (a zero when there is none)");
    }
    const at::Tensor weighted = aux_loss.reshape({}) / static_cast<double>(microbatches_);
    // On this rank's device: chunks may give a CPU zero next to a device loss.
    aux_losses_.push_back(weighted.detach().to(chunks_[action.chunk].device, at::kFloat));
    if (weighted.requires_grad()) at(action).aux_loss = weighted;
  }

  // One backward from `root` (given `grad`; undefined for a scalar loss) and, with it, from
  // the microbatch's aux loss when it has one: a single engine run, so that fully_shard's
  // reduction after the last backward includes the aux loss's gradients.
  static void backward_from(const at::Tensor& root, const at::Tensor& grad,
                            const at::Tensor& aux_loss) {
    std::vector<at::Tensor> roots{root}, grads{grad};
    if (aux_loss.defined()) {
      roots.push_back(aux_loss);
      grads.emplace_back();  // ones, the aux loss being a scalar
    }
    torch::autograd::backward(roots, grads);
  }

  void backward(const PipelineAction& action, const PipelineAction* next) {
    Microbatch& mb = at(action);
    PipelineStage& chunk = chunks_[action.chunk];
    // Gradients are reduced in the chunk's last backward of the step.
    if (chunk.fsdp)
      chunk.fsdp->set_requires_gradient_sync(++backwards_[action.chunk] == microbatches_);
    if (is_last(action.chunk)) {
      if (next) post_receive(*next);
      note(trace::Kind::kBegin, "pp_backward", action);
      backward_from(mb.loss, at::Tensor(), mb.aux_loss);
    } else {
      wait_received(action);
      // The next stage has its output: a gradient came back from it.
      mb.output_sent.wait();
      mb.output_sent = CommHandle();
      if (next) post_receive(*next);
      note(trace::Kind::kBegin, "pp_backward", action);
      backward_from(mb.output, mb.output_grad, mb.aux_loss);
    }
    note(trace::Kind::kEnd, "pp_backward", action);
    if (!is_first(action.chunk)) {
      mb.input_grad = mb.input.grad();
      if (!mb.input_grad.defined()) mb.input_grad = at::zeros_like(mb.input);  // input unused
      sends_.emplace_back(mb.input_grad, send_to(mb.input_grad, previous_rank(),
                                                 tag(Message::kGradient, stage(action.chunk) - 1,
                                                     action.microbatch),
                                                 action, "sending its input gradient to"));
    }
    // What forward kept is no longer needed.
    mb.input = at::Tensor();
    mb.output = at::Tensor();
    mb.loss = at::Tensor();
    mb.aux_loss = at::Tensor();
  }

  std::vector<PipelineStage>& chunks_;
  int64_t microbatches_;
  const PipelineSchedule::LossFn& loss_fn_;
  const Group& group_;
  int64_t rank_, ranks_, stages_;
  std::vector<at::Tensor> inputs_, targets_, losses_, aux_losses_;
  std::vector<std::vector<Microbatch>> per_chunk_;
  std::vector<Shape> shapes_;                             // of the activations each chunk receives
  std::map<int64_t, Shape> sent_shapes_;                  // of those each chunk sends
  std::map<int64_t, int64_t> backwards_;                  // per chunk, run so far
  std::vector<std::pair<at::Tensor, CommHandle>> sends_;  // the others, waited at the end
};

}  // namespace

std::string to_string(const PipelineAction& action) {
  // Appended, not `const char* + std::string`, which GCC 12 warns about (-Wstringop-overflow).
  std::string text = action.kind == PipelineAction::kForward ? "F" : "B";
  text += std::to_string(action.chunk) + "." + std::to_string(action.microbatch);
  return text;
}

PipelineSchedule::PipelineSchedule(std::vector<PipelineStage> chunks, int64_t microbatches,
                                   LossFn loss_fn, const Order& order)
    : chunks_(std::move(chunks)), microbatches_(microbatches), loss_fn_(std::move(loss_fn)) {
  if (chunks_.empty()) C10_THROW_ERROR(ValueError, "pipeline: no stage given");
  for (const PipelineStage& chunk : chunks_) {
    if (!chunk.forward) C10_THROW_ERROR(ValueError, "pipeline: the stage has no forward");
    if (!chunk.group) C10_THROW_ERROR(ValueError, "pipeline: the stage has no pipeline group");
    if (chunk.group != chunks_.front().group) {
      C10_THROW_ERROR(ValueError, "pipeline: a rank's chunks must share one pipeline group");
    }
  }
  if (microbatches_ < 1) {
    C10_THROW_ERROR(ValueError,
                    "pipeline: microbatches must be >= 1, got " + std::to_string(microbatches_));
  }
  if (!loss_fn_) C10_THROW_ERROR(ValueError, "pipeline: no loss function");
  const Group& group = *chunks_.front().group;
  actions_ = order(group.rank(), group.size(), static_cast<int64_t>(chunks_.size()), microbatches_);
}

PipelineStepResult PipelineSchedule::step(const at::Tensor& input, const at::Tensor& target) {
  StepRun run(chunks_, microbatches_, loss_fn_);
  run.set_batches(input, target);
  for (size_t i = 0; i < actions_.size(); ++i) {
    run.run(actions_[i], i + 1 < actions_.size() ? &actions_[i + 1] : nullptr);
  }
  return run.finish();
}

GPipeSchedule::GPipeSchedule(PipelineStage stage, int64_t microbatches, LossFn loss_fn)
    : PipelineSchedule({std::move(stage)}, microbatches, std::move(loss_fn), gpipe_order) {}

OneFOneBSchedule::OneFOneBSchedule(PipelineStage stage, int64_t microbatches, LossFn loss_fn)
    : PipelineSchedule({std::move(stage)}, microbatches, std::move(loss_fn), one_f_one_b_order) {}

InterleavedOneFOneBSchedule::InterleavedOneFOneBSchedule(std::vector<PipelineStage> chunks,
                                                         int64_t microbatches, LossFn loss_fn)
    : PipelineSchedule(
          std::move(chunks), microbatches, std::move(loss_fn),
          [](int64_t rank, int64_t ranks, int64_t chunks, int64_t microbatches) {
            if (chunks < 2) {
              C10_THROW_ERROR(ValueError,
                              "pipeline: an interleaved schedule needs at least 2 "
                              "chunks per rank (virtual stages), got " +
                                  std::to_string(chunks) + "; use OneFOneBSchedule for one");
            }
            if (microbatches % ranks != 0) {
              C10_THROW_ERROR(ValueError,
                              "pipeline: the interleaved schedule runs microbatches in groups "
                              "of the pipeline size (" +
                                  std::to_string(ranks) + "); " + std::to_string(microbatches) +
                                  " microbatches is not a multiple of it");
            }
            return one_f_one_b_order(rank, ranks, chunks, microbatches);
          }) {}

}  // namespace hp
