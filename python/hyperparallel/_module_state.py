"""What one fully_shard call keeps on the Python side: the module attributes of its
parameters, which show the core's state (DTensors while sharded, the unsharded
variables while unsharded), and the DTensor gradients of the core's sharded ones."""

import threading
import weakref

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import _C


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= size
    return tuple(reversed(stride))


class _ShardedParam:
    """One sharded parameter: its DTensor (what optimizers, state_dict and users see), the
    variable autograd sees while unsharded (the module's original nn.Parameter), and where
    modules hold it."""

    def __init__(self, view: "_C.ShardedParamView", mesh, slots):
        self.name = view.name
        self.variable = view.variable
        self.local = view.local  # the core's shard: the DTensor's local tensor must stay it
        self.slots = slots  # (module, attribute name) pairs, tied parameters included
        shard = (Shard(view.shard_dim),)
        self.placements = shard if mesh.ndim == 1 else (Replicate(),) + shard
        self.mesh = mesh
        self.shape = torch.Size(view.global_shape)
        self.stride = _contiguous_stride(view.global_shape)
        self.dtensor = nn.Parameter(
            self._wrap(view.local), requires_grad=view.variable.requires_grad
        )
        self.dtensor._hyperparallel_managed = True

    def _wrap(self, local: torch.Tensor) -> DTensor:
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )

    def show(self, unsharded: bool) -> None:
        shown = self.variable if unsharded else self.dtensor
        for module, name in self.slots:
            module._parameters[name] = shown

    def holds_shard(self) -> bool:
        local = self.dtensor._local_tensor
        return (
            local.data_ptr() == self.local.data_ptr()
            and local.dtype == self.local.dtype
            and local.device == self.local.device
            and local.shape == self.local.shape
        )

    def check_holds_shard(self) -> None:
        """Raises when something outside fully_shard replaced the DTensor's local tensor
        (load_state_dict(assign=True), a new nn.Parameter, to() on a submodule that is not
        fully_shard-ed): the core would go on gathering the old shard while the optimizer
        updated the new one."""
        if self.local.is_meta:
            raise RuntimeError(
                f"parameter '{self.name}' is on the meta device: call module.to_empty(device=...) "
                "on the fully_shard-ed module and initialize it (reset_parameters) before forward"
            )
        if not self.holds_shard():
            raise RuntimeError(
                f"parameter '{self.name}' no longer holds its local shard: something outside "
                "fully_shard replaced it (load_state_dict(assign=True), a new nn.Parameter, "
                "to() on a submodule that is not fully_shard-ed). Load state dicts in place, "
                "and move or cast the fully_shard-ed module (or its root)"
            )

    def follow_move(self, core: "_C.ShardState", index: int) -> None:
        """The core's shard takes the DTensor's new local tensor (moved or cast by
        module._apply), which becomes a view of it again."""
        if self.holds_shard():
            return
        self.local = core.move_shard(index, self.dtensor._local_tensor)
        self.dtensor._local_tensor = self.local
        self.dtensor.grad = None

    def push_grad(self) -> None:
        """The DTensor gradient (cleared or replaced by the user) into the core."""
        grad = self.dtensor.grad
        if grad is None:
            if self.variable.grad is not None:
                self.variable.grad = None
        elif (
            self.variable.grad is None
            or grad._local_tensor.data_ptr() != self.variable.grad.data_ptr()
        ):
            self.variable.grad = grad._local_tensor

    def pull_grad(self) -> None:
        """The core's sharded gradient as the DTensor's."""
        local = self.variable.grad
        if local is None:
            self.dtensor.grad = None
        elif (
            self.dtensor.grad is None
            or self.dtensor.grad._local_tensor.data_ptr() != local.data_ptr()
        ):
            self.dtensor.grad = self._wrap(local)


_forward_depth = threading.local()


class ModuleState:
    """The Python side of one fully_shard call (shared by its modules)."""

    def __init__(self, modules, core: "_C.ShardState", mesh):
        self.core = core
        self.fsdp = core.module()
        self.modules = [weakref.ref(m) for m in modules]
        slots = {}
        for module in modules:
            for owner in module.modules():
                for name, param in owner._parameters.items():
                    if param is not None:
                        slots.setdefault(id(param), []).append((owner, name))
        self.params = [_ShardedParam(v, mesh, slots[id(v.variable)]) for v in core.sharded_params()]
        self.shown_unsharded = None
        self.show()
        self._subtree = None
        self._end_of_backward_queued = False
        self._forwards_running = 0  # pre-forward done, post-forward not yet

    # --- the module attributes follow the core -------------------------------------
    def show(self) -> None:
        unsharded = self.core.is_unsharded()
        if unsharded == self.shown_unsharded:
            return
        for p in self.params:
            p.show(unsharded)
        self.shown_unsharded = unsharded

    def follow_moves(self) -> None:
        for index, p in enumerate(self.params):
            p.follow_move(self.core, index)

    def subtree(self) -> list["ModuleState"]:
        """The states of this call's modules' subtrees, this one first."""
        if self._subtree is None:
            states = []
            for ref in self.modules:
                for module in ref().modules():
                    state = getattr(module, "_hyperparallel_state", None)
                    if state is not None and state not in states:
                        states.append(state)
            self._subtree = states
        return self._subtree

    # --- hooks ----------------------------------------------------------------------
    def pre_forward(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        depth = getattr(_forward_depth, "value", 0)
        # A recompute reruns forwards inside backward: the core knows it, it is no new step.
        outermost = depth == 0 and torch._C._current_graph_task_id() == -1
        _forward_depth.value = depth + 1
        try:
            if outermost:
                for state in self.subtree():
                    for p in state.params:
                        p.check_holds_shard()
                    if not state.core.is_unsharded():
                        for p in state.params:
                            p.push_grad()
            tensors = self.core.pre_forward(tensors)
            if outermost:
                # Reductions left pending (set_is_last_backward(False)) finish here.
                self.pull_grads()
        except BaseException:
            _forward_depth.value = depth
            raise
        self._forwards_running += 1
        self.show()
        return tensors

    def post_forward(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        self._forwards_running -= 1
        _forward_depth.value -= 1
        tensors = self.core.post_forward(tensors)
        self.show()
        if _forward_depth.value == 0 and torch._C._current_graph_task_id() == -1:
            for tensor in tensors:
                if tensor.requires_grad:
                    tensor.register_hook(self._queue_end_of_backward)
        return tensors

    def forward_failed(self) -> None:
        """The module's forward raised after its pre-forward (one that raised undid itself)."""
        if self._forwards_running == 0:
            return
        self._forwards_running -= 1
        _forward_depth.value -= 1
        self.core.forward_failed()
        for state in self.subtree():
            state.show()

    def _queue_end_of_backward(self, grad):
        if not self._end_of_backward_queued:
            self._end_of_backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._after_core_callbacks)
        return grad

    def _after_core_callbacks(self) -> None:
        # The core queues its end-of-backward callback from its own hooks, which may run
        # after this one's (other hooks on the outputs change the order); callbacks queued
        # while the queue runs run after it: this one then runs after the core's.
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._end_of_backward_queued = False
        for state in self.subtree():
            state.show()
        self.pull_grads()

    def pull_grads(self) -> None:
        for state in self.subtree():
            if not state.core.is_unsharded():
                for p in state.params:
                    p.pull_grad()
