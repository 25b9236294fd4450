#include "hyperparallel/expert_parallel.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <numeric>
#include <string>

#include "../distributed/autograd_capsule.h"
#include "hyperparallel/collectives.h"

namespace hp {
namespace {

void require(bool ok, const std::string& message) {
  if (!ok) C10_THROW_ERROR(ValueError, message);
}

// Carries the group through the autograd context.
using GroupRef = detail::AutogradCapsule<GroupPtr>;

at::Tensor exchange(const at::Tensor& input, const Group& group,
                    const std::vector<int64_t>& output_splits,
                    const std::vector<int64_t>& input_splits) {
  const int64_t rows = std::accumulate(output_splits.begin(), output_splits.end(), int64_t{0});
  std::vector<int64_t> shape = input.sizes().vec();
  shape[0] = rows;
  at::Tensor output = at::empty(shape, input.options());
  all_to_all(output, input.contiguous(), group, output_splits, input_splits).wait();
  return output;
}

struct AllToAllRows : torch::autograd::Function<AllToAllRows> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            c10::intrusive_ptr<GroupRef> ref, std::vector<int64_t> output_splits,
                            std::vector<int64_t> input_splits) {
    at::Tensor output = exchange(input, *ref->value, output_splits, input_splits);
    ctx->saved_data["group"] = c10::IValue::make_capsule(std::move(ref));
    ctx->saved_data["output_splits"] = output_splits;
    ctx->saved_data["input_splits"] = input_splits;
    return output;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const Group& group = *GroupRef::in(ctx->saved_data["group"]);
    // What came from rank s goes back to it: the splits swap roles.
    at::Tensor grad_input = exchange(grads[0], group, ctx->saved_data["input_splits"].toIntVector(),
                                     ctx->saved_data["output_splits"].toIntVector());
    return {grad_input, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for all num_experts, this rank's slice kept.
at::Tensor stacked_linear_init(int64_t num_experts, int64_t out, int64_t in, int64_t first,
                               int64_t local) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  return at::empty({num_experts, out, in}).uniform_(-bound, bound).narrow(0, first, local).clone();
}

int64_t sum_of(const int64_t* values, int64_t count) {
  return std::accumulate(values, values + count, int64_t{0});
}

// The counts of a 1-D int64 tensor, read on the host (the tensor may live on a device).
std::vector<int64_t> to_vector(const at::Tensor& counts) {
  const at::Tensor host = counts.cpu().contiguous();
  return std::vector<int64_t>(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel());
}

void require_experts_divide(const std::string& who, int64_t num_experts, int64_t ep_size) {
  require(num_experts % ep_size == 0,
          who + ": num_experts (" + std::to_string(num_experts) +
              ") is not divisible by the expert-parallel group size (" + std::to_string(ep_size) +
              "): each ep rank holds num_experts / ep_size experts; use a multiple of " +
              std::to_string(ep_size) + " experts or an ep group whose size divides " +
              std::to_string(num_experts));
}

}  // namespace

at::Tensor all_to_all_rows(const at::Tensor& input, const GroupPtr& group,
                           std::vector<int64_t> output_splits, std::vector<int64_t> input_splits) {
  require(group != nullptr, "all_to_all_rows: no group");
  require(input.dim() >= 1, "all_to_all_rows: the input needs a dim 0 of rows");
  if (group->size() == 1) return input;
  return AllToAllRows::apply(input, c10::make_intrusive<GroupRef>(group), std::move(output_splits),
                             std::move(input_splits));
}

void MoEOptions::validate() const {
  require(dim > 0 && expert_hidden > 0 && num_experts > 0,
          "MoEOptions: dim, expert_hidden and num_experts must be positive (got " +
              std::to_string(dim) + ", " + std::to_string(expert_hidden) + ", " +
              std::to_string(num_experts) + ")");
  require(top_k >= 1 && top_k <= num_experts,
          "MoEOptions: top_k (" + std::to_string(top_k) + ") must be in [1, num_experts = " +
              std::to_string(num_experts) + "]: a token cannot pick more experts than exist");
  require(!capacity_factor || *capacity_factor > 0,
          "MoEOptions: capacity_factor must be positive (or unset for no capacity limit), got " +
              std::to_string(capacity_factor.value_or(0)));
  require(load_balance_coef >= 0,
          "MoEOptions: load_balance_coef must be >= 0 (0: no auxiliary "
          "loss), got " +
              std::to_string(load_balance_coef));
}

ExpertsImpl::ExpertsImpl(int64_t dim, int64_t hidden, int64_t num_experts, const GroupPtr& ep_group)
    : num_experts(num_experts) {
  require(dim > 0 && hidden > 0 && num_experts > 0,
          "Experts: dim, hidden and num_experts must be positive");
  const int64_t ep_size = ep_group ? ep_group->size() : 1;
  require_experts_divide("Experts", num_experts, ep_size);
  local_experts = num_experts / ep_size;
  first_expert = (ep_group ? ep_group->rank() : 0) * local_experts;
  w1 = register_parameter(
      "w1", stacked_linear_init(num_experts, hidden, dim, first_expert, local_experts));
  w3 = register_parameter(
      "w3", stacked_linear_init(num_experts, hidden, dim, first_expert, local_experts));
  w2 = register_parameter(
      "w2", stacked_linear_init(num_experts, dim, hidden, first_expert, local_experts));
  // Slices of the whole [num_experts, ...] tensors: checkpoints and full tensors hold every
  // expert, clip_grad_norm_ counts each once.
  for (const at::Tensor& weight : {w1, w3, w2}) declare_parallel_slice(weight, {ep_group, 0});
}

at::Tensor ExpertsImpl::forward(const at::Tensor& tokens,
                                const std::vector<int64_t>& tokens_per_expert) {
  const int64_t dim = w1.size(2);
  require(tokens.dim() == 2 && tokens.size(1) == dim, "Experts: tokens must be [rows, " +
                                                          std::to_string(dim) + "], got " +
                                                          c10::str(tokens.sizes()));
  require(static_cast<int64_t>(tokens_per_expert.size()) == local_experts &&
              sum_of(tokens_per_expert.data(), local_experts) == tokens.size(0),
          "Experts: tokens_per_expert needs one count per local expert (" +
              std::to_string(local_experts) + ") summing to the rows of tokens (" +
              std::to_string(tokens.size(0)) + ")");
  // Every expert runs, even on no rows: its weights then get a zero gradient, so that
  // every rank reduces the same gradients.
  std::vector<at::Tensor> outputs;
  const auto rows = tokens.split_with_sizes(tokens_per_expert, 0);
  for (int64_t e = 0; e < local_experts; ++e) {
    const at::Tensor& x = rows[e];
    at::Tensor h = at::silu(at::linear(x, w1[e])) * at::linear(x, w3[e]);
    outputs.push_back(at::linear(h, w2[e]));
  }
  return at::cat(outputs, 0);
}

void ExpertsImpl::init_normal(double in_std, double out_std) {
  at::NoGradGuard no_grad;
  auto refill = [&](at::Tensor& weight, double std) {
    std::vector<int64_t> shape = weight.sizes().vec();
    shape[0] = num_experts;
    weight.copy_(
        at::empty(shape, weight.options()).normal_(0, std).narrow(0, first_expert, local_experts));
  };
  refill(w1, in_std);
  refill(w3, in_std);
  refill(w2, out_std);
}

MoEImpl::MoEImpl(const MoEOptions& opts, GroupPtr group)
    : options(opts), ep_group(std::move(group)) {
  options.validate();
  const int64_t ep_size = ep_group ? ep_group->size() : 1;
  require_experts_divide("MoE", options.num_experts, ep_size);
  router = register_module(
      "router",
      torch::nn::Linear(torch::nn::LinearOptions(options.dim, options.num_experts).bias(false)));
  experts =
      Sharded<Experts>(Experts(options.dim, options.expert_hidden, options.num_experts, ep_group));
  register_module("experts", experts.ptr());
}

const at::Tensor& MoEImpl::aux_loss() const { return aux_loss_; }

at::Tensor MoEImpl::forward(const at::Tensor& input) {
  const int64_t dim = options.dim, k = options.top_k, num_experts = options.num_experts;
  require(input.dim() >= 1 && input.size(-1) == dim,
          "MoE: the input's last dim must be dim = " + std::to_string(dim) + ", got shape " +
              c10::str(input.sizes()));
  const at::Tensor x = input.reshape({-1, dim});
  const int64_t tokens = x.size(0);

  // Routing in fp32: bf16 probabilities would tie and flip top-k choices.
  const at::Tensor probs = at::softmax(router(x), -1, at::kFloat);  // [N, E]
  // A stable descending sort breaks ties toward the lower expert index (topk does not
  // promise an order among equal values).
  const at::Tensor top_experts =
      std::get<1>(probs.detach().sort(/*stable=*/true, -1, /*descending=*/true)).narrow(1, 0, k);
  const at::Tensor top_probs = probs.gather(1, top_experts);
  const at::Tensor gates = top_probs / top_probs.sum(-1, /*keepdim=*/true);

  // Slots (t * k + j) grouped by expert, in token order within each expert.
  const at::Tensor slot_experts = top_experts.reshape(-1);
  at::Tensor order = std::get<1>(slot_experts.sort(/*stable=*/true, 0, /*descending=*/false));
  const at::Tensor routed = at::bincount(slot_experts, {}, num_experts);
  at::Tensor kept = routed;
  if (options.capacity_factor) {
    const auto capacity = static_cast<int64_t>(
        std::ceil(*options.capacity_factor * static_cast<double>(tokens * k) / num_experts));
    // A slot's position among its expert's slots, in token order: keep the first ones.
    const at::Tensor first_slot_of_expert = routed.cumsum(0) - routed;
    const at::Tensor position =
        at::arange(tokens * k, order.options()) -
        first_slot_of_expert.index_select(0, slot_experts.index_select(0, order));
    order = order.masked_select(position < capacity);
    kept = routed.clamp_max(capacity);
  }
  routing_counts_.routed = to_vector(routed);
  routing_counts_.kept = to_vector(kept);

  const at::Tensor token_of_slot = order.div(k, "floor");
  const at::Tensor expert_out = run_experts(x.index_select(0, token_of_slot), kept);
  const at::Tensor gate_of_slot =
      gates.reshape(-1).index_select(0, order).to(expert_out.scalar_type());
  // Each token's kept slots summed, in expert order (deterministic on CPU).
  const at::Tensor out =
      at::zeros_like(x).index_add(0, token_of_slot, expert_out * gate_of_slot.unsqueeze(1));

  if (options.load_balance_coef > 0) {
    const at::Tensor fraction_routed = routed.to(at::kFloat) / static_cast<double>(tokens * k);
    aux_loss_ = options.load_balance_coef * num_experts * (fraction_routed * probs.mean(0)).sum();
  } else {
    // Made here, not at construction: a deferred construction would leave it on meta.
    aux_loss_ = at::zeros({}, probs.options());
  }
  return out.view(input.sizes());
}

at::Tensor MoEImpl::run_experts(const at::Tensor& tokens, const at::Tensor& kept) {
  const int64_t local = experts->local_experts;
  if (!ep_group || ep_group->size() == 1) return experts(tokens, to_vector(kept));
  const int64_t ep = ep_group->size();
  // How many rows each rank sends to each of this rank's experts: [source, local expert].
  at::Tensor incoming = at::empty_like(kept);
  all_to_all(incoming, kept.contiguous(), *ep_group).wait();
  const std::vector<int64_t> sent_counts = to_vector(kept), received_counts = to_vector(incoming);
  const int64_t* sent = sent_counts.data();
  const int64_t* received = received_counts.data();
  std::vector<int64_t> input_splits(ep), output_splits(ep);
  for (int64_t r = 0; r < ep; ++r) {
    input_splits[r] = sum_of(sent + r * local, local);
    output_splits[r] = sum_of(received + r * local, local);
  }
  const at::Tensor arrived = all_to_all_rows(tokens, ep_group, output_splits, input_splits);

  // Arrived rows are ordered by source rank, then local expert; the experts want them by
  // local expert, then source rank.
  std::vector<int64_t> by_expert, tokens_per_expert(local, 0);
  by_expert.reserve(arrived.size(0));
  for (int64_t e = 0; e < local; ++e) {
    int64_t source_start = 0;
    for (int64_t s = 0; s < ep; ++s) {
      const int64_t start = source_start + sum_of(received + s * local, e);
      const int64_t count = received[s * local + e];
      for (int64_t i = 0; i < count; ++i) by_expert.push_back(start + i);
      tokens_per_expert[e] += count;
      source_start += output_splits[s];
    }
  }
  const at::Tensor permutation = at::tensor(by_expert, kept.options());
  const at::Tensor outputs = experts(arrived.index_select(0, permutation), tokens_per_expert);
  const at::Tensor back_in_arrival_order =
      outputs.index_select(0, std::get<1>(permutation.sort(/*stable=*/true, 0, false)));
  return all_to_all_rows(back_in_arrival_order, ep_group, input_splits, output_splits);
}

}  // namespace hp
